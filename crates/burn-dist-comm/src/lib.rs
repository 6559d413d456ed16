//! Communication layer of burn-dist: collectives over flat buffers.
//!
//! - [`Communicator`]: all-reduce (sum, avg, max), reduce-scatter, all-gather, broadcast and
//!   barrier, issued asynchronously and completed through [`Pending`] handles.
//! - [`SharedBuffer`]: a buffer for the host communicator's in-place collectives, which peers
//!   on the same host read where it lies (in shared memory) instead of through the rings.
//! - [`HostCommunicator`]: the CPU implementation, over in-process channels
//!   ([`HostCommunicator::local_group`]) or between processes ([`init`]): TCP, and shared
//!   memory between ranks on one host. Every element is
//!   reduced in rank order, so results are bit-identical on every rank and do not depend on
//!   how buffers are split into messages.
//! - [`init`] and [`Group`]: rendezvous from `RANK`/`WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT`
//!   (or Slurm's variables) through a TCP store hosted by rank 0.
//! - [`ThreadShare`]: each rank's share of the host's cores, which `burn-dist-run` and
//!   burn-dist's `Ddp::init` give to the ranks' thread pools.
//! - `NcclCommunicator` (feature `cuda`): the same collectives on GPU buffers through NCCL,
//!   which is loaded at run time (see `docs/gpu.md`).
//!
//! Every blocking wait is bounded by [`CommConfig::timeout`]; when a peer dies, every rank's
//! error names it.

mod algorithms;
mod buffer;
mod communicator;
mod config;
mod direct;
mod divergence;
pub mod env;
mod error;
mod gate;
mod init;
#[cfg(feature = "logging")]
pub mod logging;
// The NCCL communicator (feature `cuda`); its call plans are also unit-tested without it.
#[cfg(any(test, feature = "cuda"))]
mod nccl;
mod op;
mod reduce;
mod shared;
pub mod store;
pub mod testing;
pub mod threads;
mod transport;
mod wire;

pub use buffer::{DType, HUGE_PAGE_RESULT_BYTES, HostBuffer, ReduceOp};
pub use communicator::{Communicator, HostCommunicator, Pending};
pub use config::{
    CommConfig, DEFAULT_DIVERGENCE_GRACE, DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_TIMEOUT, MAX_TIMEOUT,
};
pub use env::RankInfo;
pub use error::{CommError, Result, SharedFileProblem};
pub use init::{Group, connect, init};
#[cfg(feature = "cuda")]
pub use nccl::{DeviceBuffer, InPlaceGroup, InPlaceOp, NcclCommunicator, RawSlice};
pub use op::{Lane, OpDesc, OpKind, human_bytes};
pub use reduce::chunk_range;
pub use shared::{SharedBuffer, SharedMemory};
pub use threads::ThreadShare;
pub use transport::Link;
