//! The model's float tensors as safetensors, named by their module path (`layers.0.weight`), in
//! the model's dtype, so that other tools (Python's `safetensors`, Candle, Burn's own store)
//! load them as they are.

use std::collections::HashMap;
use std::path::Path;

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use safetensors::{Dtype, SafeTensors, tensor::TensorView};

use super::error::{CheckpointError, Result};

/// Every float tensor of `model`, by path: (name, shape, dtype, bytes).
pub(crate) struct Tensors(pub Vec<(String, Vec<usize>, DType, Vec<u8>)>);

pub(crate) fn collect<B: Backend, M: Module<B>>(model: &M) -> Tensors {
    let survey = burn_dist::Survey::of::<B, M>(model);
    let tensors = survey
        .floats
        .iter()
        .zip(&survey.float_offsets)
        .map(|(p, &at)| {
            let bytes = survey.bytes[at..at + p.numel() * p.dtype.size()].to_vec();
            (p.name.clone(), p.shape.clone(), p.dtype, bytes)
        });
    Tensors(tensors.collect())
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
        safetensors::serialize(views, Some(metadata)).map_err(|e| e.to_string())
    }
}

/// Replaces every float tensor of `model` with the tensor of the same name in the safetensors
/// `bytes` (read from `path`), converted to the model's dtype and keeping `require_grad`.
pub(crate) fn overwrite<B: Backend, M: Module<B>>(
    model: M,
    path: &Path,
    bytes: &[u8],
) -> Result<M> {
    let file = SafeTensors::deserialize(bytes)
        .map_err(|e| CheckpointError::corrupt(path, format!("not a safetensors file: {e}")))?;
    let mut map = Overwrite {
        file,
        path: Vec::new(),
        error: None,
    };
    let model = model.map(&mut map);
    match map.error {
        Some(reason) => Err(CheckpointError::corrupt(path, reason)),
        None => Ok(model),
    }
}

struct Overwrite<'a> {
    file: SafeTensors<'a>,
    path: Vec<String>,
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
