//! The reducer's device path (feature `device`): gradients stay in cubecl device memory and are
//! reduced in place by burn-dist-device's collectives, NCCL on CUDA or staged through the host
//! communicator on any runtime (wgpu in CI). Backends: burn-cubecl's, with or without fusion
//! ([`CubeResident`]).

mod copy;
mod pieces;
mod resident;
mod store;

pub use copy::contiguous_copy;
#[cfg(all(test, feature = "cuda"))]
pub(crate) use copy::{CopyReason, copy_reason};
pub use resident::CubeResident;

use burn::tensor::DType;
use burn_dist_device::DeviceDType;

/// The device collectives' element type of a Burn float dtype; `None` for the others (f64):
/// the device path moves and reduces f32, f16 and bf16.
pub fn device_dtype(dtype: DType) -> Option<DeviceDType> {
    match dtype {
        DType::F32 | DType::Flex32 => Some(DeviceDType::F32),
        DType::F16 => Some(DeviceDType::F16),
        DType::BF16 => Some(DeviceDType::BF16),
        _ => None,
    }
}
pub(crate) use pieces::{DeviceGathering, DevicePieces, GatherPart};
pub(crate) use store::{DeviceBuckets, DeviceStore};
