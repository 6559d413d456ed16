//! Burn's AdamW under a [`DecayRule`]: Burn's `AdamW` has one weight decay for every
//! parameter, so the parameters that decay and those that do not each get their own AdamW,
//! with the decay and without it. AdamW's update of a parameter reads only that parameter, its
//! gradient and its own moments, so the pair computes exactly what one AdamW with a
//! per-parameter decay would (`tests/decay_rule.rs` holds it to ZeroAdam's rule). It keeps
//! Burn's replicated state: what ZeroAdam would shard.

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::{AdamW, AdamWConfig, GradientsParams, Optimizer, adaptor::OptimizerAdaptor};
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;
use burn_dist::ParamInfo;

use crate::{DecayRule, Result};

/// Two of Burn's AdamW: one for the parameters that decay, one (decay 0) for the rest.
pub struct RuledAdamW<M: AutodiffModule<B>, B: AutodiffBackend> {
    decayed: OptimizerAdaptor<AdamW, M, B>,
    plain: OptimizerAdaptor<AdamW, M, B>,
    /// The parameters that do not decay.
    exempt: Vec<ParamId>,
}

impl<M: AutodiffModule<B>, B: AutodiffBackend> RuledAdamW<M, B> {
    /// `config`'s AdamW for the parameters of `params` (`Ddp::params()`) that `rule` decays,
    /// and the same without weight decay for the others.
    pub fn new(config: &AdamWConfig, params: &[ParamInfo], rule: &DecayRule) -> Result<Self> {
        let decays = rule.resolve(params)?;
        Ok(RuledAdamW {
            decayed: config.init(),
            plain: config.clone().with_weight_decay(0.0).init(),
            exempt: params
                .iter()
                .zip(decays)
                .filter(|(_, decays)| !decays)
                .map(|(p, _)| p.id)
                .collect(),
        })
    }

    /// One step of every parameter that has a gradient in `grads`.
    pub fn step(&mut self, lr: f64, model: M, mut grads: GradientsParams) -> M {
        let mut split = SplitGrads::<B> {
            exempt: &self.exempt,
            all: &mut grads,
            plain: GradientsParams::new(),
            _b: Default::default(),
        };
        model.visit(&mut split);
        let plain = split.plain;
        let model = self.decayed.step(lr, model, grads);
        self.plain.step(lr, model, plain)
    }
}

/// Moves the gradients of the exempt parameters out of `all` into `plain`.
struct SplitGrads<'a, B: AutodiffBackend> {
    exempt: &'a [ParamId],
    all: &'a mut GradientsParams,
    plain: GradientsParams,
    _b: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for SplitGrads<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if self.exempt.contains(&param.id)
            && let Some(grad) = self.all.remove::<B::InnerBackend, D>(param.id)
        {
            self.plain.register(param.id, grad);
        }
    }
}
