//! Burn optimizers under data parallelism: a check that every step's gradients were averaged
//! over the ranks, for optimizers that a training loop drives through Burn's `Optimizer` trait
//! (burn-train's `Learner`), where nothing else would notice.
//!
//! Why a check: Burn averages a gradient across ranks only if its parameter was marked
//! (`Tensor::set_distributed`) when backward ran. A copy of the model that lost its marks
//! (burn-train's `Learner` forks the model, which detaches every parameter) trains each rank
//! on its own gradients, silently: the loss still goes down. The reducer counts the backward
//! passes whose gradients it saw; an optimizer step with no such pass since the last one was
//! handed unsynchronized gradients.

use std::sync::Arc;

use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, MultiGradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn_dist_comm::{Communicator, HostCommunicator};

use crate::context::{SharedReducer, lock};
use crate::error::{DistError, Result};
use crate::gradient_shard::GradientShard;
use crate::{Ddp, ReducerStats};

/// A cloneable handle on a rank's reducer and communicator, for an optimizer that lives apart
/// from its [`Ddp`] (Burn's `Optimizer` trait passes no context to `step`).
#[derive(Clone)]
pub struct SyncHandle {
    reducer: SharedReducer,
    comm: Arc<HostCommunicator>,
}

impl SyncHandle {
    pub(crate) fn new(reducer: SharedReducer, comm: Arc<HostCommunicator>) -> Self {
        SyncHandle { reducer, comm }
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// The rank's host communicator.
    pub fn comm(&self) -> Arc<HostCommunicator> {
        self.comm.clone()
    }

    /// The reducer's counters.
    pub fn stats(&self) -> ReducerStats {
        lock(&self.reducer).stats()
    }

    /// ZeRO stage 2: see [`Ddp::take_gradient_shard`].
    pub fn take_gradient_shard(&self) -> Result<GradientShard> {
        lock(&self.reducer).take_gradient_shard()
    }

    /// ZeRO stage 2 on the device path: [`SyncHandle::take_gradient_shard`] without leaving
    /// device memory. The shard is a `burn_cubecl::tensor::CubeTensor<R>` of the device path's
    /// runtime (f32, one element per element of this rank's flat shard), erased because the
    /// handle is not generic; ZeroAdam's device state takes it as its gradient buffer.
    #[cfg(feature = "device")]
    #[doc(hidden)]
    pub fn take_device_gradient_shard(&self) -> Result<(Box<dyn std::any::Any>, Vec<bool>)> {
        lock(&self.reducer).take_device_gradient_shard()
    }
}

/// Remembers how many backward passes the reducer had seen at the last optimizer step.
#[derive(Clone)]
pub struct SyncCheck {
    handle: SyncHandle,
    seen: u64,
}

impl SyncCheck {
    /// Counts from now: the next step needs a synchronized backward after this call.
    pub fn new(handle: SyncHandle) -> Self {
        let seen = handle.stats().backwards;
        SyncCheck { handle, seen }
    }

    pub fn handle(&self) -> &SyncHandle {
        &self.handle
    }

    /// Call at each optimizer step: fails with [`DistError::UnsyncedStep`] when no backward
    /// pass reached the reducer since the previous step (or since [`SyncCheck::new`]).
    pub fn step(&mut self) -> Result<()> {
        let now = self.handle.stats().backwards;
        if now == self.seen {
            return Err(DistError::UnsyncedStep {
                rank: self.handle.rank(),
            });
        }
        self.seen = now;
        Ok(())
    }

    /// [`SyncCheck::step`] for Burn's `Optimizer::step`, which cannot return an error: panics
    /// with [`DistError::UnsyncedStep`]'s message, which names the fix.
    pub fn expect_synced(&mut self) {
        if let Err(error) = self.step() {
            panic!("{error}");
        }
    }
}

/// Any Burn optimizer, checked to step only on gradients averaged over the ranks: the same
/// optimizer, record and checkpoints, plus [`SyncCheck`] at every step. Build it with
/// [`Ddp::optimizer`]. Burn's `Optimizer::step` cannot return an error, so an unsynchronized
/// step panics with [`DistError::UnsyncedStep`]'s message, which names the fix.
#[derive(Clone)]
pub struct DdpOptimizer<O> {
    inner: O,
    check: SyncCheck,
}

impl<O> DdpOptimizer<O> {
    /// The wrapped optimizer.
    pub fn into_inner(self) -> O {
        self.inner
    }
}

impl<M, B, O> Optimizer<M, B> for DdpOptimizer<O>
where
    M: AutodiffModule<B>,
    B: AutodiffBackend,
    O: Optimizer<M, B>,
{
    type Record = O::Record;

    fn step(&mut self, lr: f64, module: M, grads: GradientsParams) -> M {
        self.check.expect_synced();
        self.inner.step(lr, module, grads)
    }

    /// burn-train's multi-device strategy: several devices in one process, which burn-dist
    /// replaces with one process per device.
    fn step_multi(&mut self, _lr: f64, _module: M, _grads: MultiGradientsParams) -> M {
        panic!("{}", DistError::MultiDevice)
    }

    fn to_record(&self) -> Self::Record {
        self.inner.to_record()
    }

    fn load_record(self, record: Self::Record) -> Self {
        DdpOptimizer {
            inner: self.inner.load_record(record),
            check: self.check,
        }
    }
}

impl Ddp {
    /// A handle on this rank's reducer and communicator that an optimizer can keep.
    pub fn sync_handle(&self) -> SyncHandle {
        SyncHandle::new(self.shared_reducer(), self.comm())
    }

    /// `optimizer` (any Burn optimizer, e.g. `AdamConfig::new().init()`) with a check at every
    /// step that its gradients were averaged over the ranks (see [`DdpOptimizer`]).
    pub fn optimizer<O>(&self, optimizer: O) -> DdpOptimizer<O> {
        DdpOptimizer {
            inner: optimizer,
            check: SyncCheck::new(self.sync_handle()),
        }
    }
}
