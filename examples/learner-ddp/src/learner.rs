//! One rank's training through burn-train's plain single-device `Learner`.

use std::path::Path;

use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::Dataset;
use burn::data::dataset::transform::PartialDataset;
use burn::optim::Optimizer;
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use burn::tensor::backend::AutodiffBackend;
use burn_dist::train::{EpochLoader, RankZeroRecorder, training};
use burn_dist::{Ddp, DistributedSampler};
use burn_train::Learner;
use burn_train::metric::LossMetric;

use crate::data::{RegressionBatcher, synthetic_dataset};
use crate::model::Regressor;
use crate::{DATA_SEED, Run, SAMPLER_SEED, VALID_SEED};

/// Trains `model` (already through `Ddp::prepare`) with `optim` as this rank of `ddp`'s job and
/// returns the trained model. Each rank reads its shard of the training data, in a new order
/// every epoch; only rank 0 validates, logs metrics, renders progress and writes checkpoints and
/// `experiment.log` into `artifact_dir`. With `resume`, training continues after that epoch's
/// checkpoint in `artifact_dir`, written at any world size.
pub fn fit<B, O>(
    ddp: &Ddp,
    model: Regressor<B>,
    optim: O,
    run: &Run,
    artifact_dir: &Path,
    resume: Option<usize>,
) -> Regressor<B::InnerBackend>
where
    B: AutodiffBackend,
    O: Optimizer<Regressor<B>, B> + 'static,
{
    // Rank r reads every world-th sample of the epoch's shared order from r, so step k's global
    // batch is the k-th run of `world × batch` samples of that order, as in the reference.
    let sampler = DistributedSampler::new(ddp.rank(), ddp.world_size(), SAMPLER_SEED);
    let dataset = synthetic_dataset(run.samples, DATA_SEED);
    let mut train = EpochLoader::new(dataset, sampler, RegressionBatcher, run.batch);
    if let Some(epoch) = resume {
        train = train.resume_after(epoch);
    }
    // Validation only feeds metrics and the checkpoint choice, which live on rank 0; the
    // other ranks get an empty slice of the set rather than spend time on results nobody reads.
    // At ZeRO stage 3 every forward gathers the weights from every rank, so every rank
    // validates on the whole set alongside rank 0.
    let valid = synthetic_dataset(run.valid_samples, VALID_SEED);
    let everywhere = ddp.param_shards().is_some();
    let end = if ddp.rank() == 0 || everywhere {
        valid.len()
    } else {
        0
    };
    let valid = DataLoaderBuilder::new(RegressionBatcher)
        .batch_size(run.batch)
        .build(PartialDataset::new(valid, 0, end));

    // Full precision: the optimizer state resumes exactly (a half-precision recorder would
    // round Adam's moments).
    let recorder = NamedMpkFileRecorder::<FullPrecisionSettings>::new();
    let mut training = training(ddp, artifact_dir, train.into_arc(), valid)
        .num_epochs(run.epochs)
        .metrics((LossMetric::new(),))
        .with_file_checkpointer(RankZeroRecorder::new(ddp, artifact_dir, recorder));
    if let Some(epoch) = resume {
        training = training.checkpoint(epoch);
    }
    training.launch(Learner::new(model, optim, run.lr)).model
}
