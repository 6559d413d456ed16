//! ZeroAdam offloaded (`ZeroAdam::offloaded`, feature `device`): the model and the reducer on
//! the device, the optimizer state (f32 master weights, moments) in host memory, stepped there
//! by the host step (`burn_dist_kernels::host`, the same code as the host path's).
//!
//! Per step, at stages 1 and 2:
//! 1. the gradient is reduced on the device as on the device path. Stage 2: reduce-scattered
//!    into the reducer's device shard, whose range for each bucket is read to the host as soon
//!    as the reducer takes that bucket's reduction in, during backward
//!    (`Ddp::stream_gradient_shard_to_host`; `4 ·` this rank's elements, the padding past the
//!    last parameter not read), so that when backward ends only the last buckets' reads are
//!    left to wait for. Stage 1: all-reduced in full; after backward this rank's pieces are
//!    copied into one staging buffer on the device and read down at once (`4 · shard_len`
//!    bytes);
//! 2. the host step unscales, checks, agrees, clips and updates, as on the host path;
//! 3. the new master shard, rounded to the model's dtype as the host path rounds it, is
//!    uploaded (`p · shard_len` bytes) and all-gathered device to device into the model's
//!    tensors by the same code as the device path's (`crate::new_params`); the uploaded copy
//!    goes once every parameter has its new values. A skipped step uploads and gathers
//!    nothing: the parameters do not change.
//!
//! At stage 3 the model's pieces are this rank's shard, in device memory
//! (`ParamShards::device_shard`): step 1 reads the reducer's device shard down as at stage 2,
//! during backward,
//! and step 3 writes the new shard, rounded to the model's dtype, into the pieces
//! (`ParamShards::write_shard`, `p · shard_len` bytes up); nothing is gathered (the next forward
//! gathers), so the upload and the all-gather of step 3 above are not run.
//!
//! Between steps the device holds the parameters only (at stage 3, this rank's pieces of them):
//! no master weights, no moments, no gradient shard, no model copy of the shard.
//!
//! A parameter replaced since the last step (a record loaded, `crate::loaded`) is read to the
//! host by the host path's code, through Burn: those bytes are not in the traffic count, which
//! is exact for every other step.
//!
//! Uploads go through `burn_dist_device::create_staged` (page-locked on CUDA) and reads
//! through cubecl's own read, which lands in cubecl-cuda's page-locked pool; wgpu has no
//! page-locked memory to offer and maps its own staging buffers.

use std::any::Any;
use std::sync::Arc;

use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Shape, TensorData};
use burn_cubecl::cubecl::Runtime;
use burn_cubecl::cubecl::prelude::ComputeClient;
use burn_cubecl::cubecl::server::Handle;
use burn_dist::{CubeResident, ParamInfo};
use burn_dist_comm::HostBuffer;
use burn_dist_device::{
    DeviceCollectives, DeviceDType, DeviceSlice, Traffic, create_staged, download,
};
use burn_dist_kernels::FusedAdam;

use crate::error::Result;
use crate::flat::{FlatLayout, Piece};
use crate::new_params::{NewParameters, ParamGather, WriteDeviceParams};
use crate::resident::{DeviceGradient, copy_piece, gradient_pieces_on_device, model_dtypes};

/// What the offloaded step asks of the device, whatever the backend (ZeroAdam is not generic).
pub(crate) trait OffloadState: DeviceGradient + NewParameters + Send {
    /// Stage 1: the step's gradient shard (`shard_len` f32) read to the host, its device
    /// buffer let go; `None` when no piece of it was written (no gradient for this rank's
    /// pieces).
    fn download_gradient(&mut self) -> Result<Option<Vec<f32>>>;
    /// Uploads this rank's new master weights, rounded to the model's dtype, which
    /// [`NewParameters::parameter`] then gathers from.
    fn upload_shard(&mut self, master: &[f32]) -> Result<()>;
    /// Lets the uploaded shard go (every parameter has its new values, or the write-back
    /// failed).
    fn release_shard(&mut self);
    /// Bytes between host and device so far (the collectives' and this state's).
    fn traffic(&self) -> Traffic;
    /// What runs it, for messages.
    fn name(&self) -> String;
}

/// The device side of an offloaded ZeroAdam on backend `B`: only buffers that live within a
/// step.
pub(crate) struct Offloaded<B: CubeResident> {
    collectives: Arc<dyn DeviceCollectives<B::Runtime>>,
    client: ComputeClient<B::Runtime>,
    layout: FlatLayout,
    rank: usize,
    /// The parameters' dtype (one for the whole model) and its device type.
    dtype: DType,
    device_dtype: DeviceDType,
    gather: ParamGather<B>,
    /// The step's f32 gradient shard on the device (stage 1's staging buffer); `None` between
    /// steps.
    grads: Option<Handle>,
    /// The step's new shard in the model's dtype; `None` between steps.
    model: Option<Handle>,
}

impl<B: CubeResident> Offloaded<B> {
    /// `group_bytes`: how many bytes of new parameters one all-gather brings (the reducer's
    /// bucket size).
    pub(crate) fn new(
        collectives: Arc<dyn DeviceCollectives<B::Runtime>>,
        device: &B::Device,
        layout: FlatLayout,
        dtype: DType,
        group_bytes: usize,
    ) -> Result<Self> {
        let device = B::cube_device(device);
        let client = B::Runtime::client(&device);
        // The same check of the model's dtype against the runtime as the device state's.
        let (device_dtype, _) = model_dtypes::<B>(&FusedAdam::new(client.clone()), dtype)?;
        let gather = ParamGather::new(
            collectives.clone(),
            client.clone(),
            device,
            layout.clone(),
            (dtype, device_dtype),
            group_bytes,
        );
        Ok(Offloaded {
            rank: collectives.rank(),
            collectives,
            client,
            layout,
            dtype,
            device_dtype,
            gather,
            grads: None,
            model: None,
        })
    }

    fn f32_shard(&self, handle: Handle) -> DeviceSlice<B::Runtime> {
        DeviceSlice::new(
            self.client.clone(),
            handle,
            0,
            self.layout.shard_len,
            DeviceDType::F32,
        )
    }
}

impl<B: CubeResident> DeviceGradient for Offloaded<B> {
    fn gradient_piece(&mut self, piece: &Piece, grad: &dyn Any) -> Result<()> {
        let bytes = 4 * self.layout.shard_len;
        let grads = self
            .grads
            .get_or_insert_with(|| self.client.empty(bytes))
            .clone();
        copy_piece::<B>(&self.f32_shard(grads), piece, grad, "a gradient", self.rank)
    }
}

impl<B: CubeResident> NewParameters for Offloaded<B> {
    fn parameter(&mut self, p: usize, shape: Shape) -> Result<Box<dyn Any>> {
        let model = self
            .model
            .as_ref()
            .expect("the offloaded step uploads the shard before it gathers");
        self.gather.parameter(p, shape, model)
    }
}

impl<B: CubeResident> OffloadState for Offloaded<B> {
    fn download_gradient(&mut self) -> Result<Option<Vec<f32>>> {
        let Some(grads) = self.grads.take() else {
            return Ok(None);
        };
        let shard = self.f32_shard(grads);
        match download(&shard, self.collectives.traffic(), self.rank)? {
            HostBuffer::F32(values) => Ok(Some(values)),
            other => unreachable!("an f32 slice read as {}", other.dtype()),
        }
    }

    fn upload_shard(&mut self, master: &[f32]) -> Result<()> {
        // Rounded as the host path rounds the parameters it writes (`TensorData`'s
        // conversion), so that the two write the same bits.
        let data = TensorData::new(master.to_vec(), [master.len()]).convert_dtype(self.dtype);
        let bytes = data.as_bytes();
        debug_assert_eq!(
            bytes.len(),
            self.device_dtype.size() * self.layout.shard_len
        );
        self.collectives.traffic().to_device(bytes.len());
        self.model = Some(create_staged(&self.client, bytes));
        Ok(())
    }

    fn release_shard(&mut self) {
        self.model = None;
        // After a failed write-back a group may be left; the next step gathers afresh.
        self.gather.forget();
    }

    fn traffic(&self) -> Traffic {
        self.collectives.traffic().get()
    }

    fn name(&self) -> String {
        format!(
            "{:?} ({}), state on the host",
            self.client.properties().hardware,
            self.collectives.name()
        )
    }
}

/// Step 1 of the offloaded step at stage 1: this rank's pieces of the all-reduced gradient,
/// copied into one staging buffer on the device and read to the host, with which of its pieces
/// had a gradient and which parameters did; everything outside the pieces that had one
/// (padding, parameters without a gradient) is zero, as the host path's. (At stages 2 and 3
/// the reducer's shard is read down during backward and taken as the host path takes it.)
pub(crate) fn gradient_to_host<B: AutodiffBackend, M: AutodiffModule<B>>(
    offload: &mut dyn OffloadState,
    params: &[ParamInfo],
    pieces: &[Piece],
    shard_len: usize,
    model: &M,
    grads: &GradientsParams,
) -> Result<(Vec<f32>, Vec<bool>, Vec<bool>)> {
    let has_grad = gradient_pieces_on_device::<B, M>(params, pieces, model, grads, offload)?;
    let present: Vec<bool> = pieces.iter().map(|p| has_grad[p.param]).collect();
    let mut grad = vec![0.0f32; shard_len];
    if let Some(read) = offload.download_gradient()? {
        for piece in pieces.iter().zip(&present).filter(|(_, p)| **p) {
            let range = piece.0.in_shard.clone();
            grad[range.clone()].copy_from_slice(&read[range]);
        }
    }
    Ok((grad, present, has_grad))
}

/// Step 4 of the offloaded step: the new master shard up to the device and every rank's new
/// parameters into the model, device to device; nothing when the step was skipped.
pub(crate) fn write_back<B: AutodiffBackend, M: AutodiffModule<B>>(
    offload: &mut dyn OffloadState,
    params: &[ParamInfo],
    master: &[f32],
    skipped: bool,
    model: M,
) -> Result<M> {
    if skipped {
        return Ok(model);
    }
    offload.upload_shard(master)?;
    let mut write = WriteDeviceParams::<B> {
        params,
        device: &mut *offload,
        error: None,
        _b: Default::default(),
    };
    let model = model.map(&mut write);
    let error = write.error;
    offload.release_shard();
    error.map_or(Ok(model), Err)
}
