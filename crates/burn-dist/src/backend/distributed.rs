//! Burn's distributed trait for [`DistributedBackend`]: the three backward hooks go to our reducer.
//!
//! How Burn 0.21 uses this trait (burn-autodiff `runtime/server.rs`, `distributed.rs`,
//! `tensor.rs`, `grads.rs`), for a backward pass on `Autodiff<DistributedBackend<B>>`:
//!
//! - `register_sync_parameters` is called once, before any gradient is computed, with the
//!   parameters marked by `Tensor::set_distributed` that this graph reaches (in `HashMap` order).
//!   It is not called at all when the graph has no marked parameter, and then neither are the
//!   two other hooks.
//! - `submit_gradient_sync` is called once per marked parameter, the moment its gradient is
//!   final, with a pointer into the gradients container.
//! - `submit_sync_collective` is called once, after the last step, before `backward()` returns.
//!
//! All three run synchronously on the thread that called `backward()`.

use burn_backend::distributed::{
    CollectiveTensor, DistributedBackend as BurnDistributedBackend, DistributedConfig,
    DistributedParams, ReduceOperation, TensorRef,
};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DeviceId};

use super::mode::Mode;
use crate::DistributedBackend;
use crate::sync;

impl<B: Backend, P: Mode<B>> BurnDistributedBackend for DistributedBackend<B, P> {
    /// Does nothing: burn-dist's process group is set up by burn-dist itself, not by Burn.
    ///
    /// Burn's default starts its own in-process sync server, which only Burn's default hooks
    /// feed; ours never do, so it would be an idle thread. burn-train's DDP strategy calls this.
    fn start_communication_server(_devices: &[Self::Device], _config: DistributedConfig) {}

    /// Does nothing, like [`start_communication_server`](Self::start_communication_server).
    fn close_communication_server(_device: &Self::Device) {}

    fn register_sync_parameters(device: &Self::Device, distributed_params: Vec<DistributedParams>) {
        sync::on_backward_start::<B>(device, distributed_params);
    }

    fn submit_gradient_sync(tensor: TensorRef<Self>, distributed_params: DistributedParams) {
        sync::on_gradient_ready::<B, P>(tensor, distributed_params);
    }

    fn submit_sync_collective(device: &Self::Device) {
        sync::on_backward_end::<B>(device);
    }

    /// Reduces `tensor` over the calling rank's group (`device_ids` are Burn's in-process
    /// device list; burn-dist's group is the set of ranks, one device each). Burn's nn, optim
    /// and train crates never call this; user code that calls the backend trait directly does.
    /// Without a `Ddp` on this thread the group is this process alone and the tensor is the
    /// result. A failed collective panics with its reason: the trait has no error path.
    fn all_reduce(
        tensor: FloatTensor<Self>,
        op: ReduceOperation,
        _device_ids: Vec<DeviceId>,
    ) -> CollectiveTensor<Self> {
        let reduced = sync::all_reduce_tensor::<B>(P::enter(tensor), op)
            .unwrap_or_else(|error| panic!("burn-dist: all_reduce failed: {error}"));
        CollectiveTensor::new(P::leave(reduced))
    }

    /// Does nothing: there is never a pending collective to wait for.
    ///
    /// Burn calls it to resolve a `CollectiveTensor` (ours are complete when made, see
    /// [`all_reduce`](Self::all_reduce)) and from its own sync server's callback (never started).
    /// Our reducer finishes its collectives inside `submit_sync_collective`, before `backward()`
    /// returns, so when this runs there is nothing left to synchronise.
    fn sync_collective(_device: &Self::Device) {}
}
