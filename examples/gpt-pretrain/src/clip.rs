//! Global-norm gradient clipping for Burn's optimizers, with ZeroAdam's semantics: the L2 norm
//! over *all* gradients as one vector, summed in f64, and the factor
//! `min(1, max_norm / (norm + 1e-6))` of PyTorch's `clip_grad_norm_` (burn-dist-kernels'
//! [`clip_factor`], which ZeroAdam uses too).
//!
//! Burn's own `GradientClipping::Norm` clips each tensor to the norm separately, which is a
//! different (per-tensor) rule, so it is not used.

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;
use burn_dist_kernels::{clip_factor, unscale_and_check};

/// Scales `grads` so that their global L2 norm is at most `max_norm` (no change when `None`).
/// Returns the gradients and their norm before clipping.
pub fn clip_global_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
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
    use burn::tensor::{Tensor, TensorData};
    use burn_dist::DistributedBackend;
    use burn_flex::{Flex, FlexDevice};

    use super::*;

    type B = Autodiff<DistributedBackend<Flex>>;

    #[derive(Module, Debug)]
    struct Two<B: burn::tensor::backend::Backend> {
        a: Linear<B>,
        b: Linear<B>,
    }

    fn grads_of(model: &Two<B>) -> GradientsParams {
        let x = Tensor::<B, 2>::from_data(
            TensorData::new(vec![0.5f32, -1.0, 2.0, 3.0, 1.5, -0.5], [2, 3]),
            &FlexDevice,
        );
        let loss = model.b.forward(model.a.forward(x)).powi_scalar(2).sum();
        GradientsParams::from_grads(loss.backward(), model)
    }

    /// Every gradient as one concatenated vector.
    fn flat(model: &Two<B>, grads: &GradientsParams) -> Vec<f64> {
        let mut all = Vec::new();
        for p in [&model.a.weight, &model.b.weight] {
            all.extend(
                grads
                    .get::<Flex2, 2>(p.id)
                    .unwrap()
                    .into_data()
                    .convert::<f64>()
                    .into_vec::<f64>()
                    .unwrap(),
            );
        }
        for p in [&model.a.bias, &model.b.bias] {
            let id = p.as_ref().unwrap().id;
            all.extend(
                grads
                    .get::<Flex2, 1>(id)
                    .unwrap()
                    .into_data()
                    .convert::<f64>()
                    .into_vec::<f64>()
                    .unwrap(),
            );
        }
        all
    }

    type Flex2 = <B as AutodiffBackend>::InnerBackend;

    #[test]
    fn clipping_scales_the_concatenated_gradient_to_the_global_norm() {
        let model = Two::<B> {
            a: LinearConfig::new(3, 4).init(&FlexDevice),
            b: LinearConfig::new(4, 2).init(&FlexDevice),
        };
        let reference = flat(&model, &grads_of(&model));
        let norm: f64 = reference.iter().map(|g| g * g).sum::<f64>().sqrt();
        assert!(norm > 0.5);

        // Above the norm: nothing changes, and the norm is reported.
        let (grads, reported) =
            clip_global_norm::<B, _>(&model, grads_of(&model), Some((2.0 * norm) as f32));
        assert!((reported - norm).abs() < 1e-9 * norm);
        assert_eq!(flat(&model, &grads), reference);

        // Below: every element of the concatenated vector scales by max / (norm + 1e-6).
        let max = 0.5 * norm;
        let (grads, _) = clip_global_norm::<B, _>(&model, grads_of(&model), Some(max as f32));
        let clipped = flat(&model, &grads);
        let factor = (max as f32 as f64) / (norm + 1e-6);
        for (got, want) in clipped.iter().zip(&reference) {
            assert!(
                (got - want * factor).abs() <= 1e-6 * want.abs().max(1e-3),
                "{got} vs {}",
                want * factor
            );
        }
        let new_norm: f64 = clipped.iter().map(|g| g * g).sum::<f64>().sqrt();
        assert!(
            (new_norm - max).abs() < 1e-5 * max,
            "the clipped norm is max_norm"
        );
    }
}
