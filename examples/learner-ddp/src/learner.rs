//! One rank's training through burn-train's plain single-device `Learner`.

use std::path::Path;

use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::Dataset;
use burn::data::dataset::transform::PartialDataset;
use burn::optim::AdamConfig;
use burn::record::CompactRecorder;
use burn::tensor::backend::AutodiffBackend;
use burn_dist::{DistributedSampler, ShardedDataset};
use burn_train::metric::LossMetric;
use burn_train::{Learner, SupervisedTraining};

use crate::data::{RegressionBatcher, synthetic_dataset};
use crate::model::Regressor;
use crate::silent::{NoMetricLogger, SilentRenderer};
use crate::{DATA_SEED, Run, SAMPLER_SEED, VALID_SEED};

/// Trains `model` (already through `Ddp::prepare`) as rank `rank` of `world` and returns the
/// trained model. Each rank reads its shard of the training data; only rank 0 validates, logs
/// metrics, renders progress and writes checkpoints and `experiment.log` into `artifact_dir`.
pub fn fit<B: AutodiffBackend>(
    model: Regressor<B>,
    run: &Run,
    rank: usize,
    world: usize,
    artifact_dir: &Path,
) -> Regressor<B::InnerBackend> {
    // Rank r reads every world-th sample of the shared order from r, so step k's global batch
    // is the k-th run of `world × batch` samples of that order, as in the reference. The
    // Learner builds its data loader once, so every epoch reads the epoch-0 order (no shuffle
    // in the loader: it would permute each shard on its own).
    let sampler = DistributedSampler::new(rank, world, SAMPLER_SEED);
    let train = ShardedDataset::new(synthetic_dataset(run.samples, DATA_SEED), &sampler, 0);
    let train = DataLoaderBuilder::new(RegressionBatcher)
        .batch_size(run.batch)
        .build(train);
    // Validation only feeds metrics and the checkpoint choice, which live on rank 0; the
    // other ranks get an empty slice of the set rather than spend time on results nobody reads.
    let valid = synthetic_dataset(run.valid_samples, VALID_SEED);
    let end = if rank == 0 { valid.len() } else { 0 };
    let valid = DataLoaderBuilder::new(RegressionBatcher)
        .batch_size(run.batch)
        .build(PartialDataset::new(valid, 0, end));

    let optim = AdamConfig::new().init::<B, Regressor<B>>();
    let learner = Learner::new(model, optim, run.lr);
    let training = SupervisedTraining::new(artifact_dir, train, valid).num_epochs(run.epochs);
    let training = if rank == 0 {
        training
            .metrics((LossMetric::new(),))
            .with_file_checkpointer(CompactRecorder::new())
    } else {
        // See `crate::silent` for what each of these switches off.
        training
            .with_metric_logger(NoMetricLogger)
            .renderer(SilentRenderer)
            .with_application_logger(None)
    };
    training.launch(learner).model
}
