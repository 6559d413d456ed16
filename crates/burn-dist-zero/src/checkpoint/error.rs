//! What can go wrong with a checkpoint. Every message names the file (and the rank) involved.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint file {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A file whose size, checksum or contents are not what the manifest promises.
    #[error("checkpoint file {}: {reason}", path.display())]
    Corrupt { path: PathBuf, reason: String },
    #[error(
        "checkpoint {} is incomplete (no manifest.json: its save was interrupted) and is never loaded",
        dir.display()
    )]
    Incomplete { dir: PathBuf },
    #[error("no complete checkpoint (a step-* directory with a manifest.json) under {}", root.display())]
    NotFound { root: PathBuf },
    #[error(
        "checkpoint file {}: format version {found} is newer than this build reads (up to {supported}); \
         upgrade burn-dist-zero",
        path.display()
    )]
    NewerFormat {
        path: PathBuf,
        found: u32,
        supported: u32,
    },
    /// A file of the checkpoint is not a regular file: a symbolic link (perhaps to `/dev/zero`),
    /// a FIFO, a device, a socket or a directory. Refused before anything is read from it.
    #[error(
        "checkpoint file {}: is a {kind}, not a regular file; a checkpoint holds only regular files",
        path.display()
    )]
    NotRegularFile { path: PathBuf, kind: &'static str },
    /// A file whose size is not the one the manifest lists (or, for the manifest itself, above
    /// the largest manifest this build reads). Refused before it is read.
    #[error("checkpoint file {}: {what} is {found} bytes, {expected}", path.display())]
    WrongSize {
        path: PathBuf,
        what: String,
        found: u64,
        /// What was expected, for the message: "the manifest says N (truncated or overwritten)"
        /// or "more than the N it may have" (the manifest).
        expected: String,
    },
    /// The manifest lists a file under a name the format does not define (an absolute path,
    /// `../`, another file of the directory). Nothing outside the format's own files is read.
    #[error(
        "checkpoint file {}: lists `{name}` for {what}, whose name must be `{defined}`; a checkpoint \
         reads only the files its format names",
        manifest.display()
    )]
    UndefinedFileName {
        manifest: PathBuf,
        name: String,
        what: String,
        defined: String,
    },
    /// The manifest's step is not the one in its directory's name (a manifest moved or copied
    /// into another step's directory).
    #[error(
        "checkpoint file {}: holds step {manifest_step} but lies in the directory of step {dir_step}",
        path.display()
    )]
    StepMismatch {
        path: PathBuf,
        manifest_step: u64,
        dir_step: u64,
    },
    /// The manifest's own checksum does not match its contents: a changed digit in the data
    /// position, the random state or the loss scale is refused, never applied.
    #[error(
        "checkpoint file {}: checksum mismatch (crc32 {found:08x} of its contents, it says {expected:08x}): \
         the manifest was damaged or edited",
        path.display()
    )]
    ManifestChecksum {
        path: PathBuf,
        found: u32,
        expected: u32,
    },
    /// A manifest older than this build reads: version 1 had no checksum of its own, so a
    /// damaged one could be applied unnoticed.
    #[error(
        "checkpoint file {}: format version {found} is older than this build reads (from {supported}, \
         which added the manifest's checksum); resume it with the burn-dist-zero release that wrote it",
        path.display()
    )]
    OlderFormat {
        path: PathBuf,
        found: u32,
        supported: u32,
    },
    /// A rank does not see the checkpoint directory rank 0 created: the ranks do not share a
    /// filesystem (several nodes with local disks), or they were given different directories.
    #[error(
        "rank {rank} does not see rank 0's checkpoint directory {} ({found}): every rank must save \
         to the same directory on a filesystem all nodes share (NFS, Lustre, ...)",
        dir.display()
    )]
    NotShared {
        rank: usize,
        dir: PathBuf,
        found: String,
    },
    /// A stage of a save failed on this rank or another one (`source`: this rank's error, or
    /// [`CheckpointError::Rank`] with the failing rank's). The incomplete step directory has
    /// been removed; the previous complete checkpoint stays the newest.
    #[error(
        "checkpoint save of step {step} failed while {stage} in {}: {source}{}",
        dir.display(),
        timeout_hint(source)
    )]
    Save {
        step: u64,
        stage: SaveStage,
        dir: PathBuf,
        source: Box<CheckpointError>,
    },
    /// The checkpoint does not fit the model or optimizer it is loaded into.
    #[error("checkpoint {}: {reason}", dir.display())]
    Mismatch { dir: PathBuf, reason: String },
    /// Another rank's part of a collective save or load failed.
    #[error("rank {rank}: {message}")]
    Rank { rank: usize, message: String },
    #[error(transparent)]
    Comm(#[from] burn_dist_comm::CommError),
    #[error(transparent)]
    Zero(#[from] crate::ZeroError),
}

/// The stages of a save, for its errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SaveStage {
    /// Rank 0 creates the step directory; every rank checks it sees it.
    Prepare,
    /// Every rank writes its optimizer shard, rank 0 the model weights.
    Write,
    /// The shards' sizes and checksums are gathered and rank 0 writes `manifest.json`.
    Commit,
}

impl std::fmt::Display for SaveStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SaveStage::Prepare => {
                "creating the step directory and checking that every rank sees it (.shared-check)"
            }
            SaveStage::Write => {
                "writing the optimizer shards (optim-rank-NNNNN.bin) and model.safetensors"
            }
            SaveStage::Commit => "writing manifest.json",
        })
    }
}

/// A collective that timed out during a save most often waited for a rank whose disk is slow:
/// say how to give it more time.
fn timeout_hint(source: &CheckpointError) -> String {
    match source {
        CheckpointError::Comm(burn_dist_comm::CommError::Timeout { .. }) => format!(
            "; a rank writing slowly to disk makes the others wait: raise the timeout with {}=<seconds>",
            burn_dist_comm::env::TIMEOUT_VAR
        ),
        _ => String::new(),
    }
}

pub type Result<T, E = CheckpointError> = std::result::Result<T, E>;

impl CheckpointError {
    pub(crate) fn io(path: impl AsRef<Path>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.as_ref().to_path_buf();
        move |source| CheckpointError::Io { path, source }
    }

    pub(crate) fn corrupt(path: impl AsRef<Path>, reason: impl Into<String>) -> Self {
        CheckpointError::Corrupt {
            path: path.as_ref().to_path_buf(),
            reason: reason.into(),
        }
    }
}

/// Checkpoint errors that wrap a `ZeroError` or a `CommError` unwrap into it; the rest keep
/// their type, boxed.
impl From<CheckpointError> for crate::ZeroError {
    fn from(error: CheckpointError) -> Self {
        match error {
            CheckpointError::Zero(error) => error,
            CheckpointError::Comm(error) => crate::ZeroError::Comm(error),
            other => crate::ZeroError::Checkpoint(Box::new(other)),
        }
    }
}
