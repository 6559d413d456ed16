//! Retention: keep the newest K complete checkpoints, as llm.c keeps its last few, so that a
//! long run does not fill the disk.

use std::fs;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};

use super::error::{CheckpointError, Result};
use super::{MANIFEST, files, step_dirs};

/// Keeps the `keep` newest complete checkpoints under `root` and removes every `step-*`
/// directory older than the oldest of them, complete or not (an incomplete one there is the
/// leftover of a failed save). Directories newer than the newest complete checkpoint are left
/// alone: a save may be writing them. Returns the removed directories, oldest first.
///
/// Each directory is made incomplete first (its manifest removed, durably), so a crash during
/// the removal never leaves a partly deleted directory that looks complete. Not a collective:
/// call it on one rank (rank 0) after [`save`](super::save) returned.
pub fn keep_last(root: impl AsRef<Path>, keep: NonZeroUsize) -> Result<Vec<PathBuf>> {
    let dirs = step_dirs(root.as_ref())?;
    let complete: Vec<u64> = dirs
        .iter()
        .filter(|(.., complete)| *complete)
        .map(|(step, ..)| *step)
        .collect();
    let Some(&oldest_kept) = complete.iter().rev().nth(keep.get() - 1) else {
        return Ok(Vec::new());
    };
    let mut removed = Vec::new();
    for (step, dir, complete) in dirs {
        if step >= oldest_kept {
            break;
        }
        if complete {
            let manifest = dir.join(MANIFEST);
            fs::remove_file(&manifest).map_err(CheckpointError::io(&manifest))?;
            files::sync_dir(&dir)?;
        }
        fs::remove_dir_all(&dir).map_err(CheckpointError::io(&dir))?;
        removed.push(dir);
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::step_dir;

    /// Step directories under a fresh root: `(step, complete)`.
    fn root_with(dirs: &[(u64, bool)]) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        for &(step, complete) in dirs {
            let dir = step_dir(root.path(), step);
            fs::create_dir(&dir).unwrap();
            fs::write(dir.join("optim-rank-00000.bin"), b"shard").unwrap();
            if complete {
                fs::write(dir.join(MANIFEST), b"{}").unwrap();
            }
        }
        root
    }

    fn steps_left(root: &Path) -> Vec<u64> {
        step_dirs(root).unwrap().iter().map(|(s, ..)| *s).collect()
    }

    #[test]
    fn keeps_the_newest_complete_checkpoints_and_what_is_newer() {
        let two = NonZeroUsize::new(2).unwrap();
        let root = root_with(&[(2, true), (4, false), (6, true), (8, true), (10, false)]);
        let removed = keep_last(root.path(), two).unwrap();
        assert_eq!(
            removed,
            [step_dir(root.path(), 2), step_dir(root.path(), 4)],
            "the oldest complete one and the failed save before the kept ones"
        );
        assert_eq!(steps_left(root.path()), [6, 8, 10]);
        // Nothing more to remove; fewer complete checkpoints than kept: nothing removed.
        assert!(keep_last(root.path(), two).unwrap().is_empty());
        let few = root_with(&[(2, false), (4, true)]);
        assert!(keep_last(few.path(), two).unwrap().is_empty());
        assert_eq!(steps_left(few.path()), [2, 4]);
        // Keeping one leaves the newest complete checkpoint (and the save after it).
        keep_last(root.path(), NonZeroUsize::MIN).unwrap();
        assert_eq!(steps_left(root.path()), [8, 10]);
        // No root: nothing to do.
        assert!(
            keep_last(root.path().join("absent"), two)
                .unwrap()
                .is_empty()
        );
    }
}
