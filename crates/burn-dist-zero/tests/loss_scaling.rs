//! ZeroAdam with a GradScaler: exact when nothing overflows, and a non-finite gradient on one
//! rank, or a finite one whose square overflows f32 (created after the average, so that only
//! the ranks' found-inf agreement can spread it), skips the step on every rank without
//! advancing Adam.

use burn::backend::Autodiff;
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;
use burn_dist::{Ddp, DdpConfig, DistributedBackend, GradScalerConfig};
use burn_dist_comm::testing::run_ranks;
use burn_dist_comm::{CommConfig, HostCommunicator};
use burn_dist_testing::{
    MLP_SIZES, Mlp, overflow_on_this_rank, parameters, shard_rows, synthetic_rows,
};
use burn_dist_zero::{ZeroAdam, ZeroAdamConfig};
use burn_flex::{Flex, FlexDevice};
use burn_wgpu::{Wgpu, WgpuDevice};

/// The host path.
type B = Autodiff<DistributedBackend<Flex>>;
/// The device path's CPU twin: Burn's `Wgpu` (fusion on) on lavapipe.
type OnWgpu = Autodiff<DistributedBackend<Wgpu>>;

const GLOBAL_BATCH: usize = 12;

fn loss<A: AutodiffBackend>(
    model: &Mlp<A>,
    step: usize,
    rows: std::ops::Range<usize>,
    device: &A::Device,
) -> Tensor<A, 1> {
    let [input, .., output] = MLP_SIZES;
    let x = synthetic_rows::<A, 2>(0, step, [GLOBAL_BATCH, input], rows.clone(), device);
    let y = synthetic_rows::<A, 2>(1, step, [GLOBAL_BATCH, output], rows, device);
    (model.forward(x) - y).powi_scalar(2).mean()
}

/// Trains 3 ranks for `steps` with ZeRO `stage`, on the host (Flex) or (`on_device`) with the
/// optimizer state, the gradients and the parameters in wgpu device memory. With `scaled`,
/// through a GradScaler; where `poison(rank, step)` gives a value, it is added to that rank's
/// averaged gradient (its shard at stage 2) at that step, on that rank only. Returns (parameters, scale, skipped) per
/// rank.
fn train(
    stage: u8,
    on_device: bool,
    steps: &[usize],
    scaled: bool,
    poison: &(dyn Fn(usize, usize) -> Option<f32> + Sync),
) -> Vec<(Vec<Vec<f32>>, f32, u64)> {
    if on_device {
        burn_dist_kernels::testing::wgpu_client();
        let device = WgpuDevice::default();
        let make = |comm| Ddp::for_thread_staged::<Wgpu>(comm, DdpConfig::new(), &device);
        let place = |zero: ZeroAdam, ddp: &Ddp| zero.on_device::<Wgpu>(ddp, &device).unwrap();
        train_on::<OnWgpu>(&device, &make, &place, stage, steps, scaled, poison)
    } else {
        let make = |comm| Ddp::for_thread(comm, DdpConfig::new());
        let place = |zero: ZeroAdam, _: &Ddp| zero;
        train_on::<B>(&FlexDevice, &make, &place, stage, steps, scaled, poison)
    }
}

#[allow(clippy::too_many_arguments)]
fn train_on<A: AutodiffBackend>(
    device: &A::Device,
    make_ddp: &(dyn Fn(HostCommunicator) -> Ddp + Sync),
    place: &(dyn Fn(ZeroAdam, &Ddp) -> ZeroAdam + Sync),
    stage: u8,
    steps: &[usize],
    scaled: bool,
    poison: &(dyn Fn(usize, usize) -> Option<f32> + Sync),
) -> Vec<(Vec<Vec<f32>>, f32, u64)> {
    run_ranks(
        HostCommunicator::local_group(3, &CommConfig::default()),
        |rank, comm| {
            let mut ddp = make_ddp(comm);
            let mut model = ddp.prepare(Mlp::<A>::new(&MLP_SIZES, 7, device)).unwrap();
            let zero = ZeroAdamConfig::new()
                .with_stage(stage)
                .init::<A, _>(&ddp, &model)
                .unwrap();
            let mut zero = place(zero, &ddp);
            let mut scaler = GradScalerConfig::new().with_growth_interval(2).init();
            for &step in steps {
                let mut l = loss(&model, step, shard_rows(GLOBAL_BATCH, rank, 3), device);
                if scaled {
                    l = scaler.scale_loss(l);
                }
                let mut grads = ddp.backward(l, &model).unwrap().unwrap();
                if let Some(value) = poison(rank, step) {
                    grads = overflow_on_this_rank(&ddp, grads, &model, value);
                }
                model = if scaled {
                    zero.step_scaled(1e-2, model, grads, &ddp, &mut scaler)
                        .unwrap()
                        .0
                } else {
                    zero.step(1e-2, model, grads, &ddp).unwrap().0
                };
            }
            (
                parameters::<A, _>(&model),
                scaler.scale(),
                zero.skipped_steps(),
            )
        },
    )
}

#[test]
fn power_of_two_loss_scale_changes_nothing() {
    let plain = train(1, false, &[0, 1, 2, 3, 4], false, &|_, _| None);
    let scaled = train(1, false, &[0, 1, 2, 3, 4], true, &|_, _| None);
    assert_eq!(
        scaled[0].0, plain[0].0,
        "scaling by 2^k and unscaling is exact"
    );
    assert_eq!(
        scaled[0].1,
        65536.0 * 4.0,
        "grew twice (interval 2, 5 clean steps)"
    );
    for (rank, (_, _, skipped)) in scaled.iter().enumerate() {
        assert_eq!(*skipped, 0, "rank {rank} counted a skip in a clean run");
    }
}

#[test]
fn inf_on_one_rank_skips_the_step_on_every_rank_without_advancing_adam() {
    // Step 0 too: a skip before any update (on the device there is no parameter copy yet).
    let cases = [
        (1, false, 2),
        (2, false, 2),
        (1, true, 2),
        (2, true, 2),
        (1, true, 0),
        (2, true, 0),
    ];
    assert_one_rank_overflow_skips_the_step_everywhere(f32::INFINITY, &cases);
}

/// A finite gradient whose square overflows f32 (1e30 in the scaled gradient, about 1e25
/// unscaled) counts as an overflow on the host path as it does on the device, where the
/// kernels sum the squares in f32; taken, the step would put inf into Adam's `v = g²`.
#[test]
fn a_finite_gradient_whose_square_overflows_f32_skips_the_step_on_host_and_device() {
    let cases = [(1, false, 2), (2, false, 2), (1, true, 2), (2, true, 2)];
    assert_one_rank_overflow_skips_the_step_everywhere(1e30, &cases);
}

/// For each `(stage, on_device, step)`: `value` added to rank 1's gradient at that step makes
/// every rank skip exactly that step, back off the scale once, and end where a run without
/// the step ends.
fn assert_one_rank_overflow_skips_the_step_everywhere(value: f32, cases: &[(u8, bool, usize)]) {
    for &(stage, on_device, bad) in cases {
        let what = format!("stage {stage} (device: {on_device}), {value:e} added at step {bad}");
        let poisoned = train(stage, on_device, &[0, 1, 2, 3, 4], true, &|rank, step| {
            (rank == 1 && step == bad).then_some(value)
        });
        // The same run without that step at all: Adam's step count and moments must match.
        let steps: Vec<usize> = (0..5).filter(|&s| s != bad).collect();
        let without = train(stage, on_device, &steps, true, &|_, _| None);
        for (rank, (params, scale, skipped)) in poisoned.iter().enumerate() {
            assert_eq!(
                *skipped, 1,
                "{what}: rank {rank} must skip exactly one step"
            );
            assert_eq!(params, &poisoned[0].0, "{what}: rank {rank} diverged");
            // Backed off once, grown twice (after two clean steps each): everywhere.
            assert_eq!(*scale, 131072.0, "{what}: rank {rank}'s scale");
        }
        assert_eq!(
            poisoned[0].0, without[0].0,
            "{what}: a skipped step leaves parameters and Adam state as if it never happened"
        );
    }
}
