//! [`export`]: a checkpoint's model as one safetensors file, every float tensor in its dtype,
//! one parameter in memory at a time.
//!
//! A checkpoint saved at ZeRO stage 3 keeps the trainable parameters' values only as the
//! shards' f32 master weights ([`Weights::MasterShards`]). The export reads each parameter's
//! elements straight from the shard files that hold them (seeking to them, after every shard
//! was verified in full, in pieces), converts them to the parameter's dtype and writes them:
//! neither the model nor a shard is ever held whole, so a model larger than the machine's
//! memory exports. The other tensors come from `model.safetensors` as they are.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom};
use std::ops::Range;
use std::path::{Path, PathBuf};

use burn::tensor::{DType, TensorData};
use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, View};

use super::error::{CheckpointError, Result};
use super::manifest::{Manifest, Weights};
use super::weights::safetensors_dtype;
use super::{files, resolve, safetensors_file, shard_file};
use crate::FlatLayout;

/// Writes the model of the checkpoint at `path` (a step directory or a root of them) to the
/// safetensors file `out`, atomically: every float tensor of `model.safetensors` as it is and,
/// for a checkpoint whose trainable weights are in the shards (ZeRO stage 3), each of those
/// from the shards' master weights in its dtype. The result is the model's full weights, as a
/// stage-1 or stage-2 checkpoint's `model.safetensors` is. Returns the checkpoint's manifest.
pub fn export(path: impl AsRef<Path>, out: impl AsRef<Path>) -> Result<Manifest> {
    let dir = resolve(path)?;
    let manifest = Manifest::read(&dir)?;
    let entry = manifest.model_entry(&dir)?;
    let model_bytes = files::read_verified(&dir, entry)?;
    let model_path = dir.join(entry.defined_name());
    let model = SafeTensors::deserialize(&model_bytes).map_err(|e| {
        CheckpointError::corrupt(&model_path, format!("not a safetensors file: {e}"))
    })?;
    let mut tensors: Vec<(String, Tensor<'_>)> = model
        .tensors()
        .into_iter()
        .map(|(name, view)| (name, Tensor::Stored(view)))
        .collect();
    let masters = match manifest.weights {
        Weights::ModelFile => None,
        Weights::MasterShards => Some(Masters::open(&dir, &manifest)?),
    };
    if let Some(masters) = &masters {
        let flat = FlatLayout::new(&manifest.layout.numels, 1, 1);
        for (index, param) in manifest.params.iter().enumerate() {
            let dtype = parse_dtype(&param.dtype).ok_or_else(|| {
                CheckpointError::corrupt(
                    dir.join(super::MANIFEST),
                    format!(
                        "parameter {} has dtype {}, which safetensors cannot hold",
                        param.name, param.dtype
                    ),
                )
            })?;
            tensors.push((
                param.name.clone(),
                Tensor::Master {
                    masters,
                    range: flat.param_range(index),
                    shape: param.shape.clone(),
                    dtype,
                },
            ));
        }
    }
    write(out.as_ref(), tensors, &manifest)?;
    if let Some(failure) = masters.and_then(|m| m.failure.into_inner()) {
        let _ = fs::remove_file(out.as_ref());
        return Err(failure);
    }
    Ok(manifest)
}

/// Writes `tensors` to `out` through a temporary file renamed over it.
fn write(out: &Path, tensors: Vec<(String, Tensor<'_>)>, manifest: &Manifest) -> Result<()> {
    let (dir, name) = files::dir_and_name(out)?;
    let metadata = HashMap::from([
        ("producer".to_string(), "burn-dist-ckpt export".to_string()),
        ("step".to_string(), manifest.step.to_string()),
    ]);
    files::write_atomic_with(&dir, name, |tmp| {
        safetensors_file::serialize_to_file(tensors, metadata, tmp)
            .map_err(|reason| CheckpointError::corrupt(tmp, reason))?;
        File::open(tmp)
            .and_then(|f| f.sync_all())
            .map_err(CheckpointError::io(tmp))
    })
}

fn parse_dtype(name: &str) -> Option<DType> {
    Some(match name {
        "F64" => DType::F64,
        "F32" => DType::F32,
        "F16" => DType::F16,
        "BF16" => DType::BF16,
        _ => return None,
    })
}

/// One tensor of the export: as stored in the model file, or read from the shards on demand.
enum Tensor<'a> {
    Stored(safetensors::tensor::TensorView<'a>),
    Master {
        masters: &'a Masters,
        /// Its elements in the flat vector.
        range: Range<usize>,
        shape: Vec<usize>,
        dtype: DType,
    },
}

impl View for Tensor<'_> {
    fn dtype(&self) -> Dtype {
        match self {
            Tensor::Stored(view) => view.dtype(),
            Tensor::Master { dtype, .. } => safetensors_dtype(*dtype).expect("checked on parsing"),
        }
    }

    fn shape(&self) -> &[usize] {
        match self {
            Tensor::Stored(view) => view.shape(),
            Tensor::Master { shape, .. } => shape,
        }
    }

    /// A parameter from the shards is read here, when the writer reaches it, and dropped once
    /// written: one parameter in memory at a time.
    fn data(&self) -> Cow<'_, [u8]> {
        match self {
            Tensor::Stored(view) => view.data().into(),
            Tensor::Master {
                masters,
                range,
                shape,
                dtype,
            } => {
                let values = masters.read(range.clone());
                let data = TensorData::new(values, shape.clone()).convert_dtype(*dtype);
                Cow::Owned(data.into_bytes().to_vec())
            }
        }
    }

    fn data_len(&self) -> usize {
        match self {
            Tensor::Stored(view) => view.data_len(),
            Tensor::Master { range, dtype, .. } => range.len() * dtype.size(),
        }
    }
}

/// The master weights of every shard file of a checkpoint, read on demand.
struct Masters {
    /// Per saved rank: its file and where its master weights start in it.
    shards: Vec<(PathBuf, u64)>,
    shard_len: usize,
    /// The first failure of a read (the writer's callback cannot return one).
    failure: RefCell<Option<CheckpointError>>,
}

impl Masters {
    /// Verifies every shard file in full (in pieces) and reads where its master weights are.
    fn open(dir: &Path, manifest: &Manifest) -> Result<Self> {
        let mut shards = Vec::with_capacity(manifest.world_size);
        for rank in 0..manifest.world_size {
            let entry = manifest.shard_entry(dir, rank)?;
            files::verify_streaming(dir, entry)?;
            let path = dir.join(entry.defined_name());
            let mut head = vec![0u8; 56];
            File::open(&path)
                .and_then(|mut f| f.read_exact(&mut head))
                .map_err(CheckpointError::io(&path))?;
            let header = shard_file::header(&path, &head, entry.bytes)?;
            let fits = header.rank == rank
                && header.world == manifest.world_size
                && header.s == manifest.layout.shard_len as u64
                && header.total == manifest.layout.total as u64
                && header.n == manifest.params.len() as u64;
            if !fits {
                return Err(CheckpointError::corrupt(
                    &path,
                    format!(
                        "holds rank {} of {} ({} per shard), the manifest expects rank {rank} of {} ({} per shard)",
                        header.rank,
                        header.world,
                        header.s,
                        manifest.world_size,
                        manifest.layout.shard_len
                    ),
                ));
            }
            shards.push((path, header.master_offset()));
        }
        Ok(Masters {
            shards,
            shard_len: manifest.layout.shard_len,
            failure: RefCell::new(None),
        })
    }

    /// The master weights of the flat elements `range`, from the shards that hold them; zeros
    /// after a failure, which is kept for [`export`] to return.
    fn read(&self, range: Range<usize>) -> Vec<f32> {
        let mut values = vec![0.0f32; range.len()];
        let mut at = range.start;
        while at < range.end && self.failure.borrow().is_none() {
            let rank = at / self.shard_len;
            let end = range.end.min((rank + 1) * self.shard_len);
            let (path, master) = &self.shards[rank];
            let offset = master + 4 * (at - rank * self.shard_len) as u64;
            let mut bytes = vec![0u8; 4 * (end - at)];
            let read = File::open(path).and_then(|mut file| {
                file.seek(SeekFrom::Start(offset))?;
                file.read_exact(&mut bytes)
            });
            match read {
                Ok(()) => {
                    let out = &mut values[at - range.start..end - range.start];
                    for (value, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                        *value = f32::from_le_bytes(b.try_into().expect("4 bytes"));
                    }
                }
                Err(e) => *self.failure.borrow_mut() = Some(CheckpointError::io(path)(e)),
            }
            at = end;
        }
        values
    }
}
