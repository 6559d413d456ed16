//! Checkpoints written by rank 0 and read by every rank.

use std::path::{Path, PathBuf};

use burn::record::{FileRecorder, Record, Recorder, RecorderError};
use burn::tensor::backend::Backend;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::Ddp;

/// A file recorder for burn-train's checkpointer (`with_file_checkpointer`) under burn-dist:
/// on rank 0 it is `inner`; on the other ranks it writes nothing, and reads what rank 0 wrote.
///
/// Every rank still takes its records (burn-train does, on the training thread), so a record
/// that is a collective takes part on every rank: burn-dist-zero's `ZeroAdam` gathers its
/// shards to rank 0, and at ZeRO stage 3 the model's `into_record` gathers each parameter to
/// rank 0. The other ranks hold no values in those records, and this recorder drops them
/// without encoding them. Their checkpointers work in their own [`super::rank_directory`]; a
/// load there is redirected to the same file in rank 0's directory. So a resume
/// (`.checkpoint(epoch)`) reads one set of files on every rank, at any world size.
#[derive(Debug, Clone, Default)]
pub struct RankZeroRecorder<FR> {
    inner: FR,
    /// `None` on rank 0 (and for `Default`, which burn's `Recorder` requires): record and load
    /// as `inner`.
    other_rank: Option<Redirect>,
}

/// How a rank other than 0 maps its own checkpoint paths to rank 0's.
#[derive(Debug, Clone)]
struct Redirect {
    own: PathBuf,
    main: PathBuf,
}

impl<FR> RankZeroRecorder<FR> {
    /// `inner` for rank 0's checkpoints in `directory` (the directory given to
    /// [`super::training`]).
    pub fn new(ddp: &Ddp, directory: impl AsRef<Path>, inner: FR) -> Self {
        let main = directory.as_ref().to_path_buf();
        let own = super::rank_directory(ddp, &main);
        RankZeroRecorder {
            inner,
            other_rank: (own != main).then_some(Redirect { own, main }),
        }
    }

    /// Where a load of `path` reads: the same file in rank 0's directory.
    fn source(&self, path: &Path) -> PathBuf {
        match &self.other_rank {
            Some(Redirect { own, main }) => match path.strip_prefix(own) {
                Ok(relative) => main.join(relative),
                Err(_) => path.to_path_buf(),
            },
            None => path.to_path_buf(),
        }
    }
}

impl<FR: FileRecorder<B>, B: Backend> Recorder<B> for RankZeroRecorder<FR> {
    type Settings = FR::Settings;
    type RecordArgs = PathBuf;
    type RecordOutput = ();
    type LoadArgs = PathBuf;

    /// Rank 0 encodes and writes; the others drop the record unencoded (at stage 3 encoding
    /// theirs would ask rank 0 for values it has no reason to send).
    fn record<R: Record<B>>(&self, record: R, path: PathBuf) -> Result<(), RecorderError> {
        match self.other_rank {
            None => self.inner.record(record, path),
            Some(_) => Ok(()),
        }
    }

    fn save_item<I: Serialize>(&self, item: I, path: PathBuf) -> Result<(), RecorderError> {
        match self.other_rank {
            None => self.inner.save_item(item, path),
            Some(_) => Ok(()),
        }
    }

    fn load_item<I: DeserializeOwned>(&self, path: &mut PathBuf) -> Result<I, RecorderError> {
        let mut source = self.source(path);
        self.inner.load_item(&mut source)
    }
}

impl<FR: FileRecorder<B>, B: Backend> FileRecorder<B> for RankZeroRecorder<FR> {
    fn file_extension() -> &'static str {
        FR::file_extension()
    }
}
