//! The reducer's in-place CUDA path (feature `cuda`): bucket gradients reduced by NCCL in the
//! gradients' own device memory, never copied through the host.
//!
//! - **Copy-in** ([`DeviceStore::put`]): nothing is copied. The hook hands over the gradient
//!   tensor itself (a cubecl `CubeTensor<CudaRuntime>`: burn-cuda without fusion), made unique
//!   and contiguous first when it is not ([`in_place_gradient`]). With gradient accumulation the
//!   window's local sum is kept as a device tensor (one add per micro-batch on the compute
//!   stream).
//! - **Launch** ([`DeviceStore::launch`]): for the buckets that became ready, every gradient's
//!   device address (`client.get_resource(handle)`, the `ManagedResource` kept alive until NCCL
//!   is done), one synchronization of the compute stream, then per bucket one NCCL group of
//!   per-tensor `ncclAllReduce(avg)` in place. Parameters this rank did not use get device
//!   zeros of their registered dtype.
//! - **Wait / write-back**: the reduced tensors are put back into Burn's container (the same
//!   memory when the gradient was reduced where it was), scaled by 1/K after a window of K
//!   micro-batches.
//!
//! Ordering (docs/gpu.md, "The in-place path"): cubecl-cuda 0.10 has no accessor for its
//! compute stream, so no event can order NCCL's stream after it; the launch blocks the host
//! until the compute stream has finished what was queued (`ComputeClient::sync`), once per
//! launch, i.e. once per bucket or batch of buckets that become ready together.

use std::any::Any;
use std::ops::Range;
use std::sync::Arc;

use burn::tensor::{DType, Shape};
use burn_backend::ops::FloatTensorOps;
use burn_backend::{Scalar, Slice, TensorMetadata, read_sync};
use burn_cubecl::CubeBackend;
use burn_cubecl::cubecl::cuda::{CudaDevice, CudaRuntime};
use burn_cubecl::tensor::CubeTensor;
use burn_dist_comm::{InPlaceGroup, InPlaceOp, NcclCommunicator, Pending, RawSlice, ReduceOp};

use crate::bucket::Bucket;
use crate::error::DistError;
use crate::flat::FlatLayout;

/// burn-cuda's backend without fusion: whose float primitive the device path reduces.
pub type Cube = CubeBackend<CudaRuntime, f32, i32, u8>;
/// Its float tensor.
pub type CudaTensor = CubeTensor<CudaRuntime>;

/// The device half of the reducer's bucket store: per parameter, its gradient on the GPU.
pub(crate) struct DeviceStore {
    comm: Arc<NcclCommunicator>,
    device: CudaDevice,
    /// Per parameter (visit order): the dtype every rank reduces it in (the parameter's).
    dtypes: Vec<DType>,
    /// Per parameter: this window's local gradient (sum over micro-batches), reduced in place
    /// by the launch; taken at write-back.
    grads: Vec<Option<CudaTensor>>,
    /// Host synchronizations of the compute stream (one per launch).
    pub(crate) syncs: u64,
    /// Gradients copied before their in-place reduction (by the hook, or at launch for a
    /// window's sum or a cast that came out with padded rows).
    pub(crate) copies: CopyCounts,
}

impl DeviceStore {
    pub(crate) fn new(comm: Arc<NcclCommunicator>, device: CudaDevice) -> Self {
        DeviceStore {
            comm,
            device,
            dtypes: Vec::new(),
            grads: Vec::new(),
            syncs: 0,
            copies: CopyCounts::default(),
        }
    }

    /// The parameters' dtypes (visit order); forgets every gradient held.
    pub(crate) fn register(&mut self, dtypes: Vec<DType>) {
        self.grads = (0..dtypes.len()).map(|_| None).collect();
        self.dtypes = dtypes;
    }

    /// A new window starts: drop what the last one left (reduced gradients of parameters this
    /// rank had no local gradient for, kept for `Ddp::backward`).
    pub(crate) fn begin_window(&mut self, params: usize) {
        self.grads = (0..params).map(|_| None).collect();
    }

    /// The gradient of parameter `p` arrived (`accumulate`: add it to the window's sum);
    /// `copied`: why the hook copied it, if it did.
    pub(crate) fn put(
        &mut self,
        p: usize,
        grad: CudaTensor,
        copied: Option<CopyReason>,
        accumulate: bool,
    ) -> Result<(), DistError> {
        self.copies.record(copied);
        let dtype = *self.dtypes.get(p).ok_or_else(|| {
            DistError::Usage(format!(
                "parameter #{p} has no registered dtype on the NCCL reducer"
            ))
        })?;
        nccl_dtype(dtype, p)?;
        let grad = if grad.dtype == dtype {
            grad
        } else {
            Cube::float_cast(grad, dtype.into())
        };
        self.grads[p] = Some(match self.grads[p].take() {
            Some(sum) if accumulate => Cube::float_add(sum, grad),
            _ => grad,
        });
        Ok(())
    }

    /// Launches `buckets` (consecutive, in layout order), each as one NCCL group of in-place
    /// averages over ranks. `written[p]`: whether `p` has a gradient on this rank in the window
    /// (the others contribute zeros). Without `owners` every gradient is all-reduced; with
    /// them (ZeRO-2) each parameter's piece in rank `q`'s shard is reduced to `q` only.
    pub(crate) fn launch(
        &mut self,
        buckets: &[&Bucket],
        written: &[bool],
        numels: &[usize],
        owners: Option<&FlatLayout>,
    ) -> Result<Vec<Pending<()>>, DistError> {
        let mut groups = Vec::with_capacity(buckets.len());
        let mut client = None;
        for bucket in buckets {
            let mut calls = Vec::with_capacity(bucket.params.len());
            let mut keep = Vec::with_capacity(bucket.params.len());
            for &p in &bucket.params {
                let dtype = self.dtypes[p];
                let tensor = match self.grads[p].take() {
                    // A window's sum or a cast is a new kernel output: its rows may be padded.
                    Some(grad) if written[p] && !grad.is_contiguous() => {
                        self.copies.record(copy_reason(
                            true,
                            false,
                            grad.meta.shape(),
                            grad.meta.strides(),
                        ));
                        contiguous_copy(grad)
                    }
                    Some(grad) if written[p] => grad,
                    _ => Cube::float_zeros(Shape::new([numels[p]]), &self.device, dtype.into()),
                };
                if numels[p] == 0 {
                    // Nothing to reduce (and no memory to resolve).
                    self.grads[p] = Some(tensor);
                    continue;
                }
                if tensor.shape().num_elements() != numels[p] {
                    return Err(DistError::GradientShape {
                        param: p,
                        expected: numels[p],
                        got: tensor.shape().num_elements(),
                    });
                }
                let (ptr, resource) = device_address(&tensor).map_err(|e| {
                    DistError::Usage(format!("parameter #{p}: the address of its gradient: {e}"))
                })?;
                let dtype = nccl_dtype(dtype, p)?;
                match owners {
                    None => calls.push((
                        RawSlice {
                            ptr,
                            len: numels[p],
                            dtype,
                        },
                        InPlaceOp::AllReduce(ReduceOp::Avg),
                    )),
                    Some(flat) => {
                        for (root, within) in owned_pieces(flat, p) {
                            let slice = RawSlice {
                                ptr: ptr + (within.start * dtype.size()) as u64,
                                len: within.len(),
                                dtype,
                            };
                            calls.push((
                                slice,
                                InPlaceOp::Reduce {
                                    root,
                                    op: ReduceOp::Avg,
                                },
                            ));
                        }
                    }
                }
                client.get_or_insert_with(|| tensor.client.clone());
                // The tensor (its handle) and the resource (its binding) keep the memory
                // allocated, and out of the memory pool, until NCCL is done with it.
                keep.push((tensor.clone(), resource));
                self.grads[p] = Some(tensor);
            }
            groups.push(InPlaceGroup {
                calls,
                keep_alive: Box::new(keep) as Box<dyn Any + Send>,
            });
        }
        // The gradients (and the zeros, casts and copies made above) are written by kernels
        // on this thread's compute stream, which NCCL's stream cannot wait on (no accessor in
        // cubecl-cuda 0.10): wait for it on the host, once for all these buckets.
        if let Some(client) = client {
            burn_cubecl::cubecl::future::block_on(client.sync()).map_err(|e| {
                DistError::Usage(format!(
                    "synchronizing the compute stream before reducing gradients: {e:?}"
                ))
            })?;
            self.syncs += 1;
        }
        // SAFETY: every slice is the contiguous memory of a live tensor on the communicator's
        // GPU, of `numels[p]` elements of its dtype, at the address cubecl resolved; the
        // tensors are final (the compute stream is drained) and nothing touches them until the
        // reducer has waited for these groups (`finish`, before `backward()` returns); each
        // group's `keep_alive` holds them.
        Ok(groups
            .into_iter()
            .map(|group| unsafe { self.comm.in_place(group) })
            .collect())
    }

    /// ZeRO-2, after bucket `bucket`'s reduction: this rank's segment of it (its pieces of the
    /// bucket's parameters, in flat order), read to the host for the gradient shard; the
    /// bucket's gradients are dropped from the store (Burn's container releases its copies at
    /// the end of backward).
    pub(crate) fn owned_segment(
        &mut self,
        bucket: &Bucket,
        flat: &FlatLayout,
        rank: usize,
    ) -> Result<Vec<f32>, DistError> {
        let shard = flat.shard(rank);
        let mut pieces = Vec::new();
        for &p in &bucket.params {
            let grad = self.grads[p].take();
            let Some((_, within)) = owned_pieces(flat, p).find(|(q, _)| *q == rank) else {
                continue;
            };
            let grad = grad.ok_or_else(|| {
                DistError::Usage(format!("parameter #{p}: no reduced gradient on the device"))
            })?;
            let at = flat.offsets[p] + within.start - shard.start;
            let n = flat.numels[p];
            let piece = Cube::float_slice(
                Cube::float_reshape(grad, Shape::new([n])),
                &[Slice {
                    start: within.start as isize,
                    end: Some(within.end as isize),
                    step: 1,
                }],
            );
            let values = read_sync(Cube::float_into_data(piece))
                .map_err(|e| {
                    DistError::Usage(format!("parameter #{p}: reading its reduced piece: {e:?}"))
                })?
                .convert::<f32>()
                .into_vec::<f32>()
                .map_err(|e| {
                    DistError::Usage(format!("parameter #{p}: reading its reduced piece: {e:?}"))
                })?;
            pieces.push((at, values));
        }
        pieces.sort_by_key(|(at, _)| *at);
        let start = pieces.first().map_or(0, |(at, _)| *at);
        let mut segment = Vec::new();
        for (at, values) in pieces {
            if at != start + segment.len() {
                return Err(DistError::Usage(format!(
                    "bucket pieces of rank {rank}'s shard are not contiguous at element {at}"
                )));
            }
            segment.extend(values);
        }
        Ok(segment)
    }

    /// The reduced gradient of `p`, scaled by `scale` (1/K after K micro-batches); taken.
    pub(crate) fn take(&mut self, p: usize, scale: f32) -> Option<CudaTensor> {
        let grad = self.grads.get_mut(p)?.take()?;
        Some(if scale == 1.0 {
            grad
        } else {
            let dtype = grad.dtype;
            Cube::float_mul_scalar(grad, Scalar::new(scale, &dtype))
        })
    }

    /// The reduced gradient of `p` read to the host as f32 (a parameter this rank did not use:
    /// rare, and `Ddp::backward` needs it as a new tensor anyway).
    pub(crate) fn read(&self, p: usize, scale: f32) -> Option<Vec<f32>> {
        let grad = self.grads.get(p)?.clone()?;
        let data = read_sync(Cube::float_into_data(grad)).ok()?;
        let values = data.convert::<f32>().into_vec::<f32>().ok()?;
        Some(if scale == 1.0 {
            values
        } else {
            values.into_iter().map(|v| v * scale).collect()
        })
    }
}

/// The device address of `tensor`'s first element: cubecl's `ManagedResource` pointer for the
/// tensor's handle (the handle's offset into its memory page included), with the resource,
/// which keeps the memory out of cubecl's pool while it lives. The tensor must be contiguous
/// for its elements to lie at `[address, address + bytes)`. Public for the device check.
#[doc(hidden)]
pub fn device_address(tensor: &CudaTensor) -> Result<(u64, impl Send + 'static), String> {
    let resource = tensor
        .client
        .get_resource(tensor.handle.clone())
        .map_err(|e| format!("cubecl could not resolve the tensor's memory: {e:?}"))?;
    Ok((resource.resource().ptr, resource))
}

/// Each rank's piece of parameter `p` in the flat layout: (owner, elements of `p`), non-empty
/// only.
fn owned_pieces(flat: &FlatLayout, p: usize) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
    let offset = flat.offsets[p];
    (0..flat.world).filter_map(move |q| {
        let r = flat.in_shard(flat.param_range(p), q);
        (!r.is_empty()).then(|| (q, r.start - offset..r.end - offset))
    })
}

fn nccl_dtype(dtype: DType, p: usize) -> Result<burn_dist_comm::DType, DistError> {
    Ok(match dtype {
        DType::F32 | DType::Flex32 => burn_dist_comm::DType::F32,
        DType::F16 => burn_dist_comm::DType::F16,
        DType::BF16 => burn_dist_comm::DType::BF16,
        other => {
            return Err(DistError::Usage(format!(
                "parameter #{p}: the NCCL reducer reduces f32, f16 and bf16 gradients; this one \
                 is {other:?}"
            )));
        }
    })
}

/// The gradient behind `target` as a tensor the reducer may reduce in place, and why it was
/// copied if it was: the container's own tensor when nothing else holds its memory and it is
/// contiguous, else a contiguous copy that replaces it in the container. `None` when the inner
/// backend is not burn-cuda without fusion.
///
/// # Safety
///
/// `target` points into Burn's live gradient container, at a final gradient.
pub(crate) unsafe fn in_place_gradient<T: Any>(
    target: *mut T,
) -> Option<(CudaTensor, Option<CopyReason>)> {
    // SAFETY: as the caller promised.
    let entry = unsafe { &mut *target } as &mut dyn Any;
    let tensor = entry.downcast_mut::<CudaTensor>()?;
    let reason = copy_reason(
        tensor.can_mut(),
        tensor.is_contiguous(),
        tensor.meta.shape(),
        tensor.meta.strides(),
    );
    if reason.is_some() {
        // Shared memory (another tensor, or a later backward step, reads it), a strided view or
        // padded rows: reduce a private contiguous copy instead, and let the container hold it.
        *tensor = contiguous_copy(tensor.clone());
    }
    Some((tensor.clone(), reason))
}

/// A copy of `tensor` in new memory, row-major without padding: cubecl's `into_contiguous`
/// always allocates unpadded memory, where `CubeTensor::copy` would allocate padded rows again
/// (and `burn_cubecl::kernel::into_contiguous` returns a contiguous tensor as it is). What the
/// reducer reduces instead of a gradient it cannot reduce where it is; public for the device
/// check.
#[doc(hidden)]
pub fn contiguous_copy(tensor: CudaTensor) -> CudaTensor {
    let (client, device, dtype) = (tensor.client.clone(), tensor.device.clone(), tensor.dtype);
    let output =
        burn_cubecl::cubecl::std::tensor::into_contiguous(&client, tensor.binding(), dtype.into());
    CudaTensor::new(client, output.handle, *output.metadata, device, dtype)
}

/// Why the device path copied a gradient before reducing it in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CopyReason {
    /// Its memory is shared (another tensor or a later backward step reads it).
    Shared,
    /// A private tensor whose rows cubecl-cuda's allocator padded (see [`cuda_pads_rows`]).
    Pitched,
    /// Another strided layout: a transposed or broadcast view, a slice.
    Strided,
}

/// Gradients the device path copied before reducing them in place (in the reducer's stats).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct CopyCounts {
    /// Every copy, whatever the reason.
    pub(crate) private: u64,
    /// Those of private gradients whose rows cubecl-cuda had padded.
    pub(crate) pitched: u64,
}

impl CopyCounts {
    /// Counts a gradient copied for `reason` (nothing for `None`: reduced where it was).
    pub(crate) fn record(&mut self, reason: Option<CopyReason>) {
        if let Some(reason) = reason {
            self.private += 1;
            if reason == CopyReason::Pitched {
                self.pitched += 1;
            }
        }
    }
}

/// Why a gradient with this memory and layout must be copied before an in-place reduction;
/// `None` when it can be reduced where it is (unique and contiguous).
pub(crate) fn copy_reason(
    unique: bool,
    contiguous: bool,
    shape: &[usize],
    strides: &[usize],
) -> Option<CopyReason> {
    match (unique, contiguous) {
        (true, true) => None,
        (false, _) => Some(CopyReason::Shared),
        (true, false) if is_pitched(shape, strides) => Some(CopyReason::Pitched),
        (true, false) => Some(CopyReason::Strided),
    }
}

/// The row alignment, in bytes, of cubecl-cuda 0.10's allocator (`mem_alignment` in its
/// `runtime.rs`, what `cuMemAllocPitch` returns), to which `PitchedMemoryLayoutPolicy` pads rows.
pub const CUDA_ROW_ALIGNMENT: usize = 512;

/// Whether `strides` is a padded-rows layout of `shape`: row-major, except that each row (the
/// last dimension) is followed by padding, as cubecl-runtime's `PitchedMemoryLayoutPolicy` lays
/// out the tensors cubecl-cuda creates (`create_tensor`, `empty_tensor`: kernel outputs too).
fn is_pitched(shape: &[usize], strides: &[usize]) -> bool {
    let rank = shape.len();
    rank >= 2
        && strides.len() == rank
        && strides[rank - 1] == 1
        && strides[rank - 2] > shape[rank - 1]
        && (0..rank - 2).all(|i| strides[i] == strides[i + 1] * shape[i + 1])
}

/// Whether cubecl-cuda 0.10 pads the rows of a new tensor of `shape` with elements of
/// `elem_size` bytes, which makes it non-contiguous and so costs the in-place reducer a private
/// copy of its gradient. A row of `width × elem_size` bytes is padded to a multiple of
/// `min(512, its next power of two)` (at least 16): rows of a multiple of 512 bytes, of a power
/// of two of at least 16 bytes, or of one element are not padded; nor is a tensor of rank 1.
pub fn cuda_pads_rows(shape: &[usize], elem_size: usize) -> bool {
    let Some((&width, rows)) = shape.split_last() else {
        return false;
    };
    if rows.is_empty() || width <= 1 {
        return false;
    }
    let bytes = width * elem_size;
    let align = bytes.next_power_of_two().clamp(16, CUDA_ROW_ALIGNMENT);
    !bytes.is_multiple_of(align)
}

/// Puts a reduced gradient into the container entry `target`.
///
/// # Safety
///
/// As for [`in_place_gradient`]; `T` is [`CudaTensor`] (checked).
pub(crate) unsafe fn write_back<T: Any>(target: *mut T, grad: CudaTensor) {
    // SAFETY: as the caller promised.
    let entry = unsafe { &mut *target } as &mut dyn Any;
    if let Some(entry) = entry.downcast_mut::<CudaTensor>() {
        *entry = grad;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Another backend's gradient is left alone (the hook then reports that the NCCL reducer
    /// needs burn-cuda), not reinterpreted.
    #[test]
    fn other_backends_gradients_are_not_taken_for_the_device_path() {
        type Flex = burn_flex::Flex;
        let mut grad = Flex::float_zeros(
            Shape::new([3]),
            &Default::default(),
            burn::tensor::FloatDType::F32,
        );
        // SAFETY: a live tensor.
        assert!(unsafe { in_place_gradient(&mut grad as *mut _) }.is_none());
    }

    /// The layout cubecl-cuda 0.10 gives a new tensor: its server's own `MemoryLayoutPolicy`
    /// (cubecl-runtime's `PitchedMemoryLayoutPolicy`) at the runtime's 512-byte alignment.
    fn cuda_strides(shape: &[usize], elem_size: usize) -> Vec<usize> {
        use burn_cubecl::cubecl::Runtime;
        use burn_cubecl::cubecl::server::{
            ComputeServer, MemoryLayoutDescriptor, MemoryLayoutPolicy,
        };
        type Policy = <<CudaRuntime as Runtime>::Server as ComputeServer>::MemoryLayoutPolicy;
        let descriptor = MemoryLayoutDescriptor::optimized(shape.to_vec().into(), elem_size);
        // cubecl-cuda 0.10's `runtime.rs` creates its policy with `mem_alignment = 512`.
        let (_, layouts) = Policy::new(512).apply(
            burn_cubecl::cubecl::stream_id::StreamId::current(),
            &[descriptor],
        );
        layouts[0].strides.to_vec()
    }

    fn row_major(shape: &[usize]) -> Vec<usize> {
        let mut strides = vec![1; shape.len()];
        for i in (0..shape.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * shape[i + 1];
        }
        strides
    }

    /// `cuda_pads_rows` predicts exactly which shapes cubecl-cuda's allocator pads, and every
    /// padded layout is recognized as such (a `Pitched` copy, not a `Strided` one).
    #[test]
    fn padded_rows_are_predicted_and_recognized_as_cubecl_lays_them_out() {
        let widths = (1..=300).chain([384, 511, 512, 513, 768, 1000, 1024, 3072, 50257, 50304]);
        let mut padded = 0;
        for width in widths {
            for leading in [&[][..], &[1], &[3], &[64], &[2, 5]] {
                for elem_size in [2, 4] {
                    let shape: Vec<usize> = leading.iter().copied().chain([width]).collect();
                    let strides = cuda_strides(&shape, elem_size);
                    let contiguous = strides == row_major(&shape);
                    assert_eq!(
                        cuda_pads_rows(&shape, elem_size),
                        !contiguous,
                        "{shape:?} of {elem_size} B: cubecl gives strides {strides:?}"
                    );
                    let reason = copy_reason(true, contiguous, &shape, &strides);
                    if contiguous {
                        assert_eq!(reason, None, "{shape:?}");
                    } else {
                        padded += 1;
                        assert_eq!(reason, Some(CopyReason::Pitched), "{shape:?} {strides:?}");
                    }
                }
            }
        }
        assert!(
            padded > 1000,
            "the shapes tried include padded ones: {padded}"
        );
        // The case: [64, 96] f32 has 384-byte rows, padded to 512.
        assert_eq!(cuda_strides(&[64, 96], 4), [128, 1]);
        // Rows of a multiple of 512 bytes, or of a power of two, are not padded.
        for (shape, elem_size) in [([64, 128], 4), ([64, 256], 2), ([7, 64], 4), ([3, 768], 4)] {
            assert!(!cuda_pads_rows(&shape, elem_size), "{shape:?}");
        }
    }

    /// Shared memory and strided views are copied for their own reason; a unique contiguous
    /// gradient is not copied; the counts add up per reason.
    #[test]
    fn copies_are_counted_by_reason() {
        let mut counts = CopyCounts::default();
        let transposed = copy_reason(true, false, &[96, 64], &[1, 96]);
        let broadcast = copy_reason(true, false, &[16, 128], &[0, 1]);
        let shared = copy_reason(false, true, &[16, 128], &[128, 1]);
        let shared_padded = copy_reason(false, false, &[64, 96], &[128, 1]);
        let padded = copy_reason(true, false, &[64, 96], &[128, 1]);
        let in_place = copy_reason(true, true, &[16, 128], &[128, 1]);
        assert_eq!(transposed, Some(CopyReason::Strided));
        assert_eq!(broadcast, Some(CopyReason::Strided));
        assert_eq!(shared, Some(CopyReason::Shared));
        assert_eq!(shared_padded, Some(CopyReason::Shared));
        assert_eq!(padded, Some(CopyReason::Pitched));
        assert_eq!(in_place, None);
        for reason in [
            transposed,
            broadcast,
            shared,
            shared_padded,
            padded,
            in_place,
        ] {
            counts.record(reason);
        }
        assert_eq!(
            counts,
            CopyCounts {
                private: 5,
                pitched: 1
            }
        );
    }

    /// The pieces each ZeRO-2 call reduces to its owner are exactly the flat layout's pieces of
    /// every shard (`FlatLayout::pieces`, computed per shard instead of per parameter).
    #[test]
    fn owned_pieces_are_the_flat_layouts_pieces_of_each_shard() {
        let numels = [7, 1, 300, 12, 5, 0, 64];
        for world in 1..=5 {
            let flat = FlatLayout::new(&numels, world, 4);
            let mut by_param: Vec<(usize, usize, Range<usize>)> = (0..numels.len())
                .flat_map(|p| owned_pieces(&flat, p).map(move |(q, w)| (q, p, w)))
                .collect();
            let mut by_shard: Vec<(usize, usize, Range<usize>)> = (0..world)
                .flat_map(|q| {
                    flat.pieces(q)
                        .into_iter()
                        .map(move |pc| (q, pc.param, pc.within))
                })
                .collect();
            by_param.sort_by_key(|(q, p, w)| (*q, *p, w.start));
            by_shard.sort_by_key(|(q, p, w)| (*q, *p, w.start));
            assert_eq!(by_param, by_shard, "world {world}");
        }
    }
}
