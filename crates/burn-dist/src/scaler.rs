//! Dynamic loss scaling for f16 training, with PyTorch's `GradScaler` semantics.
//!
//! The loss is multiplied by `scale` before backward, so small f16 gradients do not flush to
//! zero; the gradients are divided by it before the optimizer step. If any gradient on any rank
//! is inf or NaN, every rank skips the step (the flag is max-all-reduced) and the scale backs
//! off; after `growth_interval` clean steps it grows. The scale evolves identically on every
//! rank. bf16 has f32's exponent range and trains without a scaler.

use burn::config::Config;
use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Tensor};
use burn_dist_comm::{Communicator, HostBuffer, HostCommunicator, ReduceOp};

use crate::error::Result;

/// Settings of [`GradScaler`]; the defaults are PyTorch's.
#[derive(Config, Debug, PartialEq)]
pub struct GradScalerConfig {
    #[config(default = 65536.0)]
    pub init_scale: f32,
    #[config(default = 2.0)]
    pub growth_factor: f32,
    #[config(default = 0.5)]
    pub backoff_factor: f32,
    #[config(default = 2000)]
    pub growth_interval: u32,
}

impl GradScalerConfig {
    pub fn init(&self) -> GradScaler {
        GradScaler {
            config: self.clone(),
            scale: self.init_scale,
            growth_tracker: 0,
        }
    }
}

/// The loss scale and its history. Save it with checkpoints: `(scale, growth_tracker)`.
#[derive(Debug, Clone, PartialEq)]
pub struct GradScaler {
    config: GradScalerConfig,
    scale: f32,
    /// Clean steps since the scale last changed.
    growth_tracker: u32,
}

impl GradScaler {
    pub fn scale(&self) -> f32 {
        self.scale
    }

    pub fn growth_tracker(&self) -> u32 {
        self.growth_tracker
    }

    /// Restores a saved state.
    pub fn with_state(mut self, scale: f32, growth_tracker: u32) -> Self {
        self.scale = scale;
        self.growth_tracker = growth_tracker;
        self
    }

    /// `loss × scale`, to call `backward()` on.
    pub fn scale_loss<B: AutodiffBackend>(&self, loss: Tensor<B, 1>) -> Tensor<B, 1> {
        loss.mul_scalar(self.scale)
    }

    /// Divides every gradient by the scale and checks them. Returns the unscaled gradients, or
    /// `None` when some rank found inf/NaN (every rank gets the same answer). Then call
    /// [`update`](Self::update) with whether it was `None`.
    pub fn unscale<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        grads: GradientsParams,
        model: &M,
        comm: &HostCommunicator,
    ) -> Result<Option<GradientsParams>> {
        let mut visit = Unscale::<B> {
            grads,
            inv_scale: 1.0 / self.scale,
            found_inf: false,
            _b: Default::default(),
        };
        model.visit(&mut visit);
        let found_inf = agree_found_inf(comm, visit.found_inf)?;
        Ok((!found_inf).then_some(visit.grads))
    }

    /// Backs off after a non-finite step, grows after `growth_interval` clean ones.
    pub fn update(&mut self, found_inf: bool) {
        if found_inf {
            self.scale *= self.config.backoff_factor;
            self.growth_tracker = 0;
        } else {
            self.growth_tracker += 1;
            if self.growth_tracker == self.config.growth_interval {
                self.scale *= self.config.growth_factor;
                self.growth_tracker = 0;
            }
        }
    }
}

/// Whether any rank found inf/NaN: one byte, max-all-reduced.
pub fn agree_found_inf(comm: &HostCommunicator, found_inf: bool) -> Result<bool> {
    let flag = comm
        .all_reduce(HostBuffer::U8(vec![u8::from(found_inf)]), ReduceOp::Max)
        .wait()?;
    Ok(flag.as_bytes()[0] != 0)
}

struct Unscale<B: AutodiffBackend> {
    grads: GradientsParams,
    inv_scale: f32,
    found_inf: bool,
    _b: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Unscale<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            let grad = grad.mul_scalar(self.inv_scale);
            let finite = grad.clone().is_finite().all().into_scalar().elem::<bool>();
            self.found_inf |= !finite;
            self.grads.register(param.id, grad);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_backs_off_on_inf_and_grows_after_the_interval() {
        let mut s = GradScalerConfig::new().with_growth_interval(3).init();
        assert_eq!(s.scale(), 65536.0);
        s.update(true);
        assert_eq!((s.scale(), s.growth_tracker()), (32768.0, 0));
        s.update(false);
        s.update(false);
        assert_eq!((s.scale(), s.growth_tracker()), (32768.0, 2));
        s.update(false);
        assert_eq!((s.scale(), s.growth_tracker()), (65536.0, 0));
        s.update(false);
        s.update(true);
        assert_eq!(
            (s.scale(), s.growth_tracker()),
            (32768.0, 0),
            "an inf resets the tracker"
        );
    }
}
