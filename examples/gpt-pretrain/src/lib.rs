//! GPT-2-style pretraining with burn-dist: a decoder-only transformer trained data-parallel
//! across processes, with sharded Adam (ZeroAdam) or Burn's AdamW, global-norm clipping, a
//! cosine learning-rate schedule, gradient accumulation, mixed precision, sharded checkpoints,
//! metrics and a plot.
//!
//! ```text
//! cargo build --release -p burn-dist-run -p gpt-pretrain
//! target/release/burn-dist-run --nproc-per-node 2 -- target/release/gpt-pretrain
//! ```
//!
//! With no arguments it trains the `tiny` model on a built-in synthetic corpus whose entropy
//! (the best achievable loss) is known exactly, and prints it next to the loss. See
//! `docs/gpt-pretrain.md`.

pub mod backend;
pub mod cli;
pub mod data;
pub mod memory;
pub mod metrics;
pub mod model;
pub mod phases;
pub mod plot;
pub mod rng;
pub mod schedule;
pub mod train;
