//! The interface the reducer and ZeroAdam use for every collective on device memory.

use std::sync::Arc;

use burn_dist_comm::{HostBuffer, Pending, ReduceOp};
use cubecl::Runtime;

use crate::error::Result;
use crate::slice::DeviceSlice;
use crate::traffic::TrafficCounter;

/// Collectives in place on device memory of runtime `R`.
///
/// The semantics are the host communicator's ([`burn_dist_comm::Communicator`]): every rank
/// issues the same calls in the same order with slices of the same lengths and dtypes; floats
/// are reduced in f32 in rank order and rounded once, so results are bit-identical on every
/// rank; a failed peer fails every rank with the root cause. A call returns once its work is
/// issued; [`DevicePending::wait`] returns once its results are in device memory, visible to
/// kernels launched afterwards on the slices' clients.
pub trait DeviceCollectives<R: Runtime>: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;

    /// Reduces every slice of `slices` over ranks, in place; one group, one wait.
    fn all_reduce(&self, slices: &[DeviceSlice<R>], op: ReduceOp) -> Result<DevicePending>;

    /// Reduce-scatter in place, into uneven chunks: `slice` is cut into `counts` (one count per
    /// rank, summing to its length, a count may be 0); afterwards this rank's chunk of its
    /// slice holds the reduction of that chunk over ranks, and the rest is left as it was.
    fn reduce_scatter(
        &self,
        slice: &DeviceSlice<R>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<DevicePending>;

    /// [`DeviceCollectives::reduce_scatter`] of every `(slice, counts)` of `parts` (all of one
    /// dtype), as one collective: one NCCL group, or one host reduce-scatter of the parts'
    /// chunks laid out rank by rank; one wait. ZeRO-2 reduces a bucket's parameters with it.
    fn reduce_scatter_each(
        &self,
        parts: &[(DeviceSlice<R>, Vec<usize>)],
        op: ReduceOp,
    ) -> Result<DevicePending>;

    /// All-gather in place, of uneven chunks: `slice` is cut into `counts` as in
    /// [`DeviceCollectives::reduce_scatter`]; this rank's chunk is its contribution, and
    /// afterwards every chunk holds its owner's.
    fn all_gather(&self, slice: &DeviceSlice<R>, counts: &[usize]) -> Result<DevicePending> {
        self.all_gather_each(&[(slice.clone(), counts.to_vec())], 0)
    }

    /// [`DeviceCollectives::all_gather`] of every `(slice, counts)` of `parts` (all of one
    /// dtype), as one collective: one NCCL group, or one host all-gather whose rank-`q` chunk
    /// is rank `q`'s chunks of every part, in part order; one wait. ZeroAdam gathers a group of
    /// new parameters, and ZeRO stage 3 a unit of adjacent parameters, each into a buffer of
    /// its own, with it. `tag` names what is gathered to the peers where the transport carries
    /// it (the host communicator's message headers; NCCL carries none).
    fn all_gather_each(
        &self,
        parts: &[(DeviceSlice<R>, Vec<usize>)],
        tag: u32,
    ) -> Result<DevicePending>;

    /// Every rank's `slice` gets `root`'s.
    fn broadcast(&self, slice: &DeviceSlice<R>, root: usize) -> Result<DevicePending>;

    /// The bytes moved between host and device by these collectives, and by whoever else
    /// records in the same counter (the reducer's and the optimizer's scalar reads).
    fn traffic(&self) -> &Arc<TrafficCounter>;

    /// What moves the data, for logs and errors: "nccl" or "staged through the host".
    fn name(&self) -> &'static str;
}

/// A device collective that may still be running.
#[must_use = "a collective's result must be waited for"]
pub struct DevicePending(Waiting);

enum Waiting {
    /// Nothing to wait for (an empty call).
    Done,
    /// A host collective, then what its result becomes on the device (the staged write-back).
    Host(
        Pending<HostBuffer>,
        Box<dyn FnOnce(HostBuffer) -> Result<()> + Send>,
    ),
    /// A collective that leaves its result in device memory itself (NCCL's group).
    InPlace(Pending<()>),
}

impl DevicePending {
    /// A call that had nothing to do.
    pub(crate) fn done() -> Self {
        DevicePending(Waiting::Done)
    }

    /// The host collective `pending`, whose result `then` writes to the device (on the
    /// waiting thread).
    pub(crate) fn host(
        pending: Pending<HostBuffer>,
        then: impl FnOnce(HostBuffer) -> Result<()> + Send + 'static,
    ) -> Self {
        DevicePending(Waiting::Host(pending, Box::new(then)))
    }

    /// A collective that writes device memory itself, done when `pending` is.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn in_place(pending: Pending<()>) -> Self {
        DevicePending(Waiting::InPlace(pending))
    }

    /// Waits until the results are in device memory.
    pub fn wait(self) -> Result<()> {
        match self.0 {
            Waiting::Done => Ok(()),
            Waiting::Host(pending, then) => then(pending.wait()?),
            Waiting::InPlace(pending) => Ok(pending.wait()?),
        }
    }

    /// Whether the collective itself is over, so that [`DevicePending::wait`] would not wait
    /// for any peer (a staged one still writes its result to the device there).
    pub fn is_done(&mut self) -> bool {
        match &mut self.0 {
            Waiting::Done => true,
            Waiting::Host(pending, _) => pending.is_done(),
            Waiting::InPlace(pending) => pending.is_done(),
        }
    }
}

impl std::fmt::Debug for DevicePending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DevicePending")
    }
}
