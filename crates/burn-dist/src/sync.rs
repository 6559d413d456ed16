//! Entry points from Burn's backward hooks into the rank's gradient reducer.
//!
//! Burn calls them on the thread running `backward()`: `on_backward_start` with the marked
//! parameters of the graph, `on_gradient_ready` with each one's final gradient (a pointer into
//! the `Gradients` container, valid until that container is dropped), and `on_backward_end`
//! before `backward()` returns, where the reduced gradients are written back in place.
//!
//! With the device reducer (feature `device`: `Ddp::init_staged`, `Ddp::init_nccl`) a gradient
//! is not read: the hook leaves it in Burn's container and hands its place to the reducer, which
//! reduces it in device memory (`crate::device`). Rust has no specialization, so the device
//! store checks that the gradient's primitive is its backend's by type id. Every reducer on the
//! host path reads the gradient to the host.
//!
//! The hooks cannot return errors. Under `Ddp::backward` an error is kept and returned from
//! there; in a plain `loss.backward()` it ends the backward with the reason (`fail_op`: the
//! error line once, then an unwind without the panic hook's backtrace), because training on
//! with unsynchronized gradients would silently diverge the replicas.

use burn::tensor::backend::Backend;
use burn::tensor::backend::distributed::{DistributedParams, TensorRef};
use burn::tensor::read_sync;
use burn::tensor::{Shape, TensorData};
use burn_backend::TensorMetadata;

use crate::DistributedBackend;
use crate::backend::Mode;
use crate::context::{self, lock};
use crate::error::DistError;
use crate::reducer::Reducer;

fn report(reducer: &mut Reducer, error: DistError) {
    if !reducer.caller_collects_errors {
        crate::error::fail_op(format!("gradient synchronization failed: {error}"));
    }
    reducer.hook_error.get_or_insert(error);
}

/// Called by `register_sync_parameters` at the start of a backward pass that has marked parameters.
pub(crate) fn on_backward_start<B: Backend>(_device: &B::Device, params: Vec<DistributedParams>) {
    let Some(shared) = context::current() else {
        return;
    };
    let mut reducer = lock(&shared);
    reducer.hook_error = None;
    let ids: Vec<_> = params.iter().map(|p| p.param_id).collect();
    if let Err(error) = reducer.start(&ids) {
        report(&mut reducer, error);
    }
}

/// Called by `submit_gradient_sync` when a marked parameter's gradient is final.
pub(crate) fn on_gradient_ready<B: Backend, P: Mode<B>>(
    tensor: TensorRef<DistributedBackend<B, P>>,
    params: DistributedParams,
) {
    let Some(shared) = context::current() else {
        return;
    };
    // SAFETY: Burn hands us a pointer into its live gradient container and does not touch that
    // entry again during this backward (the gradient is final). The inner backend's tensor sits
    // inside that entry (the entry itself in the replicated mode), so the pointer to it is as
    // valid as Burn's.
    let target: *mut B::FloatTensorPrimitive = P::local_mut(unsafe { &mut *tensor.0 });
    #[cfg(feature = "device")]
    if lock(&shared).reduces_on_device() {
        return on_device_gradient::<B>(&shared, target, params);
    }
    // Read before locking: on an accelerator this waits for the kernels that produced it.
    // SAFETY: as above.
    let grad = unsafe { (*target).clone() };
    let bytes = grad.shape().num_elements() * grad.dtype().size();
    let values =
        read_sync(B::float_into_data(grad)).map(|data| data.convert::<f32>().into_vec::<f32>());
    let mut reducer = lock(&shared);
    if reducer.hook_error.is_some() {
        return;
    }
    reducer.record_host_traffic(bytes, 0);
    let result = match values {
        Ok(Ok(values)) => reducer
            .gradient(params.param_id, &values, target as usize)
            .map(|()| {
                if reducer.is_sharded() {
                    release::<B>(target);
                }
            }),
        Ok(Err(e)) => Err(DistError::TensorRead {
            what: "a gradient as f32",
            reason: format!("{e:?}"),
        }),
        Err(e) => Err(DistError::TensorRead {
            what: "a gradient from the device",
            reason: format!("{e:?}"),
        }),
    };
    if let Err(error) = result {
        report(&mut reducer, error);
    }
}

/// The device path's hook: the gradient stays where it is; the reducer takes its place.
#[cfg(feature = "device")]
fn on_device_gradient<B: Backend>(
    shared: &crate::context::SharedReducer,
    target: *mut B::FloatTensorPrimitive,
    params: DistributedParams,
) {
    let mut reducer = lock(shared);
    if reducer.hook_error.is_some() {
        return;
    }
    let primitive = std::any::TypeId::of::<B::FloatTensorPrimitive>();
    let result = match reducer.accepts_device(primitive) {
        Ok(()) => {
            // SAFETY: as in `on_gradient_ready`: a pointer into Burn's live container, at a
            // final gradient.
            let numel = unsafe { &*target }.shape().num_elements();
            reducer
                .receive(
                    params.param_id,
                    crate::reducer::Incoming::Device { numel },
                    target as usize,
                )
                .map(|()| {
                    // ZeRO-2 and 3: the store holds the gradient (or its private copy) until its
                    // bucket is reduced, and only the owners keep the result: Burn's container
                    // lets go of it now, as on the host path.
                    if reducer.is_sharded() {
                        release::<B>(target);
                    }
                })
        }
        Err(expected) => Err(DistError::WrongBackend {
            expected: expected.to_string(),
            got: std::any::type_name::<B::FloatTensorPrimitive>().to_string(),
        }),
    };
    if let Err(error) = result {
        report(&mut reducer, error);
    }
}

/// ZeRO-2 and 3: the local gradient is in its bucket now (or held by the device store until its
/// bucket is reduced) and its reduction will live only in the owners' shards, so Burn's
/// container need not keep it. It is replaced by a zero-stride view
/// of a single zero (same shape and dtype, one element of memory), so that the full-size local
/// gradients do not pile up while backward runs, as DeepSpeed frees `param.grad` once it is in a
/// bucket. Reading it gives zeros: under stage 2 the gradient is taken from the reducer.
fn release<B: Backend>(target: *mut B::FloatTensorPrimitive) {
    // SAFETY: as in `on_gradient_ready`; the entry is final and Burn does not read it again.
    let local = unsafe { &*target };
    let (shape, dtype, device) = (local.shape(), local.dtype(), B::float_device(local));
    let one = Shape::from(vec![1; shape.num_dims()]);
    let zero = B::float_zeros(one, &device, dtype.into());
    unsafe { *target = B::float_expand(zero, shape) };
}

/// Called by `submit_sync_collective` at the end of a backward pass that had marked parameters.
///
/// The targets the reducer kept are the inner backend's tensors inside Burn's entries
/// (`on_gradient_ready`), so the decorator's mode plays no part here.
pub(crate) fn on_backward_end<B: Backend>(device: &B::Device) {
    let Some(shared) = context::current() else {
        return;
    };
    let mut reducer = lock(&shared);
    if let Some(shards) = &reducer.param_shards {
        shards.end_backward();
    }
    if reducer.hook_error.is_some() {
        return;
    }
    match reducer.finish() {
        Ok(None) => {}
        #[cfg(feature = "device")]
        Ok(Some(finished)) if reducer.reduces_on_device() => {
            for (param, target) in finished.targets {
                // SAFETY: as in `on_gradient_ready`; only gradients of the device store's
                // backend were handed over (`accepts_device`).
                if let Err(error) = unsafe { reducer.write_back_device(param, target) } {
                    report(&mut reducer, error);
                    return;
                }
            }
        }
        Ok(Some(finished)) => {
            for (param, target) in finished.targets {
                let values = reducer
                    .reduced(param)
                    .expect("a gradient that arrived was used");
                let target = target as *mut B::FloatTensorPrimitive;
                // SAFETY: as in `on_gradient_ready`; the container outlives this call.
                let local = unsafe { &*target };
                let data = TensorData::new(values, local.shape()).convert_dtype(local.dtype());
                let bytes = data.bytes.len();
                unsafe { *target = B::float_from_data(data, device) };
                reducer.record_host_traffic(0, bytes);
            }
        }
        Err(error) => report(&mut reducer, error),
    }
}

/// `tensor` reduced over the calling rank's group (identity without a `Ddp`), in its dtype.
pub(crate) fn all_reduce_tensor<B: Backend>(
    tensor: B::FloatTensorPrimitive,
    op: burn::tensor::backend::distributed::ReduceOperation,
) -> Result<B::FloatTensorPrimitive, DistError> {
    use burn::tensor::backend::distributed::ReduceOperation;
    use burn_dist_comm::{Communicator, HostBuffer, ReduceOp};
    let Some(shared) = context::current() else {
        return Ok(tensor);
    };
    let comm = lock(&shared).comm();
    let (shape, dtype, device) = (tensor.shape(), tensor.dtype(), B::float_device(&tensor));
    let data = read_sync(B::float_into_data(tensor)).map_err(|e| DistError::TensorRead {
        what: "a tensor to all-reduce",
        reason: format!("{e:?}"),
    })?;
    let values = data
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| DistError::TensorRead {
            what: "a tensor to all-reduce",
            reason: format!("{e:?}"),
        })?;
    let reduce = match op {
        ReduceOperation::Sum => ReduceOp::Sum,
        ReduceOperation::Mean => ReduceOp::Avg,
    };
    let HostBuffer::F32(values) = comm.all_reduce(HostBuffer::F32(values), reduce).wait()? else {
        unreachable!("an f32 all-reduce returns f32")
    };
    let data = TensorData::new(values, shape).convert_dtype(dtype);
    Ok(B::float_from_data(data, &device))
}
