//! [`AsyncSaver`]: a checkpoint written while training goes on.
//!
//! The save's collective stages stay where every rank calls them, in the training thread; only
//! the disk writes, which need no collective, move to a background thread:
//! 1. [`AsyncSaver::save`] (a collective): this rank's state is encoded into memory (the
//!    [`Snapshot`]: its optimizer shard, and on rank 0 the model file and the manifest's
//!    draft), the step directory is prepared and checked shared as by [`super::save`], and a
//!    thread starts writing the snapshot's files, each durably and atomically;
//! 2. [`AsyncSaver::poll`] (a collective, one 8-byte all-gather per call while a save is
//!    pending, nothing otherwise): once every rank's writer is done, the ranks agree on the
//!    outcome and rank 0 commits with the manifest, as [`super::save`] does. A failed write
//!    is reported there on every rank, naming the file, and its directory is removed;
//! 3. [`AsyncSaver::wait`] does the same without waiting for the others to be done first: the
//!    end of a run, and the start of the next save (one snapshot at a time).
//!
//! Until the commit the step directory has no manifest: a rank killed during the background
//! write leaves the previous checkpoint the newest complete one, and the launcher restarts
//! from it. The checkpoint is byte for byte the one [`super::save`] writes.

use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn_dist::Ddp;

use super::agreement::{agree, gather_u64s};
use super::error::{CheckpointError, Result, SaveStage};
use super::save::{
    Faults, OptimizerPart, Snapshot, finish_save, in_stage, model_file, prepare_stage, sharded_ids,
};
use super::{TrainingState, step_dir};
use crate::ZeroAdam;

/// Saves ZeroAdam checkpoints under one root without stopping training: the state is copied
/// into memory and written by a background thread, and the checkpoint completes at a later
/// [`AsyncSaver::poll`] or [`AsyncSaver::wait`]. One per rank; every method but
/// [`AsyncSaver::pending`] and [`AsyncSaver::snapshot_bytes`] is a collective that every rank
/// calls at the same point, as [`super::save`] is.
///
/// Memory: one snapshot at a time, the bytes of this rank's files (its shard, `12 ·
/// shard_len` bytes plus a header; on rank 0 also the model file), let go file by file as
/// they are written. A second save first waits for the first.
pub struct AsyncSaver {
    root: PathBuf,
    pending: Option<Pending>,
}

/// The save in flight.
struct Pending {
    step: u64,
    dir: PathBuf,
    writer: Writer,
    /// What the snapshot held when taken.
    bytes: u64,
}

enum Writer {
    /// The background thread; it hands the snapshot back for the commit.
    Running(JoinHandle<Result<Snapshot>>),
    /// The snapshot could not be taken: reported when the save completes, as a failed write.
    Failed(CheckpointError),
}

impl AsyncSaver {
    /// Saves under `root` (every rank sees it on one shared filesystem, as for
    /// [`super::save`]).
    pub fn new(root: impl AsRef<Path>) -> Self {
        AsyncSaver {
            root: root.as_ref().to_path_buf(),
            pending: None,
        }
    }

    /// Starts the checkpoint of `state.step`: waits for the save before it to complete
    /// ([`AsyncSaver::wait`], whose error it returns), copies this rank's state into memory,
    /// prepares the step directory (every rank checks it sees it) and returns while a
    /// background thread writes the files. An error of the preparation is returned here, on
    /// every rank; one of the writes at the save's [`AsyncSaver::poll`] or
    /// [`AsyncSaver::wait`].
    pub fn save<B: Backend, M: Module<B>>(
        &mut self,
        ddp: &Ddp,
        model: &M,
        zero: &ZeroAdam,
        state: &TrainingState,
    ) -> Result<()> {
        self.wait(ddp)?;
        let (rank, step) = (ddp.rank(), state.step);
        let dir = step_dir(&self.root, step);
        let _span = tracing::info_span!("checkpoint save (async)", rank, step).entered();
        let snapshot =
            Snapshot::take(&dir, ddp, OptimizerPart::Shards(zero), state).and_then(|snapshot| {
                match rank {
                    0 => Ok(snapshot.with_model(model_file::<B, M>(
                        &dir,
                        model,
                        step,
                        &sharded_ids(ddp),
                    )?)),
                    _ => Ok(snapshot),
                }
            });
        if let Err(error) = prepare_stage(&self.root, &dir, ddp, step) {
            return finish_save(&dir, ddp, Err(error)).map(|_| ());
        }
        let (writer, bytes) = match snapshot {
            Ok(mut snapshot) => {
                let bytes = snapshot.bytes();
                let faults = Faults::injected(&snapshot, rank);
                let into = dir.clone();
                let thread = std::thread::Builder::new()
                    .name(format!("burn-dist checkpoint writer (rank {rank})"))
                    .spawn(move || {
                        let encoded = || unreachable!("the model file is in the snapshot");
                        snapshot.write(&into, rank, faults, encoded)?;
                        Ok(snapshot)
                    })
                    .map_err(CheckpointError::io(&dir));
                match thread {
                    Ok(thread) => (Writer::Running(thread), bytes),
                    Err(error) => (Writer::Failed(error), 0),
                }
            }
            Err(error) => (Writer::Failed(error), 0),
        };
        self.pending = Some(Pending {
            step,
            dir,
            writer,
            bytes,
        });
        Ok(())
    }

    /// Completes the pending save if every rank's background write is done: the ranks agree
    /// and rank 0 writes the manifest; returns the checkpoint's directory then, `None` while
    /// some rank is still writing or when no save is pending. A write that failed on any rank
    /// fails here on every rank ([`CheckpointError::Save`] in the write stage, naming the
    /// failing rank's file) and its directory is removed. Call it every step: without a
    /// pending save it costs nothing, with one an 8-byte all-gather.
    pub fn poll(&mut self, ddp: &Ddp) -> Result<Option<PathBuf>> {
        let Some(pending) = &self.pending else {
            return Ok(None);
        };
        let done = match &pending.writer {
            Writer::Running(thread) => thread.is_finished(),
            Writer::Failed(_) => true,
        };
        match gather_u64s(ddp.communicator(), &[u64::from(done)]) {
            Ok(all) if all.iter().all(|rank| rank[0] == 1) => self.wait(ddp),
            Ok(_) => Ok(None),
            Err(error) => {
                let pending = self.pending.take().expect("a save is pending");
                let failed = in_stage(&pending.dir, pending.step, SaveStage::Write)(error);
                finish_save(&pending.dir, ddp, Err(failed)).map(Some)
            }
        }
    }

    /// Completes the pending save, waiting for this rank's background write to end (then for
    /// the others', in the agreement); returns its directory, or `None` when none was pending.
    /// Errors as [`AsyncSaver::poll`]'s. Call it before the program ends: a save left pending
    /// has no manifest, and is never loaded.
    pub fn wait(&mut self, ddp: &Ddp) -> Result<Option<PathBuf>> {
        let Some(pending) = self.pending.take() else {
            return Ok(None);
        };
        let written = match pending.writer {
            Writer::Running(thread) => thread.join().unwrap_or_else(|panic| {
                let reason = panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("a panic");
                Err(CheckpointError::io(&pending.dir)(std::io::Error::other(
                    format!("the background writer stopped: {reason}"),
                )))
            }),
            Writer::Failed(error) => Err(error),
        };
        let _span = tracing::info_span!(
            "checkpoint commit (async)",
            rank = ddp.rank(),
            step = pending.step
        )
        .entered();
        let saved = agree(ddp.communicator(), written)
            .map_err(in_stage(&pending.dir, pending.step, SaveStage::Write))
            .and_then(|snapshot| snapshot.commit(&pending.dir, ddp));
        finish_save(&pending.dir, ddp, saved).map(Some)
    }

    /// The step of the save in flight, if any (not a collective).
    pub fn pending(&self) -> Option<u64> {
        self.pending.as_ref().map(|p| p.step)
    }

    /// The bytes the pending save's snapshot held in memory when taken (this rank's files);
    /// 0 when none is pending (not a collective).
    pub fn snapshot_bytes(&self) -> u64 {
        self.pending.as_ref().map_or(0, |p| p.bytes)
    }
}

impl Drop for AsyncSaver {
    fn drop(&mut self) {
        if let Some(pending) = &self.pending {
            tracing::warn!(
                step = pending.step,
                dir = %pending.dir.display(),
                "an asynchronous checkpoint save was never completed (AsyncSaver::wait): its \
                 directory has no manifest and is never loaded"
            );
        }
    }
}
