//! burn-train's `Learner` under burn-dist (feature `train`): one process per rank, each running
//! the same single-device Learner on its shard of the data.
//!
//! What a Burn user adds to a Learner program (examples/learner-ddp shows all of it):
//! - [`training`] instead of `SupervisedTraining::new`: rank 0 gets the directory, the other
//!   ranks log, render and write nothing (the one switch for rank-0-only output);
//! - [`RankZeroRecorder`] around the checkpoint recorder: rank 0 writes the checkpoints, every
//!   rank resumes from them, at any world size;
//! - [`EpochLoader`] for the training data: each rank's shard, in a new order every epoch;
//! - [`AgreedEarlyStopping`] around an early-stopping strategy, so that every rank stops with
//!   rank 0;
//! - the optimizer through [`crate::Ddp::optimizer`] (any Burn optimizer) or burn-dist-zero's
//!   `ZeroAdam`, which check that every step's gradients were averaged over the ranks (at
//!   ZeRO stage 3, `ZeroAdam` on a model from `Ddp::prepare_sharded`: every rank then runs
//!   every forward, validation included);
//! - `burn_dist::mark_for_sync(self.clone())` in `TrainStep::step` (the Learner's fork drops
//!   the marks; the optimizers above report a forgotten mark by name).

mod early_stopping;
mod loader;
mod quiet;
mod recorder;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::data::dataloader::DataLoader;
use burn::module::AutodiffModule;
use burn::optim::Optimizer;
use burn::optim::lr_scheduler::LrScheduler;
use burn::tensor::backend::AutodiffBackend;
use burn_train::{InferenceStep, LearningComponentsMarker, SupervisedTraining, TrainStep};

pub use early_stopping::AgreedEarlyStopping;
pub use loader::EpochLoader;
pub use quiet::{NoMetricLogger, SilentRenderer};
pub use recorder::RankZeroRecorder;

use crate::Ddp;

/// The directory a rank's Learner is given: `directory` on rank 0, `directory/rank-<r>` on the
/// others, which stays empty unless something writes where it should not.
pub fn rank_directory(ddp: &Ddp, directory: impl AsRef<Path>) -> PathBuf {
    let directory = directory.as_ref();
    match ddp.rank() {
        0 => directory.to_path_buf(),
        rank => directory.join(format!("rank-{rank}")),
    }
}

/// `SupervisedTraining::new` for this rank: rank 0 trains in `directory` as without
/// burn-dist; the other ranks get [`rank_directory`], no metric logger, no renderer and no
/// `experiment.log` (their warnings go to the process's own `tracing` subscriber, if any).
/// Register metrics as usual: they are computed on every rank and shown by rank 0. A later
/// `.renderer(...)` or `.with_metric_logger(...)` overrides the quiet ones.
pub fn training<B, LR, M, O>(
    ddp: &Ddp,
    directory: impl AsRef<Path>,
    train: Arc<dyn DataLoader<B, M::Input>>,
    valid: Arc<dyn DataLoader<B::InnerBackend, <M::InnerModule as InferenceStep>::Input>>,
) -> SupervisedTraining<LearningComponentsMarker<B, LR, M, O>>
where
    B: AutodiffBackend,
    LR: LrScheduler + 'static,
    M: TrainStep + AutodiffModule<B> + core::fmt::Display + 'static,
    M::InnerModule: InferenceStep,
    O: Optimizer<M, B> + 'static,
{
    let training = SupervisedTraining::new(rank_directory(ddp, directory), train, valid);
    if ddp.rank() == 0 {
        return training;
    }
    training
        .with_metric_logger(NoMetricLogger)
        .renderer(SilentRenderer)
        .with_application_logger(None)
}
