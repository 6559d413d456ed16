//! Small models, a deterministic initialization that every rank and every reference run can
//! reproduce, synthetic data and a relative-error measure, shared by burn-dist's tests, benches
//! and examples. Generic over the backend and free of Burn's `distributed` feature, so that a
//! plain-backend build (benches/plain) runs exactly the same models.

use burn::module::{Module, ModuleMapper, Param};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::nn::{
    BatchNorm, BatchNormConfig, Linear, LinearConfig, PaddingConfig2d, Relu, RmsNorm, RmsNormConfig,
};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_dist_comm::DType as CommDType;
use burn_dist_comm::testing::rank_data;

/// Values in [-scale, scale) from a seeded stream: the same for every rank and every run.
pub fn uniform(len: usize, seed: u64, stream: usize, scale: f32) -> Vec<f32> {
    let burn_dist_comm::HostBuffer::F32(v) = rank_data(CommDType::F32, len, seed, stream) else {
        unreachable!("f32 data")
    };
    v.into_iter().map(|x| x * scale).collect()
}

/// Casts every float parameter of a model to a dtype, keeping it trainable: how mixed-precision
/// runs make f16/bf16 parameters (ZeroAdam keeps the f32 master copy).
pub struct Cast(pub burn::tensor::FloatDType);

impl<B: burn::tensor::backend::AutodiffBackend> burn::module::ModuleMapper<B> for Cast {
    fn map_float<const D: usize>(
        &mut self,
        param: burn::module::Param<Tensor<B, D>>,
    ) -> burn::module::Param<Tensor<B, D>> {
        param.map(|t| Tensor::from_inner(t.inner().cast(self.0)).require_grad())
    }
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
        let fresh = seeded_like(&tensor, self.seed, self.next);
        self.next += 1;
        Param::from_mapped_value(id, fresh, mapper)
    }
}

/// Trainable `param` with [`DeterministicInit`]'s values for seed `seed` and the parameter's
/// place `stream`, but still lazy: Burn's initialization runs when the parameter is first used
/// (or `Ddp::prepare_sharded` initializes it, one parameter at a time), and these values
/// replace what it drew. A lazily created model (Burn's `*Config::init`) that every rank and
/// every reference run initializes alike.
///
/// The values are a leaf that requires a gradient, whatever Burn's own initialization left:
/// burn-nn 0.21's column-major `Linear` transposes its weight's draw in its init
/// transformation, which on Autodiff leaves a non-leaf that reports no `require_grad`, so that
/// no optimizer (Burn's own, DDP's, ZeroAdam's) would train it.
pub fn seeded_when_initialized<B: Backend, const D: usize>(
    param: Param<Tensor<B, D>>,
    seed: u64,
    stream: usize,
) -> Param<Tensor<B, D>> {
    param.init_mapper(move |tensor| seeded_like(&tensor, seed, stream).require_grad())
}

/// A tensor like `tensor` (shape, dtype, device, `require_grad`) holding seeded values scaled
/// by 1/√(fan-in).
fn seeded_like<B: Backend, const D: usize>(
    tensor: &Tensor<B, D>,
    seed: u64,
    stream: usize,
) -> Tensor<B, D> {
    let dims = tensor.dims();
    let fan_in = if D > 1 { dims[0] } else { dims[0].max(1) };
    let values = uniform(
        dims.iter().product(),
        seed,
        stream,
        1.0 / (fan_in as f32).sqrt(),
    );
    // `burn_dist::replace_values`, inlined: this crate stays free of burn-dist.
    let data = TensorData::new(values, dims.to_vec());
    Tensor::from_data(data, (&tensor.device(), tensor.dtype()))
        .set_require_grad(tensor.is_require_grad())
}

/// Gives every float parameter, in visit order, the next of `values` (f32, converted to the
/// parameter's dtype), keeping ids and `require_grad`: a model holding values read elsewhere.
pub struct SetValues {
    values: std::vec::IntoIter<Vec<f32>>,
}

impl SetValues {
    pub fn new(values: Vec<Vec<f32>>) -> Self {
        SetValues {
            values: values.into_iter(),
        }
    }
}

impl<B: Backend> ModuleMapper<B> for SetValues {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let values = self
            .values
            .next()
            .expect("a value for every float parameter");
        let data = TensorData::new(values, tensor.dims().to_vec()).convert_dtype(tensor.dtype());
        let fresh = Tensor::from_data(data, (&tensor.device(), tensor.dtype()))
            .set_require_grad(tensor.is_require_grad());
        Param::from_mapped_value(id, fresh, mapper)
    }
}

/// Parameters whose gradients the device path must not reduce where they are:
/// - `a`, used only as `aᵀ`: its gradient is a transposed (strided) view;
/// - `p1` and `p2`, added to the same tensor (`y = x·aᵀ + p1 + p2`): burn-autodiff's backward of
///   an add hands one `dy` handle to both parents (`ops::backward::binary` registers the left
///   parent's clone before the right's), so when each of the two parameters' hooks fires the
///   memory is still held by the other branch's pending gradient, and cubecl's `can_mut`
///   (nothing else holds the handle) is false for both: two copies, not one;
/// - `q`, rows of [`SharedGradients::PADDED`] f32 (384 bytes), which cubecl-cuda pitches to
///   512 bytes and the wgpu runtime does not.
///
/// So the device path copies 3 gradients on wgpu without fusion (`a`, `p1`, `p2`) and 4 on
/// CUDA (and `q`, a pitched copy); `tests/device_twin.rs` and the GPU check's `ddp-step/views`
/// assert it.
#[derive(Module, Debug)]
pub struct SharedGradients<B: Backend> {
    pub a: Param<Tensor<B, 2>>,
    pub p1: Param<Tensor<B, 2>>,
    pub p2: Param<Tensor<B, 2>>,
    pub q: Param<Tensor<B, 2>>,
}

impl<B: Backend> SharedGradients<B> {
    /// Rows of the input and of `p1`, `p2`, `q`.
    pub const ROWS: usize = 16;
    /// 128 f32 = 512-byte rows: not padded.
    pub const IN: usize = 128;
    pub const OUT: usize = 128;
    /// 96 f32 = 384-byte rows: padded on CUDA.
    pub const PADDED: usize = 96;
    /// Private copies without padded rows: the transposed one and both of the pair.
    pub const UNPITCHED_COPIES: u64 = 3;

    pub fn new(device: &B::Device) -> Self {
        let param = |shape: [usize; 2], seed: u64| {
            let values = uniform(shape[0] * shape[1], seed, 0, 0.5);
            Param::from_tensor(Tensor::from_data(TensorData::new(values, shape), device))
        };
        SharedGradients {
            a: param([Self::OUT, Self::IN], 1),
            p1: param([Self::ROWS, Self::OUT], 2),
            p2: param([Self::ROWS, Self::OUT], 3),
            q: param([Self::ROWS, Self::PADDED], 5),
        }
    }

    /// The seeded input `[ROWS, IN]`.
    pub fn input(device: &B::Device) -> Tensor<B, 2> {
        let values = uniform(Self::ROWS * Self::IN, 4, 0, 1.0);
        Tensor::from_data(TensorData::new(values, [Self::ROWS, Self::IN]), device)
    }

    pub fn loss(&self, x: Tensor<B, 2>) -> Tensor<B, 1> {
        let y = x.matmul(self.a.val().transpose()) + self.p1.val() + self.p2.val();
        y.powi_scalar(2).mean() + self.q.val().powi_scalar(2).mean()
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

/// A 3×3 convolution, batch normalization and a linear head: the normalization's gain and bias
/// reach their ops through reshapes, and its running statistics are float tensors that are not
/// trained.
#[derive(Module, Debug)]
pub struct ConvNorm<B: Backend> {
    pub conv: Conv2d<B>,
    pub norm: BatchNorm<B>,
    pub head: Linear<B>,
    pub activation: Relu,
}

/// The input of [`ConvNorm`]: channels, height, width.
pub const CONV_INPUT: [usize; 3] = [3, 6, 6];
/// Its output features.
pub const CONV_OUTPUT: usize = 8;

impl<B: Backend> ConvNorm<B> {
    pub fn new(seed: u64, device: &B::Device) -> Self {
        let [channels, height, width] = CONV_INPUT;
        let conv = Conv2dConfig::new([channels, 4], [3, 3])
            .with_padding(PaddingConfig2d::Same)
            .init(device);
        ConvNorm {
            conv,
            norm: BatchNormConfig::new(4).init(device),
            head: LinearConfig::new(4 * height * width, CONV_OUTPUT).init(device),
            activation: Relu::new(),
        }
        .map(&mut DeterministicInit::new(seed))
    }

    /// `x`: [batch, channels, height, width] of [`CONV_INPUT`].
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 2> {
        let x = self
            .activation
            .forward(self.norm.forward(self.conv.forward(x)));
        self.head.forward(x.flatten(1, 3))
    }
}

/// RMS normalization in front of an [`Mlp`]: its gain reaches the multiply through
/// `unsqueeze`, a view of the parameter.
#[derive(Module, Debug)]
pub struct RmsMlp<B: Backend> {
    pub norm: RmsNorm<B>,
    pub mlp: Mlp<B>,
}

impl<B: Backend> RmsMlp<B> {
    pub fn new(seed: u64, device: &B::Device) -> Self {
        RmsMlp {
            norm: RmsNormConfig::new(MLP_SIZES[0]).init(device),
            mlp: Mlp::new(&MLP_SIZES, seed, device),
        }
        .map(&mut DeterministicInit::new(seed + 1))
    }

    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.mlp.forward(self.norm.forward(x))
    }
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

pub mod processes;
pub mod step;

/// Asserts ‖a − b‖ / ‖b‖ ≤ `tolerance` for every tensor of `got` against `reference`, naming
/// the first tensor that is off.
pub fn assert_close(got: &[Vec<f32>], reference: &[Vec<f32>], tolerance: f64, what: &str) {
    assert_eq!(got.len(), reference.len(), "{what}: tensor count");
    for (i, (a, b)) in got.iter().zip(reference).enumerate() {
        let error = relative_error(a, b);
        assert!(
            error <= tolerance,
            "{what}: tensor {i} differs from the reference by {error:e}"
        );
    }
}
