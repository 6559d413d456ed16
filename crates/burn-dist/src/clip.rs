//! Global-norm gradient clipping for any Burn optimizer: the rule of PyTorch's
//! `clip_grad_norm_` (L2 norm, `error_if_nonfinite=false`), which ZeroAdam applies too.
//!
//! The norm is the L2 norm of *all* gradients as one vector, summed in f64 (burn-dist-kernels'
//! [`unscale_and_check`], ZeroAdam's own accumulation), and every gradient is multiplied by
//! `min(1, max_norm / (norm + 1e-6))` (burn-dist-kernels' [`clip_factor`]). A non-finite norm
//! is not an error: as in PyTorch, an infinite norm gives the factor 0 (finite gradients become
//! 0, infinite ones NaN) and a NaN norm the factor NaN (every gradient becomes NaN), so that the
//! step visibly fails instead of silently training on a clipped half.
//!
//! Burn's own `GradientClipping::Norm` clips each tensor to the norm separately, a different
//! (per-tensor) rule.
//!
//! After [`crate::Ddp::backward`] the gradients are the mean over ranks, the same on every rank,
//! so every rank computes the same norm and the same factor: no collective is needed. Under ZeRO
//! stage 2 the container is empty and ZeroAdam clips its shards itself.

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;
use burn_dist_kernels::{clip_factor, unscale_and_check};

/// Scales the gradients of `model`'s parameters in `grads` so that their global L2 norm is at
/// most `max_norm` (`None`: measure only, no change). Returns the gradients and their global
/// norm before clipping, for logging. Gradients of parameters that are not `model`'s are left
/// as they are and not counted.
///
/// ```no_run
/// # use burn::module::AutodiffModule;
/// # use burn::optim::{GradientsParams, Optimizer};
/// # use burn::tensor::backend::AutodiffBackend;
/// # fn step<B: AutodiffBackend, M: AutodiffModule<B>, O: Optimizer<M, B>>(
/// #     model: M, grads: GradientsParams, optim: &mut O) -> M {
/// let (grads, norm) = burn_dist::clip_grad_norm(&model, grads, Some(1.0));
/// println!("gradient norm {norm}");
/// optim.step(1e-3, model, grads)
/// # }
/// ```
pub fn clip_grad_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: GradientsParams,
    max_norm: Option<f32>,
) -> (GradientsParams, f64) {
    let mut norm = SumSquares::<B> {
        grads: &grads,
        sum_sq: 0.0,
        _b: Default::default(),
    };
    model.visit(&mut norm);
    let sum_sq = norm.sum_sq;
    let factor = clip_factor(sum_sq, max_norm);
    // A NaN factor is not >= 1: it scales, as in PyTorch.
    if factor >= 1.0 {
        return (grads, sum_sq.sqrt());
    }
    let mut scale = Scale::<B> {
        grads,
        factor,
        _b: Default::default(),
    };
    model.visit(&mut scale);
    (scale.grads, sum_sq.sqrt())
}

/// The sum of squares of every gradient of the model, in f64.
struct SumSquares<'a, B: AutodiffBackend> {
    grads: &'a GradientsParams,
    sum_sq: f64,
    _b: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for SumSquares<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(grad) = self.grads.get::<B::InnerBackend, D>(param.id) {
            let mut values = grad
                .into_data()
                .convert::<f32>()
                .into_vec::<f32>()
                .expect("f32 gradient values");
            // The same f64 accumulation ZeroAdam runs on its shards (inv_scale 1: no unscale).
            self.sum_sq += unscale_and_check(&mut values, 1.0).1;
        }
    }
}

/// Multiplies every gradient of the model by `factor`.
struct Scale<B: AutodiffBackend> {
    grads: GradientsParams,
    factor: f32,
    _b: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Scale<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            self.grads.register(param.id, grad.mul_scalar(self.factor));
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::Autodiff;
    use burn::module::Module;
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::backend::AutodiffBackend;
    use burn::tensor::{Tensor, TensorData};
    use burn_flex::{Flex, FlexDevice};

    use super::*;
    use crate::DistributedBackend;

    type B = Autodiff<DistributedBackend<Flex>>;
    type Inner = <B as AutodiffBackend>::InnerBackend;

    #[derive(Module, Debug)]
    struct Two<B: burn::tensor::backend::Backend> {
        a: Linear<B>,
        b: Linear<B>,
    }

    fn model() -> Two<B> {
        Two {
            a: LinearConfig::new(3, 4).init(&FlexDevice),
            b: LinearConfig::new(4, 2).init(&FlexDevice),
        }
    }

    /// A one-layer model (weight 2×1, bias 1) with the gradients `weight` and `bias` given.
    fn with_grads(weight: [f32; 2], bias: f32) -> (Linear<B>, GradientsParams) {
        let layer = LinearConfig::new(2, 1).init::<B>(&FlexDevice);
        let mut grads = GradientsParams::new();
        let w = TensorData::new(weight.to_vec(), [2, 1]);
        grads.register(
            layer.weight.id,
            Tensor::<Inner, 2>::from_data(w, &FlexDevice),
        );
        let b = TensorData::new(vec![bias], [1]);
        let bias_id = layer.bias.as_ref().expect("a bias").id;
        grads.register(bias_id, Tensor::<Inner, 1>::from_data(b, &FlexDevice));
        (layer, grads)
    }

    /// The gradients of `with_grads`'s layer: weight then bias.
    fn values(layer: &Linear<B>, grads: &GradientsParams) -> Vec<f32> {
        let w = grads
            .get::<Inner, 2>(layer.weight.id)
            .expect("weight gradient");
        let b = grads
            .get::<Inner, 1>(layer.bias.as_ref().unwrap().id)
            .expect("bias gradient");
        let mut all = w.into_data().into_vec::<f32>().unwrap();
        all.extend(b.into_data().into_vec::<f32>().unwrap());
        all
    }

    #[test]
    fn clipping_multiplies_every_gradient_by_max_norm_over_the_global_norm() {
        // Gradients (3, 0 | 4) in two tensors: the global norm is 5, while each tensor's own
        // norm is 3 or 4 (a per-tensor rule would clip them differently).
        let (layer, grads) = with_grads([3.0, 0.0], 4.0);
        let (clipped, norm) = clip_grad_norm(&layer, grads, Some(1.0));
        assert_eq!(norm, 5.0);
        let factor = (1.0f64 / (5.0 + 1e-6)) as f32;
        assert_eq!(
            values(&layer, &clipped),
            vec![3.0 * factor, 0.0, 4.0 * factor]
        );
    }

    #[test]
    fn gradients_within_max_norm_or_without_one_are_unchanged() {
        for max_norm in [Some(5.5), Some(1e9), None] {
            let (layer, grads) = with_grads([3.0, 0.0], 4.0);
            let (same, norm) = clip_grad_norm(&layer, grads, max_norm);
            assert_eq!(norm, 5.0, "{max_norm:?}");
            assert_eq!(values(&layer, &same), vec![3.0, 0.0, 4.0], "{max_norm:?}");
        }
    }

    #[test]
    fn an_infinite_norm_zeroes_finite_gradients_and_nans_infinite_ones() {
        // PyTorch: clip_coef = max_norm / (inf + 1e-6) = 0, and inf * 0 = NaN.
        let (layer, grads) = with_grads([f32::INFINITY, 2.0], -1.0);
        let (clipped, norm) = clip_grad_norm(&layer, grads, Some(1.0));
        assert_eq!(norm, f64::INFINITY);
        let got = values(&layer, &clipped);
        assert!(got[0].is_nan(), "{got:?}");
        assert_eq!(&got[1..], &[0.0, 0.0], "{got:?}");
    }

    #[test]
    fn a_nan_norm_makes_every_gradient_nan() {
        // PyTorch: clip_coef = NaN, and clamp(NaN, max=1) stays NaN.
        let (layer, grads) = with_grads([f32::NAN, 2.0], -1.0);
        let (clipped, norm) = clip_grad_norm(&layer, grads, Some(1.0));
        assert!(norm.is_nan());
        let got = values(&layer, &clipped);
        assert!(got.iter().all(|g| g.is_nan()), "{got:?}");
    }

    /// Every gradient of `Two` as one concatenated vector.
    fn flat(model: &Two<B>, grads: &GradientsParams) -> Vec<f64> {
        let mut all = Vec::new();
        for p in [&model.a.weight, &model.b.weight] {
            let g = grads.get::<Inner, 2>(p.id).unwrap();
            all.extend(g.into_data().convert::<f64>().into_vec::<f64>().unwrap());
        }
        for p in [&model.a.bias, &model.b.bias] {
            let g = grads.get::<Inner, 1>(p.as_ref().unwrap().id).unwrap();
            all.extend(g.into_data().convert::<f64>().into_vec::<f64>().unwrap());
        }
        all
    }

    fn grads_of(model: &Two<B>) -> GradientsParams {
        let x = Tensor::<B, 2>::from_data(
            TensorData::new(vec![0.5f32, -1.0, 2.0, 3.0, 1.5, -0.5], [2, 3]),
            &FlexDevice,
        );
        let loss = model.b.forward(model.a.forward(x)).powi_scalar(2).sum();
        GradientsParams::from_grads(loss.backward(), model)
    }

    #[test]
    fn backward_gradients_scale_to_max_norm_as_one_concatenated_vector() {
        let model = model();
        let reference = flat(&model, &grads_of(&model));
        let norm: f64 = reference.iter().map(|g| g * g).sum::<f64>().sqrt();
        assert!(norm > 0.5);
        let max = 0.5 * norm;
        let (grads, reported) = clip_grad_norm(&model, grads_of(&model), Some(max as f32));
        assert!((reported - norm).abs() < 1e-9 * norm);
        let clipped = flat(&model, &grads);
        let factor = (max as f32 as f64) / (norm + 1e-6);
        for (got, want) in clipped.iter().zip(&reference) {
            let want = want * factor;
            assert!(
                (got - want).abs() <= 1e-6 * want.abs().max(1e-3),
                "{got} vs {want}"
            );
        }
        let new_norm: f64 = clipped.iter().map(|g| g * g).sum::<f64>().sqrt();
        assert!(
            (new_norm - max).abs() < 1e-5 * max,
            "the clipped norm is max_norm"
        );
    }
}
