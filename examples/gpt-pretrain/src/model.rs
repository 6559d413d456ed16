//! A GPT-2-style decoder-only transformer (Radford et al., "Language Models are Unsupervised
//! Multitask Learners", 2019): token and learned position embeddings, pre-LayerNorm blocks of
//! causal multi-head self-attention and a GELU MLP, a final LayerNorm and a language-model head,
//! by default tied to the token embedding.
//!
//! The names of the tensors follow GPT-2's checkpoints (`wte`, `wpe`, `h.N.ln_1`, `attn.c_attn`,
//! `attn.c_proj`, `mlp.c_fc`, `mlp.c_proj`, `ln_f`), so the safetensors weights of a checkpoint
//! read like the reference implementation's.
//!
//! The initialization is GPT-2's (normal, std 0.02; residual projections scaled by
//! 1/√(2·layers); zero biases; unit LayerNorm gains), drawn from a seeded host stream rather than
//! the backend's RNG: the same seed gives the same model on every backend and at every world size.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::{Dropout, DropoutConfig, Embedding, Gelu, LayerNorm, LayerNormConfig, Linear};
use burn::tensor::activation::{log_softmax, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, DType, FloatDType, Int, Tensor, TensorData};

use crate::rng::SplitMix64;

/// The shape of a GPT model.
#[derive(Config, Debug, PartialEq)]
pub struct GptConfig {
    pub vocab_size: usize,
    /// Longest sequence the model reads (the number of learned positions).
    pub context: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub d_model: usize,
    /// Dropout on the embeddings, the attention weights and each residual branch (GPT-2: 0.1 in
    /// pretraining; 0 here, as in nanoGPT's pretraining runs, and so that runs are exactly
    /// reproducible at any world size).
    #[config(default = 0.0)]
    pub dropout: f64,
    /// The LM head reuses the token embedding's matrix (as GPT-2 does).
    #[config(default = true)]
    pub tie_weights: bool,
}

impl GptConfig {
    /// Trains on CPU in minutes: 2 layers, width 64, 4 heads, 64 positions.
    pub fn tiny(vocab_size: usize) -> Self {
        GptConfig::new(vocab_size, 64, 2, 4, 64)
    }

    /// GPT-2 small (124 M parameters with the vocabulary padded to 50304, as nanoGPT does).
    pub fn gpt2_124m(vocab_size: usize) -> Self {
        GptConfig::new(vocab_size, 1024, 12, 12, 768)
    }

    /// GPT-2 medium (350 M).
    pub fn gpt2_350m(vocab_size: usize) -> Self {
        GptConfig::new(vocab_size, 1024, 24, 16, 1024)
    }

    /// Checks the shape and names the offending setting.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("vocabulary size", self.vocab_size),
            ("context", self.context),
            ("layers", self.n_layer),
            ("heads", self.n_head),
            ("width", self.d_model),
        ];
        if let Some((what, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("the model's {what} must be positive"));
        }
        if !self.d_model.is_multiple_of(self.n_head) {
            return Err(format!(
                "the width {} is not divisible by the {} heads",
                self.d_model, self.n_head
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(format!("dropout {} is not in [0, 1)", self.dropout));
        }
        Ok(())
    }

    /// Trainable parameters (a tied head counted once).
    pub fn num_params(&self) -> usize {
        let (v, t, d, l) = (self.vocab_size, self.context, self.d_model, self.n_layer);
        let layer_norm = 2 * d;
        let block = 2 * layer_norm
            + (d * 3 * d + 3 * d)
            + (d * d + d)
            + (d * 4 * d + 4 * d)
            + (4 * d * d + d);
        let head = if self.tie_weights { 0 } else { d * v };
        v * d + t * d + l * block + layer_norm + head
    }

    /// Model FLOPs per trained token at sequence length `seq` (forward + backward), PaLM's
    /// estimate as nanoGPT uses it: `6·N + 12·L·d·T`, where N counts the parameters without the
    /// position embeddings (they are a lookup, not a matmul) and `12·L·d·T` is the attention's
    /// score and value matmuls.
    pub fn flops_per_token(&self, seq: usize) -> f64 {
        let n = (self.num_params() - self.context * self.d_model) as f64;
        6.0 * n + 12.0 * (self.n_layer * self.d_model * seq) as f64
    }

    /// The model, initialized from `seed` (see the module documentation).
    pub fn init<B: Backend>(&self, seed: u64, device: &B::Device) -> Gpt<B> {
        let mut init = Init {
            rng: SplitMix64::new(seed),
            drawn: 0,
            device: device.clone(),
        };
        let d = self.d_model;
        // GPT-2 scales the residual projections so that the residual stream's variance does not
        // grow with depth.
        let residual_std = 0.02 / ((2 * self.n_layer) as f64).sqrt();
        let blocks = (0..self.n_layer)
            .map(|_| Block {
                ln_1: LayerNormConfig::new(d).init(device),
                attn: CausalSelfAttention {
                    c_attn: init.linear(d, 3 * d, 0.02),
                    c_proj: init.linear(d, d, residual_std),
                    attn_dropout: DropoutConfig::new(self.dropout).init(),
                    resid_dropout: DropoutConfig::new(self.dropout).init(),
                    n_head: self.n_head,
                },
                ln_2: LayerNormConfig::new(d).init(device),
                mlp: Mlp {
                    c_fc: init.linear(d, 4 * d, 0.02),
                    c_proj: init.linear(4 * d, d, residual_std),
                    gelu: Gelu::new(),
                    dropout: DropoutConfig::new(self.dropout).init(),
                },
            })
            .collect();
        Gpt {
            wte: init.embedding(self.vocab_size, d),
            wpe: init.embedding(self.context, d),
            drop: DropoutConfig::new(self.dropout).init(),
            h: blocks,
            ln_f: LayerNormConfig::new(d).init(device),
            lm_head: (!self.tie_weights).then(|| init.linear_no_bias(d, self.vocab_size)),
            context: self.context,
        }
    }
}

/// Seeded GPT-2 initialization: every tensor takes the next values of one normal stream.
///
/// The parameters are lazy, as Burn's own initializers make them: each is drawn when first
/// used (from where the stream would be after the tensors before it, so the values do not
/// depend on the order), which lets `Ddp::prepare_sharded` build a ZeRO stage-3 model one
/// parameter at a time, never holding it whole.
struct Init<B: Backend> {
    rng: SplitMix64,
    /// Normal values the tensors so far take.
    drawn: u64,
    device: B::Device,
}

impl<B: Backend> Init<B> {
    fn normal<const D: usize>(&mut self, shape: [usize; D], std: f64) -> Param<Tensor<B, D>> {
        let count: usize = shape.iter().product();
        // Each normal value takes two draws of the stream (`SplitMix64::normal`).
        let start = self.rng.skipped(2 * self.drawn);
        self.drawn += count as u64;
        let draw = move |device: &B::Device, require_grad: bool| {
            let mut rng = start.clone();
            let values: Vec<f32> = (0..count).map(|_| (rng.normal() * std) as f32).collect();
            Tensor::from_data(TensorData::new(values, shape), device).set_require_grad(require_grad)
        };
        Param::uninitialized(
            burn::module::ParamId::new(),
            draw,
            self.device.clone(),
            true,
            shape.into(),
        )
    }

    fn linear(&mut self, d_in: usize, d_out: usize, std: f64) -> Linear<B> {
        Linear {
            weight: self.normal([d_in, d_out], std),
            bias: Some(Param::from_tensor(Tensor::zeros([d_out], &self.device))),
        }
    }

    fn linear_no_bias(&mut self, d_in: usize, d_out: usize) -> Linear<B> {
        Linear {
            weight: self.normal([d_in, d_out], 0.02),
            bias: None,
        }
    }

    fn embedding(&mut self, n: usize, d: usize) -> Embedding<B> {
        Embedding {
            weight: self.normal([n, d], 0.02),
        }
    }
}

#[derive(Module, Debug)]
pub struct Gpt<B: Backend> {
    /// Token embedding `[vocab, d]`; also the LM head when tied.
    pub wte: Embedding<B>,
    /// Position embedding `[context, d]`.
    pub wpe: Embedding<B>,
    pub drop: Dropout,
    pub h: Vec<Block<B>>,
    pub ln_f: LayerNorm<B>,
    /// `None` when tied to `wte`.
    pub lm_head: Option<Linear<B>>,
    pub context: usize,
}

#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    pub ln_1: LayerNorm<B>,
    pub attn: CausalSelfAttention<B>,
    pub ln_2: LayerNorm<B>,
    pub mlp: Mlp<B>,
}

/// Multi-head self-attention in which position `i` attends to positions `≤ i` only.
#[derive(Module, Debug)]
pub struct CausalSelfAttention<B: Backend> {
    /// Query, key and value projections in one matmul: `[d, 3d]`.
    pub c_attn: Linear<B>,
    pub c_proj: Linear<B>,
    pub attn_dropout: Dropout,
    pub resid_dropout: Dropout,
    pub n_head: usize,
}

#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    pub c_fc: Linear<B>,
    pub c_proj: Linear<B>,
    pub gelu: Gelu,
    pub dropout: Dropout,
}

impl<B: Backend> Gpt<B> {
    /// Logits `[batch, seq, vocab]` of the next token after each position of `tokens`
    /// `[batch, seq]`, `seq ≤ context`.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let [batch, seq] = tokens.dims();
        let d = self.wte.weight.dims()[1];
        assert!(
            seq <= self.context,
            "sequence of {seq} tokens exceeds the context of {}",
            self.context
        );
        let device = tokens.device();
        let positions = Tensor::<B, 1, Int>::arange(0..seq as i64, &device).reshape([1, seq]);
        let x = self.drop.forward(
            self.wte.forward(tokens) + self.wpe.forward(positions).expand([batch, seq, d]),
        );
        // The residual stream as one row per token: every Linear is then one matmul of
        // [batch·seq, d] rows. On a [batch, seq, d] tensor Burn's `linear` runs a batched
        // matmul, `batch` small ones, and its weight gradient sums `batch` partial products
        // (docs/perf/cpu-throughput.md).
        let mut x = x.reshape([batch * seq, d]);
        let causal = causal_bias::<B>(seq, (&device, self.wte.weight.val().dtype()));
        for block in &self.h {
            x = block.forward(x, batch, &causal);
        }
        let x = self.ln_f.forward(x);
        let logits = match &self.lm_head {
            Some(head) => head.forward(x),
            None => x.matmul(self.wte.weight.val().transpose()),
        };
        let vocab = logits.dims()[1];
        logits.reshape([batch, seq, vocab])
    }

    /// Mean cross-entropy (nats per token) of predicting `targets` `[batch, seq]`, computed in
    /// f32 whatever the model's dtype, as mixed-precision training does.
    pub fn loss(&self, inputs: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let [batch, seq] = targets.dims();
        let logits = self.forward(inputs);
        let vocab = logits.dims()[2];
        let log_probs = log_softmax(
            logits.reshape([batch * seq, vocab]).cast(FloatDType::F32),
            1,
        );
        log_probs
            .gather(1, targets.reshape([batch * seq, 1]))
            .mean()
            .neg()
    }
}

/// `[1, seq·seq]`: for each (query `i`, key `j`) pair in row-major order, 0 where `j ≤ i` and
/// −∞ above the diagonal, in the model's dtype (`on`: device and dtype). Added to the attention
/// scores viewed as `[batch·heads, seq·seq]`, it is one row shared by every row, which Flex adds
/// with SIMD. A mask filled in instead would have to be expanded to the scores' shape and, not
/// being contiguous, copied in the forward and again in the backward pass; a `[1, 1, seq, seq]`
/// bias takes Flex's element-by-element path. Softmax gives the future exactly 0 either way.
fn causal_bias<B: Backend>(seq: usize, on: (&B::Device, DType)) -> Tensor<B, 2> {
    let future = Tensor::<B, 2, Bool>::tril_mask([seq, seq], 0, on.0);
    Tensor::<B, 2>::zeros([seq, seq], on)
        .mask_fill(future, f32::NEG_INFINITY)
        .reshape([1, seq * seq])
}

impl<B: Backend> Block<B> {
    /// `x`: `[batch·seq, d]`, the rows of `batch` sequences.
    fn forward(&self, x: Tensor<B, 2>, batch: usize, causal: &Tensor<B, 2>) -> Tensor<B, 2> {
        let x = x.clone() + self.attn.forward(self.ln_1.forward(x), batch, causal);
        x.clone() + self.mlp.forward(self.ln_2.forward(x))
    }
}

impl<B: Backend> CausalSelfAttention<B> {
    /// `x`: `[batch·seq, d]`; `causal`: [`causal_bias`] of `seq`.
    fn forward(&self, x: Tensor<B, 2>, batch: usize, causal: &Tensor<B, 2>) -> Tensor<B, 2> {
        let [rows, d] = x.dims();
        let seq = rows / batch;
        let (heads, head_dim) = (self.n_head, d / self.n_head);
        let qkv = self.c_attn.forward(x);
        let split = |i: usize| {
            qkv.clone()
                .slice([0..rows, i * d..(i + 1) * d])
                .reshape([batch, seq, heads, head_dim])
                .swap_dims(1, 2)
        };
        let (q, k, v) = (split(0), split(1), split(2));
        let scores = q
            .matmul(k.transpose())
            .mul_scalar(1.0 / (head_dim as f64).sqrt())
            .reshape([batch * heads, seq * seq]);
        let scores = (scores + causal.clone()).reshape([batch, heads, seq, seq]);
        let weights = softmax(scores, 3);
        let y = self
            .attn_dropout
            .forward(weights)
            .matmul(v)
            .swap_dims(1, 2)
            .reshape([rows, d]);
        self.resid_dropout.forward(self.c_proj.forward(y))
    }
}

impl<B: Backend> Mlp<B> {
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let x = self.gelu.forward(self.c_fc.forward(x));
        self.dropout.forward(self.c_proj.forward(x))
    }
}

#[cfg(test)]
mod tests {
    use burn_flex::{Flex, FlexDevice};

    use super::*;

    type B = Flex;

    fn count<M: Module<B>>(model: &M) -> usize {
        model.num_params()
    }

    #[test]
    fn parameter_count_matches_gpt2_and_the_formula() {
        // GPT-2 small with its 50257-token vocabulary: 124,439,808 parameters (tied head), as
        // Hugging Face's `gpt2` checkpoint counts them.
        assert_eq!(GptConfig::gpt2_124m(50257).num_params(), 124_439_808);
        // GPT-2 medium: 354,823,168.
        assert_eq!(GptConfig::gpt2_350m(50257).num_params(), 354_823_168);
        let config = GptConfig {
            n_layer: 3,
            ..GptConfig::tiny(32)
        };
        let model = config.init::<B>(1, &FlexDevice);
        assert_eq!(count(&model), config.num_params());
        let untied = config.with_tie_weights(false);
        assert_eq!(
            count(&untied.init::<B>(1, &FlexDevice)),
            untied.num_params()
        );
    }

    #[test]
    fn a_position_does_not_see_later_tokens() {
        let model = GptConfig::new(16, 8, 2, 2, 16).init::<B>(3, &FlexDevice);
        let a = Tensor::<B, 2, Int>::from_data([[1, 2, 3, 4, 5]], &FlexDevice);
        let b = Tensor::<B, 2, Int>::from_data([[1, 2, 3, 9, 9]], &FlexDevice);
        let (la, lb) = (model.forward(a), model.forward(b));
        let prefix = |l: Tensor<B, 3>| l.slice([0..1, 0..3, 0..16]).into_data();
        assert_eq!(prefix(la.clone()), prefix(lb.clone()), "positions 0..3");
        assert_ne!(
            la.into_data(),
            lb.into_data(),
            "later positions do see them"
        );
    }

    #[test]
    fn initial_loss_is_near_uniform() {
        // Small initial weights: the first predictions are close to uniform, loss ≈ ln(vocab).
        let model = GptConfig::tiny(64).init::<B>(5, &FlexDevice);
        let tokens: Vec<i64> = (0..2 * 33).map(|i| (i * 7 % 64) as i64).collect();
        let data = Tensor::<B, 2, Int>::from_data(TensorData::new(tokens, [2, 33]), &FlexDevice);
        let loss = model
            .loss(data.clone().slice([0..2, 0..32]), data.slice([0..2, 1..33]))
            .into_scalar();
        assert!((loss - 64f32.ln()).abs() < 0.1, "loss {loss}");
    }
}
