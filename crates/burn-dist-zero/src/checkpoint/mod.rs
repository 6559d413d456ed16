//! Sharded checkpoints: the model's weights, every rank's optimizer shard and a manifest.
//!
//! A checkpoint of step `s` is the directory `<root>/step-<s, 10 digits>/`:
//!
//! - `model.safetensors`: every float tensor of the model, named by its module path
//!   (`layers.0.weight`), in the model's dtype; written by rank 0. At ZeRO stage 3 (the model's
//!   parameters sharded) it holds the tensors that are not sharded, and the manifest says that
//!   the trainable parameters' values are the shards' master weights ([`Weights`]): no rank
//!   holds them whole. [`export`] writes them all into one file, one parameter at a time;
//! - `optim-rank-NNNNN.bin`: rank N's [`OptimizerShard`] (see [`shard_file`] for the format);
//! - `manifest.json`: format version, world size, step, data position, scaler and random
//!   stream state, the flat layout, the size and CRC-32 of every other file, and a CRC-32 of its
//!   own content. Written last, by rank 0, once every rank's files are durable. **A directory
//!   without a manifest is incomplete and is never loaded**, so a crash during a save leaves the
//!   previous checkpoint as the latest; a save that fails removes its directory.
//!
//! Readers treat every file as untrusted input: only the names the format defines, regular
//! files of the listed size, a manifest whose checksum and step hold (see [`Manifest::read`]).
//!
//! [`AsyncSaver`] writes the same checkpoint while training goes on: the state is copied into
//! memory and written by a background thread, and the manifest is committed at a later step.
//!
//! [`save`] and [`load`] are collectives: every rank calls them. [`load`] works at any world
//! size: each rank assembles its new shard from the old shards that overlap it (the flat
//! element order does not depend on the world size, so this is exact). See
//! `docs/checkpoints.md`.

mod agreement;
mod async_save;
mod error;
mod export;
mod fault_points;
mod files;
pub mod manifest;
pub mod reshard;
mod retention;
mod safetensors_file;
mod save;
pub mod shard_file;
mod weights;

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use burn::module::AutodiffModule;
use burn::optim::Optimizer;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::backend::AutodiffBackend;
use burn_dist::{Ddp, GradScaler, ParamInfo};
use safetensors::{Dtype, tensor::TensorView};

use crate::{FlatLayout, OptimizerShard, ZeroAdam};
use agreement::{agree, gather_u64s};
use manifest::parse_step;

pub use async_save::AsyncSaver;
pub use error::{CheckpointError, Result, SaveStage};
pub use export::export;
pub use fault_points::{FAULT_VAR, PAUSE_VAR, inject_fault_on_this_thread};
pub use manifest::{
    FORMAT_VERSION, FileEntry, LayoutEntry, MANIFEST, MODEL_FILE, Manifest, OPTIMIZER_FILE,
    OptimizerState, ParamEntry, RandomState, ScalerState, Weights, shard_file as shard_file_name,
};
pub use retention::keep_last;
pub use save::{save, save_optimizer};

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

/// Loads the checkpoint at `path` (a step directory, or a root whose newest complete
/// checkpoint is taken) into `model` and `zero`, at any world size. A collective. Verifies the
/// size and checksum of every file it reads; nothing is changed unless every rank succeeds:
/// after a failure on any rank, every rank's `zero`, and every clone of `model` kept by the
/// caller (at ZeRO stage 3 too, whose clones share their pieces), are as they were.
/// Restores the rank random stream; returns the model (marked for gradient sync) and the
/// training state, whose scaler state and data position the caller applies.
pub fn load<B: AutodiffBackend, M: AutodiffModule<B>>(
    path: impl AsRef<Path>,
    ddp: &Ddp,
    model: M,
    zero: &mut ZeroAdam,
) -> Result<(M, TrainingState)> {
    let rank = ddp.rank();
    let (model, shard, state) =
        load_parts::<B, M, _>(path.as_ref(), ddp, model, |dir, manifest| {
            expect_optimizer(dir, manifest, OptimizerState::Shards)?;
            let shard = assemble_shard(dir, manifest, zero.layout(), rank)?;
            zero.check_import(&shard)?;
            Ok(shard)
        })?;
    zero.import(shard)?;
    Ok((model, state))
}

/// Loads a checkpoint of [`save_optimizer`] into `model` and `optim` (any Burn optimizer, as
/// built for a fresh run), at any world size: every rank reads the same record. A collective,
/// with [`load`]'s checks; returns the model (marked for gradient sync), the optimizer and the
/// training state.
pub fn load_optimizer<B, M, O>(
    path: impl AsRef<Path>,
    ddp: &Ddp,
    model: M,
    optim: O,
) -> Result<(M, O, TrainingState)>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: Optimizer<M, B>,
{
    let device = model.devices().into_iter().next().unwrap_or_default();
    let (model, record, state) =
        load_parts::<B, M, _>(path.as_ref(), ddp, model, |dir, manifest| {
            expect_optimizer(dir, manifest, OptimizerState::Record)?;
            let entry = manifest.record_entry(dir)?;
            let bytes = files::read_verified(dir, entry)?;
            BinBytesRecorder::<FullPrecisionSettings>::default()
                .load::<O::Record>(bytes, &device)
                .map_err(|e| {
                    CheckpointError::corrupt(
                        dir.join(OPTIMIZER_FILE),
                        format!("not a record of this optimizer: {e}"),
                    )
                })
        })?;
    Ok((model, optim.load_record(record), state))
}

/// The checkpoint must hold the optimizer state that the caller loads.
fn expect_optimizer(dir: &Path, manifest: &Manifest, expected: OptimizerState) -> Result<()> {
    if manifest.optimizer == expected {
        return Ok(());
    }
    let reason = match manifest.optimizer {
        OptimizerState::Shards => {
            "holds ZeroAdam shards (saved with `checkpoint::save`): load it with `checkpoint::load`"
        }
        OptimizerState::Record => {
            "holds a Burn optimizer's record (saved with `checkpoint::save_optimizer`): load it \
             with `checkpoint::load_optimizer`"
        }
    };
    Err(CheckpointError::Mismatch {
        dir: dir.to_path_buf(),
        reason: reason.into(),
    })
}

/// What [`load`] and [`load_optimizer`] share: the manifest, the model, the agreement of every
/// rank, the bucket order and the random stream; `optimizer` reads the optimizer's part on
/// each rank before anything changes.
///
/// All or nothing: every rank first reads and checks everything (the model's new tensors are a
/// new value; a sharded model's pieces, which every clone of it shares, are only staged), then
/// the ranks agree, and only once every check of every rank has passed is anything written.
fn load_parts<B: AutodiffBackend, M: AutodiffModule<B>, T>(
    path: &Path,
    ddp: &Ddp,
    model: M,
    optimizer: impl FnOnce(&Path, &Manifest) -> Result<T>,
) -> Result<(M, T, TrainingState)> {
    let (comm, rank) = (ddp.communicator(), ddp.rank());
    let _span = tracing::info_span!("checkpoint load", rank).entered();
    let local = (|| {
        let dir = resolve(path)?;
        let manifest = Manifest::read(&dir)?;
        check_fits(&dir, &manifest, ddp.params())?;
        let entry = manifest.model_entry(&dir)?;
        let bytes = files::read_verified(&dir, entry)?;
        let ids: Vec<_> = ddp.params().iter().map(|p| p.id).collect();
        let shards = ddp.param_shards();
        let (master, flat);
        let trainable = match (&shards, manifest.weights) {
            // A sharded model keeps its handles; the values go into this rank's pieces.
            (Some(shards), weights) => weights::Trainable::IntoPieces {
                shards,
                from_file: weights == Weights::ModelFile,
            },
            (None, Weights::ModelFile) => weights::Trainable::FromFile,
            // A stage-3 checkpoint into a whole model: the values are the master weights.
            (None, Weights::MasterShards) => {
                master = join_shards(&dir, &manifest, |shard| [&shard.master])?
                    .pop()
                    .expect("one part");
                flat = FlatLayout::new(&manifest.layout.numels, 1, 1);
                weights::Trainable::FromMaster {
                    master: &master,
                    layout: &flat,
                }
            }
        };
        let restore = weights::Restore {
            ids: &ids,
            trainable,
        };
        let (model, staged) =
            weights::overwrite::<B, M>(model, &dir.join(entry.defined_name()), &bytes, restore)?;
        let part = optimizer(&dir, &manifest)?;
        Ok((dir, manifest, model, staged, part))
    })();
    let (dir, manifest, model, staged, part) = agree(comm, local)?;

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
    // Every check of every rank has passed: from here on nothing fails.
    if let Some(shards) = ddp.param_shards() {
        staged.write(&shards);
    }
    ddp.seed(manifest.random.seed);
    ddp.set_step(manifest.random.step);
    tracing::info!(dir = %dir.display(), saved_world = manifest.world_size, "checkpoint loaded");
    let state = TrainingState {
        step: manifest.step,
        samples_consumed: manifest.samples_consumed,
        scaler: manifest.scaler,
        random: manifest.random,
    };
    Ok((ddp.mark(model), part, state))
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
    expect_optimizer(&dir, &manifest, OptimizerState::Shards)?;
    let (mut time, mut skipped) = (Vec::new(), 0);
    let [master, m, v]: [Vec<f32>; 3] = join_shards(&dir, &manifest, |shard| {
        if shard.rank == 0 {
            (time, skipped) = (shard.time.clone(), shard.skipped);
        }
        [&shard.master, &shard.m, &shard.v]
    })?
    .try_into()
    .expect("three parts");
    Ok(FullState {
        manifest,
        master,
        m,
        v,
        time,
        skipped,
    })
}

/// The parts of every saved shard that `parts` picks (say, the master weights), each joined
/// over the ranks in order into `total` elements, padding dropped. One shard is read at a time.
fn join_shards<const N: usize>(
    dir: &Path,
    manifest: &Manifest,
    mut parts: impl FnMut(&OptimizerShard) -> [&Vec<f32>; N],
) -> Result<Vec<Vec<f32>>> {
    let total = manifest.layout.total;
    let mut joined = vec![Vec::with_capacity(total); N];
    for rank in 0..manifest.world_size {
        let shard = read_shard(dir, manifest, rank)?;
        let keep = shard.layout.shard_len.min(total - joined[0].len());
        for (out, part) in joined.iter_mut().zip(parts(&shard)) {
            out.extend_from_slice(&part[..keep]);
        }
    }
    Ok(joined)
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
    let bytes = safetensors_file::serialize(views, metadata)
        .map_err(|reason| CheckpointError::corrupt(out, reason))?;
    let (dir, name) = files::dir_and_name(out)?;
    files::write_atomic(&dir, name, &bytes)?;
    Ok(full)
}
