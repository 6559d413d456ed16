//! burn-train's single-device `Learner` trained data-parallel with burn-dist: one process per
//! rank, `Autodiff<DistributedBackend<Flex>>`, each rank on its shard of the data (a new order
//! every epoch), gradients averaged during `backward()`, Burn's Adam or burn-dist-zero's
//! `ZeroAdam` (stages 1 to 3; at stage 3 on `DistributedBackend<Flex, Sharded>`) through Burn's
//! `Optimizer` trait; metrics, logs and checkpoints on rank 0 only, and a resume from any
//! epoch's checkpoint at any world size. With `--backend wgpu` (feature `wgpu`) the same on
//! Burn's `Wgpu` with the device path, ZeroAdam's state in device memory or, with
//! `--offload`, in host memory (`ZeroAdam::offloaded`).
//!
//! The binary (`src/main.rs`) runs [`learner::fit`]; [`reference::custom_loop`] trains the same
//! model on the same data with a plain loop in one process, which the launched test compares
//! against.

pub mod data;
pub mod learner;
pub mod model;
pub mod reference;
pub mod sync;

/// Seed of the model's deterministic initialization.
pub const MODEL_SEED: u64 = 7;
/// Seed of the training data.
pub const DATA_SEED: u64 = 3;
/// Seed of the held-out validation data.
pub const VALID_SEED: u64 = 5;
/// Seed of the data order, shared by every rank.
pub const SAMPLER_SEED: u64 = 42;

/// The optimizer a run trains with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum OptimizerChoice {
    /// Burn's Adam (`AdamConfig`), checked by `Ddp::optimizer`.
    #[default]
    Adam,
    /// burn-dist-zero's ZeroAdam, stage 1 (sharded optimizer state), as plain Adam.
    Zero1,
    /// ZeroAdam stage 2 (sharded state and gradients).
    Zero2,
    /// ZeroAdam stage 3: the parameters sharded too (`DistributedBackend<Flex, Sharded>`,
    /// `Ddp::prepare_sharded`).
    Zero3,
}

impl OptimizerChoice {
    /// ZeroAdam's stage, `None` for Burn's Adam.
    pub fn zero_stage(self) -> Option<u8> {
        match self {
            OptimizerChoice::Adam => None,
            OptimizerChoice::Zero1 => Some(1),
            OptimizerChoice::Zero2 => Some(2),
            OptimizerChoice::Zero3 => Some(3),
        }
    }
}

/// The backend a run trains on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum BackendChoice {
    /// burn-flex on the CPU: the host path.
    #[default]
    Flex,
    /// Burn's `Wgpu` (fusion on, feature `wgpu`): the device path.
    Wgpu,
}

/// What one training run does; the Learner run and the reference loop take the same values.
#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    /// Training samples; a multiple of the global batch (world size × `batch`).
    pub samples: usize,
    /// Validation samples (rank 0 only).
    pub valid_samples: usize,
    pub epochs: usize,
    /// Samples per step on each rank.
    pub batch: usize,
    /// Constant learning rate of Burn's Adam.
    pub lr: f64,
}

impl Run {
    /// Checks that `world` ranks split every global batch evenly, so that each step is one
    /// global batch of `world × batch` samples, exactly as in the one-process reference.
    pub fn check(&self, world: usize) -> Result<(), String> {
        if self.batch == 0 || self.epochs == 0 || self.samples == 0 {
            return Err(format!(
                "--batch-size ({}), --epochs ({}) and --samples ({}) must be positive",
                self.batch, self.epochs, self.samples
            ));
        }
        let global = world * self.batch;
        if !self.samples.is_multiple_of(global) {
            return Err(format!(
                "--samples {} is not a multiple of the global batch {global} \
                 (world size {world} × --batch-size {})",
                self.samples, self.batch
            ));
        }
        Ok(())
    }

    /// Optimizer steps per epoch with `world` ranks (after [`Run::check`]).
    pub fn steps_per_epoch(&self, world: usize) -> usize {
        self.samples / (world * self.batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(samples: usize, batch: usize) -> Run {
        Run {
            samples,
            valid_samples: 0,
            epochs: 1,
            batch,
            lr: 1e-2,
        }
    }

    #[test]
    fn uneven_global_batches_are_refused_naming_the_sizes() {
        assert_eq!(run(64, 4).check(2), Ok(()));
        assert_eq!(run(64, 4).steps_per_epoch(2), 8);
        let error = run(60, 4).check(2).unwrap_err();
        assert!(
            error.contains("--samples 60") && error.contains("global batch 8"),
            "{error}"
        );
        assert!(
            run(64, 0)
                .check(2)
                .unwrap_err()
                .contains("--batch-size (0)")
        );
    }
}
