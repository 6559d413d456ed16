//! `Ddp::prepare_sharded`: a model becomes sharded one parameter at a time, so that no rank
//! ever holds it whole.
//!
//! Three walks over the model:
//! 1. **Plan** (a visitor; nothing is initialized): every tensor's name, kind and size, from
//!    Burn's lazy parameters (`Param::lazy_shape`), checked against rank 0's; which float
//!    parameters are trainable; the flat layout of those over the group. A float tensor is
//!    planned by its number of dimensions and elements, not its shape: Burn's lazy shape is
//!    the shape *before* the parameter's init transformation (a column-major `Linear` stores
//!    its `[d_output, d_input]` draw transposed, `[d_input, d_output]`), which only
//!    initializing tells, and a rank that initialized a parameter already (loaded a record
//!    before preparing) must not differ from one that did not.
//! 2. **Stream** (a mapper): each tensor in turn is materialized (Burn initializes a lazy
//!    parameter here, alone), its shape and dtype checked against rank 0's, rank 0's values
//!    broadcast; a trainable parameter keeps only this rank's piece of them and leaves a
//!    one-element stand-in in the model, the others keep rank 0's values. At most one tensor
//!    is whole at a time.
//! 3. **Install** (a mapper): every stand-in becomes a handle to its parameter in the rank's
//!    [`ParamShards`], which exists only once every piece is known.

use std::any::Any;
use std::sync::Arc;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamMapper};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Bool, DType, Int, Tensor, TensorData};
use burn_dist_comm::{Communicator, HostBuffer};

use super::shards::{Holding, ShardedParamInfo};
use super::{ParamHandle, ParamShards, Sharded, ShardedFloat, record};
use crate::error::{DistError, Result};
use crate::flat::FlatLayout;
use crate::model::{ParamInfo, replace_values, stable_param_id};
use crate::{Ddp, DistributedBackend};

/// The elements of every shard of the flat layout are a multiple of this: ZeroAdam's default
/// `align`, the fused kernels' vector width.
pub const SHARD_ALIGN: usize = 4;

/// What walk 1 learns without initializing anything.
#[derive(Default)]
pub(crate) struct ShardPlan {
    /// One line per tensor: kind, name and shape, or for a float tensor its number of
    /// dimensions and elements (see the module's docs; dtypes are not known before
    /// initialization either).
    pub lines: Vec<String>,
    /// Per float tensor, in visit order: name, elements, trainable.
    pub floats: Vec<(String, usize, bool)>,
    path: Vec<String>,
}

impl ShardPlan {
    fn record(&mut self, kind: &str, size: &str) -> String {
        let name = self.path.join(".");
        self.lines.push(format!("{kind} {name} {size}"));
        name
    }

    /// Elements of each trainable float parameter, in visit order.
    fn trainable_numels(&self) -> Vec<usize> {
        self.floats
            .iter()
            .filter(|(_, _, trainable)| *trainable)
            .map(|&(_, numel, _)| numel)
            .collect()
    }
}

impl<B: AutodiffBackend> ModuleVisitor<B> for ShardPlan {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        // An init transformation may permute the lazy shape, never change the element count.
        let numel = param.lazy_shape().num_elements();
        let trainable = lazy_require_grad(param);
        let kind = if trainable { "param" } else { "float" };
        let name = self.record(kind, &format!("{D}-d, {numel} elements"));
        self.floats.push((name, numel, trainable));
    }

    fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<B, D, Int>>) {
        self.record("int", &format!("{:?}", param.lazy_shape().as_slice()));
    }

    fn visit_bool<const D: usize>(&mut self, param: &Param<Tensor<B, D, Bool>>) {
        self.record("bool", &format!("{:?}", param.lazy_shape().as_slice()));
    }
}

/// Whether `param` requires a gradient, without initializing it. Burn keeps that flag of a
/// lazy parameter private, but applies it to whatever is loaded into the parameter: so a
/// one-element stand-in is loaded into a (lazy, cheap) clone, and the flag read from it.
fn lazy_require_grad<B: Backend, const D: usize>(param: &Param<Tensor<B, D>>) -> bool {
    if param.is_initialized() {
        return param.val().is_require_grad();
    }
    let stand_in = Tensor::<B, D>::zeros([1; D], &param.lazy_device());
    param
        .clone()
        .transform_for_load(stand_in, param.id)
        .val()
        .is_require_grad()
}

/// Walk 2: rank 0's values, one tensor at a time; trainable parameters keep this rank's piece.
struct Stream<'a, X: Backend> {
    ddp: &'a Ddp,
    layout: &'a FlatLayout,
    plan: &'a ShardPlan,
    /// Float tensors seen so far, trainable parameters seen so far.
    float: usize,
    trainable: usize,
    sharded: Vec<ShardedParamInfo>,
    pieces: Vec<Vec<u8>>,
    devices: Vec<X::Device>,
    /// Every float parameter as the reducer knows it (stable ids), visit order.
    floats: Vec<ParamInfo>,
    error: Option<DistError>,
}

impl<X: Backend> Stream<'_, X> {
    /// Rank 0's bytes of a tensor named `name` whose bytes here are `data`, after checking that
    /// every rank has the same shape, dtype and size for it.
    fn rank0_bytes(&mut self, name: &str, data: TensorData) -> Option<Vec<u8>> {
        if self.error.is_some() {
            return None;
        }
        match self.broadcast(name, data) {
            Ok(bytes) => Some(bytes),
            Err(error) => {
                self.error = Some(error);
                None
            }
        }
    }

    fn broadcast(&self, name: &str, data: TensorData) -> Result<Vec<u8>> {
        let code = dtype_code(data.dtype);
        // The plan agreed on the number of dimensions: every rank sends as many values.
        let mut mine = vec![code, data.bytes.len() as u64];
        mine.extend(data.shape.as_slice().iter().map(|&d| d as u64));
        let bytes = data.into_bytes().to_vec();
        let all = self.ddp.all_gather_u64s(&mine)?;
        let n = mine.len();
        if let Some(rank) = (1..self.ddp.world_size()).find(|&q| all[n * q..n * q + n] != all[..n])
        {
            let at = |q: usize| &all[n * q..n * q + n];
            let (theirs, rank0) = (at(rank), at(0));
            return Err(DistError::ModelMismatch(format!(
                "tensor `{name}` has shape {:?}, dtype code {} and {} bytes on rank {rank} but \
                 shape {:?}, dtype code {} and {} bytes on rank 0 (codes: {})",
                &theirs[2..],
                theirs[0],
                theirs[1],
                &rank0[2..],
                rank0[0],
                rank0[1],
                DTYPE_CODES
            )));
        }
        Ok(self
            .ddp
            .communicator()
            .broadcast(HostBuffer::U8(bytes), 0)
            .wait()?
            .as_bytes()
            .to_vec())
    }
}

const DTYPE_CODES: &str = "1 f32, 2 f16, 3 bf16, 4 f64, 0 other";

fn dtype_code(dtype: DType) -> u64 {
    match dtype {
        DType::F32 => 1,
        DType::F16 => 2,
        DType::BF16 => 3,
        DType::F64 => 4,
        _ => 0,
    }
}

impl<X, B> ModuleMapper<B> for Stream<'_, X>
where
    X: Backend,
    B: AutodiffBackend<InnerBackend = DistributedBackend<X, Sharded>>,
{
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (_, tensor, mapper) = param.consume();
        // Prepared before: the record hooks wrap the parameter's own mapper, which is kept.
        let mapper = record::own_mapper::<X, B, D>(&tensor).unwrap_or(mapper);
        let (name, numel, trainable) = self.plan.floats[self.float].clone();
        // The initialized tensor's shape, not the lazy one (see the module's docs), as
        // `Ddp::prepare` sees it: the same ids and shapes at every stage.
        let shape = tensor.dims().to_vec();
        let id = stable_param_id(self.float, &name, &shape);
        self.float += 1;
        let (dtype, device) = (tensor.dtype(), tensor.device());
        let inner = tensor.inner();
        let inner_device = inner.device();
        self.floats.push(ParamInfo {
            id,
            name: name.clone(),
            shape: shape.clone(),
            dtype,
            require_grad: trainable,
        });
        let Some(bytes) = self.rank0_bytes(&name, inner.into_data()) else {
            return Param::from_mapped_value(id, Tensor::zeros([1; D], &device), mapper);
        };
        // Every rank has this shape (the broadcast checked), so every rank fails alike here.
        if shape.iter().product::<usize>() != numel {
            self.error = Some(DistError::ModelMismatch(format!(
                "tensor `{name}` was planned with {numel} elements (Burn's lazy shape) but \
                 initialized with shape {shape:?}"
            )));
            return Param::from_mapped_value(id, Tensor::zeros([1; D], &device), mapper);
        }
        let data = TensorData::from_bytes_vec(bytes, shape.clone(), dtype);
        if !trainable {
            let like = Tensor::<B, D>::zeros([1; D], &device);
            return Param::from_mapped_value(id, replace_values(&like, data), mapper);
        }
        // This rank's piece; the model keeps a one-element stand-in until walk 3.
        let index = self.trainable;
        self.trainable += 1;
        let range = self.layout.param_range(index);
        let counts = (0..self.layout.world)
            .map(|q| self.layout.in_shard(range.clone(), q).len())
            .collect();
        // Empty where the parameter lies outside this rank's shard (`in_shard` then says
        // nothing about where).
        let mine = self.layout.in_shard(range.clone(), self.ddp.rank());
        let elem = dtype.size();
        let piece = match mine.is_empty() {
            true => Vec::new(),
            false => data.as_bytes()
                [(mine.start - range.start) * elem..(mine.end - range.start) * elem]
                .to_vec(),
        };
        self.pieces.push(piece);
        self.sharded.push(ShardedParamInfo {
            id,
            name,
            shape,
            dtype,
            counts,
        });
        self.devices.push(inner_device);
        Param::from_mapped_value(id, Tensor::zeros([1; D], &device), mapper)
    }

    fn map_int<const D: usize>(
        &mut self,
        param: Param<Tensor<B, D, Int>>,
    ) -> Param<Tensor<B, D, Int>> {
        let (id, tensor, mapper) = param.consume();
        let (device, dtype, dims) = (tensor.device(), tensor.dtype(), tensor.dims());
        let tensor = match self.rank0_bytes("an int tensor", tensor.into_data()) {
            Some(bytes) => Tensor::from_data(
                TensorData::from_bytes_vec(bytes, dims.to_vec(), dtype),
                (&device, dtype),
            ),
            None => Tensor::zeros(dims, &device),
        };
        Param::from_mapped_value(id, tensor, mapper)
    }

    fn map_bool<const D: usize>(
        &mut self,
        param: Param<Tensor<B, D, Bool>>,
    ) -> Param<Tensor<B, D, Bool>> {
        let (id, tensor, mapper) = param.consume();
        let (device, dtype, dims) = (tensor.device(), tensor.dtype(), tensor.dims());
        let tensor = match self.rank0_bytes("a bool tensor", tensor.into_data()) {
            Some(bytes) => Tensor::from_data(
                TensorData::from_bytes_vec(bytes, dims.to_vec(), dtype),
                (&device, dtype),
            ),
            None => Tensor::empty(dims, &device),
        };
        Param::from_mapped_value(id, tensor, mapper)
    }
}

/// Walk 3: every stand-in of a trainable parameter becomes a handle into `shards`.
struct Install<X: Backend> {
    shards: Arc<ParamShards>,
    devices: Vec<X::Device>,
    next: usize,
}

impl<X, B> ModuleMapper<B> for Install<X>
where
    X: Backend,
    B: AutodiffBackend<InnerBackend = DistributedBackend<X, Sharded>>,
{
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let index = self.next;
        if self
            .shards
            .params()
            .get(index)
            .is_none_or(|p| p.id != param.id)
        {
            return param; // not trainable: it kept rank 0's values
        }
        self.next += 1;
        let (id, _stand_in, mapper) = param.consume();
        let device = self.devices[index].clone();
        let handle = ParamHandle::<X>::new(self.shards.clone(), index, device.clone());
        let tensor = record::wrap::<X, B, D>(ShardedFloat::Param(handle)).require_grad();
        let param = Param::from_mapped_value(id, tensor, ParamMapper::default());
        record::install::<X, B, D>(param, &self.shards, index, device, mapper)
    }
}

/// What a primitive of `DistributedBackend<X, Sharded>` holds (see [`ParamShards::holding`]).
fn probe<X: Backend>(primitive: &dyn Any) -> Option<Holding> {
    primitive
        .downcast_ref::<ShardedFloat<X>>()
        .map(|float| match float {
            ShardedFloat::Local(_) => Holding::Local,
            ShardedFloat::Param(handle) => Holding::Handle {
                index: handle.index(),
                whole: handle.is_whole(),
                shards: handle.shards_address(),
            },
        })
}

impl Ddp {
    /// ZeRO stage 3: makes `model` identical on every rank, as [`Ddp::prepare`] does, but keeps
    /// on this rank only its piece of each trainable parameter, and never holds the whole
    /// model: parameters are initialized (Burn creates them lazily), checked, broadcast from
    /// rank 0 and cut one at a time. Each trainable parameter's tensor becomes a handle that
    /// the ops using it gather and release (see [`crate::sharding`]); the other tensors keep
    /// rank 0's values. Train it with ZeroAdam at stage 3.
    ///
    /// Each sharded parameter gets record hooks (`crate::sharding`'s `record.rs`): at stage 3
    /// `into_record` gathers every parameter to rank 0 only (a collective: every rank takes the
    /// record), and `load_record` of a full record keeps the model sharded, each rank cutting
    /// its piece out of the loaded values.
    pub fn prepare_sharded<X, B, M>(&mut self, model: M) -> Result<M>
    where
        X: Backend,
        B: AutodiffBackend<InnerBackend = DistributedBackend<X, Sharded>>,
        M: Module<B>,
    {
        // On the device path the pieces go to the device store's memory, whose backend must be
        // this model's: refused here, by name, rather than in the first op's gather.
        #[cfg(feature = "device")]
        if self.reduces_on_device() {
            let primitive = std::any::TypeId::of::<X::FloatTensorPrimitive>();
            let shared = self.shared_reducer();
            if let Err(expected) = crate::context::lock(&shared).accepts_device(primitive) {
                return Err(DistError::WrongBackend {
                    expected: expected.to_string(),
                    got: std::any::type_name::<X::FloatTensorPrimitive>().to_string(),
                });
            }
        }
        let mut plan = ShardPlan::default();
        model.visit(&mut plan);
        // The window decides which gathers each rank issues ahead: ranks that differ would
        // pair different gathers.
        let prefetch = format!("{:?}", self.prefetch);
        self.check_same_model(&plan.lines, &[("DdpConfig::prefetch", prefetch)])?;
        let layout = FlatLayout::new(&plan.trainable_numels(), self.world_size(), SHARD_ALIGN);
        let mut stream = Stream::<X> {
            ddp: self,
            layout: &layout,
            plan: &plan,
            float: 0,
            trainable: 0,
            sharded: Vec::new(),
            pieces: Vec::new(),
            devices: Vec::new(),
            floats: Vec::new(),
            error: None,
        };
        let model = model.map(&mut stream);
        let Stream {
            sharded,
            pieces,
            devices,
            floats,
            error,
            ..
        } = stream;
        if let Some(error) = error {
            return Err(error);
        }
        let shards = ParamShards::new(
            self.comm(),
            layout.clone(),
            sharded,
            pieces,
            Box::new(probe::<X>),
            self.prefetch,
        );
        // The device path: the pieces move into the reducer's device memory, and gathers fill
        // fresh device buffers there.
        #[cfg(feature = "device")]
        let shards = match self.reduces_on_device() {
            true => {
                let shared = self.shared_reducer();
                shards.on_device(|dtype, shard| {
                    crate::context::lock(&shared).device_pieces(dtype, shard)
                })?
            }
            false => shards,
        };
        let shards = Arc::new(shards);
        let model = model.map(&mut Install::<X> {
            shards: shards.clone(),
            devices,
            next: 0,
        });
        self.register_params(floats);
        self.shard_gradients(layout)?;
        // One bucket being reduced while the next fills, as DeepSpeed's two reduce buffers:
        // the buckets of a backward must not pile up to the size of the gradient.
        let shared = self.shared_reducer();
        let mut reducer = crate::context::lock(&shared);
        reducer.default_in_flight(2);
        reducer.param_shards = Some(shards.clone());
        drop(reducer);
        self.shards = Some(shards);
        Ok(self.mark(model))
    }
}
