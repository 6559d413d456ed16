//! Collectives on cubecl device memory, with the host collectives' semantics and errors.
//!
//! One interface, [`DeviceCollectives`], two implementations:
//! - [`NcclCollectives`] (feature `cuda`): NCCL in place on the CUDA memory, one NCCL group per
//!   call; nothing crosses to the host;
//! - [`StagedCollectives`]: any cubecl runtime (wgpu, or CUDA without NCCL): each slice is read
//!   to the host, reduced by the host communicator ([`burn_dist_comm::HostCommunicator`]), and
//!   written back in place by a copy kernel.
//!
//! burn-dist's reducer and ZeroAdam use only the interface, so the NCCL path and the staged path
//! run the same code above it, and the staged path on wgpu (Mesa's lavapipe in CI) is the CPU
//! twin of the NCCL path.
//!
//! Every call works in place on [`DeviceSlice`]s: a range of elements of a cubecl buffer. Each
//! implementation counts the bytes it moves between host and device ([`Traffic`]), so tests
//! can assert that the NCCL path moves none and the staged path exactly what it must.

mod collectives;
mod copy;
mod error;
mod memory;
#[cfg(feature = "cuda")]
mod nccl;
mod slice;
mod staged;
mod traffic;

pub use collectives::{DeviceCollectives, DevicePending};
pub use copy::{PendingDownload, copy, create_staged, download, download_async, upload_into};
pub use error::{DeviceError, Result};
pub use memory::{DeviceMemory, device_memory};
#[cfg(feature = "cuda")]
pub use nccl::{NcclCollectives, device_address};
pub use slice::{DeviceDType, DeviceSlice};
pub use staged::StagedCollectives;
pub use traffic::{Traffic, TrafficCounter};
