//! The one training step that the DDP-overhead benches and the plain-vs-decorated equivalence
//! test all run, so that `Autodiff<Flex>` (benches/plain) and
//! `Autodiff<DistributedBackend<Flex>>` (benches/) execute the same code, and the file format in
//! which both write their final parameters.

use std::io::{Read, Write};
use std::path::Path;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Tensor};

use crate::{TransformerBlock, synthetic_rows};

/// Sizes of the benchmarked transformer step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepConfig {
    pub d_model: usize,
    pub heads: usize,
    pub batch: usize,
    pub seq: usize,
    /// Seed of the deterministic initialization.
    pub seed: u64,
}

/// The benchmark configuration: ~593 k parameters (2.4 MB of f32 gradients), one step in the
/// tens of milliseconds on Flex on a 2-core machine, long enough that per-step fixed costs do not
/// dominate and short enough to sample well.
pub const BENCH: StepConfig = StepConfig {
    d_model: 256,
    heads: 8,
    batch: 16,
    seq: 32,
    seed: 17,
};

/// Adam learning rate of the benches and the equivalence runs.
pub const LR: f64 = 1e-3;

/// Bucket caps (bytes) for the DDP bench, scaled down from DDP's 1 MiB / 25 MiB defaults in
/// proportion to the model: at the defaults its 2.4 MB of gradients would fill only 2 buckets,
/// and the bench should exercise several buckets as a real model does.
pub const BENCH_FIRST_BUCKET_BYTES: usize = 256 << 10;
pub const BENCH_BUCKET_BYTES: usize = 1 << 20;

impl StepConfig {
    pub fn model<B: Backend>(&self, device: &B::Device) -> TransformerBlock<B> {
        TransformerBlock::new(self.d_model, self.heads, self.seed, device)
    }

    /// Input and target of step `step`: seeded, identical in every build.
    pub fn batch<B: Backend>(
        &self,
        step: usize,
        device: &B::Device,
    ) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let shape = [self.batch, self.seq, self.d_model];
        let x = synthetic_rows::<B, 3>(0, step, shape, 0..self.batch, device);
        let y = synthetic_rows::<B, 3>(1, step, shape, 0..self.batch, device);
        (x, y)
    }
}

/// One optimizer step: forward, MSE loss, `loss.backward()`, `GradientsParams::from_grads`,
/// `optim.step`. Plain Burn code on purpose: under an active `Ddp` the backward hooks run the
/// reducer, so the same function measures both the plain and the synchronized step. Returns
/// the updated model and the loss before the step.
pub fn transformer_step<B, O>(
    model: TransformerBlock<B>,
    optim: &mut O,
    x: Tensor<B, 3>,
    y: Tensor<B, 3>,
    lr: f64,
) -> (TransformerBlock<B>, f32)
where
    B: AutodiffBackend,
    O: Optimizer<TransformerBlock<B>, B>,
{
    let loss = (model.forward(x) - y).powi_scalar(2).mean();
    let value = loss.clone().into_scalar().elem::<f32>();
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    (optim.step(lr, model, grads), value)
}

/// Every float parameter's values as f32, in module visit order.
pub fn float_params<B: Backend, M: Module<B>>(model: &M) -> Vec<Vec<f32>> {
    struct Collect(Vec<Vec<f32>>);
    impl<B: Backend> ModuleVisitor<B> for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let data = param.val().into_data().convert::<f32>();
            self.0.push(data.into_vec::<f32>().expect("f32 values"));
        }
    }
    let mut collect = Collect(Vec::new());
    model.visit(&mut collect);
    collect.0
}

/// Bytes of f32 gradient per step: 4 × the elements of every trainable float parameter.
pub fn trainable_f32_bytes<B: Backend, M: Module<B>>(model: &M) -> u64 {
    struct Count(u64);
    impl<B: Backend> ModuleVisitor<B> for Count {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let value = param.val();
            if value.is_require_grad() {
                self.0 += 4 * value.shape().num_elements() as u64;
            }
        }
    }
    let mut count = Count(0);
    model.visit(&mut count);
    count.0
}

/// Writes tensors as: count (u32 LE), then per tensor its length (u32 LE) and its values (f32 LE).
/// The lengths make a size mismatch between builds an explicit error instead of a misaligned read.
pub fn write_params(path: &Path, tensors: &[Vec<f32>]) -> std::io::Result<()> {
    let mut bytes = Vec::new();
    bytes.extend((tensors.len() as u32).to_le_bytes());
    for t in tensors {
        bytes.extend((t.len() as u32).to_le_bytes());
        bytes.extend(t.iter().flat_map(|v| v.to_le_bytes()));
    }
    std::fs::File::create(path)?.write_all(&bytes)
}

/// Reads what [`write_params`] wrote.
pub fn read_params(path: &Path) -> std::io::Result<Vec<Vec<f32>>> {
    let mut bytes = Vec::new();
    std::fs::File::open(path)?.read_to_end(&mut bytes)?;
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "truncated parameter file");
    let mut at = 0;
    let u32_at = |at: &mut usize| -> std::io::Result<usize> {
        let word = bytes.get(*at..*at + 4).ok_or_else(bad)?;
        *at += 4;
        Ok(u32::from_le_bytes(word.try_into().expect("4 bytes")) as usize)
    };
    let count = u32_at(&mut at)?;
    let mut tensors = Vec::with_capacity(count);
    for _ in 0..count {
        let len = u32_at(&mut at)?;
        let raw = bytes.get(at..at + 4 * len).ok_or_else(bad)?;
        at += 4 * len;
        tensors.push(
            raw.chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect(),
        );
    }
    if at != bytes.len() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "trailing bytes in parameter file",
        ));
    }
    Ok(tensors)
}

/// Trains `config`'s transformer for `steps` Adam steps, one fresh seeded batch per step, calls
/// `after_step(step, loss)` after each, and returns the final parameters. Both params binaries
/// run this loop; the caller builds the model (`config.model`) so that the DDP one can pass it
/// through `Ddp::prepare` first, and checks the reducer in `after_step`.
pub fn train_steps<B, O>(
    config: &StepConfig,
    mut model: TransformerBlock<B>,
    optim: &mut O,
    steps: usize,
    device: &B::Device,
    mut after_step: impl FnMut(usize, f32),
) -> Vec<Vec<f32>>
where
    B: AutodiffBackend,
    O: Optimizer<TransformerBlock<B>, B>,
{
    for step in 0..steps {
        let (x, y) = config.batch::<B>(step, device);
        let (next, loss) = transformer_step(model, optim, x, y, LR);
        model = next;
        after_step(step, loss);
    }
    float_params::<B, _>(&model)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_files_round_trip_bit_for_bit_and_reject_truncation() {
        let dir = std::env::temp_dir().join(format!("burn-dist-params-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p.bin");
        let tensors = vec![
            vec![1.5, -0.0, f32::MIN_POSITIVE / 2.0],
            vec![],
            vec![f32::NAN],
        ];
        write_params(&path, &tensors).unwrap();
        let back = read_params(&path).unwrap();
        let bits = |t: &[Vec<f32>]| -> Vec<Vec<u32>> {
            t.iter()
                .map(|v| v.iter().map(|x| x.to_bits()).collect())
                .collect()
        };
        assert_eq!(bits(&back), bits(&tensors));
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
        assert!(read_params(&path).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
