//! Sharded checkpoints: the model's weights, every rank's optimizer shard and a manifest.
//!
//! A checkpoint of step `s` is the directory `<root>/step-<s, 10 digits>/`:
//!
//! - `model.safetensors`: every float tensor of the model, named by its module path
//!   (`layers.0.weight`), in the model's dtype; written by rank 0;
//! - `optim-rank-NNNNN.bin`: rank N's [`OptimizerShard`] (see [`shard_file`] for the format);
//! - `manifest.json`: format version, world size, step, data position, scaler and random
//!   stream state, the flat layout, and the size and CRC-32 of every other file. Written last,
//!   by rank 0, once every rank's files are durable. **A directory without a manifest is
//!   incomplete and is never loaded**, so a crash during a save leaves the previous checkpoint
//!   as the latest.
//!
//! [`save`] and [`load`] are collectives: every rank calls them. [`load`] works at any world
//! size: each rank assembles its new shard from the old shards that overlap it (the flat
//! element order does not depend on the world size, so this is exact). See
//! `docs/checkpoints.md`.

mod error;
mod fault_points;
mod files;
pub mod manifest;
pub mod reshard;
mod retention;
pub mod shard_file;
mod weights;

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use burn::module::{AutodiffModule, Module};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn_dist::{Ddp, GradScaler, ParamInfo};
use burn_dist_comm::{Communicator, HostBuffer, HostCommunicator};
use safetensors::{Dtype, tensor::TensorView};

use crate::{FlatLayout, OptimizerShard, ZeroAdam};
use manifest::parse_step;

pub use error::{CheckpointError, Result, SaveStage};
pub use fault_points::{FAULT_VAR, PAUSE_VAR, inject_fault_on_this_thread};
pub use manifest::{
    FORMAT_VERSION, FileEntry, LayoutEntry, MANIFEST, MODEL_FILE, Manifest, ParamEntry,
    RandomState, ScalerState, shard_file as shard_file_name,
};
pub use retention::keep_last;

/// Everything besides weights and optimizer state that a resumed run needs.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TrainingState {
    /// Optimizer steps taken (the checkpoint's step).
    pub step: u64,
    /// Samples consumed by all ranks together, so that a run resumed at another world size
    /// continues at the same place in the data.
    pub samples_consumed: u64,
    /// The loss scaler's state, when training with one.
    pub scaler: Option<ScalerState>,
    /// The rank random stream: [`load`] restores it with `Ddp::seed` and `Ddp::set_step`.
    pub random: RandomState,
}

impl TrainingState {
    pub fn new(step: u64, samples_consumed: u64) -> Self {
        TrainingState {
            step,
            samples_consumed,
            ..Default::default()
        }
    }

    pub fn with_scaler(mut self, scaler: &GradScaler) -> Self {
        self.scaler = Some(ScalerState {
            scale: scaler.scale(),
            growth_tracker: scaler.growth_tracker(),
        });
        self
    }

    /// The seed given to `Ddp::seed` and the step last given to `Ddp::set_step`.
    pub fn with_random(mut self, seed: u64, step: u64) -> Self {
        self.random = RandomState { seed, step };
        self
    }

    /// `scaler` with the saved state, if one was saved.
    pub fn restore_scaler(&self, scaler: GradScaler) -> GradScaler {
        match self.scaler {
            Some(s) => scaler.with_state(s.scale, s.growth_tracker),
            None => scaler,
        }
    }
}

/// The directory of step `step`'s checkpoint under `root`.
pub fn step_dir(root: impl AsRef<Path>, step: u64) -> PathBuf {
    root.as_ref().join(format!("step-{step:010}"))
}

/// The `step-*` directories under `root`, by step, each with whether it is complete (has a
/// manifest). No directory: none.
fn step_dirs(root: &Path) -> Result<Vec<(u64, PathBuf, bool)>> {
    let entries = match fs::read_dir(root) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(CheckpointError::io(root)(e)),
    };
    let mut dirs = Vec::new();
    for entry in entries {
        let entry = entry.map_err(CheckpointError::io(root))?;
        let Some(step) = entry.file_name().to_str().and_then(parse_step) else {
            continue;
        };
        let dir = entry.path();
        let complete = dir.join(MANIFEST).is_file();
        dirs.push((step, dir, complete));
    }
    dirs.sort_by_key(|(step, ..)| *step);
    Ok(dirs)
}

/// The newest complete checkpoint under `root` (highest step with a manifest), if any.
pub fn latest(root: impl AsRef<Path>) -> Result<Option<PathBuf>> {
    let dirs = step_dirs(root.as_ref())?;
    Ok(dirs
        .into_iter()
        .rev()
        .find(|(.., complete)| *complete)
        .map(|(_, dir, _)| dir))
}

/// A checkpoint directory, or the newest complete checkpoint when `path` is a root of them.
pub fn resolve(path: impl AsRef<Path>) -> Result<PathBuf> {
    let path = path.as_ref();
    if path.join(MANIFEST).is_file() {
        return Ok(path.to_path_buf());
    }
    let is_step_dir = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(parse_step)
        .is_some();
    if is_step_dir {
        return Err(CheckpointError::Incomplete {
            dir: path.to_path_buf(),
        });
    }
    latest(path)?.ok_or_else(|| CheckpointError::NotFound {
        root: path.to_path_buf(),
    })
}

/// Writes the checkpoint of `state.step` under `root` and returns its directory. A collective:
/// every rank calls it with its own `zero`; rank 0 also writes the model and, after every
/// rank's shard is durable, the manifest. Saving a step again replaces it (it is incomplete in
/// between).
///
/// Every rank must see `root` on one shared filesystem: rank 0 writes a check file into the new
/// step directory and every rank reads it back before any shard is written. When any rank
/// fails in any stage, every rank fails with [`CheckpointError::Save`] naming the stage, the
/// step and (through the failing rank's error) the file, rank 0 removes the incomplete step
/// directory, and the previous complete checkpoint stays the newest.
pub fn save<B: Backend, M: Module<B>>(
    root: impl AsRef<Path>,
    ddp: &Ddp,
    model: &M,
    zero: &ZeroAdam,
    state: &TrainingState,
) -> Result<PathBuf> {
    let dir = step_dir(&root, state.step);
    let _span =
        tracing::info_span!("checkpoint save", rank = ddp.rank(), step = state.step).entered();
    let saved = save_stages::<B, M>(root.as_ref(), &dir, ddp, model, zero, state);
    if let Err(CheckpointError::Save { source, .. }) = &saved {
        if ddp.rank() == 0 {
            remove_incomplete(&dir);
        }
        // When the ranks agreed on the failure (the collectives work), nobody returns before
        // rank 0 has removed the directory: a launcher stopping the job as soon as one rank
        // exits cannot interrupt the removal.
        if !matches!(**source, CheckpointError::Comm(_)) {
            let _ = gather_u64s(ddp.communicator(), &[0]);
        }
    }
    saved?;
    tracing::info!(dir = %dir.display(), "checkpoint saved");
    Ok(dir)
}

/// The name of the file by which every rank checks that it sees rank 0's step directory.
const SHARED_CHECK: &str = ".shared-check";

/// The stages of [`save`]; every error is wrapped with its stage.
fn save_stages<B: Backend, M: Module<B>>(
    root: &Path,
    dir: &Path,
    ddp: &Ddp,
    model: &M,
    zero: &ZeroAdam,
    state: &TrainingState,
) -> Result<()> {
    let (comm, rank, step) = (ddp.communicator(), ddp.rank(), state.step);
    let in_stage = |stage: SaveStage| {
        move |source: CheckpointError| CheckpointError::Save {
            step,
            stage,
            dir: dir.to_path_buf(),
            source: Box::new(source),
        }
    };
    let write = |name: &str, fault: &str, bytes: &[u8]| {
        let fault = fault_points::injected_error(fault, rank, step);
        files::write_atomic_or_fail(dir, name, bytes, fault)
    };

    // 1. Rank 0 makes the directory (and un-completes an older save of this step) and writes a
    //    random check value into it; every rank reads it back, so ranks that do not share the
    //    filesystem fail here, before anything large is written.
    let check_value =
        std::hash::BuildHasher::hash_one(&std::collections::hash_map::RandomState::new(), step);
    (|| {
        let prepared = if rank == 0 {
            prepare_dir(root, dir)
                .and_then(|()| write(SHARED_CHECK, "shared-check", &check_value.to_le_bytes()))
        } else {
            Ok(())
        };
        agree(comm, prepared)?;
        let expected = gather_u64s(comm, &[check_value])?[0][0];
        agree(comm, check_shared(dir, rank, expected))
    })()
    .map_err(in_stage(SaveStage::Prepare))?;

    // 2. Every rank writes its shard durably; rank 0 the weights too.
    let written = (|| {
        let bytes = shard_file::encode(&zero.export());
        write(&manifest::shard_file(rank), "shard", &bytes)?;
        fault_points::pause_point("after-shard", rank, step);
        let (size, crc) = files::fingerprint(&bytes);
        let model_entry = if rank == 0 {
            let (entry, bytes) = model_file::<B, M>(dir, model, step)?;
            write(MODEL_FILE, "model", &bytes)?;
            Some(entry)
        } else {
            None
        };
        Ok((size, crc, model_entry))
    })();
    let (size, crc, model_entry) = agree(comm, written).map_err(in_stage(SaveStage::Write))?;

    // 3. Every shard is durable once every rank got here: rank 0 commits with the manifest.
    (|| {
        let all = gather_u64s(comm, &[size, u64::from(crc)])?;
        let committed = if rank == 0 {
            let mut entries: Vec<FileEntry> = model_entry.into_iter().collect();
            for (r, fingerprint) in all.iter().enumerate() {
                entries.push(FileEntry {
                    name: manifest::shard_file(r),
                    rank: Some(r),
                    bytes: fingerprint[0],
                    crc32: fingerprint[1] as u32,
                });
            }
            let manifest = Manifest {
                format_version: FORMAT_VERSION,
                world_size: ddp.world_size(),
                step,
                samples_consumed: state.samples_consumed,
                scaler: state.scaler,
                random: state.random,
                layout: LayoutEntry::of(zero.layout()),
                buckets: ddp.next_layout().bucket_params(),
                params: ddp.params().iter().map(param_entry).collect(),
                files: entries,
            };
            // The check file has done its job; a leftover one would be harmless.
            let _ = fs::remove_file(dir.join(SHARED_CHECK));
            write(MANIFEST, "manifest", &manifest.signed_json())
        } else {
            Ok(())
        };
        // 4. Nobody returns before the checkpoint is complete (or every rank knows it failed).
        agree(comm, committed)
    })()
    .map_err(in_stage(SaveStage::Commit))
}

/// This rank reads rank 0's check value back from `dir`.
fn check_shared(dir: &Path, rank: usize, expected: u64) -> Result<()> {
    let not_shared = |found: String| CheckpointError::NotShared {
        rank,
        dir: dir.to_path_buf(),
        found,
    };
    let path = dir.join(SHARED_CHECK);
    let bytes =
        match files::read_untrusted(&path, "the shared-directory check", files::Size::Exactly(8)) {
            Ok(bytes) => bytes,
            Err(CheckpointError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                let what = if dir.is_dir() {
                    format!("the directory exists but has no {SHARED_CHECK}")
                } else {
                    "no such directory here".to_string()
                };
                return Err(not_shared(what));
            }
            Err(e) => return Err(e),
        };
    let found = u64::from_le_bytes(bytes.try_into().expect("8 bytes"));
    if found != expected {
        return Err(not_shared(format!(
            "its {SHARED_CHECK} holds {found:016x}, rank 0 wrote {expected:016x}: another job saving the same step?"
        )));
    }
    Ok(())
}

/// Rank 0, after a failed save: removes the step directory unless its manifest was committed
/// (a failure after the commit leaves a complete checkpoint, which stays).
fn remove_incomplete(dir: &Path) {
    if dir.join(MANIFEST).exists() {
        return;
    }
    match fs::remove_dir_all(dir) {
        Ok(()) => {
            tracing::warn!(dir = %dir.display(), "removed the incomplete checkpoint of the failed save")
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(
            dir = %dir.display(),
            "could not remove the incomplete checkpoint of the failed save ({e}); it is never loaded, delete it by hand"
        ),
    }
}

/// Every rank's `mine` (the same length on every rank), by rank.
fn gather_u64s(comm: &HostCommunicator, mine: &[u64]) -> Result<Vec<Vec<u64>>> {
    let bytes: Vec<u8> = mine.iter().flat_map(|x| x.to_le_bytes()).collect();
    let len = bytes.len();
    let all = comm
        .all_gather(HostBuffer::U8(bytes), len * comm.world_size())
        .wait()?;
    Ok(all
        .as_bytes()
        .chunks_exact(len)
        .map(|rank| {
            rank.chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect()
        })
        .collect())
}

fn param_entry(p: &ParamInfo) -> ParamEntry {
    ParamEntry {
        name: p.name.clone(),
        shape: p.shape.clone(),
        dtype: format!("{:?}", p.dtype),
    }
}

fn prepare_dir(root: &Path, dir: &Path) -> Result<()> {
    fs::create_dir_all(dir).map_err(CheckpointError::io(dir))?;
    files::sync_dir(root)?;
    let manifest = dir.join(MANIFEST);
    if manifest.exists() {
        fs::remove_file(&manifest).map_err(CheckpointError::io(&manifest))?;
        files::sync_dir(dir)?;
    }
    Ok(())
}

/// The model's safetensors bytes and their manifest entry.
fn model_file<B: Backend, M: Module<B>>(
    dir: &Path,
    model: &M,
    step: u64,
) -> Result<(FileEntry, Vec<u8>)> {
    let metadata = HashMap::from([
        ("producer".to_string(), "burn-dist".to_string()),
        ("step".to_string(), step.to_string()),
    ]);
    let bytes = weights::collect::<B, M>(model)
        .serialize(metadata)
        .map_err(|reason| CheckpointError::corrupt(dir.join(MODEL_FILE), reason))?;
    let (size, crc) = files::fingerprint(&bytes);
    let entry = FileEntry {
        name: MODEL_FILE.into(),
        rank: None,
        bytes: size,
        crc32: crc,
    };
    Ok((entry, bytes))
}

/// Loads the checkpoint at `path` (a step directory, or a root whose newest complete
/// checkpoint is taken) into `model` and `zero`, at any world size. A collective. Verifies the
/// size and checksum of every file it reads; nothing is changed unless every rank succeeds.
/// Restores the rank random stream; returns the model (marked for gradient sync) and the
/// training state, whose scaler state and data position the caller applies.
pub fn load<B: AutodiffBackend, M: AutodiffModule<B>>(
    path: impl AsRef<Path>,
    ddp: &Ddp,
    model: M,
    zero: &mut ZeroAdam,
) -> Result<(M, TrainingState)> {
    let (comm, rank) = (ddp.communicator(), ddp.rank());
    let _span = tracing::info_span!("checkpoint load", rank).entered();
    let local = (|| {
        let dir = resolve(path.as_ref())?;
        let manifest = Manifest::read(&dir)?;
        check_fits(&dir, &manifest, ddp.params())?;
        let entry = manifest.model_entry(&dir)?;
        let bytes = files::read_verified(&dir, entry)?;
        let model = weights::overwrite::<B, M>(model, &dir.join(entry.defined_name()), &bytes)?;
        let shard = assemble_shard(&dir, &manifest, zero.layout(), rank)?;
        Ok((dir, manifest, model, shard))
    })();
    let (dir, manifest, model, shard) = agree(comm, local)?;

    // Every rank must have loaded the same step (a save racing with the resolution of
    // `latest` could make them differ).
    let steps: Vec<u64> = gather_u64s(comm, &[manifest.step])?
        .iter()
        .map(|rank| rank[0])
        .collect();
    if steps.iter().any(|&s| s != steps[0]) {
        return Err(CheckpointError::Mismatch {
            dir,
            reason: format!("the ranks resolved different steps: {steps:?}"),
        });
    }

    // Every rank read the same manifest, so every rank fails alike (before anything changes).
    let order: Vec<usize> = manifest.buckets.iter().flatten().copied().collect();
    ddp.adopt_bucket_order(&order)
        .map_err(|e| CheckpointError::corrupt(dir.join(MANIFEST), format!("buckets: {e}")))?;
    zero.import(shard)?;
    ddp.seed(manifest.random.seed);
    ddp.set_step(manifest.random.step);
    tracing::info!(dir = %dir.display(), saved_world = manifest.world_size, "checkpoint loaded");
    let state = TrainingState {
        step: manifest.step,
        samples_consumed: manifest.samples_consumed,
        scaler: manifest.scaler,
        random: manifest.random,
    };
    Ok((ddp.mark(model), state))
}

/// The checkpoint's parameters must be the model's, in the same order.
fn check_fits(dir: &Path, manifest: &Manifest, params: &[ParamInfo]) -> Result<()> {
    let mismatch = |reason: String| {
        Err(CheckpointError::Mismatch {
            dir: dir.to_path_buf(),
            reason,
        })
    };
    if params.len() != manifest.params.len() {
        return mismatch(format!(
            "holds {} trainable parameters, the model has {} (was `Ddp::prepare` called?)",
            manifest.params.len(),
            params.len()
        ));
    }
    for (i, (ours, saved)) in params.iter().zip(&manifest.params).enumerate() {
        if ours.name != saved.name || ours.shape != saved.shape {
            return mismatch(format!(
                "parameter #{i} is {} {:?} in the checkpoint but {} {:?} in the model",
                saved.name, saved.shape, ours.name, ours.shape
            ));
        }
    }
    Ok(())
}

/// This rank's shard of `layout` (the optimizer's current layout, at the current world size),
/// assembled from the saved shards that overlap it.
fn assemble_shard(
    dir: &Path,
    manifest: &Manifest,
    layout: &FlatLayout,
    rank: usize,
) -> Result<OptimizerShard> {
    if layout.numels != manifest.layout.numels {
        return Err(CheckpointError::Mismatch {
            dir: dir.to_path_buf(),
            reason: "the flat layout's parameter sizes differ from the optimizer's".into(),
        });
    }
    let copies = reshard::copies(layout.shard(rank), manifest.layout.shard_len, layout.total);
    let mut out = OptimizerShard {
        rank,
        layout: layout.clone(),
        master: vec![0.0; layout.shard_len],
        m: vec![0.0; layout.shard_len],
        v: vec![0.0; layout.shard_len],
        time: Vec::new(),
        skipped: 0,
    };
    // The step counts are the same in every shard; a rank whose shard is all padding reads
    // them from rank 0's.
    let mut old_ranks: Vec<usize> = copies.iter().map(|c| c.old_rank).collect();
    old_ranks.dedup();
    if old_ranks.is_empty() {
        old_ranks.push(0);
    }
    for old_rank in old_ranks {
        let old = read_shard(dir, manifest, old_rank)?;
        if out.time.is_empty() {
            out.time = old.time.clone();
            out.skipped = old.skipped;
        }
        for c in copies.iter().filter(|c| c.old_rank == old_rank) {
            out.master[c.to.clone()].copy_from_slice(&old.master[c.from.clone()]);
            out.m[c.to.clone()].copy_from_slice(&old.m[c.from.clone()]);
            out.v[c.to.clone()].copy_from_slice(&old.v[c.from.clone()]);
        }
    }
    Ok(out)
}

/// Rank `rank`'s saved shard, verified against the manifest.
fn read_shard(dir: &Path, manifest: &Manifest, rank: usize) -> Result<OptimizerShard> {
    let entry = manifest.shard_entry(dir, rank)?;
    let path = dir.join(entry.defined_name());
    let bytes = files::read_verified(dir, entry)?;
    let shard = shard_file::decode(&path, &bytes)?;
    if shard.rank != rank
        || shard.layout.world != manifest.world_size
        || shard.layout.shard_len != manifest.layout.shard_len
        || shard.layout.numels != manifest.layout.numels
        || shard.time.len() != manifest.params.len()
    {
        return Err(CheckpointError::corrupt(
            &path,
            format!(
                "holds rank {} of {} ({} per shard), the manifest expects rank {rank} of {} ({} per shard)",
                shard.rank,
                shard.layout.world,
                shard.layout.shard_len,
                manifest.world_size,
                manifest.layout.shard_len
            ),
        ));
    }
    Ok(shard)
}

/// The full (unsharded) optimizer state of a checkpoint: `total` elements each, padding
/// dropped.
#[derive(Debug, Clone, PartialEq)]
pub struct FullState {
    pub manifest: Manifest,
    pub master: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    pub time: Vec<u32>,
    pub skipped: u64,
}

impl FullState {
    /// Parameter `i`'s elements of a flat vector.
    pub fn param<'a>(&self, flat: &'a [f32], i: usize) -> &'a [f32] {
        let start: usize = self.manifest.layout.numels[..i].iter().sum();
        &flat[start..start + self.manifest.layout.numels[i]]
    }
}

/// Reads and verifies every shard of the checkpoint at `path` (a step directory or a root) and
/// joins them. Needs no communicator: the consolidation tool and tests use it.
pub fn read_full(path: impl AsRef<Path>) -> Result<FullState> {
    let dir = resolve(path)?;
    let manifest = Manifest::read(&dir)?;
    let total = manifest.layout.total;
    let mut full = FullState {
        master: Vec::with_capacity(total),
        m: Vec::with_capacity(total),
        v: Vec::with_capacity(total),
        time: Vec::new(),
        skipped: 0,
        manifest,
    };
    for rank in 0..full.manifest.world_size {
        let shard = read_shard(&dir, &full.manifest, rank)?;
        let keep = shard.layout.shard_len.min(total - full.master.len());
        full.master.extend_from_slice(&shard.master[..keep]);
        full.m.extend_from_slice(&shard.m[..keep]);
        full.v.extend_from_slice(&shard.v[..keep]);
        if rank == 0 {
            full.time = shard.time;
            full.skipped = shard.skipped;
        }
    }
    Ok(full)
}

/// Verifies the size and checksum of every file of the checkpoint at `path`; returns its
/// manifest.
pub fn verify(path: impl AsRef<Path>) -> Result<Manifest> {
    let dir = resolve(path)?;
    let manifest = Manifest::read(&dir)?;
    for entry in &manifest.files {
        files::read_verified(&dir, entry)?;
    }
    Ok(manifest)
}

/// Writes the full fp32 master weights and Adam moments of the checkpoint at `path` to one
/// safetensors file `out`: `<name>`, `<name>.exp_avg`, `<name>.exp_avg_sq` (PyTorch's names
/// for Adam's moments). Returns the state it wrote.
pub fn consolidate(path: impl AsRef<Path>, out: impl AsRef<Path>) -> Result<FullState> {
    let full = read_full(path)?;
    let out = out.as_ref();
    let mut tensors = Vec::new();
    for (i, p) in full.manifest.params.iter().enumerate() {
        for (suffix, flat) in [
            ("", &full.master),
            (".exp_avg", &full.m),
            (".exp_avg_sq", &full.v),
        ] {
            tensors.push((
                format!("{}{suffix}", p.name),
                p.shape.clone(),
                full.param(flat, i),
            ));
        }
    }
    let views = tensors
        .iter()
        .map(|(name, shape, values)| {
            TensorView::new(Dtype::F32, shape.clone(), bytemuck::cast_slice(values))
                .map(|view| (name.as_str(), view))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| CheckpointError::corrupt(out, e.to_string()))?;
    let metadata = HashMap::from([
        (
            "producer".to_string(),
            "burn-dist-ckpt consolidate".to_string(),
        ),
        ("step".to_string(), full.manifest.step.to_string()),
        ("adam_steps".to_string(), format!("{:?}", full.time)),
    ]);
    let bytes = safetensors::serialize(views, Some(metadata))
        .map_err(|e| CheckpointError::corrupt(out, e.to_string()))?;
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = out
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| CheckpointError::corrupt(out, "not a file name"))?;
    files::write_atomic(&parent, name, &bytes)?;
    Ok(full)
}

/// Every rank's outcome of a local part of a collective: `Ok` everywhere, or every rank fails
/// (a failing rank with its own error, the others naming the first failing rank and its
/// message). Always runs the same collectives on every rank, so a failure never hangs a peer.
fn agree<T>(comm: &HostCommunicator, local: Result<T>) -> Result<T> {
    let world = comm.world_size();
    let message = match &local {
        Ok(_) => Vec::new(),
        Err(e) => e.to_string().into_bytes(),
    };
    let lengths: Vec<usize> = gather_u64s(comm, &[message.len() as u64])?
        .iter()
        .map(|rank| rank[0] as usize)
        .collect();
    let longest = lengths.iter().copied().max().unwrap_or(0);
    if longest == 0 {
        return local;
    }
    let mut padded = message;
    padded.resize(longest, 0);
    let all = comm
        .all_gather(HostBuffer::U8(padded), longest * world)
        .wait()?;
    // This rank's own error, or the first failing rank's.
    local?;
    let rank = lengths
        .iter()
        .position(|&l| l > 0)
        .expect("some rank failed");
    let bytes = &all.as_bytes()[rank * longest..rank * longest + lengths[rank]];
    Err(CheckpointError::Rank {
        rank,
        message: String::from_utf8_lossy(bytes).into_owned(),
    })
}
