//! ZeroAdam offloaded (`ZeroAdam::offloaded`): the model and the reducer on the device (Burn's
//! `Wgpu`, fusion on, over Mesa's lavapipe, with the staged device collectives), the optimizer
//! state on the host, stepped by the host step. At ZeRO stages 1 to 3 (stage 3: the model's
//! pieces in device memory, `DistributedBackend<Wgpu, Sharded>`), 1 to 3 thread ranks:
//! - it equals ZeroAdam with its state in device memory (`on_device`) to 1e-5 (the fused
//!   kernels and the host step round differently in a few operations);
//! - it equals the host path on the same device bit for bit: the gradient is reduced in the
//!   same order (the staged collectives are the host collectives), the update is the host
//!   step, and the new parameters are rounded by the same conversion;
//! - f16 parameters under loss scaling skip the same steps as on the device;
//! - the bytes between host and device per step are exactly the formula's;
//! - a state exported with offload imports without it and back, and the run goes on; a
//!   sharded checkpoint written offloaded resumes at other world sizes, with and without;
//! - a record kept in memory and loaded back is trained on from its values.
//!
//! Device memory against the formula: tests/device_memory.rs.

use burn::backend::Autodiff;
use burn::tensor::FloatDType;
use burn_dist::{
    Ddp, DdpConfig, DistributedAutodiff, DistributedBackend, FlatLayout, GradScalerConfig,
    ReducerStats, ShardStats, Sharded,
};
use burn_dist_comm::{CommConfig, HostCommunicator};
use burn_dist_testing::placed::{Place, Placed, placed_ranks, train_placed};
use burn_dist_testing::roll_back::{
    AfterLoad, RolledBack, assert_trained_on_from_the_load, roll_back,
};
use burn_dist_testing::{
    MLP_SIZES, Mlp, Synthetic, assert_close, parameters, shard_rows, synthetic_rows, train_ranks,
    zero_mlp_step,
};
use burn_dist_zero::{ZeroAdam, ZeroAdamConfig, ZeroError};
use burn_wgpu::{Wgpu, WgpuDevice};

/// The device path's twin at stages 1 and 2.
type OnWgpu = Autodiff<DistributedBackend<Wgpu>>;
/// The device path's twin at stage 3: the model's pieces in device memory.
type ShardedOnWgpu = Autodiff<DistributedBackend<Wgpu, Sharded>>;

const STAGES: [u8; 3] = [1, 2, 3];
const STEPS: usize = 6;
const LR: f64 = 1e-2;
const GLOBAL_BATCH: usize = 12;
/// The fused kernels on lavapipe and the host step differ in the last bits of a few f32
/// operations (the bias corrections' powers, the square root's rounding).
const TOLERANCE: f64 = 1e-5;

/// `$f::<B>(args)` with `B` the backend of ZeRO stage `$stage` on wgpu: sharded at stage 3.
macro_rules! at_stage {
    ($stage:expr, $f:ident($($arg:expr),* $(,)?)) => {
        match $stage {
            3 => $f::<ShardedOnWgpu>($($arg),*),
            _ => $f::<OnWgpu>($($arg),*),
        }
    };
}

/// `world` ranks on wgpu with the reducer on the device path, ZeroAdam placed at `place`, on
/// backend `B` (`at_stage!`).
fn train_staged_on<B: DistributedAutodiff<Device = WgpuDevice>>(
    world: usize,
    ddp_config: &DdpConfig,
    config: ZeroAdamConfig,
    place: Place,
) -> Vec<(Vec<Vec<f32>>, ReducerStats)> {
    burn_dist_kernels::testing::wgpu_client();
    let placed = Placed::<Wgpu> {
        config,
        place,
        device: WgpuDevice::default(),
    };
    train_placed::<B, Wgpu>(world, ddp_config, &placed, STEPS, GLOBAL_BATCH, LR)
}

/// [`train_staged_on`] on the backend of `config`'s stage, one micro-batch per step.
fn train_staged(
    world: usize,
    config: ZeroAdamConfig,
    place: Place,
) -> Vec<(Vec<Vec<f32>>, ReducerStats)> {
    let ddp_config = DdpConfig::new();
    at_stage!(
        config.stage,
        train_staged_on(world, &ddp_config, config, place)
    )
}

/// The host path (`Ddp::for_thread`: each gradient read to the host, reduced by the host
/// collectives, the host step, the new parameters written from the host; at stage 3 the pieces
/// in host memory) on the same wgpu device, on backend `B`.
fn train_host_path<B: DistributedAutodiff<Device = WgpuDevice>>(
    world: usize,
    ddp_config: &DdpConfig,
    config: ZeroAdamConfig,
) -> Vec<Vec<Vec<f32>>> {
    burn_dist_kernels::testing::wgpu_client();
    train_ranks::<B>(
        world,
        ddp_config,
        Synthetic::Mlp,
        &config,
        STEPS,
        GLOBAL_BATCH,
        LR,
        &WgpuDevice::default(),
    )
}

/// One step of the test MLP on this rank's rows of batch `step`, in f32.
fn mlp_step<B: burn::tensor::backend::AutodiffBackend<Device = WgpuDevice>>(
    ddp: &mut Ddp,
    model: Mlp<B>,
    zero: &mut ZeroAdam,
    (rank, world, step): (usize, usize, usize),
) -> Mlp<B> {
    let at = (rank, world, step);
    let device = WgpuDevice::default();
    zero_mlp_step(
        ddp,
        model,
        zero,
        at,
        (GLOBAL_BATCH, LR),
        FloatDType::F32,
        &device,
    )
}

#[test]
fn offloaded_step_equals_the_device_step_at_stages_1_to_3() {
    for stage in STAGES {
        for world in [1, 2, 3] {
            let config = ZeroAdamConfig::new().with_stage(stage);
            let device = train_staged(world, config.clone(), Place::Device);
            let offloaded = train_staged(world, config, Place::Offloaded);
            let what = format!("stage {stage}, {world} ranks");
            for (rank, (params, stats)) in offloaded.iter().enumerate() {
                assert!(
                    params == &offloaded[0].0,
                    "{what}: rank {rank} differs from rank 0"
                );
                assert!(
                    stats.device_launches > 0,
                    "{what}: the reducer ran on the host"
                );
            }
            assert_close(
                &offloaded[0].0,
                &device[0].0,
                TOLERANCE,
                &format!("{what}: offloaded vs on the device"),
            );
        }
    }
}

/// The host path on the same wgpu device: the same arithmetic as the offloaded step, in the
/// same order, so the same bits. With clipping, which the host step does on both.
///
/// Also over accumulation windows of 3 micro-batches on 2 ranks: at stages 2 and 3 the shard
/// read during backward is the sum of the window's micro-batches, and its mean is taken on the
/// host (the device shard is not scaled too, `DeviceBuckets::end_shard_window`).
#[test]
fn offloaded_step_equals_the_host_path_bit_for_bit() {
    let runs = [1, 2, 3]
        .map(|world| (world, 1))
        .into_iter()
        .chain([(2, 3)]);
    for (world, accumulation) in runs {
        let ddp_config = DdpConfig::new().with_accumulation_steps(accumulation);
        for stage in STAGES {
            let config = ZeroAdamConfig::new()
                .with_stage(stage)
                .with_max_grad_norm(Some(0.05));
            let host = at_stage!(stage, train_host_path(world, &ddp_config, config.clone()));
            let offloaded = at_stage!(
                stage,
                train_staged_on(world, &ddp_config, config, Place::Offloaded)
            );
            for (rank, (host, (offloaded, _))) in host.iter().zip(&offloaded).enumerate() {
                assert!(
                    host == offloaded,
                    "stage {stage}, {world} ranks × {accumulation} micro-batches, rank {rank}: \
                     the offloaded step and the host path differ"
                );
            }
        }
    }
}

/// The model's element counts, per parameter.
fn mlp_numels() -> Vec<usize> {
    MLP_SIZES
        .windows(2)
        .flat_map(|w| [w[0] * w[1], w[1]])
        .collect()
}

/// Per step and rank, with Ψ the model's elements, S the rank's shard (its padded length) and
/// O the elements it owns (f32 everywhere): the reducer stages every gradient down (4Ψ) and at
/// stage 1 every reduced gradient back up (4Ψ), at stage 2 only this rank's owned elements
/// (4O); the gradient shard comes down once: at stage 1 the offloaded step reads it whole
/// (4S), at stage 2 the reducer reads each bucket's owned range during backward (4O: the
/// padding past the last parameter is not read); the new shard goes up once (4S); the
/// all-gather of the new parameters stages this rank's pieces down (4O) and the
/// others' up (4(Ψ − O)). No scalar crosses: the agreement is the host's.
#[test]
fn offloaded_step_moves_the_gradient_shard_down_and_the_new_shard_up_exactly() {
    let numels = mlp_numels();
    let total = numels.iter().sum::<usize>() as u64;
    for (stage, world) in [(1, 1), (1, 3), (2, 1), (2, 3)] {
        let flat = FlatLayout::new(&numels, world, 4);
        let s = flat.shard_len as u64;
        let ranks = train_staged(
            world,
            ZeroAdamConfig::new().with_stage(stage),
            Place::Offloaded,
        );
        for (rank, (_, stats)) in ranks.iter().enumerate() {
            let range = flat.shard(rank);
            let owned = (total as usize).min(range.end).saturating_sub(range.start) as u64;
            let (written_back, shard_read) = if stage == 1 {
                (total, s)
            } else {
                (owned, owned)
            };
            let per_step = (
                4 * total + 4 * shard_read + 4 * owned,
                4 * written_back + 4 * s + 4 * (total - owned),
            );
            assert_eq!(
                (stats.bytes_to_host, stats.bytes_to_device),
                (STEPS as u64 * per_step.0, STEPS as u64 * per_step.1),
                "stage {stage}, {world} ranks, rank {rank}: bytes between host and device"
            );
            assert_eq!(
                stats.device_calls,
                2 * STEPS as u64,
                "stage {stage}, {world} ranks, rank {rank}: one reduction and one gather per step"
            );
        }
    }
}

/// Stage 3, per rank, with Ψ, S and O as at stages 1 and 2 (S of the sharded model's layout):
/// once, the shard up when the model is prepared and down when ZeroAdam is built (4S each);
/// per step, every gradient down and this rank's reduced pieces up (4Ψ, 4O), the gradient
/// shard's owned ranges down during backward (4O) and the new shard up into the model's
/// pieces (4S), no all-gather of new
/// parameters (the next forward gathers), no scalar; and what the ops' gathers and the final
/// reads moved (`ShardStats`: the parameters' bytes per gather, and Ψ read at the end).
#[test]
fn offloaded_stage_three_moves_the_shards_and_what_the_gathers_need_exactly() {
    let numels = mlp_numels();
    let total = numels.iter().sum::<usize>() as u64;
    let device = WgpuDevice::default();
    burn_dist_kernels::testing::wgpu_client();
    for world in [1, 3] {
        let flat = FlatLayout::new(&numels, world, burn_dist::SHARD_ALIGN);
        let s = flat.shard_len as u64;
        let ranks: Vec<(ReducerStats, ShardStats)> = placed_ranks::<ShardedOnWgpu, Wgpu, _>(
            world,
            &DdpConfig::new(),
            (3, Place::Offloaded),
            FloatDType::F32,
            &device,
            &|rank, ddp, mut model, zero| {
                for step in 0..STEPS {
                    model = mlp_step(ddp, model, zero, (rank, world, step));
                }
                parameters::<ShardedOnWgpu, _>(&model);
                (ddp.stats(), ddp.shard_stats().expect("a sharded model"))
            },
        );
        for (rank, (reducer, shards)) in ranks.iter().enumerate() {
            let range = flat.shard(rank);
            let owned = (total as usize).min(range.end).saturating_sub(range.start) as u64;
            let gathered = shards.gathered_bytes + shards.unused_bytes + 4 * total;
            let expected = 2 * 4 * s + STEPS as u64 * (4 * total + 2 * 4 * owned + 4 * s);
            assert_eq!(
                reducer.bytes_to_host + reducer.bytes_to_device,
                expected + gathered,
                "{world} ranks, rank {rank}: bytes between host and device ({} down, {} up)",
                reducer.bytes_to_host,
                reducer.bytes_to_device,
            );
        }
    }
}

/// Stages 2 and 3 read the gradient shard to the host during backward, bucket by bucket: with
/// small buckets and one bucket in flight at most (a launch past it waits for the oldest, a
/// fixed point in backward), some reads are issued while gradients are still to come, every
/// step; and the run ends bit for bit where the same run ends with the shard read at once
/// after backward (`Ddp::stream_gradient_shard_to_host(false)`), which issues no such read.
#[test]
fn offloaded_stages_two_and_three_read_the_gradient_shard_during_backward() {
    const BUCKET_BYTES: usize = 1024;
    let buckets = burn_dist::BucketConfig::new()
        .with_first_bucket_bytes(BUCKET_BYTES)
        .with_bucket_bytes(BUCKET_BYTES)
        .with_max_in_flight_bytes(Some(BUCKET_BYTES));
    let config = DdpConfig::new().with_buckets(buckets);
    for stage in [2, 3] {
        let runs: Vec<Vec<(Vec<Vec<f32>>, ReducerStats)>> = [true, false]
            .into_iter()
            .map(|stream| at_stage!(stage, streamed_run(stage, stream, &config)))
            .collect();
        let (streamed, at_once) = (&runs[0], &runs[1]);
        for (rank, ((params, stats), (at_once, at_once_stats))) in
            streamed.iter().zip(at_once).enumerate()
        {
            let what = format!("stage {stage}, rank {rank}");
            assert!(
                stats.shard_reads >= 2 * STEPS as u64,
                "{what}: the shard read bucket by bucket ({} reads in {STEPS} steps)",
                stats.shard_reads
            );
            assert!(
                stats.shard_reads_in_backward >= STEPS as u64,
                "{what}: a read issued during backward every step ({} in {STEPS} steps)",
                stats.shard_reads_in_backward
            );
            assert_eq!(
                (
                    at_once_stats.shard_reads,
                    at_once_stats.shard_reads_in_backward
                ),
                (0, 0),
                "{what}: nothing streamed when turned off"
            );
            assert!(
                params == at_once,
                "{what}: streamed and read at once end differently"
            );
        }
    }
}

/// Two ranks at `stage`, ZeroAdam offloaded, the gradient shard streamed to the host during
/// backward or not; the parameters and reducer stats at the end, by rank.
fn streamed_run<B: DistributedAutodiff<Device = WgpuDevice>>(
    stage: u8,
    stream: bool,
    config: &DdpConfig,
) -> Vec<(Vec<Vec<f32>>, ReducerStats)> {
    const WORLD: usize = 2;
    let device = WgpuDevice::default();
    burn_dist_kernels::testing::wgpu_client();
    placed_ranks::<B, Wgpu, _>(
        WORLD,
        config,
        (stage, Place::Offloaded),
        FloatDType::F32,
        &device,
        &|rank, ddp, mut model, zero| {
            ddp.stream_gradient_shard_to_host(stream);
            for step in 0..STEPS {
                model = mlp_step(ddp, model, zero, (rank, WORLD, step));
            }
            (parameters::<B, _>(&model), ddp.stats())
        },
    )
}

/// f16 parameters under loss scaling from a scale too large for f16: the scaled loss and its
/// gradients overflow in the model's dtype until the scale has backed off, and again after it
/// has grown.
/// The offloaded step and the device step skip exactly the same steps on every rank, and end
/// with the same scale, and parameters equal to f16's rounding.
#[test]
fn f16_with_loss_scaling_skips_the_same_steps_offloaded_as_on_the_device() {
    for stage in STAGES {
        let device = at_stage!(stage, train_f16_scaled(stage, Place::Device));
        let offloaded = at_stage!(stage, train_f16_scaled(stage, Place::Offloaded));
        let what = format!("stage {stage}");
        let skips = &device[0].1;
        assert!(
            skips.iter().any(|&s| s) && skips.iter().any(|&s| !s),
            "{what}: the run must both skip and step for this test to tell ({skips:?})"
        );
        for (rank, (params, skipped, scale)) in offloaded.iter().enumerate() {
            assert_eq!(skipped, skips, "{what}, rank {rank}: skipped steps");
            assert_eq!(*scale, device[0].2, "{what}, rank {rank}: the final scale");
            assert!(
                params == &offloaded[0].0,
                "{what}: rank {rank} differs from rank 0"
            );
        }
        assert_close(
            &offloaded[0].0,
            &device[0].0,
            1e-3,
            &format!("{what}: f16, offloaded vs on the device"),
        );
    }
}

/// Two ranks, an f16 MLP on wgpu on backend `B`, 10 steps through a GradScaler starting at 2^18
/// (growth every 2 clean steps). Per rank: the parameters, which steps were skipped, the final
/// scale.
fn train_f16_scaled<B: DistributedAutodiff<Device = WgpuDevice>>(
    stage: u8,
    place: Place,
) -> Vec<(Vec<Vec<f32>>, Vec<bool>, f32)> {
    burn_dist_kernels::testing::wgpu_client();
    let (world, f16) = (2, FloatDType::F16);
    let device = WgpuDevice::default();
    placed_ranks::<B, Wgpu, _>(
        world,
        &DdpConfig::new(),
        (stage, place),
        f16,
        &device,
        &|rank, ddp, mut model, zero| {
            let mut scaler = GradScalerConfig::new()
                .with_init_scale(262_144.0)
                .with_growth_interval(2)
                .init();
            let mut skipped = Vec::new();
            for step in 0..10 {
                let [input, .., output] = MLP_SIZES;
                let rows = shard_rows(GLOBAL_BATCH, rank, world);
                let x =
                    synthetic_rows::<B, 2>(0, step, [GLOBAL_BATCH, input], rows.clone(), &device);
                let y = synthetic_rows::<B, 2>(1, step, [GLOBAL_BATCH, output], rows, &device);
                let loss = (model.forward(x.cast(f16)) - y.cast(f16))
                    .powi_scalar(2)
                    .mean();
                let grads = ddp
                    .backward(scaler.scale_loss(loss), &model)
                    .unwrap()
                    .unwrap();
                let (next, report) = zero
                    .step_scaled(LR, model, grads, ddp, &mut scaler)
                    .unwrap();
                model = next;
                skipped.push(report.skipped);
            }
            eprintln!("stage {stage}, {place:?}, rank {rank}: skipped {skipped:?}");
            (parameters::<B, _>(&model), skipped, scaler.scale())
        },
    )
}

/// A rank's end of [`resumed`]: its parameters, and whether the import was exact.
type Resumed = (Vec<Vec<f32>>, bool);

/// Two ranks at `stage` on backend `B`: 3 steps with the state at `first`, its export (each
/// rank's shard) imported into a fresh ZeroAdam at `then`, 3 more steps. Per rank: the final
/// parameters, and whether the state read back right after the import was the exported one
/// exactly.
fn resumed<B: DistributedAutodiff<Device = WgpuDevice>>(
    stage: u8,
    first: Place,
    then: Place,
) -> Vec<Resumed> {
    burn_dist_kernels::testing::wgpu_client();
    let world = 2;
    let device = WgpuDevice::default();
    placed_ranks::<B, Wgpu, _>(
        world,
        &DdpConfig::new(),
        (stage, first),
        FloatDType::F32,
        &device,
        &|rank, ddp, mut model, zero| {
            for s in 0..3 {
                model = mlp_step(ddp, model, zero, (rank, world, s));
            }
            let saved = zero.export();
            let fresh = ZeroAdamConfig::new()
                .with_stage(stage)
                .init::<B, _>(ddp, &model)
                .unwrap();
            let mut zero = then.apply::<Wgpu>(fresh, ddp, &device).unwrap();
            zero.import(saved.clone()).unwrap();
            let exact = zero.export() == saved;
            for s in 3..6 {
                model = mlp_step(ddp, model, &mut zero, (rank, world, s));
            }
            (parameters::<B, _>(&model), exact)
        },
    )
}

/// A state saved with offload loads without it (into device memory) and back: nothing of it
/// is lost on the way (the export after the import is the saved one, bit for bit), and the run
/// goes on as an uninterrupted run at the new place does (to the two steps' rounding), or bit
/// for bit when the place does not change.
#[test]
fn a_state_saved_offloaded_resumes_on_the_device_and_back() {
    use Place::{Device, Offloaded};
    for stage in STAGES {
        let what = |first: Place, then: Place| format!("stage {stage}, {first:?} then {then:?}");
        let runs: Vec<((Place, Place), Vec<Resumed>)> = [
            (Offloaded, Offloaded),
            (Offloaded, Device),
            (Device, Offloaded),
            (Device, Device),
        ]
        .into_iter()
        .map(|(a, b)| ((a, b), at_stage!(stage, resumed(stage, a, b))))
        .collect();
        for ((first, then), ranks) in &runs {
            for (rank, (params, exact)) in ranks.iter().enumerate() {
                let what = what(*first, *then);
                assert!(*exact, "{what}: rank {rank}'s state changed on import");
                assert!(params == &ranks[0].0, "{what}: rank {rank} differs");
            }
        }
        let uninterrupted = |place| {
            at_stage!(
                stage,
                train_checkpointed((2, stage, place), None, 0..6, None)
            )
            .remove(0)
        };
        let (offloaded, on_device) = (uninterrupted(Offloaded), uninterrupted(Device));
        assert!(
            runs[0].1[0].0 == offloaded,
            "{}: the resumed run differs from the uninterrupted one",
            what(Offloaded, Offloaded)
        );
        assert_close(
            &runs[1].1[0].0,
            &on_device,
            TOLERANCE,
            &what(Offloaded, Device),
        );
        assert_close(
            &runs[2].1[0].0,
            &offloaded,
            TOLERANCE,
            &what(Device, Offloaded),
        );
    }
}

/// `world` ranks at `stage` on backend `B` with ZeroAdam at `place`: from a fresh model, or
/// from the checkpoint `from` (a sharded checkpoint of `burn_dist_zero::checkpoint`, of any
/// world size), the steps `steps` of the synthetic MLP task; with `save_to`, a checkpoint of
/// the step after the last one is written there. Per rank: the final parameters.
fn train_checkpointed<B: DistributedAutodiff<Device = WgpuDevice>>(
    (world, stage, place): (usize, u8, Place),
    from: Option<&std::path::Path>,
    steps: std::ops::Range<usize>,
    save_to: Option<SaveTo<'_>>,
) -> Vec<Vec<Vec<f32>>> {
    use burn_dist_zero::{TrainingState, checkpoint};
    burn_dist_kernels::testing::wgpu_client();
    placed_ranks::<B, Wgpu, _>(
        world,
        &DdpConfig::new(),
        (stage, place),
        FloatDType::F32,
        &WgpuDevice::default(),
        &|rank, ddp, mut model, zero| {
            if let Some(dir) = from {
                let dir = checkpoint::latest(dir).unwrap().expect("a checkpoint");
                model = checkpoint::load::<B, _>(dir, ddp, model, zero).unwrap().0;
            }
            for s in steps.clone() {
                model = mlp_step(ddp, model, zero, (rank, world, s));
            }
            let end = steps.end;
            let state = TrainingState::new(end as u64, (end * GLOBAL_BATCH) as u64);
            match save_to {
                Some(SaveTo::Now(root)) => {
                    checkpoint::save(root, ddp, &model, zero, &state).unwrap();
                }
                Some(SaveTo::Background(root)) => {
                    let mut saver = checkpoint::AsyncSaver::new(root);
                    saver.save(ddp, &model, zero, &state).unwrap();
                    assert!(saver.wait(ddp).unwrap().is_some(), "rank {rank}: committed");
                }
                None => {}
            }
            parameters::<B, _>(&model)
        },
    )
}

/// Where [`train_checkpointed`] saves at its end: `checkpoint::save`, or
/// `checkpoint::AsyncSaver` (saved, then waited for).
#[derive(Clone, Copy)]
enum SaveTo<'a> {
    Now(&'a std::path::Path),
    Background(&'a std::path::Path),
}

/// On the device path, with the state in device memory or offloaded, at stages 1 to 3 on 2
/// ranks: the checkpoint `AsyncSaver` writes is the synchronous save's, file for file.
#[test]
fn an_asynchronous_save_on_the_device_path_writes_the_synchronous_checkpoint() {
    for stage in STAGES {
        for place in [Place::Device, Place::Offloaded] {
            let (now, background) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
            for save_to in [
                SaveTo::Now(now.path()),
                SaveTo::Background(background.path()),
            ] {
                at_stage!(
                    stage,
                    train_checkpointed((2, stage, place), None, 0..3, Some(save_to))
                );
            }
            let files = |root: &std::path::Path| {
                let dir = burn_dist_zero::checkpoint::step_dir(root, 3);
                let mut files: Vec<(std::ffi::OsString, Vec<u8>)> = std::fs::read_dir(dir)
                    .unwrap()
                    .map(|e| {
                        let e = e.unwrap();
                        (e.file_name(), std::fs::read(e.path()).unwrap())
                    })
                    .collect();
                files.sort();
                files
            };
            let written = files(background.path());
            assert!(
                written.iter().any(|(name, _)| name == "manifest.json"),
                "stage {stage}, {place:?}: committed"
            );
            assert!(
                written == files(now.path()),
                "stage {stage}, {place:?}: the asynchronous checkpoint differs"
            );
        }
    }
}

/// A sharded checkpoint written offloaded at 2 ranks resumes at 1 and 3 ranks, with the state
/// in device memory or offloaded, and one written with the state in device memory resumes
/// offloaded: each run goes on as the uninterrupted 2-rank run (to the rounding of other
/// reductions and of the two steps' arithmetic), and at 2 ranks offloaded bit for bit.
#[test]
fn a_checkpoint_written_offloaded_resumes_at_other_world_sizes_with_and_without_offload() {
    use Place::{Device, Offloaded};
    for stage in STAGES {
        let uninterrupted = at_stage!(
            stage,
            train_checkpointed((2, stage, Offloaded), None, 0..6, None)
        );
        for written in [Offloaded, Device] {
            let root = tempfile::tempdir().unwrap();
            at_stage!(
                stage,
                train_checkpointed(
                    (2, stage, written),
                    None,
                    0..3,
                    Some(SaveTo::Now(root.path()))
                )
            );
            for (world, place) in [
                (2, Offloaded),
                (1, Device),
                (1, Offloaded),
                (3, Device),
                (3, Offloaded),
            ] {
                let resumed = at_stage!(
                    stage,
                    train_checkpointed((world, stage, place), Some(root.path()), 3..6, None)
                );
                let what = format!(
                    "stage {stage}: written {written:?} at 2 ranks, resumed {place:?} at {world}"
                );
                for (rank, params) in resumed.iter().enumerate() {
                    assert!(
                        params == &resumed[0],
                        "{what}: rank {rank} differs from rank 0"
                    );
                }
                if (world, place, written) == (2, Offloaded, Offloaded) {
                    assert!(resumed[0] == uninterrupted[0], "{what}: not bit for bit");
                } else {
                    assert_close(&resumed[0], &uninterrupted[0], TOLERANCE, &what);
                }
            }
        }
    }
}

/// "Roll back to the best model" (`burn_dist_testing::roll_back`) on 2 ranks on wgpu at
/// `stage` on backend `B`, ZeroAdam offloaded.
fn rolled_back_offloaded<B: DistributedAutodiff<Device = WgpuDevice>>(
    stage: u8,
    after_load: AfterLoad,
) -> Vec<RolledBack<()>> {
    burn_dist_kernels::testing::wgpu_client();
    placed_ranks::<B, Wgpu, _>(
        2,
        &DdpConfig::new(),
        (stage, Place::Offloaded),
        FloatDType::F32,
        &WgpuDevice::default(),
        &|rank, ddp, model, zero| {
            let step =
                |ddp: &mut Ddp, zero: &mut _, model, s| mlp_step(ddp, model, zero, (rank, 2, s));
            roll_back(ddp, zero, model, step, after_load, |_| ())
        },
    )
}

/// A record kept in memory and loaded back into the model: the offloaded step takes the
/// loaded values (read from the device model, at stage 3 from its pieces) into its master
/// weights on the host, and goes on from them, bit for bit as a run whose master weights were
/// set to them by an import.
#[test]
fn offloaded_step_goes_on_from_a_record_loaded_back_at_stages_1_to_3() {
    for stage in STAGES {
        assert_trained_on_from_the_load(
            &at_stage!(stage, rolled_back_offloaded(stage, AfterLoad::TrainOn)),
            &at_stage!(
                stage,
                rolled_back_offloaded(stage, AfterLoad::ImportLoadedMaster)
            ),
            &format!("stage {stage}, offloaded on wgpu"),
        );
    }
}

/// The typed refusals: a host-path `Ddp`, a state placed twice, and stage 3 with the model's
/// pieces in host memory.
#[test]
fn offload_refuses_what_it_cannot_do_by_name() {
    burn_dist_kernels::testing::wgpu_client();
    let device = WgpuDevice::default();
    let comm = HostCommunicator::local_group(1, &CommConfig::default()).remove(0);
    let mut host_ddp = Ddp::for_thread(comm, DdpConfig::new());
    let model = host_ddp
        .prepare(Mlp::<OnWgpu>::new(&MLP_SIZES, 7, &device))
        .unwrap();
    let zero = ZeroAdamConfig::new()
        .init::<OnWgpu, _>(&host_ddp, &model)
        .unwrap();
    let error = zero
        .offloaded::<Wgpu>(&host_ddp, &device)
        .err()
        .expect("a host-path Ddp");
    assert!(
        matches!(error, ZeroError::NotOnDevicePath { .. }),
        "{error}"
    );

    let comm = HostCommunicator::local_group(1, &CommConfig::default()).remove(0);
    let mut ddp = Ddp::for_thread_staged::<Wgpu>(comm, DdpConfig::new(), &device);
    let model = ddp
        .prepare(Mlp::<OnWgpu>::new(&MLP_SIZES, 7, &device))
        .unwrap();
    let offloaded = ZeroAdamConfig::new()
        .init::<OnWgpu, _>(&ddp, &model)
        .unwrap()
        .offloaded::<Wgpu>(&ddp, &device)
        .unwrap();
    let error = offloaded
        .on_device::<Wgpu>(&ddp, &device)
        .err()
        .expect("placed twice");
    assert!(
        matches!(
            error,
            ZeroError::AlreadyPlaced {
                asked: "on_device",
                ..
            }
        ),
        "{error}"
    );

    // The host path's Ddp on the wgpu backend: the stage-3 pieces stay in host memory.
    let comm = HostCommunicator::local_group(1, &CommConfig::default()).remove(0);
    let mut host_ddp = Ddp::for_thread(comm, DdpConfig::new());
    let model = host_ddp
        .prepare_sharded(Mlp::<ShardedOnWgpu>::new(&MLP_SIZES, 7, &device))
        .unwrap();
    let zero = ZeroAdamConfig::new()
        .with_stage(3)
        .init::<ShardedOnWgpu, _>(&host_ddp, &model)
        .unwrap();
    let error = zero
        .offloaded::<Wgpu>(&host_ddp, &device)
        .err()
        .expect("stage 3 with the pieces in host memory");
    assert!(
        matches!(error, ZeroError::Stage3OnDevice { asked: "offloaded" }),
        "{error}"
    );
    assert!(
        error.to_string().contains("ZeroAdam::offloaded at stage 3"),
        "{error}"
    );
}

/// A window streamed to the host leaves a device shard that is not the window's mean (its
/// mean is taken on the host): a step that would update from it in device memory is refused,
/// naming the switch, instead of stepping on the wrong gradient.
#[test]
fn the_device_step_refuses_a_gradient_shard_streamed_to_the_host() {
    burn_dist_kernels::testing::wgpu_client();
    let device = WgpuDevice::default();
    let comm = HostCommunicator::local_group(1, &CommConfig::default()).remove(0);
    let config = DdpConfig::new().with_accumulation_steps(2);
    let mut ddp = Ddp::for_thread_staged::<Wgpu>(comm, config, &device);
    let mut model = ddp
        .prepare(Mlp::<OnWgpu>::new(&MLP_SIZES, 7, &device))
        .unwrap();
    let mut zero = ZeroAdamConfig::new()
        .with_stage(2)
        .init::<OnWgpu, _>(&ddp, &model)
        .unwrap()
        .on_device::<Wgpu>(&ddp, &device)
        .unwrap();
    ddp.stream_gradient_shard_to_host(true);
    let [input, .., output] = MLP_SIZES;
    let mut grads = None;
    for micro_batch in 0..2 {
        model = ddp.mark(model);
        let x = synthetic_rows::<OnWgpu, 2>(0, micro_batch, [4, input], 0..4, &device);
        let y = synthetic_rows::<OnWgpu, 2>(1, micro_batch, [4, output], 0..4, &device);
        let loss = (model.forward(x) - y).powi_scalar(2).mean();
        grads = ddp.backward(loss, &model).unwrap();
    }
    let grads = grads.expect("the window's last micro-batch");
    let error = zero
        .step(LR, model, grads, &ddp)
        .expect_err("a streamed shard stepped on the device");
    assert!(
        error.to_string().contains("streamed to the host")
            && error.to_string().contains("stream_gradient_shard_to_host"),
        "{error}"
    );
}

/// Two MLP branches, the second used on no rank (`unused_everywhere`) or on rank 0 only: a
/// parameter without a gradient in a step. Offloaded, the step is the host path's bit for bit
/// at stages 1 to 3 on 2 ranks: a branch no rank used has no gradient anywhere and keeps its
/// initial values (its Adam step count does not advance), and one used on rank 0 only gets the
/// average everywhere (stages 1 and 2: at stage 3 every rank must use the sharded parameters
/// alike, a use is a gather).
#[test]
fn offloaded_step_treats_parameters_without_a_gradient_as_the_host_path_does() {
    for unused_everywhere in [true, false] {
        let stages = if unused_everywhere {
            &STAGES[..]
        } else {
            &STAGES[..2]
        };
        for &stage in stages {
            let host = at_stage!(stage, two_branches(stage, None, unused_everywhere));
            let offloaded = at_stage!(
                stage,
                two_branches(stage, Some(Place::Offloaded), unused_everywhere)
            );
            let what =
                format!("stage {stage}, second branch unused everywhere: {unused_everywhere}");
            assert!(
                host == offloaded,
                "{what}: offloaded and the host path differ"
            );
            let first_layer = MLP_SIZES.len() - 1;
            let initial =
                parameters::<OnWgpu, _>(&Mlp::<OnWgpu>::new(&MLP_SIZES, 8, &WgpuDevice::default()));
            let second = &offloaded[0][2 * first_layer..];
            assert_eq!(
                second == &initial[..],
                unused_everywhere,
                "{what}: the second branch's values"
            );
        }
    }
}

/// [`offloaded_step_treats_parameters_without_a_gradient_as_the_host_path_does`]'s run on 2
/// ranks on backend `B`: ZeroAdam at `stage`, placed at `place` with the staged collectives,
/// or on the host path (`None`); per rank, its final parameters.
fn two_branches<B: DistributedAutodiff<Device = WgpuDevice>>(
    stage: u8,
    place: Option<Place>,
    unused_everywhere: bool,
) -> Vec<Vec<Vec<f32>>> {
    const WORLD: usize = 2;
    burn_dist_kernels::testing::wgpu_client();
    let device = WgpuDevice::default();
    let comms = HostCommunicator::local_group(WORLD, &CommConfig::default());
    burn_dist_comm::testing::run_ranks(comms, |rank, comm| {
        let mut ddp = match place {
            Some(_) => Ddp::for_thread_staged::<Wgpu>(comm, DdpConfig::new(), &device),
            None => Ddp::for_thread(comm, DdpConfig::new()),
        };
        let branches: Vec<Mlp<B>> = (0..2)
            .map(|i| Mlp::new(&MLP_SIZES, 7 + i, &device))
            .collect();
        let mut model = B::prepare_model(&mut ddp, branches).expect("prepared");
        let zero = ZeroAdamConfig::new()
            .with_stage(stage)
            .init::<B, _>(&ddp, &model)
            .expect("ZeroAdam built");
        let mut zero = match place {
            Some(place) => place.apply::<Wgpu>(zero, &ddp, &device).expect("placed"),
            None => zero,
        };
        let rows = shard_rows(GLOBAL_BATCH, rank, WORLD);
        for step in 0..STEPS {
            model = ddp.mark(model);
            let x = || {
                synthetic_rows::<B, 2>(0, step, [GLOBAL_BATCH, MLP_SIZES[0]], rows.clone(), &device)
            };
            let mut out = model[0].forward(x());
            if !unused_everywhere && rank == 0 {
                out = out + model[1].forward(x());
            }
            let loss = out.powi_scalar(2).mean();
            let grads = ddp.backward(loss, &model).unwrap().unwrap();
            model = zero.step(LR, model, grads, &ddp).unwrap().0;
        }
        parameters::<B, _>(&model)
    })
}
