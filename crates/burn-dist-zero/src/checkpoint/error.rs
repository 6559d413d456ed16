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
