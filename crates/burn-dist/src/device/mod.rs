//! The reducer's device path (feature `device`): gradients stay in cubecl device memory and are
//! reduced in place by burn-dist-device's collectives, NCCL on CUDA or staged through the host
//! communicator on any runtime (wgpu in CI). Backends: burn-cubecl's, with or without fusion
//! ([`CubeResident`]).

mod copy;
mod resident;
mod store;

pub use copy::contiguous_copy;
#[cfg(all(test, feature = "cuda"))]
pub(crate) use copy::{CopyReason, copy_reason};
pub use resident::CubeResident;
pub(crate) use store::{DeviceBuckets, DeviceStore};
