//! The model's float tensors as safetensors, named by their module path (`layers.0.weight`), in
//! the model's dtype, so that other tools (Python's `safetensors`, Candle, Burn's own store)
//! load them as they are.

use std::collections::HashMap;
use std::path::Path;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use burn_dist::{FlatLayout, ParamShards};
use safetensors::{Dtype, SafeTensors, tensor::TensorView};

use super::error::{CheckpointError, Result};

/// Float tensors of a model, by path: (name, shape, dtype, bytes).
pub(crate) struct Tensors(pub Vec<(String, Vec<usize>, DType, Vec<u8>)>);

/// Every float tensor of `model` but those whose id is in `skip` (ZeRO stage 3's sharded
/// parameters, which no rank holds whole and which are never read here).
pub(crate) fn collect<B: Backend, M: Module<B>>(model: &M, skip: &[ParamId]) -> Tensors {
    let mut collect = Collect {
        skip,
        path: Vec::new(),
        tensors: Vec::new(),
    };
    model.visit(&mut collect);
    Tensors(collect.tensors)
}

struct Collect<'a> {
    skip: &'a [ParamId],
    path: Vec<String>,
    tensors: Vec<(String, Vec<usize>, DType, Vec<u8>)>,
}

impl<B: Backend> ModuleVisitor<B> for Collect<'_> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if self.skip.contains(&param.id) {
            return;
        }
        let tensor = param.val();
        let (shape, dtype) = (tensor.dims().to_vec(), tensor.dtype());
        let bytes = tensor.into_data().into_bytes().to_vec();
        self.tensors
            .push((self.path.join("."), shape, dtype, bytes));
    }
}

/// Where [`overwrite`] takes the trainable parameters' values from.
pub(crate) enum Trainable<'a> {
    /// From the file, like every other tensor.
    FromFile,
    /// From the checkpoint's full master weights (`layout`'s flat order, f32), converted to
    /// each parameter's dtype: a stage-3 checkpoint loaded into a model that is not sharded.
    FromMaster {
        master: &'a [f32],
        layout: &'a FlatLayout,
    },
    /// Into this rank's pieces of a sharded model (whose handles stay): cut from the file's
    /// tensors when it has them (`from_file`) and staged ([`StagedPieces`]), else left to the
    /// optimizer's import of its master weights.
    IntoPieces {
        shards: &'a ParamShards,
        from_file: bool,
    },
}

/// How every trainable parameter's values come back: `ids`, in flat (visit) order, and where
/// from.
pub(crate) struct Restore<'a> {
    pub ids: &'a [ParamId],
    pub trainable: Trainable<'a>,
}

pub(crate) fn safetensors_dtype(dtype: DType) -> Option<Dtype> {
    Some(match dtype {
        DType::F64 => Dtype::F64,
        DType::F32 | DType::Flex32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        _ => return None,
    })
}

fn burn_dtype(dtype: Dtype) -> Option<DType> {
    Some(match dtype {
        Dtype::F64 => DType::F64,
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        _ => return None,
    })
}

impl Tensors {
    /// The safetensors file's bytes, with `metadata` in its header.
    pub fn serialize(&self, metadata: HashMap<String, String>) -> Result<Vec<u8>, String> {
        let views = self
            .0
            .iter()
            .map(|(name, shape, dtype, bytes)| {
                let dtype = safetensors_dtype(*dtype).ok_or_else(|| {
                    format!("tensor {name} has dtype {dtype:?}, which safetensors cannot hold")
                })?;
                let view = TensorView::new(dtype, shape.clone(), bytes)
                    .map_err(|e| format!("tensor {name}: {e}"))?;
                Ok((name.as_str(), view))
            })
            .collect::<Result<Vec<_>, String>>()?;
        super::safetensors_file::serialize(views, metadata)
    }
}

/// This rank's pieces of a sharded model's parameters, cut from a checkpoint's file but not
/// written yet: the pieces are shared by every clone of the model, so a load writes them only
/// once every rank has read everything it needs ([`StagedPieces::write`]), and a load that
/// fails on any rank leaves them as they were.
#[derive(Default)]
pub(crate) struct StagedPieces(Vec<(usize, Vec<u8>)>);

impl StagedPieces {
    /// Writes every staged piece into `shards` (every rank calls it, with the same parameters).
    pub(crate) fn write(self, shards: &ParamShards) {
        for (index, piece) in self.0 {
            shards.set_piece(index, &piece);
        }
    }
}

/// Replaces every float tensor of `model` with the tensor of the same name in the safetensors
/// `bytes` (read from `path`), converted to the model's dtype and keeping `require_grad`; the
/// trainable parameters as `restore` says. The model is a new value (`model` itself is left
/// as it was); the pieces of a sharded model are returned staged, unwritten.
pub(crate) fn overwrite<B: Backend, M: Module<B>>(
    model: M,
    path: &Path,
    bytes: &[u8],
    restore: Restore<'_>,
) -> Result<(M, StagedPieces)> {
    let file = SafeTensors::deserialize(bytes)
        .map_err(|e| CheckpointError::corrupt(path, format!("not a safetensors file: {e}")))?;
    let mut map = Overwrite {
        file,
        restore,
        path: Vec::new(),
        staged: StagedPieces::default(),
        error: None,
    };
    let model = model.map(&mut map);
    match map.error {
        Some(reason) => Err(CheckpointError::corrupt(path, reason)),
        None => Ok((model, map.staged)),
    }
}

struct Overwrite<'a> {
    file: SafeTensors<'a>,
    restore: Restore<'a>,
    path: Vec<String>,
    staged: StagedPieces,
    error: Option<String>,
}

impl<B: Backend> ModuleMapper<B> for Overwrite<'_> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        if self.error.is_some() {
            return param;
        }
        let name = self.path.join(".");
        let trainable = self.restore.ids.iter().position(|&id| id == param.id);
        match (&self.restore.trainable, trainable) {
            (Trainable::IntoPieces { .. }, Some(index)) => {
                return self.load_piece(param, &name, index);
            }
            (Trainable::FromMaster { master, layout }, Some(index)) => {
                let (id, tensor, mapper) = param.consume();
                let values = master[layout.param_range(index)].to_vec();
                let data =
                    TensorData::new(values, tensor.dims().to_vec()).convert_dtype(tensor.dtype());
                return Param::from_mapped_value(
                    id,
                    burn_dist::replace_values(&tensor, data),
                    mapper,
                );
            }
            _ => {}
        }
        let (id, tensor, mapper) = param.consume();
        let (shape, dtype) = (tensor.dims().to_vec(), tensor.dtype());
        let stored = match self.file.tensor(&name) {
            Ok(view) => view,
            Err(_) => {
                self.error = Some(format!("has no tensor {name} (the model has one)"));
                return Param::from_mapped_value(id, tensor, mapper);
            }
        };
        let Some(stored_dtype) = burn_dtype(stored.dtype()) else {
            self.error = Some(format!("tensor {name} has dtype {:?}", stored.dtype()));
            return Param::from_mapped_value(id, tensor, mapper);
        };
        if stored.shape() != shape.as_slice() {
            self.error = Some(format!(
                "tensor {name} has shape {:?}, the model's is {shape:?}",
                stored.shape()
            ));
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let data = TensorData::from_bytes_vec(stored.data().to_vec(), shape, stored_dtype)
            .convert_dtype(dtype);
        Param::from_mapped_value(id, burn_dist::replace_values(&tensor, data), mapper)
    }
}

impl Overwrite<'_> {
    /// A sharded parameter: its handle stays in the model; the file's values, when they are
    /// to be taken, are cut into this rank's piece of it, staged.
    fn load_piece<B: Backend, const D: usize>(
        &mut self,
        param: Param<Tensor<B, D>>,
        name: &str,
        index: usize,
    ) -> Param<Tensor<B, D>> {
        let Trainable::IntoPieces {
            shards,
            from_file: true,
        } = &self.restore.trainable
        else {
            return param;
        };
        let shape = param.val().dims().to_vec();
        match self.file.tensor(name) {
            Ok(stored) if stored.shape() == shape.as_slice() => match burn_dtype(stored.dtype()) {
                Some(dtype) => {
                    let full = TensorData::from_bytes_vec(stored.data().to_vec(), shape, dtype);
                    self.staged.0.push((index, shards.cut_piece(index, full)));
                }
                None => self.error = Some(format!("tensor {name} has dtype {:?}", stored.dtype())),
            },
            Ok(stored) => {
                self.error = Some(format!(
                    "tensor {name} has shape {:?}, the model's is {shape:?}",
                    stored.shape()
                ))
            }
            Err(_) => self.error = Some(format!("has no tensor {name} (the model has one)")),
        }
        param
    }
}
