//! ZeroAdam's state and step in device memory (feature `device`): the fp32 master weights, the
//! moments and the gradient shard live in buffers of the model's runtime; the fused kernels of
//! `burn-dist-kernels` update them in place, writing the shard's copy in the model's dtype; the
//! new parameters are all-gathered from it device to device (`crate::new_params`, which the
//! offloaded state shares).
//!
//! At stage 3 the model's pieces are the shard itself (`ParamShards::device_shard`): in f32 the
//! fused step updates them in place as its master weights, otherwise it writes its rounded
//! model copy into them; nothing is gathered after the step (the next forward gathers).
//!
//! Per step only scalars cross to the host: the shard's (sum of squares, found-inf) down, the
//! agreed totals, `1 / loss_scale` and the step's hyper-parameters up. The gradient shard is
//! copied from the gradients on the device (stage 1) or is the reducer's device shard, filled
//! by the device reduce-scatter (stage 2).
//!
//! The kernels keep one step counter for the whole shard, where Burn (and the host path) count
//! per parameter. The two agree whenever every parameter has a gradient at every step, which
//! this path requires (a step where a parameter has none is refused, naming it).

use std::any::Any;
use std::sync::Arc;

use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Shape};
use burn_cubecl::cubecl::Runtime;
use burn_cubecl::cubecl::server::Handle;
use burn_cubecl::tensor::CubeTensor;
use burn_dist::{CubeResident, ParamInfo, SyncHandle};
use burn_dist_device::{
    DeviceCollectives, DeviceDType, DeviceSlice, Traffic, TrafficCounter, copy, upload_into,
};
use burn_dist_kernels::{FusedAdam, Hyper, ModelDtype, StepBuffers};

use crate::error::{Result, ZeroError};
use crate::flat::{FlatLayout, Piece};
use crate::new_params::{NewParameters, ParamGather};

/// Bytes of the hyper-parameters `FusedAdam::update` uploads each step (nine f32).
const HYPER_BYTES: usize = 9 * 4;

/// Where stage 1's shard of the gradient is gathered on the device, for either owner of the
/// optimizer state (in device memory, `Resident`; offloaded, `crate::offload`): filled by
/// [`gradient_pieces_on_device`].
pub(crate) trait DeviceGradient {
    /// Copies `piece` of the parameter's gradient (`grad`, the backend's float primitive)
    /// into the gradient shard, on the device.
    fn gradient_piece(&mut self, piece: &Piece, grad: &dyn Any) -> Result<()>;
}

/// Step 1 on the device path: this rank's shard of the averaged gradient into `device` (the
/// reducer's device shard at stages 2 and 3; this rank's pieces of each gradient copied at
/// stage 1), and per parameter whether it had a gradient.
pub(crate) fn gradient_on_device<B: AutodiffBackend, M: AutodiffModule<B>>(
    stage: u8,
    params: &[ParamInfo],
    pieces: &[Piece],
    model: &M,
    grads: &GradientsParams,
    sync: &SyncHandle,
    device: &mut dyn ResidentState,
) -> Result<Vec<bool>> {
    if stage >= 2 {
        let (shard, used) = sync.take_device_gradient_shard()?;
        device.gradient_shard(shard)?;
        return Ok(used);
    }
    gradient_pieces_on_device::<B, M>(params, pieces, model, grads, device)
}

/// Stage 1's step 1 on the device path: this rank's pieces of each all-reduced gradient
/// copied into `device`'s gradient shard, and per parameter whether it had a gradient.
pub(crate) fn gradient_pieces_on_device<B: AutodiffBackend, M: AutodiffModule<B>>(
    params: &[ParamInfo],
    pieces: &[Piece],
    model: &M,
    grads: &GradientsParams,
    device: &mut dyn DeviceGradient,
) -> Result<Vec<bool>> {
    let mut gather = GatherShard::<B> {
        params,
        pieces,
        grads,
        device,
        has_grad: vec![false; params.len()],
        error: None,
        _b: Default::default(),
    };
    model.visit(&mut gather);
    match gather.error {
        Some(error) => Err(error),
        None => Ok(gather.has_grad),
    }
}

/// The reducer's gradient shard (`Ddp::take_device_gradient_shard`, behind `dyn Any`) as the
/// buffer of an f32 shard of `shard_len` elements, checked to be one.
fn reducer_gradient_shard<B: CubeResident>(
    shard: Box<dyn Any>,
    shard_len: usize,
) -> Result<Handle> {
    let shard =
        shard
            .downcast::<CubeTensor<B::Runtime>>()
            .map_err(|_| ZeroError::WrongGradient {
                expected: std::any::type_name::<CubeTensor<B::Runtime>>(),
                got: "the reducer's gradient shard is of another runtime".into(),
            })?;
    let len = shard.meta.shape().num_elements();
    if len != shard_len || shard.dtype != DType::F32 || !shard.is_contiguous() {
        return Err(ZeroError::WrongGradient {
            expected: std::any::type_name::<CubeTensor<B::Runtime>>(),
            got: format!(
                "the reducer's gradient shard ({len} elements of {:?}) does not fit this \
                 rank's optimizer shard ({shard_len} f32)",
                shard.dtype
            ),
        });
    }
    Ok(shard.handle)
}

/// What ZeroAdam asks of its device state, whatever the backend (ZeroAdam is not generic).
pub(crate) trait ResidentState: DeviceGradient + NewParameters + Send {
    /// Stages 2 and 3: the reducer's gradient shard in device memory
    /// (`Ddp::take_device_gradient_shard`), which becomes the gradient shard as it is.
    fn gradient_shard(&mut self, shard: Box<dyn Any>) -> Result<()>;
    /// Stages 1 and 2: copies `piece` of a parameter's values (`param`, the backend's float
    /// primitive, in the model's dtype) into the master weights, converted to f32, on the
    /// device: a parameter replaced since the last step (`crate::loaded`).
    fn take_master_piece(&mut self, piece: &Piece, param: &dyn Any) -> Result<()>;
    /// Stage 3 below f32: copies `piece` of the model copy, which is the model's pieces (a
    /// record loaded wrote them), into the master weights, converted to f32.
    fn take_master_from_model_copy(&mut self, piece: &Piece) -> Result<()>;
    /// Pass 1 on the shard; this shard's (found_inf, sum of squares of the unscaled gradient).
    fn check(&mut self, inv_scale: f32) -> Result<(bool, f64)>;
    /// With every rank's agreed (found_inf, total sum of squares): finalize and update.
    fn update(&mut self, found_inf: bool, total_sum_sq: f64, hyper: Hyper) -> Result<()>;
    /// (master, m, v), read back (checkpoints).
    fn state(&self) -> [Vec<f32>; 3];
    /// Replaces the state (a checkpoint's), with `steps_taken` steps already counted.
    fn load(&mut self, master: &[f32], m: &[f32], v: &[f32], steps_taken: u32) -> Result<()>;
    /// Bytes between host and device so far (the collectives' and the step's scalars).
    fn traffic(&self) -> Traffic;
    /// What runs it, for messages.
    fn name(&self) -> String;
}

/// Where the stage-3 model's pieces are, for [`Resident::new`]: the shard buffer of
/// `ParamShards::device_shard`, in the parameters' dtype.
pub(crate) struct Stage3Pieces(pub(crate) Handle);

/// ZeroAdam's device state on backend `B`.
pub(crate) struct Resident<B: CubeResident> {
    fused: FusedAdam<B::Runtime>,
    buffers: StepBuffers,
    collectives: Arc<dyn DeviceCollectives<B::Runtime>>,
    layout: FlatLayout,
    rank: usize,
    /// The parameters' device dtype (one for the whole model).
    device_dtype: DeviceDType,
    /// The all-gathers of the new parameters from the model copy (`crate::new_params`).
    gather: ParamGather<B>,
    /// Stage 3: the model's pieces are the shard buffer (master weights in f32, the model
    /// copy otherwise), which `load` must write in place.
    stage3: bool,
    /// Stages 2 and 3: the gradient shard is the reducer's, handed over each step, and let go
    /// once the step is issued (the next backward fills a new one), so that no shard of the
    /// gradient stays between steps (a 4-byte stand-in holds its place).
    grads_from_reducer: bool,
}

impl<B: CubeResident> Resident<B> {
    /// `group_bytes`: how many bytes of new parameters one all-gather brings (the reducer's
    /// bucket size); `grads_from_reducer`: stages 2 and 3, whose gradient shard the reducer
    /// hands over each step; `stage3`: the model's pieces, which the step then updates in
    /// place.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        collectives: Arc<dyn DeviceCollectives<B::Runtime>>,
        device: &B::Device,
        layout: FlatLayout,
        dtype: DType,
        master: &[f32],
        m: &[f32],
        v: &[f32],
        steps_taken: u32,
        decays: &[bool],
        group_bytes: usize,
        grads_from_reducer: bool,
        stage3: Option<Stage3Pieces>,
    ) -> Result<Self> {
        let device = B::cube_device(device);
        let client = B::Runtime::client(&device);
        let fused = FusedAdam::new(client.clone());
        let (flat_dtype, model_dtype) = model_dtypes::<B>(&fused, dtype)?;
        // Stage 3 in f32: the pieces are the master weights, stepped in place with no copy.
        let model_dtype = match (&stage3, model_dtype) {
            (Some(_), ModelDtype::F32) => ModelDtype::None,
            (_, dtype) => dtype,
        };
        fits_on_device(
            burn_dist_device::device_memory::<B::Runtime>(&client, &device),
            collectives.rank(),
            layout.shard_len,
            model_dtype,
        )?;
        let zeros = vec![0.0; m.len()];
        let master = if master.is_empty() { &zeros } else { master };
        let mut buffers = fused.upload(master, m, v, steps_taken, &zeros, 1.0, model_dtype);
        fused.set_decay_mask(&mut buffers, decays);
        if grads_from_reducer {
            buffers.grads = client.empty(4);
        }
        if let Some(Stage3Pieces(pieces)) = &stage3 {
            match model_dtype {
                ModelDtype::None => buffers.master = pieces.clone(),
                _ => buffers.model = pieces.clone(),
            }
        }
        let rank = collectives.rank();
        let gather = ParamGather::new(
            collectives.clone(),
            client,
            device,
            layout.clone(),
            (dtype, flat_dtype),
            group_bytes,
        );
        Ok(Resident {
            rank,
            fused,
            buffers,
            collectives,
            gather,
            layout,
            device_dtype: flat_dtype,
            stage3: stage3.is_some(),
            grads_from_reducer,
        })
    }

    fn counter(&self) -> &TrafficCounter {
        self.collectives.traffic()
    }

    fn client(&self) -> &burn_cubecl::cubecl::prelude::ComputeClient<B::Runtime> {
        self.fused.client()
    }

    fn f32_buffer(&self, handle: &burn_cubecl::cubecl::server::Handle) -> DeviceSlice<B::Runtime> {
        DeviceSlice::new(
            self.client().clone(),
            handle.clone(),
            0,
            self.layout.shard_len,
            DeviceDType::F32,
        )
    }

    /// Copies `piece` of `primitive` (`what` in messages) into the f32 shard buffer `target`.
    fn copy_piece(
        &self,
        piece: &Piece,
        primitive: &dyn Any,
        what: &str,
        target: &Handle,
    ) -> Result<()> {
        copy_piece::<B>(&self.f32_buffer(target), piece, primitive, what, self.rank)
    }

    /// Uploads one f32 scalar buffer, counted.
    fn upload_scalars(&self, values: &[f32]) -> burn_cubecl::cubecl::server::Handle {
        self.counter().to_device(4 * values.len());
        self.client()
            .create_from_slice(bytemuck::cast_slice(values))
    }
}

impl<B: CubeResident> DeviceGradient for Resident<B> {
    fn gradient_piece(&mut self, piece: &Piece, grad: &dyn Any) -> Result<()> {
        self.copy_piece(piece, grad, "a gradient", &self.buffers.grads)
    }
}

impl<B: CubeResident> NewParameters for Resident<B> {
    fn parameter(&mut self, p: usize, shape: Shape) -> Result<Box<dyn Any>> {
        self.gather.parameter(p, shape, &self.buffers.model)
    }
}

impl<B: CubeResident> ResidentState for Resident<B> {
    fn gradient_shard(&mut self, shard: Box<dyn Any>) -> Result<()> {
        // The reducer hands it over: nothing else holds it, and pass 1 unscales it in place.
        self.buffers.grads = reducer_gradient_shard::<B>(shard, self.layout.shard_len)?;
        Ok(())
    }

    fn take_master_piece(&mut self, piece: &Piece, param: &dyn Any) -> Result<()> {
        self.copy_piece(piece, param, "a parameter", &self.buffers.master)
    }

    fn take_master_from_model_copy(&mut self, piece: &Piece) -> Result<()> {
        let model = DeviceSlice::new(
            self.client().clone(),
            self.buffers.model.clone(),
            0,
            self.layout.shard_len,
            self.device_dtype,
        );
        let master = self.f32_buffer(&self.buffers.master);
        copy(
            &model.range(piece.in_shard.clone()),
            &master.range(piece.in_shard.clone()),
            self.rank,
        )?;
        Ok(())
    }

    fn check(&mut self, inv_scale: f32) -> Result<(bool, f64)> {
        self.buffers.inv_scale = self.upload_scalars(&[inv_scale]);
        self.fused.unscale_and_check(&self.buffers);
        let stats = self.fused.read_f32(&self.buffers.stats);
        self.counter().to_host(4 * stats.len());
        Ok((stats[1] > 0.0, f64::from(stats[0])))
    }

    fn update(&mut self, found_inf: bool, total_sum_sq: f64, hyper: Hyper) -> Result<()> {
        // The kernels take the global statistics from `stats`, as after an all-reduce on the
        // device; an infinite or NaN total also counts as found-inf there.
        let found = if found_inf { 1.0 } else { 0.0 };
        self.buffers.stats = self.upload_scalars(&[total_sum_sq as f32, found]);
        self.counter().to_device(HYPER_BYTES);
        self.fused.update(&self.buffers, hyper);
        if self.grads_from_reducer {
            // The update's launch holds the shard until it has run; nothing reads it after.
            self.buffers.grads = self.client().empty(4);
        }
        Ok(())
    }

    fn state(&self) -> [Vec<f32>; 3] {
        let b = &self.buffers;
        [b.master.clone(), b.m.clone(), b.v.clone()].map(|h| self.fused.read_f32(&h))
    }

    fn load(&mut self, master: &[f32], m: &[f32], v: &[f32], steps_taken: u32) -> Result<()> {
        let model_dtype = self.buffers.model_dtype;
        let pieces_are_master = self.stage3 && model_dtype == ModelDtype::None;
        if pieces_are_master {
            // Stage 3 in f32: the model's pieces are the master weights, written in place
            // before anything else changes.
            let pieces = self.f32_buffer(&self.buffers.master);
            let values = burn_dist_comm::HostBuffer::F32(master.to_vec());
            upload_into(&pieces, &values, self.counter(), self.rank)?;
        }
        let zeros = vec![0.0; master.len()];
        let fresh = self
            .fused
            .upload(master, m, v, steps_taken, &zeros, 1.0, model_dtype);
        let old = std::mem::replace(&mut self.buffers, fresh);
        // The decay mask is the layout's and the rule's, not the state's: it stays.
        self.buffers.decay_mask = old.decay_mask;
        if pieces_are_master {
            self.buffers.master = old.master;
        } else if self.stage3 {
            // Below f32 the pieces are the model copy; the caller writes the rounded master.
            self.buffers.model = old.model;
        }
        if self.grads_from_reducer {
            self.buffers.grads = self.client().empty(4);
        }
        Ok(())
    }

    fn traffic(&self) -> Traffic {
        self.counter().get()
    }

    fn name(&self) -> String {
        format!(
            "{:?} ({})",
            self.client().properties().hardware,
            self.collectives.name()
        )
    }
}

/// The device type and the fused kernels' model-copy type of parameters of `dtype`, checked
/// against what `fused`'s runtime can hold (f16 on WGSL needs `shader-f16`; WGSL has no bf16).
/// Whether the state that [`Resident::new`] uploads (master weights, moments and gradient
/// shard in f32, and the model-dtype copy: all of them at once while it uploads) fits in what
/// the device has left, when the runtime says (`memory`; `None`: not known, not checked).
fn fits_on_device(
    memory: Option<burn_dist_device::DeviceMemory>,
    rank: usize,
    shard_len: usize,
    model_dtype: ModelDtype,
) -> Result<()> {
    let Some(memory) = memory else {
        return Ok(());
    };
    let copy = match model_dtype {
        ModelDtype::None => 0,
        ModelDtype::F32 => 4,
        ModelDtype::F16 | ModelDtype::Bf16 => 2,
    };
    let needed = (16 + copy) * shard_len as u64;
    if needed > memory.available {
        return Err(ZeroError::DeviceMemory {
            rank,
            shard_len,
            needed,
            available: memory.available,
            total: memory.total,
        });
    }
    Ok(())
}

pub(crate) fn model_dtypes<B: CubeResident>(
    fused: &FusedAdam<B::Runtime>,
    dtype: DType,
) -> Result<(DeviceDType, ModelDtype)> {
    let flat_dtype = burn_dist::device_dtype(dtype).ok_or_else(|| ZeroError::UnsupportedDtype {
        what: "parameters",
        dtype: format!("{dtype:?}"),
        on: String::new(),
    })?;
    let model_dtype = match flat_dtype {
        DeviceDType::F32 => ModelDtype::F32,
        DeviceDType::F16 => ModelDtype::F16,
        DeviceDType::BF16 => ModelDtype::Bf16,
    };
    if !fused.supports(model_dtype) {
        return Err(ZeroError::UnsupportedDtype {
            what: "parameters",
            dtype: flat_dtype.to_string(),
            on: format!(
                " on {}, whose runtime has no such type",
                B::Runtime::name(fused.client())
            ),
        });
    }
    Ok((flat_dtype, model_dtype))
}

fn device_dtype(dtype: DType) -> Result<DeviceDType> {
    burn_dist::device_dtype(dtype).ok_or_else(|| ZeroError::UnsupportedDtype {
        what: "gradients",
        dtype: format!("{dtype:?}"),
        on: String::new(),
    })
}

/// Copies `piece` of `primitive` (a float primitive of backend `B`, a parameter's or its
/// gradient's, `what` in messages) into `target`, an f32 buffer of the rank's shard, on the
/// device.
pub(crate) fn copy_piece<B: CubeResident>(
    target: &DeviceSlice<B::Runtime>,
    piece: &Piece,
    primitive: &dyn Any,
    what: &str,
    rank: usize,
) -> Result<()> {
    let primitive = primitive
        .downcast_ref::<B::FloatTensorPrimitive>()
        .ok_or_else(|| ZeroError::WrongGradient {
            expected: std::any::type_name::<B::FloatTensorPrimitive>(),
            got: format!("{what} is of another backend"),
        })?;
    let (view, _) = B::cube_view(primitive);
    let view = if view.is_contiguous() {
        view
    } else {
        burn_dist::contiguous_copy(view)
    };
    let numel = view.meta.shape().num_elements();
    let dtype = device_dtype(view.dtype)?;
    let source = DeviceSlice::new(view.client.clone(), view.handle.clone(), 0, numel, dtype);
    copy(
        &source.range(piece.within.clone()),
        &target.range(piece.in_shard.clone()),
        rank,
    )?;
    Ok(())
}

/// Stage 1: copies, for every piece of this rank's shard, the parameter's gradient piece into
/// the device gradient shard; records which parameters had a gradient.
pub(crate) struct GatherShard<'a, B: burn::tensor::backend::AutodiffBackend> {
    pub(crate) params: &'a [burn_dist::ParamInfo],
    pub(crate) pieces: &'a [Piece],
    pub(crate) grads: &'a burn::optim::GradientsParams,
    pub(crate) device: &'a mut dyn DeviceGradient,
    /// Per parameter (all of them, not only this shard's): whether it had a gradient.
    pub(crate) has_grad: Vec<bool>,
    /// The first failure (a visitor cannot return one).
    pub(crate) error: Option<ZeroError>,
    pub(crate) _b: std::marker::PhantomData<B>,
}

impl<B: burn::tensor::backend::AutodiffBackend> burn::module::ModuleVisitor<B>
    for GatherShard<'_, B>
{
    fn visit_float<const D: usize>(
        &mut self,
        param: &burn::module::Param<burn::tensor::Tensor<B, D>>,
    ) {
        let Some(index) = self.params.iter().position(|p| p.id == param.id) else {
            return;
        };
        let Some(grad) = self.grads.get::<B::InnerBackend, D>(param.id) else {
            return;
        };
        self.has_grad[index] = true;
        let primitive = grad.into_primitive().tensor();
        for piece in self.pieces.iter().filter(|p| p.param == index) {
            if self.error.is_none()
                && let Err(e) = self.device.gradient_piece(piece, &primitive)
            {
                self.error = Some(e);
            }
        }
    }
}

/// Stages 1 and 2: copies, for every piece of this rank's shard of a parameter replaced since
/// the last step, the parameter's values into the device master weights (`crate::loaded`).
pub(crate) struct TakeMaster<'a, B: burn::tensor::backend::AutodiffBackend> {
    pub(crate) params: &'a [burn_dist::ParamInfo],
    pub(crate) pieces: &'a [Piece],
    /// The replaced parameters, in parameter order.
    pub(crate) replaced: &'a [usize],
    pub(crate) device: &'a mut dyn ResidentState,
    /// The first failure (a visitor cannot return one).
    pub(crate) error: Option<ZeroError>,
    pub(crate) _b: std::marker::PhantomData<B>,
}

impl<B: burn::tensor::backend::AutodiffBackend> burn::module::ModuleVisitor<B>
    for TakeMaster<'_, B>
{
    fn visit_float<const D: usize>(
        &mut self,
        param: &burn::module::Param<burn::tensor::Tensor<B, D>>,
    ) {
        let Some(index) = self.params.iter().position(|p| p.id == param.id) else {
            return;
        };
        if !self.replaced.contains(&index) || self.error.is_some() {
            return;
        }
        let primitive = param.val().inner().into_primitive().tensor();
        for piece in self.pieces.iter().filter(|p| p.param == index) {
            if let Err(e) = self.device.take_master_piece(piece, &primitive) {
                self.error = Some(e);
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_dist_device::DeviceMemory;

    #[test]
    fn a_state_larger_than_what_the_device_has_left_is_refused_naming_the_way_out() {
        const GIB: u64 = 1 << 30;
        // A 6 B-parameter bf16 model on one rank: 18 bytes per element against 78 GiB.
        let shard_len = 6_000_000_000;
        let h100 = DeviceMemory {
            available: 66 * GIB,
            total: 80 * GIB,
        };
        let error = fits_on_device(Some(h100), 0, shard_len, ModelDtype::Bf16).unwrap_err();
        let message = error.to_string();
        for needle in [
            "rank 0: ZeroAdam's state in device memory needs 100.58 GiB",
            "only 66.00 GiB of the device's 80.00 GiB are available",
            "ZeroAdam::offloaded",
        ] {
            assert!(message.contains(needle), "`{message}` lacks `{needle}`");
        }
        // On 8 ranks it fits; the f32 stage-3 state, whose pieces are the master weights,
        // counts no copy.
        fits_on_device(Some(h100), 3, shard_len / 8, ModelDtype::Bf16).unwrap();
        let tight = DeviceMemory {
            available: 16 * 1000,
            total: GIB,
        };
        fits_on_device(Some(tight), 0, 1000, ModelDtype::None).unwrap();
        assert!(fits_on_device(Some(tight), 0, 1000, ModelDtype::F32).is_err());
        // Not known (wgpu): not checked.
        fits_on_device(None, 0, shard_len, ModelDtype::Bf16).unwrap();
    }
}
