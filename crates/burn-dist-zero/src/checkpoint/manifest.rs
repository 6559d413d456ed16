//! `manifest.json`: what a complete checkpoint holds. Written last, by rank 0; its presence
//! is what makes a checkpoint directory complete.
//!
//! The manifest is untrusted input like every file of a checkpoint: it carries a CRC-32 of its
//! own canonical content (`manifest_crc32`), its files must have the names the format defines,
//! and its step must be the one in its directory's name.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::error::{CheckpointError, Result};
use super::files::{self, Size};
use crate::FlatLayout;

/// The manifest format this build writes, and the only one it reads. Version 2 added
/// `manifest_crc32`; version 1 manifests are refused ([`CheckpointError::OlderFormat`]), since
/// without a checksum a damaged one would be applied unnoticed.
pub const FORMAT_VERSION: u32 = 2;

/// The manifest's own checksum: the CRC-32 of its canonical content (the manifest without this
/// field, as compact JSON in field order).
pub const CHECKSUM_FIELD: &str = "manifest_crc32";

/// The largest manifest read (it lists every parameter; a GPT-2 checkpoint's is a few KiB).
pub const MAX_MANIFEST_BYTES: u64 = 16 << 20;

pub const MANIFEST: &str = "manifest.json";
pub const MODEL_FILE: &str = "model.safetensors";
/// The optimizer record of a checkpoint of a Burn optimizer ([`OptimizerState::Record`]).
pub const OPTIMIZER_FILE: &str = "optimizer.bin";

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
    /// How the optimizer state is stored. Written only when it is not the default (ZeroAdam's
    /// shards), so that the checksum of a manifest written before this field existed holds.
    #[serde(default, skip_serializing_if = "OptimizerState::is_shards")]
    pub optimizer: OptimizerState,
    /// Where the trainable parameters' values are. Written only when it is not the default
    /// (`model.safetensors`), so that the checksums of earlier manifests hold.
    #[serde(default, skip_serializing_if = "Weights::is_model_file")]
    pub weights: Weights,
    /// The flat layout of the trainable parameters (and of ZeroAdam's shards).
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

/// How a checkpoint stores the optimizer state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerState {
    /// ZeroAdam's shards, one file per rank (`optim-rank-NNNNN.bin`), resharded on load.
    #[default]
    Shards,
    /// Any Burn optimizer's record, the same on every rank, written once by rank 0
    /// ([`OPTIMIZER_FILE`], Burn's binary record format at full precision).
    Record,
}

impl OptimizerState {
    fn is_shards(&self) -> bool {
        *self == OptimizerState::Shards
    }

    /// The files of a checkpoint of `world` ranks, the manifest aside.
    pub fn file_count(&self, world: usize) -> Option<usize> {
        match self {
            OptimizerState::Shards => world.checked_add(1),
            OptimizerState::Record => Some(2),
        }
    }
}

/// Where a checkpoint keeps the trainable parameters' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Weights {
    /// In `model.safetensors`, with every other float tensor of the model, in the model's
    /// dtype (written by rank 0, which holds them all).
    #[default]
    ModelFile,
    /// In the optimizer shards' f32 master weights, of which each parameter's values are the
    /// conversion to its dtype (the manifest's `params`); `model.safetensors` holds the other
    /// tensors only. ZeRO stage 3 saves so: no rank holds the whole model.
    MasterShards,
}

impl Weights {
    fn is_model_file(&self) -> bool {
        *self == Weights::ModelFile
    }
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
    /// The rank whose optimizer shard it holds; `None` for the model weights and the
    /// optimizer record.
    pub rank: Option<usize>,
    pub bytes: u64,
    pub crc32: u32,
    /// Whether it is the optimizer record ([`OPTIMIZER_FILE`]); written only when true.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub optimizer_record: bool,
}

impl FileEntry {
    /// The name the format gives this entry's file: `model.safetensors` for the weights,
    /// `optim-rank-NNNNN.bin` for rank N's shard, `optimizer.bin` for an optimizer record.
    pub fn defined_name(&self) -> String {
        match (self.rank, self.optimizer_record) {
            (Some(rank), _) => shard_file(rank),
            (None, true) => OPTIMIZER_FILE.into(),
            (None, false) => MODEL_FILE.into(),
        }
    }

    /// What the file is, for messages.
    pub fn what(&self) -> String {
        match (self.rank, self.optimizer_record) {
            (Some(rank), _) => format!("rank {rank}'s optimizer shard"),
            (None, true) => "the optimizer record".into(),
            (None, false) => "the model weights".into(),
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
            .find(|f| f.rank.is_none() && !f.optimizer_record)
            .ok_or_else(|| CheckpointError::corrupt(dir.join(MANIFEST), "lists no model weights"))
    }

    /// The entry of the optimizer record ([`OptimizerState::Record`]).
    pub fn record_entry(&self, dir: &Path) -> Result<&FileEntry> {
        self.files
            .iter()
            .find(|f| f.optimizer_record)
            .ok_or_else(|| {
                CheckpointError::corrupt(dir.join(MANIFEST), "lists no optimizer record")
            })
    }

    /// Reads and checks `dir/manifest.json`. A missing manifest means an incomplete checkpoint;
    /// a format version other than this build's is refused before anything else is
    /// interpreted; then the manifest's checksum, its file names, its step against the
    /// directory's name (when that is a `step-*` name) and its internal consistency.
    pub fn read(dir: &Path) -> Result<Manifest> {
        let path = dir.join(MANIFEST);
        let bytes =
            match files::read_untrusted(&path, "the manifest", Size::AtMost(MAX_MANIFEST_BYTES)) {
                Ok(bytes) => bytes,
                Err(CheckpointError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::NotFound =>
                {
                    return Err(CheckpointError::Incomplete {
                        dir: dir.to_path_buf(),
                    });
                }
                Err(e) => return Err(e),
            };
        let mut value: serde_json::Value = serde_json::from_slice(&bytes)
            .map_err(|e| CheckpointError::corrupt(&path, format!("not valid JSON: {e}")))?;
        let version = value
            .get("format_version")
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| CheckpointError::corrupt(&path, "has no format_version"))?;
        let found = u32::try_from(version).unwrap_or(u32::MAX);
        if version > u64::from(FORMAT_VERSION) {
            return Err(CheckpointError::NewerFormat {
                path,
                found,
                supported: FORMAT_VERSION,
            });
        }
        if version < u64::from(FORMAT_VERSION) {
            return Err(CheckpointError::OlderFormat {
                path,
                found,
                supported: FORMAT_VERSION,
            });
        }
        let expected = value
            .as_object_mut()
            .and_then(|fields| fields.remove(CHECKSUM_FIELD))
            .and_then(|crc| crc.as_u64())
            .and_then(|crc| u32::try_from(crc).ok())
            .ok_or_else(|| {
                CheckpointError::corrupt(
                    &path,
                    format!("has no {CHECKSUM_FIELD} (a 32-bit number)"),
                )
            })?;
        let manifest: Manifest = serde_json::from_value(value)
            .map_err(|e| CheckpointError::corrupt(&path, format!("unreadable manifest: {e}")))?;
        let found = manifest.checksum();
        if found != expected {
            return Err(CheckpointError::ManifestChecksum {
                path,
                found,
                expected,
            });
        }
        manifest.check(&path)?;
        if let Some(dir_step) = dir
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(parse_step)
            && dir_step != manifest.step
        {
            return Err(CheckpointError::StepMismatch {
                path,
                manifest_step: manifest.step,
                dir_step,
            });
        }
        Ok(manifest)
    }

    /// The CRC-32 of the canonical content: compact JSON of every field in declaration order.
    /// Reading and writing compute it from the parsed values, so the layout of the file
    /// (indentation, key order) does not matter, and any change of a value does.
    fn checksum(&self) -> u32 {
        crc32fast::hash(&serde_json::to_vec(self).expect("a manifest serializes"))
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
        for entry in &self.files {
            let defined = entry.defined_name();
            if entry.name != defined {
                return Err(CheckpointError::UndefinedFileName {
                    manifest: path.to_path_buf(),
                    name: entry.name.clone(),
                    what: entry.what(),
                    defined,
                });
            }
        }
        // The model and one shard per rank (or the optimizer record): with the count, distinct
        // entries and ranks below the world size, every rank has its shard. (The count also
        // bounds the loop by the size of the manifest, whatever world size it claims.)
        let expected = self.optimizer.file_count(self.world_size);
        if expected != Some(self.files.len()) {
            return bad(format!(
                "lists {} files, a checkpoint of {} ranks ({:?} optimizer state) has {}",
                self.files.len(),
                self.world_size,
                self.optimizer,
                expected.unwrap_or(usize::MAX)
            ));
        }
        let records = self.files.iter().filter(|f| f.optimizer_record).count();
        if records != usize::from(self.optimizer == OptimizerState::Record) {
            return bad(format!(
                "lists {records} optimizer records for {:?} optimizer state",
                self.optimizer
            ));
        }
        for (i, entry) in self.files.iter().enumerate() {
            if entry.rank.is_some_and(|rank| rank >= self.world_size) {
                return bad(format!(
                    "lists {} in a checkpoint of {} ranks",
                    entry.what(),
                    self.world_size
                ));
            }
            if self.files[..i]
                .iter()
                .any(|f| (f.rank, f.optimizer_record) == (entry.rank, entry.optimizer_record))
            {
                return bad(format!("lists {} twice", entry.what()));
            }
        }
        Ok(())
    }

    /// Writes the manifest atomically (the commit point of a save), with its checksum.
    pub fn write(&self, dir: &Path) -> Result<()> {
        files::write_atomic(dir, MANIFEST, &self.signed_json())
    }

    /// The manifest's JSON with [`CHECKSUM_FIELD`] added last.
    pub(crate) fn signed_json(&self) -> Vec<u8> {
        #[derive(Serialize)]
        struct Signed<'a> {
            #[serde(flatten)]
            manifest: &'a Manifest,
            manifest_crc32: u32,
        }
        let signed = Signed {
            manifest: self,
            manifest_crc32: self.checksum(),
        };
        serde_json::to_vec_pretty(&signed).expect("a manifest serializes")
    }
}

/// The step of a checkpoint directory's name `step-<digits>`.
pub(crate) fn parse_step(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::parse_step;

    /// Only `step-` and decimal digits name a checkpoint directory: Rust's integer parser alone
    /// would also take a sign (`step-+5`), and a foreign directory would count as step 5.
    #[test]
    fn a_step_directory_is_named_step_and_digits_only() {
        assert_eq!(parse_step("step-0000000005"), Some(5));
        assert_eq!(parse_step("step-7"), Some(7));
        for name in [
            "step-", "step-+5", "step--5", "step-5a", "step- 5", "Step-5", "5",
        ] {
            assert_eq!(parse_step(name), None, "{name:?}");
        }
    }
}
