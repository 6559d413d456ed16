//! The model the Learner trains: burn-dist-models' MLP with an MSE loss, wired into burn-train's
//! `TrainStep` and `InferenceStep`.

use std::sync::atomic::{AtomicBool, Ordering};

use burn::module::Module;
use burn::nn::loss::{MseLoss, Reduction};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn_dist_models::{MLP_SIZES, Mlp};
use burn_train::{InferenceStep, RegressionOutput, TrainOutput, TrainStep};

use crate::data::RegressionBatch;
use crate::sync::mark_for_sync;

/// Whether [`TrainStep::step`] marks the model (the binary's hidden `--skip-mark` clears it, to
/// show the error a forgotten mark gives).
pub static MARK_FOR_SYNC: AtomicBool = AtomicBool::new(true);

/// burn-dist-models' [`Mlp`] (sizes [`MLP_SIZES`], no dropout) as a regressor. A wrapper because
/// burn-train's step traits cannot be implemented for a type of another crate.
#[derive(Module, Debug)]
pub struct Regressor<B: Backend> {
    pub mlp: Mlp<B>,
}

impl<B: Backend> Regressor<B> {
    /// Deterministically initialized from `seed`: identical on every rank and in the reference.
    pub fn new(seed: u64, device: &B::Device) -> Self {
        Regressor {
            mlp: Mlp::new(&MLP_SIZES, seed, device),
        }
    }

    /// Forward pass and mean squared error over the batch.
    pub fn forward_regression(&self, batch: RegressionBatch<B>) -> RegressionOutput<B> {
        let output = self.mlp.forward(batch.inputs);
        let loss = MseLoss::new().forward(output.clone(), batch.targets.clone(), Reduction::Mean);
        RegressionOutput::new(loss, output, batch.targets)
    }
}

impl<B: AutodiffBackend> TrainStep for Regressor<B> {
    type Input = RegressionBatch<B>;
    type Output = RegressionOutput<B>;

    fn step(&self, batch: RegressionBatch<B>) -> TrainOutput<RegressionOutput<B>> {
        // The Learner's fork dropped the sync marks (see `crate::sync`): mark the copy that runs
        // this step, so that `backward()` averages the gradients over the ranks.
        let model = if MARK_FOR_SYNC.load(Ordering::Relaxed) {
            mark_for_sync(self.clone())
        } else {
            self.clone()
        };
        let item = model.forward_regression(batch);
        TrainOutput::new(&model, item.loss.clone().backward(), item)
    }
}

impl<B: Backend> InferenceStep for Regressor<B> {
    type Input = RegressionBatch<B>;
    type Output = RegressionOutput<B>;

    fn step(&self, batch: RegressionBatch<B>) -> RegressionOutput<B> {
        self.forward_regression(batch)
    }
}
