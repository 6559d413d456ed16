//! `manifest.json`: what a complete checkpoint holds. Written last, by rank 0; its presence
//! is what makes a checkpoint directory complete.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::error::{CheckpointError, Result};
use super::files;
use crate::FlatLayout;

/// The manifest format this build writes, and the newest it reads.
pub const FORMAT_VERSION: u32 = 1;

pub const MANIFEST: &str = "manifest.json";
pub const MODEL_FILE: &str = "model.safetensors";

/// Name of rank `rank`'s optimizer shard file.
pub fn shard_file(rank: usize) -> String {
    format!("optim-rank-{rank:05}.bin")
}

/// The contents of `manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format_version: u32,
    pub world_size: usize,
    pub step: u64,
    /// Samples consumed by all ranks together since the start of training.
    pub samples_consumed: u64,
    pub scaler: Option<ScalerState>,
    pub random: RandomState,
    pub layout: LayoutEntry,
    /// The gradient buckets in use when it was saved: each bucket's parameters (visit-order
    /// indices) in the order they become ready. Restored on load (at the same parameter count)
    /// so that a resumed run reduces in the tuned buckets from its first step; ZeRO-2's frozen
    /// layout is derived from the flat layout and kept as it is.
    #[serde(default)]
    pub buckets: Vec<Vec<usize>>,
    /// The trainable parameters, in flat (module visit) order.
    pub params: Vec<ParamEntry>,
    /// Every file of the checkpoint but the manifest.
    pub files: Vec<FileEntry>,
}

/// A `GradScaler`'s state.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ScalerState {
    pub scale: f32,
    pub growth_tracker: u32,
}

/// Where the ranks are in their random streams (see `burn_dist::random`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RandomState {
    pub seed: u64,
    pub step: u64,
}

/// The flat layout the optimizer shards were written with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutEntry {
    pub numels: Vec<usize>,
    pub total: usize,
    /// Elements per shard: `total` split over `world_size` ranks, rounded up to the alignment.
    pub shard_len: usize,
}

impl LayoutEntry {
    pub fn of(layout: &FlatLayout) -> Self {
        LayoutEntry {
            numels: layout.numels.clone(),
            total: layout.total,
            shard_len: layout.shard_len,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamEntry {
    /// Dotted path in the module, e.g. `layers.0.weight`; the tensor's name in the files.
    pub name: String,
    pub shape: Vec<usize>,
    /// The model's dtype (Burn's name), e.g. `F32`, `BF16`.
    pub dtype: String,
}

/// One file of the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    pub name: String,
    /// The rank whose optimizer shard it holds; `None` for the model weights.
    pub rank: Option<usize>,
    pub bytes: u64,
    pub crc32: u32,
}

impl FileEntry {
    /// What the file is, for messages.
    pub fn what(&self) -> String {
        match self.rank {
            Some(rank) => format!("rank {rank}'s optimizer shard"),
            None => "the model weights".into(),
        }
    }
}

impl Manifest {
    /// The entry of rank `rank`'s shard file.
    pub fn shard_entry(&self, dir: &Path, rank: usize) -> Result<&FileEntry> {
        self.files
            .iter()
            .find(|f| f.rank == Some(rank))
            .ok_or_else(|| {
                CheckpointError::corrupt(
                    dir.join(MANIFEST),
                    format!(
                        "lists no optimizer shard for rank {rank} of {}",
                        self.world_size
                    ),
                )
            })
    }

    pub fn model_entry(&self, dir: &Path) -> Result<&FileEntry> {
        self.files
            .iter()
            .find(|f| f.rank.is_none())
            .ok_or_else(|| CheckpointError::corrupt(dir.join(MANIFEST), "lists no model weights"))
    }

    /// Reads and checks `dir/manifest.json`. A missing manifest means an incomplete checkpoint;
    /// a newer format version is refused before anything else is interpreted.
    pub fn read(dir: &Path) -> Result<Manifest> {
        let path = dir.join(MANIFEST);
        let bytes = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(CheckpointError::Incomplete {
                    dir: dir.to_path_buf(),
                });
            }
            Err(e) => return Err(CheckpointError::io(&path)(e)),
        };
        let value: serde_json::Value = serde_json::from_slice(&bytes)
            .map_err(|e| CheckpointError::corrupt(&path, format!("not valid JSON: {e}")))?;
        let version = value
            .get("format_version")
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| CheckpointError::corrupt(&path, "has no format_version"))?;
        if version > u64::from(FORMAT_VERSION) {
            return Err(CheckpointError::NewerFormat {
                path,
                found: u32::try_from(version).unwrap_or(u32::MAX),
                supported: FORMAT_VERSION,
            });
        }
        let manifest: Manifest = serde_json::from_value(value)
            .map_err(|e| CheckpointError::corrupt(&path, format!("unreadable manifest: {e}")))?;
        manifest.check(&path)?;
        Ok(manifest)
    }

    /// Internal consistency, so that later indexing cannot panic on a hand-edited manifest.
    fn check(&self, path: &Path) -> Result<()> {
        let layout = &self.layout;
        let bad = |reason: String| Err(CheckpointError::corrupt(path, reason));
        if self.world_size == 0 {
            return bad("world_size is 0".into());
        }
        if layout.numels.len() != self.params.len() {
            return bad(format!(
                "{} parameters but {} sizes in the layout",
                self.params.len(),
                layout.numels.len()
            ));
        }
        for (param, &numel) in self.params.iter().zip(&layout.numels) {
            if param.shape.iter().product::<usize>() != numel {
                return bad(format!(
                    "parameter {} has shape {:?} but {numel} elements",
                    param.name, param.shape
                ));
            }
        }
        if layout.numels.iter().sum::<usize>() != layout.total
            || layout
                .shard_len
                .checked_mul(self.world_size)
                .is_none_or(|n| n < layout.total)
        {
            return bad(format!(
                "inconsistent layout ({} elements, {} per shard over {} ranks)",
                layout.total, layout.shard_len, self.world_size
            ));
        }
        for rank in 0..self.world_size {
            if !self.files.iter().any(|f| f.rank == Some(rank)) {
                return bad(format!(
                    "lists no optimizer shard for rank {rank} of {}",
                    self.world_size
                ));
            }
        }
        Ok(())
    }

    /// Writes the manifest atomically (the commit point of a save).
    pub fn write(&self, dir: &Path) -> Result<()> {
        let json = serde_json::to_vec_pretty(self).expect("a manifest serializes");
        files::write_atomic(dir, MANIFEST, &json)
    }
}
