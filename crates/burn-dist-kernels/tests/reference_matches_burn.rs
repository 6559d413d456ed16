//! The CPU reference computes what Burn 0.21's own optimizers compute: `AdamW`, and `Adam` with
//! L2 `WeightDecayConfig`, run through `SimpleOptimizer::step` on plain Flex tensors (no
//! autodiff, so this builds even where burn-dist turns Burn's `distributed` feature on).

use burn::optim::decay::WeightDecayConfig;
use burn::optim::{AdamConfig, AdamWConfig, SimpleOptimizer};
use burn::tensor::{Tensor, TensorData};
use burn_dist_kernels::testing::Rng;
use burn_dist_kernels::{ModelCopy, StepScalars, adam_update, clip_factor, unscale_and_check};
use burn_flex::{Flex, FlexDevice};

const N: usize = 517;
const STEPS: u32 = 6;

fn tensor(x: &[f32]) -> Tensor<Flex, 1> {
    Tensor::from_data(TensorData::new(x.to_vec(), [x.len()]), &FlexDevice)
}

fn values(t: &Tensor<Flex, 1>) -> Vec<f32> {
    t.to_data().to_vec::<f32>().unwrap()
}

/// Runs `STEPS` steps of Burn's optimizer and of the reference on the same random parameters and
/// gradients; returns the largest relative difference of the parameters over the steps (0 when
/// bitwise equal), and checks the moments of the reference against Burn's state.
fn max_difference<O: SimpleOptimizer<Flex>>(
    optim: &O,
    scalars: impl Fn(u32) -> StepScalars,
    moments: impl Fn(&O::State<1>) -> (Vec<f32>, Vec<f32>),
) -> f32 {
    let seed = Rng::fresh_seed();
    println!("seed {seed} (replay with BURN_DIST_SEED={seed})");
    let mut rng = Rng::new(seed);
    let mut master = rng.nonzero_vec(N, 1e-3, 2.0);
    let (mut m, mut v) = (vec![0.0f32; N], vec![0.0f32; N]);
    let mut param = tensor(&master);
    let mut state = None;
    let mut worst = 0.0f32;
    for step in 1..=STEPS {
        let grads = rng.nonzero_vec(N, 1e-4, 3.0);
        let s = scalars(step);
        let (next, next_state) = optim.step(s.lr as f64, param, tensor(&grads), state);
        (param, state) = (next, next_state);

        let mut copy = vec![0.0f32; N];
        adam_update(
            &mut master,
            &mut m,
            &mut v,
            &grads,
            1.0,
            false,
            &s,
            ModelCopy::F32(&mut copy),
        );
        assert_eq!(copy, master, "the f32 model copy is the master");

        let burn = values(&param);
        for (a, b) in master.iter().zip(&burn) {
            worst = worst.max((a - b).abs() / b.abs().max(1e-30));
        }
        let (bm, bv) = moments(state.as_ref().unwrap());
        assert_eq!(
            (&m, &v),
            (&bm, &bv),
            "moments differ from Burn's at step {step} (seed {seed})"
        );
    }
    worst
}

#[test]
fn reference_adamw_equals_burn_adamw_bitwise() {
    for weight_decay in [0.0f32, 0.05] {
        let optim = AdamWConfig::new()
            .with_beta_1(0.85)
            .with_beta_2(0.995)
            .with_epsilon(1e-6)
            .with_weight_decay(weight_decay)
            .build();
        let worst = max_difference(
            &optim,
            |step| StepScalars {
                lr: 3e-3,
                beta1: 0.85,
                beta2: 0.995,
                eps: 1e-6,
                weight_decay,
                decoupled: true,
                step,
            },
            |s| (values(&s.momentum.moment_1), values(&s.momentum.moment_2)),
        );
        assert_eq!(
            worst, 0.0,
            "AdamW weight_decay={weight_decay}: max relative difference {worst}"
        );
    }
}

#[test]
fn reference_adam_l2_equals_burn_adam_with_weight_decay_bitwise() {
    for weight_decay in [None, Some(0.01f32)] {
        let optim = AdamConfig::new()
            .with_beta_1(0.9)
            .with_beta_2(0.98)
            .with_epsilon(1e-7)
            .with_weight_decay(weight_decay.map(WeightDecayConfig::new))
            .build();
        let worst = max_difference(
            &optim,
            |step| StepScalars {
                lr: 1e-2,
                beta1: 0.9,
                beta2: 0.98,
                eps: 1e-7,
                weight_decay: weight_decay.unwrap_or(0.0),
                decoupled: false,
                step,
            },
            |s| (values(&s.momentum.moment_1), values(&s.momentum.moment_2)),
        );
        assert_eq!(
            worst, 0.0,
            "Adam weight_decay={weight_decay:?}: max relative difference {worst}"
        );
    }
}

/// Unscaling then clipping by the global norm, as ZeroAdam composes them, equals Burn's AdamW
/// fed with the gradient unscaled and clipped by hand.
#[test]
fn unscale_then_clip_then_update_equals_burn_adamw_on_the_clipped_gradient() {
    let mut rng = Rng::new(Rng::fresh_seed());
    let scaled: Vec<f32> = rng.nonzero_vec(N, 1e-2, 1e3);
    let mut grads = scaled.clone();
    let (found_inf, sum_sq) = unscale_and_check(&mut grads, 1.0 / 1024.0);
    assert!(!found_inf);
    let clip = clip_factor(sum_sq, Some(0.5));
    assert!(clip < 1.0);
    let clipped: Vec<f32> = grads.iter().map(|g| g * clip).collect();

    let master0 = rng.nonzero_vec(N, 1e-3, 2.0);
    let optim = AdamWConfig::new().with_weight_decay(0.1).build();
    let (burn, _) = optim.step(1e-3f32 as f64, tensor(&master0), tensor(&clipped), None);

    let mut master = master0.clone();
    let (mut m, mut v) = (vec![0.0f32; N], vec![0.0f32; N]);
    let s = StepScalars {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-5,
        weight_decay: 0.1,
        decoupled: true,
        step: 1,
    };
    adam_update(
        &mut master,
        &mut m,
        &mut v,
        &grads,
        clip,
        false,
        &s,
        ModelCopy::None,
    );
    assert_eq!(master, values(&burn));
}
