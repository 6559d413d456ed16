//! The CPU reference of the fused optimizer step: plain Rust over slices.
//!
//! It computes, element by element and in the same f32 operation order, what Burn 0.21's
//! `AdamW` (decoupled weight decay) and `Adam` + `WeightDecayConfig` (L2 weight decay) compute
//! on a tensor (`burn-optim-0.21.0/src/optim/{adamw.rs,adam.rs,decay.rs}`), so that
//! an optimizer built on it (ZeroAdam) matches Burn's to rounding. The unit tests in
//! `tests/reference_matches_burn.rs` check that against Burn's own `SimpleOptimizer::step` on
//! Flex tensors.
//!
//! The step is split in the two passes of the fused kernels:
//! 1. [`unscale_and_check`]: `g *= inv_scale`, inf/NaN detection and the sum of squares of the
//!    unscaled gradient (for global-norm clipping);
//! 2. [`adam_update`]: `g' = g * clip`, then the Adam(W) update of the fp32 master weights and
//!    moments, and the model-dtype copy; nothing changes when `found_inf`.
//!
//! [`adam_update_f64`] evaluates the same update in f64, as the oracle of the kernel tests.

use half::{bf16, f16};

/// The scalars of one optimizer step.
///
/// `lr` is f32 here; Burn passes its learning rate as f64 and rounds it to f32 when it scales a
/// tensor. The reference equals Burn exactly when Burn's f64 learning rate is an f32 value (the
/// decay factor `1 - lr * weight_decay` is computed in f64 as Burn does).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepScalars {
    /// Learning rate.
    pub lr: f32,
    /// Exponential decay of the first moment.
    pub beta1: f32,
    /// Exponential decay of the second moment.
    pub beta2: f32,
    /// Numerical-stability term of the denominator.
    pub eps: f32,
    /// Weight decay: decoupled (AdamW) or L2 (Adam), see [`StepScalars::decoupled`].
    pub weight_decay: f32,
    /// `true`: Burn's `AdamW` (decoupled weight decay). `false`: Burn's `Adam` with
    /// `WeightDecayConfig { penalty: weight_decay }` (L2: `g += weight_decay * param`).
    pub decoupled: bool,
    /// The step number `t`, 1-based: the value Burn's `AdaptiveMomentumState::time` has after
    /// this step's update.
    pub step: u32,
}

/// The per-step factors, computed once on the host exactly as Burn computes them (f32 `powi`),
/// and shared by [`adam_update`] and the device kernels.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepFactors {
    /// `1 - beta1`.
    pub one_minus_beta1: f32,
    /// `1 - beta2`.
    pub one_minus_beta2: f32,
    /// AdamW: `1 - beta1^t`, the divisor of `m`.
    pub bias_correction1: f32,
    /// AdamW: `1 - beta2^t`, the divisor of `v`.
    pub bias_correction2: f32,
    /// Adam: `sqrt(1 - beta2^t) / (1 - beta1^t)`, the factor of `m`.
    pub combined: f32,
    /// Adam: `eps * sqrt(1 - beta2^t)`; AdamW: `eps`.
    pub eps: f32,
    /// AdamW: `1 - lr * weight_decay` (computed in f64, rounded to f32), or 1 without decay.
    pub decay: f32,
}

impl StepScalars {
    /// The per-step factors of this step, as Burn computes them.
    pub fn factors(&self) -> StepFactors {
        let t = self.step as i32;
        let p1 = self.beta1.powi(t);
        let p2 = self.beta2.powi(t);
        let bias_correction2_sqrt = (1.0 - p2).sqrt();
        // Burn's AdamW: `decay_rate = lr * (weight_decay as f64)` with an f64 `lr`, then
        // `mul_scalar(1.0 - decay_rate)`, which Flex rounds to f32.
        let decay_rate = self.lr as f64 * self.weight_decay as f64;
        let decay = if decay_rate == 0.0 {
            1.0
        } else {
            (1.0 - decay_rate) as f32
        };
        StepFactors {
            one_minus_beta1: 1.0 - self.beta1,
            one_minus_beta2: 1.0 - self.beta2,
            bias_correction1: 1.0 - p1,
            bias_correction2: 1.0 - p2,
            combined: bias_correction2_sqrt / (1.0 - p1),
            eps: if self.decoupled {
                self.eps
            } else {
                self.eps * bias_correction2_sqrt
            },
            decay,
        }
    }
}

/// The model-dtype copy written by [`adam_update`]: the new master weights rounded to nearest
/// even.
pub enum ModelCopy<'a> {
    /// No copy (the caller copies the master weights itself).
    None,
    /// An f32 copy (a plain copy of the master weights).
    F32(&'a mut [f32]),
    /// An f16 copy.
    F16(&'a mut [f16]),
    /// A bf16 copy.
    Bf16(&'a mut [bf16]),
}

impl ModelCopy<'_> {
    pub(crate) fn len(&self) -> Option<usize> {
        match self {
            ModelCopy::None => None,
            ModelCopy::F32(x) => Some(x.len()),
            ModelCopy::F16(x) => Some(x.len()),
            ModelCopy::Bf16(x) => Some(x.len()),
        }
    }
}

/// True when `x` is infinite or NaN (all exponent bits set), tested on the bits so that no
/// compiler flag can fold it away.
#[inline]
pub fn is_non_finite(x: f32) -> bool {
    x.to_bits() & 0x7f80_0000 == 0x7f80_0000
}

/// Pass 1: `g *= inv_scale` in place; returns (found_inf, sum of squares of the unscaled g in
/// f64). `found_inf` is true when an unscaled gradient is infinite or NaN; the sum is then not
/// meaningful.
pub fn unscale_and_check(grads: &mut [f32], inv_scale: f32) -> (bool, f64) {
    let mut found_inf = false;
    let mut sum_sq = 0.0f64;
    for g in grads.iter_mut() {
        *g *= inv_scale;
        found_inf |= is_non_finite(*g);
        sum_sq += (*g as f64) * (*g as f64);
    }
    (found_inf, sum_sq)
}

/// The clip factor of global-norm clipping: `min(1, max_norm / (sqrt(total_sum_sq) + 1e-6))`,
/// as PyTorch's `clip_grad_norm_` computes it (its `clip_coef_clamped`). `None`: no clipping (1).
/// A non-finite sum gives what PyTorch gives: 0 for an infinite norm, NaN for a NaN one (its
/// clamp keeps a NaN, where `f64::min` would drop it).
pub fn clip_factor(total_sum_sq: f64, max_norm: Option<f32>) -> f32 {
    match max_norm {
        None => 1.0,
        Some(max_norm) => {
            let coef = max_norm as f64 / (total_sum_sq.sqrt() + 1e-6);
            if coef > 1.0 { 1.0 } else { coef as f32 }
        }
    }
}

/// Pass 2: if `found_inf` nothing changes; else `g' = g * clip`, then the Adam(W) update of
/// `master`/`m`/`v` in f32, and `model` (f32/f16/bf16) = the new master rounded to nearest even.
///
/// First step: Burn initializes the moments on its first step as `m = (1 - b1) g`,
/// `v = (1 - b2) g²`. That is exactly this update from `m = v = 0` (`0 * b + x = x`), so the
/// caller starts from zeroed moments with `step = 1`.
///
/// # Panics
/// When the slices do not have the same length.
#[allow(clippy::too_many_arguments)]
pub fn adam_update(
    master: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    grads: &[f32],
    clip: f32,
    found_inf: bool,
    s: &StepScalars,
    mut model: ModelCopy<'_>,
) {
    let n = master.len();
    assert!(
        m.len() == n && v.len() == n && grads.len() == n && model.len().is_none_or(|l| l == n),
        "adam_update: slices of different lengths (master {n}, m {}, v {}, grads {}, model {:?})",
        m.len(),
        v.len(),
        grads.len(),
        model.len()
    );
    if found_inf {
        return;
    }
    let f = s.factors();
    for i in 0..n {
        let p = adam_element(master[i], &mut m[i], &mut v[i], grads[i], clip, s, &f);
        master[i] = p;
        match &mut model {
            ModelCopy::None => {}
            ModelCopy::F32(x) => x[i] = p,
            ModelCopy::F16(x) => x[i] = f16::from_f32(p),
            ModelCopy::Bf16(x) => x[i] = bf16::from_f32(p),
        }
    }
}

/// One element of the update, in Burn's operation order. Returns the new parameter. Also the
/// element function of the fast path (`host`): always inlined, so that its loops vectorize.
#[inline(always)]
pub(crate) fn adam_element(
    p: f32,
    m: &mut f32,
    v: &mut f32,
    g: f32,
    clip: f32,
    s: &StepScalars,
    f: &StepFactors,
) -> f32 {
    let mut g = g * clip;
    if !s.decoupled && s.weight_decay != 0.0 {
        // decay.rs: `tensor.mul_scalar(penalty).add(grad)`.
        g += p * s.weight_decay; // IEEE addition commutes: equal to `p * wd + g`.
    }
    // adam.rs / adamw.rs: `moment.mul_scalar(beta).add(grad.mul_scalar(1 - beta))`.
    *m = *m * s.beta1 + g * f.one_minus_beta1;
    *v = *v * s.beta2 + (g * g) * f.one_minus_beta2;
    if s.decoupled {
        // adamw.rs: `m / (1 - b1^t)` over `sqrt(v / (1 - b2^t)) + eps`, then
        // `param * (1 - lr * wd) - delta * lr`.
        let delta = (*m / f.bias_correction1) / ((*v / f.bias_correction2).sqrt() + f.eps);
        p * f.decay - delta * s.lr
    } else {
        // adam.rs: `m * combined` over `sqrt(v) + eps * sqrt(1 - b2^t)`, then `param - delta * lr`.
        let delta = (*m * f.combined) / (v.sqrt() + f.eps);
        p - delta * s.lr
    }
}

/// The same update as [`adam_update`], evaluated in f64 from the same f32 inputs and scalars
/// (bias corrections with f64 `powi`, the clip factor and `1 - lr * wd` in f64). The oracle of
/// the kernel tests: an f32 result is compared with it by relative norm.
#[allow(clippy::too_many_arguments)]
pub fn adam_update_f64(
    master: &mut [f64],
    m: &mut [f64],
    v: &mut [f64],
    grads: &[f64],
    clip: f64,
    found_inf: bool,
    s: &StepScalars,
) {
    let n = master.len();
    assert!(m.len() == n && v.len() == n && grads.len() == n);
    if found_inf {
        return;
    }
    let (lr, b1, b2, eps, wd) = (
        s.lr as f64,
        s.beta1 as f64,
        s.beta2 as f64,
        s.eps as f64,
        s.weight_decay as f64,
    );
    let t = s.step as i32;
    let bc1 = 1.0 - b1.powi(t);
    let bc2 = 1.0 - b2.powi(t);
    for i in 0..n {
        let p = master[i];
        let mut g = grads[i] * clip;
        if !s.decoupled {
            g += wd * p;
        }
        m[i] = b1 * m[i] + (1.0 - b1) * g;
        v[i] = b2 * v[i] + (1.0 - b2) * g * g;
        master[i] = if s.decoupled {
            p * (1.0 - lr * wd) - lr * (m[i] / bc1) / ((v[i] / bc2).sqrt() + eps)
        } else {
            p - lr * (m[i] * bc2.sqrt() / bc1) / (v[i].sqrt() + eps * bc2.sqrt())
        };
    }
}

/// `‖a − b‖ / ‖b‖` over f32 results against their f64 evaluation (0 when both are zero).
pub fn relative_error(actual: &[f32], expected: &[f64]) -> f64 {
    assert_eq!(actual.len(), expected.len());
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (&a, &e) in actual.iter().zip(expected) {
        diff += (a as f64 - e) * (a as f64 - e);
        norm += e * e;
    }
    if norm == 0.0 {
        diff.sqrt()
    } else {
        (diff / norm).sqrt()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scalars(decoupled: bool, step: u32) -> StepScalars {
        StepScalars {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            decoupled,
            step,
        }
    }

    #[test]
    fn unscale_detects_inf_and_nan_and_sums_squares() {
        let mut g = vec![2.0f32, -4.0, 6.0];
        assert_eq!(unscale_and_check(&mut g, 0.5), (false, 1.0 + 4.0 + 9.0));
        assert_eq!(g, [1.0, -2.0, 3.0]);
        let mut g = vec![1.0f32, f32::NAN];
        assert!(unscale_and_check(&mut g, 1.0).0);
        let mut g = vec![f32::MAX, 1.0];
        assert!(
            unscale_and_check(&mut g, 4.0).0,
            "overflow on unscale is inf"
        );
        let mut g = vec![f32::NEG_INFINITY];
        assert!(unscale_and_check(&mut g, 1.0).0);
    }

    #[test]
    fn clip_factor_is_pytorch_clip_coef_clamped() {
        assert_eq!(clip_factor(100.0, None), 1.0);
        assert_eq!(clip_factor(100.0, Some(20.0)), 1.0);
        assert_eq!(clip_factor(100.0, Some(5.0)), (5.0 / (10.0 + 1e-6)) as f32);
        // Non-finite norms, as PyTorch with error_if_nonfinite=false: 0 and NaN.
        assert_eq!(clip_factor(f64::INFINITY, Some(5.0)), 0.0);
        assert!(clip_factor(f64::NAN, Some(5.0)).is_nan());
    }

    #[test]
    fn found_inf_changes_nothing() {
        let (mut p, mut m, mut v) = (vec![1.0f32; 4], vec![0.5f32; 4], vec![0.25f32; 4]);
        let mut copy = vec![f16::from_f32(7.0); 4];
        adam_update(
            &mut p,
            &mut m,
            &mut v,
            &[1.0; 4],
            1.0,
            true,
            &scalars(true, 3),
            ModelCopy::F16(&mut copy),
        );
        assert_eq!((p, m, v), (vec![1.0; 4], vec![0.5; 4], vec![0.25; 4]));
        assert_eq!(copy, vec![f16::from_f32(7.0); 4]);
    }

    /// A model copy longer than the shard would otherwise be written only in part, silently.
    #[test]
    #[should_panic(expected = "slices of different lengths")]
    fn a_model_copy_of_another_length_is_refused() {
        let (mut p, mut m, mut v) = (vec![1.0f32; 4], vec![0.0f32; 4], vec![0.0f32; 4]);
        let mut longer = vec![0.0f32; 5];
        adam_update(
            &mut p,
            &mut m,
            &mut v,
            &[1.0; 4],
            1.0,
            false,
            &scalars(true, 1),
            ModelCopy::F32(&mut longer),
        );
    }

    #[test]
    fn f32_update_is_within_1e_6_of_f64() {
        for decoupled in [true, false] {
            let n = 1000;
            let p: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
                .collect();
            let g: Vec<f32> = (0..n)
                .map(|i| ((i * 53 % 97) as f32 - 48.5) / 70.0)
                .collect();
            let (mut p32, mut m32, mut v32) = (p, vec![0.0f32; n], vec![0.0f32; n]);
            let to64 = |x: &[f32]| x.iter().map(|&x| x as f64).collect::<Vec<_>>();
            // Each step from the same f32 state: the bound is per step, as for the kernels.
            for step in 1..=5 {
                let s = scalars(decoupled, step);
                let (mut p64, mut m64, mut v64) = (to64(&p32), to64(&m32), to64(&v32));
                adam_update(
                    &mut p32,
                    &mut m32,
                    &mut v32,
                    &g,
                    0.75,
                    false,
                    &s,
                    ModelCopy::None,
                );
                adam_update_f64(&mut p64, &mut m64, &mut v64, &to64(&g), 0.75, false, &s);
                assert!(relative_error(&p32, &p64) < 1e-6, "decoupled={decoupled}");
                assert!(relative_error(&m32, &m64) < 1e-6);
                assert!(relative_error(&v32, &v64) < 1e-6);
            }
        }
    }
}
