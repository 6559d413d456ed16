//! Scaffolding shared by the tests, benches and examples: small models, a deterministic
//! initialization that every rank and every reference run can reproduce, synthetic data, and
//! parameter comparison. Not part of the stable API.

use burn::module::{Module, ModuleMapper, Param};
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, Tensor, TensorData};
use burn_dist_comm::DType as CommDType;
use burn_dist_comm::testing::rank_data;

use crate::model::Survey;

/// Values in [-scale, scale) from a seeded stream: the same for every rank and every run.
pub fn uniform(len: usize, seed: u64, stream: usize, scale: f32) -> Vec<f32> {
    let burn_dist_comm::HostBuffer::F32(v) = rank_data(CommDType::F32, len, seed, stream) else {
        unreachable!("f32 data")
    };
    v.into_iter().map(|x| x * scale).collect()
}

/// Overwrites every float parameter with seeded values scaled by 1/√(fan-in), so that models
/// built independently (on every rank, in the reference) start identical whatever the backend's
/// own RNG did.
pub struct DeterministicInit {
    pub seed: u64,
    next: usize,
}

impl DeterministicInit {
    pub fn new(seed: u64) -> Self {
        DeterministicInit { seed, next: 0 }
    }
}

impl<B: Backend> ModuleMapper<B> for DeterministicInit {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let dims = tensor.dims();
        let fan_in = if D > 1 { dims[0] } else { dims[0].max(1) };
        let values = uniform(
            dims.iter().product(),
            self.seed,
            self.next,
            1.0 / (fan_in as f32).sqrt(),
        );
        self.next += 1;
        let mut fresh = Tensor::from_data(TensorData::new(values, dims.to_vec()), &tensor.device());
        if tensor.is_require_grad() {
            fresh = fresh.require_grad();
        }
        Param::from_mapped_value(id, fresh, mapper)
    }
}

/// A three-layer perceptron.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    pub layers: Vec<Linear<B>>,
    pub activation: Relu,
}

impl<B: Backend> Mlp<B> {
    /// `sizes` = [input, hidden…, output].
    pub fn new(sizes: &[usize], seed: u64, device: &B::Device) -> Self {
        let layers = sizes
            .windows(2)
            .map(|w| LinearConfig::new(w[0], w[1]).init(device))
            .collect();
        Mlp {
            layers,
            activation: Relu::new(),
        }
        .map(&mut DeterministicInit::new(seed))
    }

    pub fn forward(&self, mut x: Tensor<B, 2>) -> Tensor<B, 2> {
        let last = self.layers.len() - 1;
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(x);
            if i < last {
                x = self.activation.forward(x);
            }
        }
        x
    }
}

/// One transformer encoder block (no dropout) with a linear head.
#[derive(Module, Debug)]
pub struct TransformerBlock<B: Backend> {
    pub encoder: TransformerEncoder<B>,
    pub head: Linear<B>,
}

impl<B: Backend> TransformerBlock<B> {
    pub fn new(d_model: usize, heads: usize, seed: u64, device: &B::Device) -> Self {
        let encoder = TransformerEncoderConfig::new(d_model, 2 * d_model, heads, 1)
            .with_dropout(0.0)
            .init(device);
        let head = LinearConfig::new(d_model, d_model).init(device);
        TransformerBlock { encoder, head }.map(&mut DeterministicInit::new(seed))
    }

    /// `x`: [batch, sequence, d_model].
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.head
            .forward(self.encoder.forward(TransformerEncoderInput::new(x)))
    }
}

/// Every float tensor's values, in visit order.
pub fn parameters<B: Backend, M: Module<B>>(model: &M) -> Vec<Vec<f32>> {
    let survey = Survey::of::<B, M>(model);
    survey
        .floats
        .iter()
        .zip(&survey.float_offsets)
        .map(|(p, &at)| {
            let bytes = survey.bytes[at..at + p.numel() * p.dtype.size()].to_vec();
            let data = TensorData::from_bytes_vec(bytes, p.shape.clone(), p.dtype);
            data.convert::<f32>().into_vec::<f32>().expect("f32 values")
        })
        .collect()
}

/// ‖a − b‖ / ‖b‖, in f64.
pub fn relative_error(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "compared tensors differ in size");
    let diff: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
        .sum();
    let norm: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    if norm == 0.0 {
        diff.sqrt()
    } else {
        (diff / norm).sqrt()
    }
}

/// Layer sizes of the synthetic-data MLP used by the tests and the example.
pub const MLP_SIZES: [usize; 4] = [16, 48, 48, 8];

/// Rows `rows` of the seeded matrix `stream` of step `step`, whose full shape is `shape`
/// (`shape[0]` = global batch). Every rank and every reference run sees the same matrix.
pub fn synthetic_rows<B: Backend, const D: usize>(
    stream: usize,
    step: usize,
    shape: [usize; D],
    rows: std::ops::Range<usize>,
    device: &B::Device,
) -> Tensor<B, D> {
    let row: usize = shape[1..].iter().product();
    let all = uniform(shape[0] * row, 1000 + step as u64, stream, 1.0);
    let mut shard = shape;
    shard[0] = rows.len();
    Tensor::from_data(
        TensorData::new(
            all[rows.start * row..rows.end * row].to_vec(),
            shard.to_vec(),
        ),
        device,
    )
}

/// Rows of a global batch that rank `rank` of `world` reads (contiguous equal shards).
pub fn shard_rows(global_batch: usize, rank: usize, world: usize) -> std::ops::Range<usize> {
    let per = global_batch / world;
    rank * per..(rank + 1) * per
}

/// Trains [`MLP_SIZES`] with Adam on synthetic regression data for `steps` steps: this rank's
/// shard of each global batch, split into the `ddp`'s accumulation micro-batches. Calls
/// `on_step(step, local loss)` and returns the final parameters. The example and the
/// equivalence tests run exactly this loop.
pub fn train_synthetic_mlp<B: burn::tensor::backend::AutodiffBackend>(
    ddp: &mut crate::Ddp,
    steps: usize,
    global_batch: usize,
    lr: f64,
    device: &B::Device,
    mut on_step: impl FnMut(usize, f32),
) -> crate::Result<Vec<Vec<f32>>> {
    use burn::optim::{AdamConfig, Optimizer};
    let (rank, world, micro) = (ddp.rank(), ddp.world_size(), ddp.accumulation_steps());
    let mut model = ddp.prepare(Mlp::<B>::new(&MLP_SIZES, 7, device))?;
    let mut optim = AdamConfig::new().init();
    let [input, .., output] = MLP_SIZES;
    for step in 0..steps {
        let shard = shard_rows(global_batch, rank, world);
        let per_micro = shard.len() / micro;
        let mut losses = 0.0;
        for m in 0..micro {
            let rows = shard.start + m * per_micro..shard.start + (m + 1) * per_micro;
            model = ddp.mark(model);
            let x = synthetic_rows::<B, 2>(0, step, [global_batch, input], rows.clone(), device);
            let y = synthetic_rows::<B, 2>(1, step, [global_batch, output], rows, device);
            let loss = (model.forward(x) - y).powi_scalar(2).mean();
            losses += loss.clone().into_scalar().elem::<f32>();
            if let Some(grads) = ddp.backward(loss, &model)? {
                model = optim.step(lr, model, grads);
            }
        }
        on_step(step, losses / micro as f32);
    }
    Ok(parameters::<B, _>(&model))
}
