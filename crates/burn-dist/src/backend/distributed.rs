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

use crate::DistributedBackend;
use crate::sync;

impl<B: Backend> BurnDistributedBackend for DistributedBackend<B> {
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
        sync::on_gradient_ready::<B>(tensor, distributed_params);
    }

    fn submit_sync_collective(device: &Self::Device) {
        sync::on_backward_end::<B>(device);
    }

    /// Panics: Burn's in-process device all-reduce is not how burn-dist reduces.
    ///
    /// Who calls it in Burn 0.21: only Burn's own sync server (started by Burn's default
    /// `start_communication_server` and fed by Burn's default hooks, both replaced here) and
    /// `Autodiff::all_reduce`, which is reached only when user code calls the backend trait
    /// directly. Burn's nn, optim and train crates never call it (burn-optim's `all_reduce` goes
    /// through burn-collective, another crate). Its contract is "reduce this tensor across the
    /// listed in-process devices", returning a handle with no error path, which our per-process
    /// group cannot honour from a list of device ids, and returning the tensor unchanged would
    /// be a silent wrong answer. So it fails loudly with a pointer to what to use instead.
    fn all_reduce(
        _tensor: FloatTensor<Self>,
        _op: ReduceOperation,
        _device_ids: Vec<DeviceId>,
    ) -> CollectiveTensor<Self> {
        panic!(
            "burn-dist: Burn's in-process DistributedBackend::all_reduce is not supported by \
             burn_dist::DistributedBackend. Gradients of parameters marked with \
             `Tensor::set_distributed` are reduced during backward(); for other tensors use \
             burn-dist's collectives."
        )
    }

    /// Does nothing: there is never a pending collective to wait for.
    ///
    /// Burn calls it to resolve a `CollectiveTensor` (only [`all_reduce`](Self::all_reduce)
    /// makes one, and ours panics) and from its own sync server's callback (never started).
    /// Our reducer finishes its collectives inside `submit_sync_collective`, before `backward()`
    /// returns, so when this runs there is nothing left to synchronise.
    fn sync_collective(_device: &Self::Device) {}
}
