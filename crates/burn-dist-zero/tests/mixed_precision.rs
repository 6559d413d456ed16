//! Mixed precision with ZeroAdam: f16 parameters with fp32 master weights and loss scaling,
//! and bf16 parameters without scaling, train to within 2 % of the f32 run's final loss.
//!
//! The loss is multiplied by [`SMALL`] before backward, so that the gradients are as small as
//! real ones often are: in f16 they then underflow to zero unless the loss scaler lifts them,
//! so an inert scaler (scale 1) leaves f16 untrained and fails the comparison. Adam's eps is
//! tiny so that f32's and bf16's updates do not feel the factor (Adam is otherwise scale
//! invariant).

use burn::backend::Autodiff;
use burn::module::Module;
use burn::tensor::FloatDType;
use burn_dist::{Ddp, DdpConfig, DistributedBackend, GradScalerConfig};
use burn_dist_comm::testing::run_ranks;
use burn_dist_comm::{CommConfig, HostCommunicator};
use burn_dist_testing::{Cast, MLP_SIZES, Mlp, shard_rows, synthetic_rows};
use burn_dist_zero::ZeroAdamConfig;
use burn_flex::{Flex, FlexDevice};

type B = Autodiff<DistributedBackend<Flex>>;

const GLOBAL_BATCH: usize = 12;
const STEPS: usize = 25;
/// 2⁻²⁰: the loss's gradient seed in f16 becomes subnormal, and every gradient below f16's
/// smallest subnormal (2⁻²⁴) flushes to zero without scaling.
const SMALL: f32 = 1.0 / (1 << 20) as f32;

/// First and final loss (in f32, averaged over 2 ranks) of memorizing one fixed batch with
/// parameters in `dtype`.
fn losses(dtype: FloatDType, scaled: bool) -> (f32, f32) {
    let losses: Vec<(f32, f32)> = run_ranks(
        HostCommunicator::local_group(2, &CommConfig::default()),
        |rank, comm| {
            let mut ddp = Ddp::for_thread(comm, DdpConfig::new());
            let model = Mlp::<B>::new(&MLP_SIZES, 7, &FlexDevice).map(&mut Cast(dtype));
            let mut model = ddp.prepare(model).unwrap();
            let mut zero = ZeroAdamConfig::new()
                .with_epsilon(1e-20)
                .init::<B, _>(&ddp, &model)
                .unwrap();
            let mut scaler = GradScalerConfig::new().init();
            let [input, .., output] = MLP_SIZES;
            let rows = shard_rows(GLOBAL_BATCH, rank, 2);
            let x = synthetic_rows::<B, 2>(0, 0, [GLOBAL_BATCH, input], rows.clone(), &FlexDevice)
                .cast(dtype);
            let y =
                synthetic_rows::<B, 2>(1, 0, [GLOBAL_BATCH, output], rows, &FlexDevice).cast(dtype);
            let mut seen = Vec::new();
            for _ in 0..STEPS {
                let loss = (model.forward(x.clone()) - y.clone()).powi_scalar(2).mean();
                seen.push(loss.clone().cast(FloatDType::F32).into_scalar());
                let loss = loss.mul_scalar(SMALL);
                let grads;
                (model, _) = if scaled {
                    grads = ddp
                        .backward(scaler.scale_loss(loss), &model)
                        .unwrap()
                        .unwrap();
                    zero.step_scaled(1e-3, model, grads, &ddp, &mut scaler)
                        .unwrap()
                } else {
                    grads = ddp.backward(loss, &model).unwrap().unwrap();
                    zero.step(1e-3, model, grads, &ddp).unwrap()
                };
            }
            (seen[0], seen[STEPS - 1])
        },
    );
    let mean = |pick: fn(&(f32, f32)) -> f32| losses.iter().map(pick).sum::<f32>() / 2.0;
    (mean(|l| l.0), mean(|l| l.1))
}

#[test]
fn f16_with_loss_scaling_and_bf16_without_train_like_f32() {
    let (first, f32_loss) = losses(FloatDType::F32, false);
    println!("f32: loss {first} -> {f32_loss}");
    assert!(
        f32_loss < 0.7 * first,
        "the task must be learnable for the comparison to mean anything"
    );
    for (dtype, scaled) in [(FloatDType::F16, true), (FloatDType::BF16, false)] {
        let (_, loss) = losses(dtype, scaled);
        let gap = (loss - f32_loss).abs() / f32_loss;
        println!(
            "{dtype:?}: final loss {loss} vs f32 {f32_loss} ({:.3} %)",
            100.0 * gap
        );
        assert!(
            gap <= 0.02,
            "{dtype:?}: final loss {loss} vs f32 {f32_loss} ({:.2} %)",
            100.0 * gap
        );
    }
}
