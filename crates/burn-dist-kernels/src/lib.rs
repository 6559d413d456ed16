//! Fused optimizer kernels for burn-dist, written once in CubeCL, and their CPU reference.
//!
//! The ZeroAdam step on a flat fp32 shard is two fused passes (see `docs/kernels.md`):
//! 1. unscale + inf/NaN detection + sum of squares ([`reference::unscale_and_check`]);
//! 2. the clipped Adam(W) update of master weights, moments and the model-dtype copy
//!    ([`reference::adam_update`]).
//!
//! [`reference`] is plain Rust over slices; `kernels` runs the same function on any cubecl
//! runtime ([`FusedAdam`]), with no host read between the passes; [`host`] is the same
//! function again, bitwise, vectorized and multi-threaded: the CPU-offload step.

pub mod host;
pub mod kernels;
pub mod reference;
pub mod testing;

pub use kernels::{FusedAdam, Hyper, ModelDtype, StepBuffers};
pub use reference::{
    ModelCopy, StepFactors, StepScalars, adam_update, adam_update_f64, clip_factor, is_non_finite,
    relative_error, unscale_and_check,
};
