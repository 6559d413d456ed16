//! The reference: the same model, data, optimizer and learning rate as the Learner run, written
//! as a plain loop in one process, reading each global batch whole.

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn_dist::DistributedSampler;
use burn_dist_models::step::float_params;

use crate::data::{RegressionBatch, RegressionBatcher, Sample, synthetic_dataset};
use crate::model::Regressor;
use crate::{DATA_SEED, MODEL_SEED, Run, SAMPLER_SEED};

/// Trains for `run.epochs` epochs on batches of `global_batch` samples taken in each epoch's
/// data order that the ranks share (the sampler's order at world size 1), and returns the final
/// parameters in visit order.
pub fn custom_loop<B: AutodiffBackend>(
    run: &Run,
    global_batch: usize,
    device: &B::Device,
) -> Vec<Vec<f32>> {
    let dataset = synthetic_dataset(run.samples, DATA_SEED);
    let sampler = DistributedSampler::new(0, 1, SAMPLER_SEED);
    let mut model = Regressor::<B>::new(MODEL_SEED, device);
    let mut optim = AdamConfig::new().init::<B, Regressor<B>>();
    for epoch in 0..run.epochs as u64 {
        for rows in sampler.indices(dataset.len(), epoch).chunks(global_batch) {
            let items: Vec<Sample> = rows
                .iter()
                .map(|&i| dataset.get(i).expect("the sampler's indices are in range"))
                .collect();
            let batch: RegressionBatch<B> = RegressionBatcher.batch(items, device);
            let loss = model.forward_regression(batch).loss;
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(run.lr, model, grads);
        }
    }
    float_params::<B, _>(&model)
}
