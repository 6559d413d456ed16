//! The device half of the reducer's bucket store, for any [`CubeResident`] backend: per
//! parameter, its gradient in device memory, reduced in place by a [`DeviceCollectives`] (NCCL,
//! or staged through the host communicator). The reducer's state machine around it is the
//! host path's (`crate::reducer`).
//!
//! - **Copy-in** ([`DeviceBuckets::put`]): the gradient's cubecl tensor itself when nothing
//!   else holds its memory and it is contiguous (burn-cubecl without fusion), else a private
//!   contiguous copy on the device (fusion's tensors are always shared with fusion's own
//!   handle). With gradient accumulation the window's sum is a device tensor.
//! - **Launch**: per bucket, one all-reduce (average) of the bucket's gradients per dtype;
//!   under ZeRO-2, one grouped reduce-scatter per dtype of every parameter's pieces to their
//!   owners (`reduce_scatter_each`: one NCCL group and one host sync per bucket, not one per
//!   parameter). Parameters
//!   this rank did not use contribute device zeros of their registered dtype.
//! - **Write-back**: the reduced tensor replaces the gradient in Burn's container (through
//!   [`CubeResident::from_cube`], so fusion sees it), scaled by 1/K after K micro-batches.

use std::any::TypeId;
use std::ops::Range;
use std::sync::Arc;

use burn::tensor::{DType, Shape};
use burn_backend::ops::FloatTensorOps;
use burn_backend::{Scalar, Slice, TensorMetadata, read_sync};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use burn_dist_device::{
    DeviceCollectives, DeviceDType, DevicePending, DeviceSlice, PendingDownload, Traffic, download,
    download_async,
};

use super::copy::{CopyCounts, contiguous_copy, copy_reason};
use super::pieces::{CubePieces, DevicePieces};
use super::resident::CubeResident;
use crate::bucket::Bucket;
use crate::error::DistError;
use crate::flat::FlatLayout;
use crate::gradient_shard::owner_counts;

/// burn-cubecl's operations on the cubecl tensors the store holds (which float type the
/// backend is instantiated with does not matter to them: each tensor carries its dtype).
type Cube<R> = CubeBackend<R, f32, i32, u8>;

/// What the reducer asks of the device store, whatever the backend (the reducer is not generic).
pub(crate) trait DeviceBuckets: Send {
    /// Whether gradients whose primitive has type id `primitive` are this store's backend's.
    fn accepts(&self, primitive: TypeId) -> bool;
    /// The backend's float primitive, for messages.
    fn primitive_name(&self) -> &'static str;
    /// The parameters' dtypes (visit order); forgets every gradient held.
    fn register(&mut self, dtypes: Vec<DType>);
    /// A new window starts: drop what the last one left.
    fn begin_window(&mut self, params: usize);
    /// The gradient of parameter `p`, at `target` in Burn's container, arrived (`accumulate`:
    /// add it to the window's sum).
    ///
    /// # Safety
    /// `target` points at a live float primitive of the backend [`DeviceBuckets::accepts`].
    unsafe fn put(&mut self, p: usize, target: usize, accumulate: bool) -> Result<(), DistError>;
    /// Launches `buckets`; per bucket, the reductions to wait for.
    fn launch(
        &mut self,
        buckets: &[&Bucket],
        written: &[bool],
        numels: &[usize],
        owners: Option<&FlatLayout>,
    ) -> Result<Vec<Vec<DevicePending>>, DistError>;
    /// ZeRO-2: a new window's gradient shard of `shard_len` f32 zeros, in device memory;
    /// `stream`: read it to the host bucket by bucket on the window's last micro-batch
    /// ([`DeviceBuckets::take_streamed_shard`]).
    fn begin_shard_window(&mut self, shard_len: usize, stream: bool);
    /// ZeRO-2, after a bucket's reduction: copies (the window's first micro-batch) or adds
    /// this rank's pieces of the bucket's gradients into the device shard, on the device;
    /// drops the bucket's gradients. `(first, last)`: where the micro-batch stands in the
    /// window; on the last, a streamed window issues the read of the bucket's range of the
    /// shard.
    fn add_owned(
        &mut self,
        bucket: &Bucket,
        flat: &FlatLayout,
        rank: usize,
        window: (bool, bool),
    ) -> Result<AddedOwned, DistError>;
    /// ZeRO-2, at the end of a window of `micro_batches`: the shard becomes their mean. A
    /// streamed window's mean is taken on the host only ([`StreamedShard::finish`]): nothing
    /// takes its device shard ([`DeviceBuckets::streamed`]), so it is not scaled there too.
    fn end_shard_window(&mut self, micro_batches: usize);
    /// Whether this window's shard is read to the host bucket by bucket, so that its device
    /// copy is not the window's mean and must not be taken.
    fn streamed(&self) -> bool;
    /// ZeRO-2: the finished shard (a `CubeTensor<R>`, erased), taken.
    fn take_shard(&mut self) -> Option<Box<dyn std::any::Any>>;
    /// A shard [`DeviceBuckets::take_shard`] returned, read to the host (a host optimizer).
    fn read_shard(&self, shard: Box<dyn std::any::Any>, rank: usize)
    -> Result<Vec<f32>, DistError>;
    /// A streamed window's finished shard on the host: the reads issued bucket by bucket,
    /// waited for, with what the device shard got after them (the window's mean, a test's
    /// poison) applied the same way; `None` when the window was not streamed.
    fn take_streamed_shard(&mut self) -> Result<Option<Vec<f32>>, DistError>;
    /// Adds `value` to the finished shard's first element; false without one (tests).
    fn add_to_shard_start(&mut self, value: f32) -> bool;
    /// Replaces the gradient at `target` with `p`'s reduced one, scaled by `scale`.
    ///
    /// # Safety
    /// As for [`DeviceBuckets::put`].
    unsafe fn write_back(&mut self, p: usize, target: usize, scale: f32) -> Result<(), DistError>;
    /// `p`'s reduced gradient, scaled, read to the host (a parameter this rank did not use).
    fn read(&self, p: usize, scale: f32) -> Option<Vec<f32>>;
    /// Launches (each waits for the compute stream once, on either implementation).
    fn launches(&self) -> u64;
    /// Gradients copied before their reduction.
    fn copies(&self) -> CopyCounts;
    /// Bytes between host and device so far.
    fn traffic(&self) -> Traffic;
    /// Collectives issued on device memory so far (groups or staged host collectives).
    fn device_calls(&self) -> u64;
    /// ZeRO stage 3: this rank's shard of the sharded parameters (`shard`: its bytes, in
    /// `dtype`), placed in this store's device memory, gathered by the gather collectives.
    fn pieces(&self, dtype: DType, shard: &[u8]) -> Result<Box<dyn DevicePieces>, DistError>;
}

/// The device store of backend `B`.
pub(crate) struct DeviceStore<B: CubeResident> {
    collectives: Arc<dyn DeviceCollectives<B::Runtime>>,
    /// ZeRO stage 3's parameter gathers: the host communicator's gather lane when staged, so
    /// that a gather never waits behind a gradient reduction (NCCL: the same communicator).
    gathers: Arc<dyn DeviceCollectives<B::Runtime>>,
    device: <B::Runtime as burn_cubecl::cubecl::Runtime>::Device,
    /// Per parameter (visit order): the dtype every rank reduces it in (the parameter's).
    dtypes: Vec<DType>,
    /// Per parameter: this window's local gradient, reduced in place by the launch.
    grads: Vec<Option<CubeTensor<B::Runtime>>>,
    launches: u64,
    copies: CopyCounts,
    /// ZeRO-2: this rank's gradient shard (f32), accumulated over the window.
    shard: Option<CubeTensor<B::Runtime>>,
    /// ZeRO-2, a streamed window: the shard's reads, issued during backward.
    streamed: Option<StreamedShard>,
}

/// A gradient shard read to the host bucket by bucket ([`DeviceBuckets::begin_shard_window`]
/// with `stream`).
/// What [`DeviceBuckets::add_owned`] did with one bucket.
pub(crate) struct AddedOwned {
    /// The bucket's elements this rank owns.
    pub(crate) elements: usize,
    /// Whether it issued the read of them to the host (a streamed window's last micro-batch).
    pub(crate) read_issued: bool,
}

struct StreamedShard {
    len: usize,
    /// Per bucket with elements on this rank: its range of the shard and the read issued.
    reads: Vec<(Range<usize>, PendingDownload)>,
    /// The window's 1/K after K micro-batches, multiplied in on the device after the reads.
    scale: Option<f32>,
    /// What tests added to the shard's first element after the reads, in order.
    added_to_start: Vec<f32>,
}

impl StreamedShard {
    /// The shard as the device holds it: the reads in place, zeros elsewhere (padding past
    /// the last parameter, which no bucket covers), then the same f32 operations as the
    /// device's, in the same order, so the values are the device shard's bit for bit.
    fn finish(self) -> Result<Vec<f32>, DistError> {
        let mut values = vec![0.0f32; self.len];
        for (range, read) in self.reads {
            let read = read.wait()?.to_f32_vec();
            values[range].copy_from_slice(&read);
        }
        if let Some(scale) = self.scale {
            values.iter_mut().for_each(|v| *v *= scale);
        }
        for value in self.added_to_start {
            values[0] += value;
        }
        Ok(values)
    }
}

impl<B: CubeResident> DeviceStore<B> {
    pub(crate) fn new(
        collectives: Arc<dyn DeviceCollectives<B::Runtime>>,
        gathers: Arc<dyn DeviceCollectives<B::Runtime>>,
        device: <B::Runtime as burn_cubecl::cubecl::Runtime>::Device,
    ) -> Self {
        DeviceStore {
            collectives,
            gathers,
            device,
            dtypes: Vec::new(),
            grads: Vec::new(),
            launches: 0,
            copies: CopyCounts::default(),
            shard: None,
            streamed: None,
        }
    }

    /// The slice of `tensor`'s memory that holds its `numel` elements.
    fn slice(
        tensor: &CubeTensor<B::Runtime>,
        numel: usize,
        p: usize,
    ) -> Result<DeviceSlice<B::Runtime>, DistError> {
        Ok(DeviceSlice::new(
            tensor.client.clone(),
            tensor.handle.clone(),
            0,
            numel,
            device_dtype(tensor.dtype, p)?,
        ))
    }
}

impl<B: CubeResident> DeviceBuckets for DeviceStore<B> {
    fn accepts(&self, primitive: TypeId) -> bool {
        primitive == TypeId::of::<B::FloatTensorPrimitive>()
    }

    fn primitive_name(&self) -> &'static str {
        std::any::type_name::<B::FloatTensorPrimitive>()
    }

    fn register(&mut self, dtypes: Vec<DType>) {
        self.grads = (0..dtypes.len()).map(|_| None).collect();
        self.dtypes = dtypes;
    }

    fn begin_window(&mut self, params: usize) {
        self.grads = (0..params).map(|_| None).collect();
    }

    unsafe fn put(&mut self, p: usize, target: usize, accumulate: bool) -> Result<(), DistError> {
        let dtype = *self.dtypes.get(p).ok_or_else(|| {
            DistError::Usage(format!(
                "parameter #{p} has no registered dtype on the device reducer"
            ))
        })?;
        device_dtype(dtype, p)?;
        // SAFETY: as the caller promised.
        let local = unsafe { &*(target as *const B::FloatTensorPrimitive) };
        let (view, unique) = B::cube_view(local);
        let reason = copy_reason(
            unique,
            view.is_contiguous(),
            view.meta.shape(),
            view.meta.strides(),
        );
        self.copies.record(reason);
        // Shared memory (fusion's handle, another tensor, a later backward step), a strided
        // view or padded rows: reduce a private contiguous copy instead.
        let grad = if reason.is_some() {
            contiguous_copy(view)
        } else {
            view
        };
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

    fn launch(
        &mut self,
        buckets: &[&Bucket],
        written: &[bool],
        numels: &[usize],
        owners: Option<&FlatLayout>,
    ) -> Result<Vec<Vec<DevicePending>>, DistError> {
        let mut launched = Vec::with_capacity(buckets.len());
        for bucket in buckets {
            // One collective per dtype, in order of first appearance (the same on every rank:
            // dtypes are registered per parameter): an all-reduce of the bucket's slices, or at
            // ZeRO-2 one grouped reduce-scatter of each slice to the owners of its pieces.
            let mut groups: Vec<(DeviceDType, Vec<DeviceSlice<B::Runtime>>)> = Vec::new();
            type Parts<R> = Vec<(DeviceSlice<R>, Vec<usize>)>;
            let mut scatters: Vec<(DeviceDType, Parts<B::Runtime>)> = Vec::new();
            let mut pending = Vec::new();
            for &p in &bucket.params {
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
                    _ => Cube::<B::Runtime>::float_zeros(
                        Shape::new([numels[p]]),
                        &self.device,
                        self.dtypes[p].into(),
                    ),
                };
                if numels[p] == 0 {
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
                let slice = Self::slice(&tensor, numels[p], p)?;
                match owners {
                    None => match groups.iter_mut().find(|(d, _)| *d == slice.dtype) {
                        Some((_, group)) => group.push(slice),
                        None => groups.push((slice.dtype, vec![slice])),
                    },
                    Some(flat) => {
                        // The shards are consecutive ranges: the pieces follow each other in
                        // rank order, as the reduce-scatter's chunks do.
                        let part = (slice.clone(), owner_counts(flat, flat.param_range(p)));
                        match scatters.iter_mut().find(|(d, _)| *d == slice.dtype) {
                            Some((_, parts)) => parts.push(part),
                            None => scatters.push((slice.dtype, vec![part])),
                        }
                    }
                }
                self.grads[p] = Some(tensor);
            }
            for (_, group) in groups {
                pending.push(
                    self.collectives
                        .all_reduce(&group, burn_dist_comm::ReduceOp::Avg)?,
                );
            }
            for (_, parts) in scatters {
                pending.push(
                    self.collectives
                        .reduce_scatter_each(&parts, burn_dist_comm::ReduceOp::Avg)?,
                );
            }
            launched.push(pending);
        }
        self.launches += 1;
        Ok(launched)
    }

    fn begin_shard_window(&mut self, shard_len: usize, stream: bool) {
        self.streamed = stream.then(|| StreamedShard {
            len: shard_len,
            reads: Vec::new(),
            scale: None,
            added_to_start: Vec::new(),
        });
        self.shard = Some(Cube::<B::Runtime>::float_zeros(
            Shape::new([shard_len]),
            &self.device,
            DType::F32.into(),
        ));
    }

    fn add_owned(
        &mut self,
        bucket: &Bucket,
        flat: &FlatLayout,
        rank: usize,
        (first, last): (bool, bool),
    ) -> Result<AddedOwned, DistError> {
        let start = flat.shard(rank).start;
        // The bucket's elements in this rank's shard: one range, since a frozen ZeRO-2 bucket
        // is a contiguous run of the flat layout.
        let mut span: Option<Range<usize>> = None;
        let mut shard = self.shard.take().ok_or_else(|| {
            DistError::Usage("no gradient shard on the device for this window".into())
        })?;
        let mut owned = 0;
        let mut read_issued = false;
        for &p in &bucket.params {
            let grad = self.grads[p].take();
            let Some((_, within)) = owned_pieces(flat, p).find(|(q, _)| *q == rank) else {
                continue;
            };
            let grad = grad.ok_or_else(|| {
                DistError::Usage(format!("parameter #{p}: no reduced gradient on the device"))
            })?;
            let n = flat.numels[p];
            let piece = Cube::float_slice(
                Cube::float_reshape(grad, Shape::new([n])),
                &[slice(within.clone())],
            );
            let piece = if piece.dtype == DType::F32 {
                piece
            } else {
                Cube::float_cast(piece, DType::F32.into())
            };
            let at = flat.offsets[p] + within.start - start;
            let range = [slice(at..at + within.len())];
            let value = if first {
                piece
            } else {
                Cube::float_add(Cube::float_slice(shard.clone(), &range), piece)
            };
            shard = Cube::float_slice_assign(shard, &range, value);
            owned += within.len();
            span = Some(match span {
                Some(s) => s.start.min(at)..s.end.max(at + within.len()),
                None => at..at + within.len(),
            });
        }
        if let (true, Some(streamed), Some(span)) = (last, self.streamed.as_mut(), span) {
            // The copy into the read's staging buffer is ordered before the next bucket's
            // kernels on the shard, so this reads the bucket's final values.
            let slice = DeviceSlice::new(
                shard.client.clone(),
                shard.handle.clone(),
                span.start,
                span.len(),
                DeviceDType::F32,
            );
            let read = download_async(&slice, self.collectives.traffic(), rank)?;
            streamed.reads.push((span, read));
            read_issued = true;
        }
        self.shard = Some(shard);
        Ok(AddedOwned {
            elements: owned,
            read_issued,
        })
    }

    fn end_shard_window(&mut self, micro_batches: usize) {
        if micro_batches > 1
            && let Some(shard) = self.shard.take()
        {
            // The same f32 product as the host shard's.
            let scale = 1.0 / micro_batches as f32;
            self.shard = Some(match self.streamed.as_mut() {
                Some(streamed) => {
                    streamed.scale = Some(scale);
                    shard
                }
                None => Cube::float_mul_scalar(shard, Scalar::new(scale, &DType::F32)),
            });
        }
    }

    fn streamed(&self) -> bool {
        self.streamed.is_some()
    }

    fn take_shard(&mut self) -> Option<Box<dyn std::any::Any>> {
        self.shard
            .take()
            .map(|shard| Box::new(shard) as Box<dyn std::any::Any>)
    }

    fn read_shard(
        &self,
        shard: Box<dyn std::any::Any>,
        rank: usize,
    ) -> Result<Vec<f32>, DistError> {
        let shard = shard
            .downcast::<CubeTensor<B::Runtime>>()
            .map_err(|_| DistError::Usage("a gradient shard of another runtime".into()))?;
        let len = shard.shape().num_elements();
        let values = download(
            &Self::slice(&shard, len, 0)?,
            self.collectives.traffic(),
            rank,
        )?;
        Ok(values.to_f32_vec())
    }

    fn take_streamed_shard(&mut self) -> Result<Option<Vec<f32>>, DistError> {
        self.streamed.take().map(StreamedShard::finish).transpose()
    }

    fn add_to_shard_start(&mut self, value: f32) -> bool {
        let Some(shard) = self.shard.take() else {
            return false;
        };
        if let Some(streamed) = self.streamed.as_mut() {
            streamed.added_to_start.push(value);
        }
        let first = Cube::float_slice(shard.clone(), &[slice(0..1)]);
        let first = Cube::float_add_scalar(first, Scalar::new(value, &DType::F32));
        self.shard = Some(Cube::float_slice_assign(shard, &[slice(0..1)], first));
        true
    }

    unsafe fn write_back(&mut self, p: usize, target: usize, scale: f32) -> Result<(), DistError> {
        let grad = self
            .grads
            .get_mut(p)
            .and_then(Option::take)
            .ok_or_else(|| {
                DistError::Usage(format!("parameter #{p}: no reduced gradient on the device"))
            })?;
        let grad = if scale == 1.0 {
            grad
        } else {
            let dtype = grad.dtype;
            Cube::float_mul_scalar(grad, Scalar::new(scale, &dtype))
        };
        // SAFETY: as the caller promised.
        unsafe { *(target as *mut B::FloatTensorPrimitive) = B::from_cube(grad) };
        Ok(())
    }

    fn read(&self, p: usize, scale: f32) -> Option<Vec<f32>> {
        let grad = self.grads.get(p)?.clone()?;
        let bytes = grad.shape().num_elements() * grad.dtype.size();
        let data = read_sync(Cube::float_into_data(grad)).ok()?;
        self.collectives.traffic().to_host(bytes);
        let values = data.convert::<f32>().into_vec::<f32>().ok()?;
        Some(values.into_iter().map(|v| v * scale).collect())
    }

    fn launches(&self) -> u64 {
        self.launches
    }

    fn copies(&self) -> CopyCounts {
        self.copies
    }

    fn traffic(&self) -> Traffic {
        self.collectives.traffic().get()
    }

    fn device_calls(&self) -> u64 {
        self.collectives.traffic().calls()
    }

    fn pieces(&self, dtype: DType, shard: &[u8]) -> Result<Box<dyn DevicePieces>, DistError> {
        let pieces = CubePieces::<B>::new(self.gathers.clone(), self.device.clone(), dtype, shard)
            .map_err(DistError::from)?;
        Ok(Box::new(pieces))
    }
}

/// Elements `range` of a dimension.
fn slice(range: Range<usize>) -> Slice {
    Slice {
        start: range.start as isize,
        end: Some(range.end as isize),
        step: 1,
    }
}

/// The device collectives' element type for a gradient of `dtype`.
fn device_dtype(dtype: DType, p: usize) -> Result<DeviceDType, DistError> {
    super::device_dtype(dtype).ok_or_else(|| DistError::UnsupportedDtype {
        param: p,
        dtype: format!("{dtype:?}"),
    })
}

/// Each rank's piece of parameter `p` in the flat layout: (owner, elements of `p`), non-empty
/// only, in rank order.
pub(crate) fn owned_pieces(
    flat: &FlatLayout,
    p: usize,
) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
    let offset = flat.offsets[p];
    (0..flat.world).filter_map(move |q| {
        let r = flat.in_shard(flat.param_range(p), q);
        (!r.is_empty()).then(|| (q, r.start - offset..r.end - offset))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
