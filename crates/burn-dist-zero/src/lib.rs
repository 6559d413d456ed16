//! ZeRO for burn-dist: Adam(W) with the fp32 master weights and moments sharded across ranks.
//!
//! With N ranks each rank keeps 1/N of the optimizer state. On the host the update is
//! `burn_dist_kernels::host` (the CPU reference of the fused step, vectorized and on rayon
//! threads, bitwise equal to it); on a device, the fused kernels; offloaded (a device model,
//! the state on the host), the host step between the device's reduction and its gather.

pub mod checkpoint;
mod config;
mod decay;
mod error;
mod loaded;
#[cfg(feature = "device")]
mod new_params;
#[cfg(feature = "device")]
mod offload;
#[cfg(feature = "device")]
mod resident;
mod ruled_adamw;
mod shard;
mod zero_adam;

/// The flat layout lives in burn-dist: its reducer cuts ZeRO-2 buckets at the same shard
/// boundaries.
pub use burn_dist::flat::{self, FlatLayout, Piece};
pub use checkpoint::{CheckpointError, TrainingState};
pub use config::ZeroAdamConfig;
pub use decay::DecayRule;
pub use error::{Result, ZeroError};
pub use loaded::Replacements;
pub use ruled_adamw::RuledAdamW;
pub use shard::{OptimizerShard, StepReport};
pub use zero_adam::{Placement, ZeroAdam, ZeroAdamRecord};
