//! What the reducer needs from a module: its parameters in visit order, a fingerprint to
//! compare across ranks, their bytes for the start-up broadcast, and the marks that make
//! Burn's backward call our hooks.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId, Parameter};
use burn::tensor::backend::distributed::DistributedParamId;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{BasicOps, Bool, DType, Int, Tensor, TensorData};

/// A tensor holding `data` on `like`'s device, in `like`'s dtype, requiring grad if `like` did:
/// what every mapper that replaces a parameter's values needs (the start-up broadcast,
/// checkpoint loading, an optimizer's write-back).
pub fn replace_values<B: Backend, const D: usize>(
    like: &Tensor<B, D>,
    data: TensorData,
) -> Tensor<B, D> {
    // The dtype is explicit: `from_data` alone would use the device's default float type and
    // silently turn an f16 parameter into an f32 one.
    let fresh = Tensor::from_data(data, (&like.device(), like.dtype()));
    if like.is_require_grad() {
        fresh.require_grad()
    } else {
        fresh
    }
}

/// A float parameter of the model, as the reducer knows it.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamInfo {
    pub id: ParamId,
    /// Dotted path in the module, e.g. `layers.0.weight`.
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
    pub require_grad: bool,
}

impl ParamInfo {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Everything `prepare` learns from one walk over the module.
#[derive(Default)]
pub struct Survey {
    /// Float parameters, in visit order.
    pub floats: Vec<ParamInfo>,
    /// One line per tensor (float, int, bool) describing name, kind, shape and dtype.
    pub fingerprint: Vec<String>,
    /// The values of every tensor, concatenated in visit order (for the broadcast).
    pub bytes: Vec<u8>,
    /// Where each of `floats` starts in `bytes`.
    pub float_offsets: Vec<usize>,
    path: Vec<String>,
}

impl Survey {
    pub fn of<B: Backend, M: Module<B>>(model: &M) -> Survey {
        let mut survey = Survey::default();
        model.visit(&mut survey);
        survey
    }

    fn record(&mut self, kind: &str, shape: Vec<usize>, dtype: DType, data: TensorData) -> String {
        let name = self.path.join(".");
        self.fingerprint
            .push(format!("{kind} {name} {shape:?} {dtype:?}"));
        self.bytes.extend_from_slice(data.as_bytes());
        name
    }
}

impl<B: Backend> ModuleVisitor<B> for Survey {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let tensor = param.val();
        let (shape, dtype) = (tensor.dims().to_vec(), tensor.dtype());
        let require_grad = tensor.is_require_grad();
        let kind = if require_grad { "param" } else { "float" };
        self.float_offsets.push(self.bytes.len());
        let name = self.record(kind, shape.clone(), dtype, tensor.into_data());
        self.floats.push(ParamInfo {
            id: param.id,
            name,
            shape,
            dtype,
            require_grad,
        });
    }

    fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<B, D, Int>>) {
        let tensor = param.val();
        self.record(
            "int",
            tensor.dims().to_vec(),
            tensor.dtype(),
            tensor.into_data(),
        );
    }

    fn visit_bool<const D: usize>(&mut self, param: &Param<Tensor<B, D, Bool>>) {
        let tensor = param.val();
        self.record(
            "bool",
            tensor.dims().to_vec(),
            tensor.dtype(),
            tensor.into_data(),
        );
    }
}

/// Replaces every tensor's values with the next bytes of a broadcast buffer (same layout as
/// [`Survey::bytes`]), keeping ids and `require_grad`.
pub(crate) struct Overwrite<'a> {
    pub bytes: &'a [u8],
    pub at: usize,
}

impl Overwrite<'_> {
    /// An int or bool tensor with the next values, in its own dtype (these never need grad).
    fn replace<B: Backend, const D: usize, K: BasicOps<B>>(
        &mut self,
        param: Param<Tensor<B, D, K>>,
    ) -> Param<Tensor<B, D, K>>
    where
        Tensor<B, D, K>: Parameter,
    {
        let (id, tensor, mapper) = param.consume();
        let (device, dtype) = (tensor.device(), tensor.dtype());
        let data = self.next(&tensor.dims(), dtype);
        Param::from_mapped_value(id, Tensor::from_data(data, (&device, dtype)), mapper)
    }

    fn next(&mut self, shape: &[usize], dtype: DType) -> TensorData {
        let len = shape.iter().product::<usize>() * dtype.size();
        let bytes = self.bytes[self.at..self.at + len].to_vec();
        self.at += len;
        TensorData::from_bytes_vec(bytes, shape.to_vec(), dtype)
    }
}

impl<B: Backend> ModuleMapper<B> for Overwrite<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let data = self.next(&tensor.dims(), tensor.dtype());
        Param::from_mapped_value(id, replace_values(&tensor, data), mapper)
    }

    fn map_int<const D: usize>(
        &mut self,
        param: Param<Tensor<B, D, Int>>,
    ) -> Param<Tensor<B, D, Int>> {
        self.replace(param)
    }

    fn map_bool<const D: usize>(
        &mut self,
        param: Param<Tensor<B, D, Bool>>,
    ) -> Param<Tensor<B, D, Bool>> {
        self.replace(param)
    }
}

/// Gives every float parameter, in visit order, the `ParamId` that [`stable_param_id`] derives
/// from its place in the model.
pub(crate) struct StableIds<'a> {
    pub ids: &'a [ParamId],
    pub next: usize,
}

impl<B: Backend> ModuleMapper<B> for StableIds<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (_, tensor, mapper) = param.consume();
        let id = self.ids[self.next];
        self.next += 1;
        Param::from_mapped_value(id, tensor, mapper)
    }
}

/// The `ParamId` of the `index`-th float parameter (visit order), named `name`, of shape
/// `shape`: the same in every process and every run of the same model.
///
/// Why: Burn draws ParamIds at random per process, and a model loaded from a record takes the
/// ids saved in it (burn-train's Learner resumes that way). The reducer and ZeroAdam key
/// parameters by id, so the ids of a resumed process must be those of the process that saved.
/// With ids derived from the model's structure they are.
pub(crate) fn stable_param_id(index: usize, name: &str, shape: &[usize]) -> ParamId {
    // FNV-1a over the parameter's place, name and shape; distinct parameters of one model
    // differ in `index`, so only a 64-bit hash collision could give two of them one id.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &byte in bytes {
            hash = (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    eat(&(index as u64).to_le_bytes());
    eat(name.as_bytes());
    for &dim in shape {
        eat(&(dim as u64).to_le_bytes());
    }
    ParamId::from(hash)
}

/// Marks every trainable float parameter for gradient sync, with its `ParamId` as the
/// distributed id (what Burn's optimizers use when they re-mark after a step).
pub(crate) struct Mark;

/// `model` with every trainable float parameter marked for gradient sync, keyed by its
/// `ParamId` as `Ddp::prepare` registered it (the key Burn's optimizers keep when they re-mark).
/// Values are unchanged; without a `Ddp` in the process the hooks do nothing. `Ddp::mark` does
/// the same; this form needs no `Ddp`, for code that cannot reach one, such as a burn-train
/// `TrainStep` (the Learner's fork drops the marks: see the guide).
pub fn mark_for_sync<B: AutodiffBackend, M: Module<B>>(model: M) -> M {
    model.map(&mut Mark)
}

impl<B: AutodiffBackend> ModuleMapper<B> for Mark {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let tensor = if tensor.is_require_grad() {
            tensor.set_distributed(distributed_id(id))
        } else {
            tensor
        };
        Param::from_mapped_value(id, tensor, mapper)
    }
}

pub(crate) fn distributed_id(id: ParamId) -> DistributedParamId {
    DistributedParamId::from(id.val())
}

/// Where rank `rank`'s fingerprint first differs from rank 0's, or `None` when they agree.
pub(crate) fn first_difference(rank0: &[String], other: &[String], rank: usize) -> Option<String> {
    for (i, (a, b)) in rank0.iter().zip(other).enumerate() {
        if a != b {
            return Some(format!(
                "tensor #{i} is `{b}` on rank {rank} but `{a}` on rank 0"
            ));
        }
    }
    (rank0.len() != other.len()).then(|| {
        format!(
            "rank {rank} has {} tensors, rank 0 has {}",
            other.len(),
            rank0.len()
        )
    })
}
