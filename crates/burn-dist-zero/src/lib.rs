//! ZeRO for burn-dist: Adam(W) with the fp32 master weights and moments sharded across ranks.
//!
//! With N ranks each rank keeps 1/N of the optimizer state. The update itself is the CPU
//! reference of the fused step in `burn-dist-kernels` (the GPU runs the fused kernels).

pub mod checkpoint;
mod config;
mod error;
#[cfg(feature = "device")]
mod resident;
mod zero_adam;

/// The flat layout lives in burn-dist: its reducer cuts ZeRO-2 buckets at the same shard
/// boundaries.
pub use burn_dist::flat::{self, FlatLayout, Piece};
pub use checkpoint::{CheckpointError, TrainingState};
pub use config::ZeroAdamConfig;
pub use error::{Result, ZeroError};
pub use zero_adam::{OptimizerShard, StepReport, ZeroAdam};
