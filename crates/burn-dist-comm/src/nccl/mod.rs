//! The NCCL communicator (feature `cuda`): the [`Communicator`](crate::Communicator)
//! collectives on GPU buffers.
//!
//! - **Buffers.** `DeviceBuffer`: a view of `len` elements (f32, f16, bf16 or u8) in an
//!   allocation on this rank's GPU. Every collective runs in place on it (reduce-scatter hands
//!   back the same allocation narrowed to this rank's chunk; all-gather widens a shard back in
//!   place when it can). `NcclCommunicator::upload` and `NcclCommunicator::download` move
//!   data between host and device. `NcclCommunicator::in_place` runs a group of calls on
//!   memory it does not own (Burn/cubecl tensors: burn-dist's device reducer).
//! - **Streams.** One dedicated comm stream per communicator, on the device's primary context
//!   (the one cubecl-cuda uses). Collectives run on it in issue order.
//! - **Chunks.** Exactly the host communicator's: rank `q` owns
//!   [`chunk_range`](crate::chunk_range) of the buffer, or the `counts[q]` elements of
//!   `reduce_scatter_counts`. Uneven chunks run as grouped `ncclReduce`/`ncclBroadcast` calls
//!   (see `plan`), equal ones as the native calls.
//! - **Rendezvous.** Rank 0 mints NCCL's unique id and `set`s it in the TCP store; the other
//!   ranks `get` it (bounded by the join timeout). The key carries how many NCCL communicators
//!   the rank has joined before, so that a job may build several.
//! - **Timeouts.** The communicator is non-blocking (`blocking = 0`): initialisation and every
//!   collective are polled (`ncclCommGetAsyncError`, and a CUDA event for completion), and on
//!   a failure or after [`CommConfig::timeout`](crate::CommConfig::timeout) the worker calls
//!   `ncclCommAbort`, which also stops kernels waiting for a dead peer. Every
//!   [`Pending::wait`](crate::Pending::wait) therefore returns.
//! - **Numerics.** NCCL reduces in its own order, rounding f16/bf16 partial sums at each step,
//!   so with more than one rank the results match the host communicator's to rounding, not
//!   bit for bit (they are still identical on every rank). Max follows NCCL's NaN handling.
//!   At world size 1 every collective returns its input exactly.
//! - **Libraries.** libcuda and libnccl are opened at run time; a missing library is an error
//!   naming it and the names tried (see `error` and docs/gpu.md).

#[cfg(feature = "cuda")]
mod buffer;
#[cfg(feature = "cuda")]
mod communicator;
#[cfg(feature = "cuda")]
mod error;
#[cfg(feature = "cuda")]
mod in_place;
pub(crate) mod plan;
#[cfg(feature = "cuda")]
mod worker;

#[cfg(feature = "cuda")]
pub use buffer::DeviceBuffer;
#[cfg(feature = "cuda")]
pub use communicator::NcclCommunicator;
#[cfg(feature = "cuda")]
pub use in_place::{InPlaceGroup, InPlaceOp, RawSlice};
