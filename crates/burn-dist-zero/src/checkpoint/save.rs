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
enum OptimizerPart<'a> {
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
    let saved = save_stages::<B, M>(root, &dir, ddp, model, optimizer, state);
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
    optimizer: OptimizerPart<'_>,
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

    // 2. Every rank writes its shard durably (or rank 0 the optimizer record); rank 0 the
    //    weights too.
    let kind = match optimizer {
        OptimizerPart::Shards(_) => OptimizerState::Shards,
        OptimizerPart::Record(_) => OptimizerState::Record,
    };
    let layout = match optimizer {
        OptimizerPart::Shards(zero) => zero.layout().clone(),
        // The parameters' flat order, for the manifest (a record has no shards).
        OptimizerPart::Record(_) => {
            let numels: Vec<usize> = ddp.params().iter().map(ParamInfo::numel).collect();
            FlatLayout::new(&numels, ddp.world_size(), 1)
        }
    };
    // ZeRO stage 3: no rank holds the sharded parameters whole; their values are the shards'
    // master weights, and the model file holds the other tensors.
    let sharded: Vec<_> = ddp
        .param_shards()
        .map(|shards| shards.params().iter().map(|p| p.id).collect())
        .unwrap_or_default();
    let weights = match sharded.is_empty() {
        true => Weights::ModelFile,
        false => Weights::MasterShards,
    };
    let written = (|| {
        let (size, crc) = match &optimizer {
            OptimizerPart::Shards(zero) => {
                let bytes = shard_file::encode(&zero.export());
                write(&manifest::shard_file(rank), "shard", &bytes)?;
                files::fingerprint(&bytes)
            }
            OptimizerPart::Record(Some(encoded)) => {
                let path = dir.join(OPTIMIZER_FILE);
                let bytes = encoded
                    .as_ref()
                    .map_err(|reason| CheckpointError::corrupt(&path, reason.clone()))?;
                write(OPTIMIZER_FILE, "optimizer", bytes)?;
                files::fingerprint(bytes)
            }
            OptimizerPart::Record(None) => (0, 0),
        };
        fault_points::pause_point("after-shard", rank, step);
        let model_entry = if rank == 0 {
            let (entry, bytes) = model_file::<B, M>(dir, model, step, &sharded)?;
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
            match kind {
                OptimizerState::Shards => {
                    for (r, fingerprint) in all.iter().enumerate() {
                        entries.push(FileEntry {
                            name: manifest::shard_file(r),
                            rank: Some(r),
                            bytes: fingerprint[0],
                            crc32: fingerprint[1] as u32,
                            optimizer_record: false,
                        });
                    }
                }
                OptimizerState::Record => entries.push(FileEntry {
                    name: OPTIMIZER_FILE.into(),
                    rank: None,
                    bytes: all[0][0],
                    crc32: all[0][1] as u32,
                    optimizer_record: true,
                }),
            }
            let manifest = Manifest {
                format_version: FORMAT_VERSION,
                world_size: ddp.world_size(),
                step,
                samples_consumed: state.samples_consumed,
                scaler: state.scaler,
                random: state.random,
                optimizer: kind,
                weights,
                layout: LayoutEntry::of(&layout),
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
fn model_file<B: Backend, M: Module<B>>(
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
