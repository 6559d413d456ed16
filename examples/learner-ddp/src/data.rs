//! Synthetic regression data: seeded inputs and the outputs of a fixed linear teacher, as a Burn
//! dataset and batcher, so that every rank and the reference loop read exactly the same samples.

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_dist_models::{MLP_SIZES, uniform};

/// Features per sample: the MLP's input width.
pub const INPUTS: usize = MLP_SIZES[0];
/// Targets per sample: the MLP's output width.
pub const OUTPUTS: usize = MLP_SIZES[MLP_SIZES.len() - 1];

/// One training example.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub input: Vec<f32>,
    pub target: Vec<f32>,
}

/// `samples` examples whose target is `input · T` for a seeded teacher matrix `T`: learnable, so
/// the loss falls, and the same for every rank and every run with the same `seed`.
pub fn synthetic_dataset(samples: usize, seed: u64) -> InMemDataset<Sample> {
    let inputs = uniform(samples * INPUTS, seed, 0, 1.0);
    let teacher = uniform(INPUTS * OUTPUTS, seed, 1, 1.0 / (INPUTS as f32).sqrt());
    let items = inputs
        .chunks_exact(INPUTS)
        .map(|input| {
            let target = (0..OUTPUTS)
                .map(|o| {
                    (0..INPUTS)
                        .map(|i| input[i] * teacher[i * OUTPUTS + o])
                        .sum()
                })
                .collect();
            Sample {
                input: input.to_vec(),
                target,
            }
        })
        .collect();
    InMemDataset::new(items)
}

/// A batch of samples as `[batch, INPUTS]` and `[batch, OUTPUTS]` tensors.
#[derive(Debug, Clone)]
pub struct RegressionBatch<B: Backend> {
    pub inputs: Tensor<B, 2>,
    pub targets: Tensor<B, 2>,
}

/// Stacks samples into a [`RegressionBatch`], in the order given.
#[derive(Debug, Clone, Copy, Default)]
pub struct RegressionBatcher;

impl<B: Backend> Batcher<B, Sample, RegressionBatch<B>> for RegressionBatcher {
    fn batch(&self, items: Vec<Sample>, device: &B::Device) -> RegressionBatch<B> {
        let rows = items.len();
        let inputs: Vec<f32> = items.iter().flat_map(|s| s.input.iter().copied()).collect();
        let targets: Vec<f32> = items.into_iter().flat_map(|s| s.target).collect();
        RegressionBatch {
            inputs: Tensor::from_data(TensorData::new(inputs, [rows, INPUTS]), device),
            targets: Tensor::from_data(TensorData::new(targets, [rows, OUTPUTS]), device),
        }
    }
}
