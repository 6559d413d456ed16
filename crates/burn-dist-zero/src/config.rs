//! `ZeroAdamConfig`: the settings of Burn's `AdamConfig`/`AdamWConfig`, plus sharding and
//! global-norm clipping.

use burn::config::Config;

use crate::{DecayRule, ZeroAdam};

/// Adam or AdamW with the optimizer state sharded across ranks ([`ZeroAdam`]).
///
/// Same update as Burn's `AdamW` (decoupled weight decay, Loshchilov & Hutter, "Decoupled
/// Weight Decay Regularization", 2019) or, with `decoupled_weight_decay = false`, Burn's `Adam`
/// with L2 weight decay (Kingma & Ba, "Adam: A Method for Stochastic Optimization", 2015), with
/// the same defaults, so results can be compared with Burn's optimizers directly.
#[derive(Config, Debug)]
pub struct ZeroAdamConfig {
    #[config(default = 0.9)]
    pub beta_1: f32,
    #[config(default = 0.999)]
    pub beta_2: f32,
    #[config(default = 1e-5)]
    pub epsilon: f32,
    /// Burn's `AdamWConfig` default.
    #[config(default = 1e-4)]
    pub weight_decay: f32,
    /// Which parameters weight decay applies to: all (Burn's optimizers), the tensors of two
    /// or more dimensions (`DecayRule::Matrices`, GPT-2's rule), or a mask.
    #[config(default = "DecayRule::All")]
    pub decay: DecayRule,
    /// AdamW (true) or Adam with L2 weight decay (false).
    #[config(default = true)]
    pub decoupled_weight_decay: bool,
    /// Clip the gradient to this global L2 norm (over all ranks' shards), as PyTorch's
    /// `clip_grad_norm_` does.
    #[config(default = "None")]
    pub max_grad_norm: Option<f32>,
    /// Shard lengths are a multiple of this many elements (the fused kernels' vector width).
    #[config(default = 4)]
    pub align: usize,
    /// ZeRO stage: 1 shards the optimizer state (gradients are all-reduced in full); 2 also
    /// shards the gradients (each bucket is reduced straight to the ranks that own its
    /// elements, and each rank keeps only its shard of the gradient); 3 also shards the
    /// parameters (the model must come from `Ddp::prepare_sharded`; the step writes this
    /// rank's shard of the new parameters into the model's pieces, with no all-gather).
    #[config(default = 1)]
    pub stage: u8,
    /// Threads of the host step (state on the host, not `ZeroAdam::on_device`): `Some(n)` gives
    /// this optimizer its own pool of n threads; `None` runs on rayon's global pool, which
    /// Burn's Flex backend shares: `RAYON_NUM_THREADS` threads, else one per core. With several
    /// ranks on one machine, give each rank its share of the cores. The result does not depend
    /// on the thread count (see `burn_dist_kernels::host`).
    #[config(default = "None")]
    pub host_threads: Option<usize>,
}

impl ZeroAdamConfig {
    /// The optimizer for `model`, whose trainable parameters `ddp` has prepared.
    pub fn init<B, M>(&self, ddp: &burn_dist::Ddp, model: &M) -> crate::Result<ZeroAdam>
    where
        B: burn::tensor::backend::AutodiffBackend,
        M: burn::module::AutodiffModule<B>,
    {
        ZeroAdam::new::<B, M>(self.clone(), ddp, model)
    }
}
