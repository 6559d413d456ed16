//! [`save`]: the collective that writes a checkpoint, in stages whose errors name the stage,
//! the step and the file; a failed save removes its step directory.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use burn::module::{AutodiffModule, Module};
use burn::optim::Optimizer;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn_dist::{Ddp, FlatLayout, ParamInfo};

use super::agreement::{agree, gather_u64s};
use super::error::{CheckpointError, Result, SaveStage};
use super::manifest::{
    self, FORMAT_VERSION, FileEntry, LayoutEntry, MANIFEST, MODEL_FILE, Manifest, OPTIMIZER_FILE,
    OptimizerState, ParamEntry, Weights,
};
use super::{TrainingState, fault_points, files, shard_file, step_dir, weights};
use crate::ZeroAdam;

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
    save_parts::<B, M>(
        root.as_ref(),
        ddp,
        model,
        OptimizerPart::Shards(zero),
        state,
    )
}

/// [`save`] for any Burn optimizer (`AdamConfig::new().init()`, `ddp.optimizer(...)`, ...):
/// the model, `optim`'s record and the training state under the same atomic manifest. The
/// record is the same on every rank, so rank 0 alone writes it ([`OPTIMIZER_FILE`], Burn's
/// binary format at full precision). A collective, like [`save`]; load it with
/// [`super::load_optimizer`], at any world size.
pub fn save_optimizer<B, M, O>(
    root: impl AsRef<Path>,
    ddp: &Ddp,
    model: &M,
    optim: &O,
    state: &TrainingState,
) -> Result<PathBuf>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: Optimizer<M, B>,
{
    if ddp.param_shards().is_some() {
        // Every rank refuses alike, before anything is written.
        return Err(CheckpointError::Mismatch {
            dir: root.as_ref().to_path_buf(),
            reason: "the model's parameters are sharded (ZeRO stage 3), which only ZeroAdam \
                     trains: save it with `checkpoint::save`"
                .into(),
        });
    }
    // Encoded here, but a failure is reported in the write stage, where every rank agrees on it.
    let record = (ddp.rank() == 0).then(|| {
        BinBytesRecorder::<FullPrecisionSettings>::default()
            .record(optim.to_record(), ())
            .map_err(|e| e.to_string())
    });
    save_parts::<B, M>(
        root.as_ref(),
        ddp,
        model,
        OptimizerPart::Record(record),
        state,
    )
}

/// What a checkpoint saves of the optimizer.
pub(super) enum OptimizerPart<'a> {
    /// Every rank writes its ZeroAdam shard.
    Shards(&'a ZeroAdam),
    /// Rank 0 writes the record: its encoding, `Some` on rank 0 only.
    Record(Option<std::result::Result<Vec<u8>, String>>),
}

fn save_parts<B: Backend, M: Module<B>>(
    root: &Path,
    ddp: &Ddp,
    model: &M,
    optimizer: OptimizerPart<'_>,
    state: &TrainingState,
) -> Result<PathBuf> {
    let dir = step_dir(root, state.step);
    let _span =
        tracing::info_span!("checkpoint save", rank = ddp.rank(), step = state.step).entered();
    let saved = (|| {
        // Encoded before the directory exists; an encoding failure is reported in the write
        // stage, where every rank agrees on it.
        let snapshot = Snapshot::take(&dir, ddp, optimizer, state);
        prepare_stage(root, &dir, ddp, state.step)?;
        let written = snapshot.and_then(|mut snapshot| {
            let faults = Faults::injected(&snapshot, ddp.rank());
            // The model is encoded once the shard is written and let go, so that rank 0
            // holds one of the two at a time.
            let model_file = || model_file::<B, M>(&dir, model, state.step, &sharded_ids(ddp));
            snapshot.write(&dir, ddp.rank(), faults, model_file)?;
            Ok(snapshot)
        });
        let snapshot = agree(ddp.communicator(), written).map_err(in_stage(
            &dir,
            state.step,
            SaveStage::Write,
        ))?;
        snapshot.commit(&dir, ddp)
    })();
    finish_save(&dir, ddp, saved)
}

/// After the stages of a save on every rank: on failure rank 0 removes the incomplete step
/// directory, and nobody returns before it has; on success, the directory.
pub(super) fn finish_save(dir: &Path, ddp: &Ddp, saved: Result<()>) -> Result<PathBuf> {
    if let Err(CheckpointError::Save { source, .. }) = &saved {
        if ddp.rank() == 0 {
            remove_incomplete(dir);
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
    Ok(dir.to_path_buf())
}

/// The name of the file by which every rank checks that it sees rank 0's step directory.
const SHARED_CHECK: &str = ".shared-check";

/// Wraps an error of `stage` of the save of `step` into `dir`.
pub(super) fn in_stage(
    dir: &Path,
    step: u64,
    stage: SaveStage,
) -> impl Fn(CheckpointError) -> CheckpointError + '_ {
    move |source| CheckpointError::Save {
        step,
        stage,
        dir: dir.to_path_buf(),
        source: Box::new(source),
    }
}

/// Stage 1 of a save, a collective: rank 0 makes the directory (and un-completes an older save
/// of this step) and writes a random check value into it; every rank reads it back, so ranks
/// that do not share the filesystem fail here, before anything large is written.
pub(super) fn prepare_stage(root: &Path, dir: &Path, ddp: &Ddp, step: u64) -> Result<()> {
    let (comm, rank) = (ddp.communicator(), ddp.rank());
    let check_value =
        std::hash::BuildHasher::hash_one(&std::collections::hash_map::RandomState::new(), step);
    (|| {
        let prepared = if rank == 0 {
            prepare_dir(root, dir).and_then(|()| {
                let fault = fault_points::injected_error("shared-check", rank, step);
                files::write_atomic_or_fail(dir, SHARED_CHECK, &check_value.to_le_bytes(), fault)
            })
        } else {
            Ok(())
        };
        agree(comm, prepared)?;
        let expected = gather_u64s(comm, &[check_value])?[0][0];
        agree(comm, check_shared(dir, rank, expected))
    })()
    .map_err(in_stage(dir, step, SaveStage::Prepare))
}

/// A rank's part of a checkpoint, encoded in memory: what its write stage writes and what the
/// commit needs. An asynchronous save ([`super::AsyncSaver`]) holds it while a background
/// thread writes it; each file's bytes are let go once written.
pub(super) struct Snapshot {
    step: u64,
    /// This rank's optimizer file (its shard, or rank 0's record), if it writes one.
    optimizer: Option<OptimizerFile>,
    /// Rank 0: the model file's manifest entry and bytes (`None` once written), once encoded.
    model: Option<(FileEntry, Option<Vec<u8>>)>,
    /// Rank 0: the manifest without its file entries, as of the save (the commit may come
    /// steps later, when the bucket layout may have changed).
    draft: Option<Manifest>,
}

/// This rank's optimizer file in a [`Snapshot`].
struct OptimizerFile {
    name: String,
    /// Its name in the fault points ([`fault_points::injected_error`]).
    fault: &'static str,
    /// `None` once written.
    bytes: Option<Vec<u8>>,
    /// Size and CRC-32, for the manifest.
    fingerprint: (u64, u32),
}

/// The injected disk errors (tests) of one rank's writes, resolved where the save was called:
/// the thread-local injection of thread ranks does not reach a background writer.
pub(super) struct Faults {
    /// This rank's optimizer file's (its shard's or the record's).
    optimizer: Option<std::io::Error>,
    model: Option<std::io::Error>,
}

impl Faults {
    /// The faults injected for `rank`'s writes of `snapshot`.
    pub(super) fn injected(snapshot: &Snapshot, rank: usize) -> Faults {
        let fault = |file| fault_points::injected_error(file, rank, snapshot.step);
        Faults {
            optimizer: snapshot.optimizer.as_ref().and_then(|f| fault(f.fault)),
            model: fault("model"),
        }
    }
}

/// The ids of the parameters sharded at ZeRO stage 3 (none otherwise): their values are the
/// shards' master weights, and the model file holds the other tensors.
pub(super) fn sharded_ids(ddp: &Ddp) -> Vec<burn::module::ParamId> {
    ddp.param_shards()
        .map(|shards| shards.params().iter().map(|p| p.id).collect())
        .unwrap_or_default()
}

impl Snapshot {
    /// Encodes this rank's optimizer file of the checkpoint of `state.step` into `dir` (not
    /// created yet): its shard, or on rank 0 `optimizer`'s record; on rank 0 also the
    /// manifest's draft. The model file is encoded by [`Snapshot::write`]'s caller.
    pub(super) fn take(
        dir: &Path,
        ddp: &Ddp,
        optimizer: OptimizerPart<'_>,
        state: &TrainingState,
    ) -> Result<Snapshot> {
        let (rank, step) = (ddp.rank(), state.step);
        let (kind, layout) = match &optimizer {
            OptimizerPart::Shards(zero) => (OptimizerState::Shards, zero.layout().clone()),
            // The parameters' flat order, for the manifest (a record has no shards).
            OptimizerPart::Record(_) => {
                let numels: Vec<usize> = ddp.params().iter().map(ParamInfo::numel).collect();
                (
                    OptimizerState::Record,
                    FlatLayout::new(&numels, ddp.world_size(), 1),
                )
            }
        };
        let file = |name: String, fault, bytes: Vec<u8>| OptimizerFile {
            name,
            fault,
            fingerprint: files::fingerprint(&bytes),
            bytes: Some(bytes),
        };
        let optimizer = match optimizer {
            OptimizerPart::Shards(zero) => Some(file(
                manifest::shard_file(rank),
                "shard",
                shard_file::encode(&zero.export()),
            )),
            OptimizerPart::Record(Some(encoded)) => {
                let bytes = encoded
                    .map_err(|reason| CheckpointError::corrupt(dir.join(OPTIMIZER_FILE), reason))?;
                Some(file(OPTIMIZER_FILE.to_string(), "optimizer", bytes))
            }
            OptimizerPart::Record(None) => None,
        };
        let draft = (rank == 0).then(|| Manifest {
            format_version: FORMAT_VERSION,
            world_size: ddp.world_size(),
            step,
            samples_consumed: state.samples_consumed,
            scaler: state.scaler,
            random: state.random,
            optimizer: kind,
            weights: match sharded_ids(ddp).is_empty() {
                true => Weights::ModelFile,
                false => Weights::MasterShards,
            },
            layout: LayoutEntry::of(&layout),
            buckets: ddp.next_layout().bucket_params(),
            params: ddp.params().iter().map(param_entry).collect(),
            files: Vec::new(),
        });
        Ok(Snapshot {
            step,
            optimizer,
            model: None,
            draft,
        })
    }

    /// Rank 0: the model file, encoded now (an asynchronous save, which cannot keep the model).
    pub(super) fn with_model(mut self, (entry, bytes): (FileEntry, Vec<u8>)) -> Self {
        self.model = Some((entry, Some(bytes)));
        self
    }

    /// The bytes this snapshot holds in memory (its files' not yet written).
    pub(super) fn bytes(&self) -> u64 {
        let optimizer = self
            .optimizer
            .as_ref()
            .and_then(|f| f.bytes.as_ref())
            .map_or(0, Vec::len);
        let model = self
            .model
            .as_ref()
            .and_then(|(_, bytes)| bytes.as_ref())
            .map_or(0, Vec::len);
        (optimizer + model) as u64
    }

    /// Stage 2 on this rank alone (no collective: an asynchronous save runs it on a background
    /// thread): its optimizer file, durably, then on rank 0 the model file, encoded by
    /// `model_file` if it was not already; each file's bytes are let go once written.
    pub(super) fn write(
        &mut self,
        dir: &Path,
        rank: usize,
        faults: Faults,
        model_file: impl FnOnce() -> Result<(FileEntry, Vec<u8>)>,
    ) -> Result<()> {
        if let Some(file) = &mut self.optimizer
            && let Some(bytes) = file.bytes.take()
        {
            files::write_atomic_or_fail(dir, &file.name, &bytes, faults.optimizer)?;
        }
        fault_points::pause_point("after-shard", rank, self.step);
        if rank != 0 {
            return Ok(());
        }
        if self.model.is_none() {
            let (entry, bytes) = model_file()?;
            self.model = Some((entry, Some(bytes)));
        }
        if let Some((_, bytes)) = &mut self.model
            && let Some(bytes) = bytes.take()
        {
            files::write_atomic_or_fail(dir, MODEL_FILE, &bytes, faults.model)?;
        }
        Ok(())
    }

    /// Stage 3, a collective, once every rank's files are durable: the sizes and checksums
    /// are gathered and rank 0 commits with the manifest; nobody returns before the
    /// checkpoint is complete (or every rank knows it failed).
    pub(super) fn commit(self, dir: &Path, ddp: &Ddp) -> Result<()> {
        let (comm, rank) = (ddp.communicator(), ddp.rank());
        let (size, crc) = self.optimizer.as_ref().map_or((0, 0), |f| f.fingerprint);
        (|| {
            let all = gather_u64s(comm, &[size, u64::from(crc)])?;
            let committed = match self.draft {
                Some(mut manifest) => {
                    manifest.files = self.model.map(|(entry, _)| entry).into_iter().collect();
                    manifest
                        .files
                        .extend(optimizer_entries(manifest.optimizer, &all));
                    // The check file has done its job; a leftover one would be harmless.
                    let _ = fs::remove_file(dir.join(SHARED_CHECK));
                    let fault = fault_points::injected_error("manifest", rank, self.step);
                    files::write_atomic_or_fail(dir, MANIFEST, &manifest.signed_json(), fault)
                }
                None => Ok(()),
            };
            agree(comm, committed)
        })()
        .map_err(in_stage(dir, self.step, SaveStage::Commit))
    }
}

/// The manifest entries of the optimizer files, from every rank's (size, crc).
fn optimizer_entries(kind: OptimizerState, all: &[Vec<u64>]) -> Vec<FileEntry> {
    match kind {
        OptimizerState::Shards => all
            .iter()
            .enumerate()
            .map(|(r, fingerprint)| FileEntry {
                name: manifest::shard_file(r),
                rank: Some(r),
                bytes: fingerprint[0],
                crc32: fingerprint[1] as u32,
                optimizer_record: false,
            })
            .collect(),
        OptimizerState::Record => vec![FileEntry {
            name: OPTIMIZER_FILE.into(),
            rank: None,
            bytes: all[0][0],
            crc32: all[0][1] as u32,
            optimizer_record: true,
        }],
    }
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

/// The model's safetensors bytes (every float tensor but the sharded parameters `sharded`) and
/// their manifest entry.
pub(super) fn model_file<B: Backend, M: Module<B>>(
    dir: &Path,
    model: &M,
    step: u64,
    sharded: &[burn::module::ParamId],
) -> Result<(FileEntry, Vec<u8>)> {
    let metadata = HashMap::from([
        ("producer".to_string(), "burn-dist".to_string()),
        ("step".to_string(), step.to_string()),
    ]);
    let bytes = weights::collect::<B, M>(model, sharded)
        .serialize(metadata)
        .map_err(|reason| CheckpointError::corrupt(dir.join(MODEL_FILE), reason))?;
    let (size, crc) = files::fingerprint(&bytes);
    let entry = FileEntry {
        name: MODEL_FILE.into(),
        rank: None,
        bytes: size,
        crc32: crc,
        optimizer_record: false,
    };
    Ok((entry, bytes))
}
