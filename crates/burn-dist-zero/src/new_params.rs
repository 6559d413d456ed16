//! The new parameters after a step at stages 1 and 2, from this rank's copy of its shard in
//! the model's dtype in device memory to the model's tensors: all-gathered device to device by
//! the reducer's device collectives, a group of parameters at a time straight into one fresh
//! buffer each, which becomes the model's tensor. No buffer of the whole flat parameter vector
//! exists, and the old parameters are released group by group as the model takes the new ones.
//!
//! One code for both places the optimizer state may live on the device path: in device memory
//! (`crate::resident`, whose fused kernels write the model copy) and offloaded to the host
//! (`crate::offload`, which uploads the copy the host step computed).

use std::any::Any;
use std::sync::Arc;

use burn::tensor::{DType, Shape};
use burn_cubecl::cubecl::Runtime;
use burn_cubecl::cubecl::prelude::ComputeClient;
use burn_cubecl::cubecl::server::Handle;
use burn_cubecl::tensor::CubeTensor;
use burn_dist::CubeResident;
use burn_dist_device::{DeviceCollectives, DeviceDType, DeviceSlice, copy};

use crate::error::Result;
use crate::flat::{FlatLayout, Piece};

/// Where the step's new parameters come from, whatever the backend (ZeroAdam is not generic).
pub(crate) trait NewParameters {
    /// Parameter `p`'s new values (model dtype) as a float primitive of the backend, of
    /// `shape`, all-gathered over ranks device to device with the parameters after it that fit
    /// in one group, when it is not in the group gathered last. Ask in parameter order: every
    /// rank issues the same gathers.
    fn parameter(&mut self, p: usize, shape: Shape) -> Result<Box<dyn Any>>;
}

/// The all-gathers of the new parameters from a model-dtype shard buffer on backend `B`.
pub(crate) struct ParamGather<B: CubeResident> {
    collectives: Arc<dyn DeviceCollectives<B::Runtime>>,
    client: ComputeClient<B::Runtime>,
    device: <B::Runtime as Runtime>::Device,
    layout: FlatLayout,
    rank: usize,
    /// This rank's pieces of the flat layout.
    pieces: Vec<Piece>,
    /// The parameters' dtype (one for the whole model) and its device type.
    dtype: DType,
    device_dtype: DeviceDType,
    /// Bytes of new parameters gathered at once (at least one parameter).
    group_bytes: usize,
    /// The group gathered last, not yet handed to the model: (parameter, its buffer).
    gathered: Vec<(usize, Handle)>,
}

impl<B: CubeResident> ParamGather<B> {
    /// `group_bytes`: how many bytes of new parameters one all-gather brings (the reducer's
    /// bucket size).
    pub(crate) fn new(
        collectives: Arc<dyn DeviceCollectives<B::Runtime>>,
        client: ComputeClient<B::Runtime>,
        device: <B::Runtime as Runtime>::Device,
        layout: FlatLayout,
        (dtype, device_dtype): (DType, DeviceDType),
        group_bytes: usize,
    ) -> Self {
        let rank = collectives.rank();
        ParamGather {
            pieces: layout.pieces(rank),
            collectives,
            client,
            device,
            layout,
            rank,
            dtype,
            device_dtype,
            group_bytes,
            gathered: Vec::new(),
        }
    }

    /// See [`NewParameters::parameter`]; `model` is this rank's shard of the new parameters in
    /// the model's dtype (`shard_len` elements), read only when a group is gathered.
    pub(crate) fn parameter(
        &mut self,
        p: usize,
        shape: Shape,
        model: &Handle,
    ) -> Result<Box<dyn Any>> {
        let at = match self.gathered.iter().position(|(q, _)| *q == p) {
            Some(at) => at,
            None => {
                self.gather_group(p, model)?;
                0
            }
        };
        let (_, handle) = self.gathered.remove(at);
        let tensor = CubeTensor::new_contiguous(
            self.client.clone(),
            self.device.clone(),
            shape,
            handle,
            self.dtype,
        );
        Ok(Box::new(B::from_cube(tensor)))
    }

    /// Drops a group gathered but not handed over (a write-back that failed part way), so
    /// that the next step's gathers start afresh instead of handing out stale values.
    pub(crate) fn forget(&mut self) {
        self.gathered.clear();
    }

    /// All-gathers the new values of parameter `first` and of the ones after it that fit in
    /// `group_bytes`, each into a fresh buffer: this rank's pieces copied from the model copy
    /// of the shard, the other ranks' by one collective.
    fn gather_group(&mut self, first: usize, model: &Handle) -> Result<()> {
        let elem = self.device_dtype.size();
        let numels = &self.layout.numels;
        let mut end = first;
        let mut bytes = 0;
        while end < numels.len() && (end == first || bytes + numels[end] * elem <= self.group_bytes)
        {
            bytes += numels[end] * elem;
            end += 1;
        }
        let model = DeviceSlice::new(
            self.client.clone(),
            model.clone(),
            0,
            self.layout.shard_len,
            self.device_dtype,
        );
        let mut parts = Vec::with_capacity(end - first);
        for (p, &numel) in numels.iter().enumerate().take(end).skip(first) {
            let handle = self.client.empty((numel * elem).max(elem));
            let slice = DeviceSlice::new(self.client.clone(), handle, 0, numel, self.device_dtype);
            for piece in self.pieces.iter().filter(|piece| piece.param == p) {
                copy(
                    &model.range(piece.in_shard.clone()),
                    &slice.range(piece.within.clone()),
                    self.rank,
                )?;
            }
            let range = self.layout.param_range(p);
            let counts = (0..self.layout.world)
                .map(|q| self.layout.in_shard(range.clone(), q).len())
                .collect();
            parts.push((slice, counts));
        }
        let tag = u32::try_from(first + 1).expect("fewer than 2^32 parameters");
        self.collectives.all_gather_each(&parts, tag)?.wait()?;
        self.gathered = (first..end)
            .zip(parts)
            .map(|(p, (slice, _))| (p, slice.handle))
            .collect();
        Ok(())
    }
}

/// Replaces every parameter with its all-gathered new values, from device memory, a group at
/// a time (each old parameter is dropped as its new one takes its place).
pub(crate) struct WriteDeviceParams<'a, B: burn::tensor::backend::AutodiffBackend> {
    pub(crate) params: &'a [burn_dist::ParamInfo],
    pub(crate) device: &'a mut dyn NewParameters,
    /// The first failure (a mapper cannot return one); the parameters after it keep their
    /// old values.
    pub(crate) error: Option<crate::ZeroError>,
    pub(crate) _b: std::marker::PhantomData<B>,
}

impl<B: burn::tensor::backend::AutodiffBackend> burn::module::ModuleMapper<B>
    for WriteDeviceParams<'_, B>
{
    fn map_float<const D: usize>(
        &mut self,
        param: burn::module::Param<burn::tensor::Tensor<B, D>>,
    ) -> burn::module::Param<burn::tensor::Tensor<B, D>> {
        use burn::tensor::{Tensor, TensorPrimitive};
        let Some(index) = self.params.iter().position(|p| p.id == param.id) else {
            return param;
        };
        if self.error.is_some() {
            return param;
        }
        let (id, tensor, mapper) = param.consume();
        let primitive = match self.device.parameter(index, tensor.shape()) {
            Ok(primitive) => primitive,
            Err(error) => {
                self.error = Some(error);
                return burn::module::Param::from_mapped_value(id, tensor, mapper);
            }
        };
        // The gradients were this backend's (`gradient_piece` checked their type), so are the
        // parameters.
        let primitive = *primitive
            .downcast::<<B::InnerBackend as burn::tensor::backend::BackendTypes>::FloatTensorPrimitive>()
            .unwrap_or_else(|_| {
                panic!(
                    "ZeroAdam's device state and the model are on different backends (the model: \
                     `{}`)",
                    std::any::type_name::<B::InnerBackend>()
                )
            });
        let inner = Tensor::<B::InnerBackend, D>::from_primitive(TensorPrimitive::Float(primitive));
        let fresh = Tensor::<B, D>::from_inner(inner);
        let fresh = if tensor.is_require_grad() {
            fresh.require_grad()
        } else {
            fresh
        };
        burn::module::Param::from_mapped_value(id, fresh, mapper)
    }
}
