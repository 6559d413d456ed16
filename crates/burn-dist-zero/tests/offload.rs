//! ZeroAdam offloaded (`ZeroAdam::offloaded`): the model and the reducer on the device (Burn's
//! `Wgpu`, fusion on, over Mesa's lavapipe, with the staged device collectives), the optimizer
//! state on the host, stepped by the host step. At ZeRO stages 1 and 2, 1 to 3 thread ranks:
//! - it equals ZeroAdam with its state in device memory (`on_device`) to 1e-5 (the fused
//!   kernels and the host step round differently in a few operations);
//! - it equals the host path on the same device bit for bit: the gradient is reduced in the
//!   same order (the staged collectives are the host collectives), the update is the host
//!   step, and the new parameters are rounded by the same conversion;
//! - f16 parameters under loss scaling skip the same steps as on the device;
//! - the bytes between host and device per step are exactly the formula's;
//! - a state exported with offload imports without it and back, and the run goes on.
//!
//! Device memory against the formula: tests/device_memory.rs.

use burn::backend::Autodiff;
use burn::module::{AutodiffModule, Module};
use burn::tensor::FloatDType;
use burn::tensor::backend::AutodiffBackend;
use burn_dist::{Ddp, DdpConfig, DistributedBackend, FlatLayout, GradScalerConfig, ReducerStats};
use burn_dist_comm::testing::run_ranks;
use burn_dist_comm::{CommConfig, HostCommunicator};
use burn_dist_testing::roll_back::{
    AfterLoad, RolledBack, assert_trained_on_from_the_load, roll_back,
};
use burn_dist_testing::{
    BurnAdamW, Cast, MLP_SIZES, Mlp, OptimizerKind, Stepper, Synthetic, assert_close, parameters,
    shard_rows, synthetic_rows, train_ranks, train_ranks_with, zero_mlp_step,
};
use burn_dist_zero::{ZeroAdam, ZeroAdamConfig, ZeroError};
use burn_wgpu::{Wgpu, WgpuDevice};

/// The device path's twin.
type OnWgpu = Autodiff<DistributedBackend<Wgpu>>;

const STEPS: usize = 6;
const LR: f64 = 1e-2;
const GLOBAL_BATCH: usize = 12;
/// The fused kernels on lavapipe and the host step differ in the last bits of a few f32
/// operations (the bias corrections' powers, the square root's rounding).
const TOLERANCE: f64 = 1e-5;

/// Where ZeroAdam's state lives beside a model on the wgpu device.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Place {
    /// In device memory (`on_device`).
    Device,
    /// On the host (`offloaded`).
    Offloaded,
}

impl Place {
    fn apply(self, zero: ZeroAdam, ddp: &Ddp, device: &WgpuDevice) -> ZeroAdam {
        match self {
            Place::Device => zero.on_device::<Wgpu>(ddp, device),
            Place::Offloaded => zero.offloaded::<Wgpu>(ddp, device),
        }
        .expect("ZeroAdam placed beside a wgpu model")
    }
}

/// ZeroAdam with a config, placed once built.
struct Placed(ZeroAdamConfig, Place);

impl OptimizerKind for Placed {
    fn build<A, M>(&self, ddp: &Ddp, model: &M) -> Box<dyn Stepper<A, M>>
    where
        A: AutodiffBackend,
        M: AutodiffModule<A> + 'static,
    {
        let zero = self.0.init::<A, M>(ddp, model).expect("ZeroAdam");
        Box::new(self.1.apply(zero, ddp, &WgpuDevice::default()))
    }
}

/// `world` ranks on wgpu with the reducer on the device path, ZeroAdam placed at `place`.
fn train_staged(
    world: usize,
    config: ZeroAdamConfig,
    place: Place,
) -> Vec<(Vec<Vec<f32>>, ReducerStats)> {
    burn_dist_kernels::testing::wgpu_client();
    let device = WgpuDevice::default();
    train_ranks_with::<OnWgpu>(
        world,
        |comm| Ddp::for_thread_staged::<Wgpu>(comm, DdpConfig::new(), &device),
        Synthetic::Mlp,
        &Placed(config, place),
        STEPS,
        GLOBAL_BATCH,
        LR,
        &device,
    )
}

#[test]
fn offloaded_step_equals_the_device_step_at_stages_1_and_2() {
    for stage in [1, 2] {
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

/// The host path (`Ddp::for_thread`: each gradient read to the host, reduced by the host
/// collectives, the host step, the new parameters written from the host) on the same wgpu
/// device: the same arithmetic as the offloaded step, in the same order, so the same bits.
/// With clipping, which the host step does on both.
#[test]
fn offloaded_step_equals_the_host_path_bit_for_bit() {
    let device = WgpuDevice::default();
    burn_dist_kernels::testing::wgpu_client();
    for stage in [1, 2] {
        for world in [1, 2, 3] {
            let config = ZeroAdamConfig::new()
                .with_stage(stage)
                .with_max_grad_norm(Some(0.05));
            let host = train_ranks::<OnWgpu>(
                world,
                &DdpConfig::new(),
                Synthetic::Mlp,
                &config.clone(),
                STEPS,
                GLOBAL_BATCH,
                LR,
                &device,
            );
            let offloaded = train_staged(world, config, Place::Offloaded);
            for (rank, (host, (offloaded, _))) in host.iter().zip(&offloaded).enumerate() {
                assert!(
                    host == offloaded,
                    "stage {stage}, {world} ranks, rank {rank}: the offloaded step and the host \
                     path differ"
                );
            }
        }
    }
}

/// Per step and rank, with Ψ the model's elements, S the rank's shard (its padded length) and
/// O the elements it owns (f32 everywhere): the reducer stages every gradient down (4Ψ) and at
/// stage 1 every reduced gradient back up (4Ψ), at stage 2 only this rank's owned elements
/// (4O); the offloaded step reads the gradient shard down once (4S) and uploads the new shard
/// once (4S); the all-gather of the new parameters stages this rank's pieces down (4O) and the
/// others' up (4(Ψ − O)). No scalar crosses: the agreement is the host's.
#[test]
fn offloaded_step_moves_the_gradient_shard_down_and_the_new_shard_up_exactly() {
    let reference = train_ranks::<burn::backend::Autodiff<DistributedBackend<burn_flex::Flex>>>(
        1,
        &DdpConfig::new(),
        Synthetic::Mlp,
        &BurnAdamW,
        1,
        GLOBAL_BATCH,
        LR,
        &burn_flex::FlexDevice,
    )
    .remove(0);
    let numels: Vec<usize> = reference.iter().map(Vec::len).collect();
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
            let written_back = if stage == 1 { total } else { owned };
            let per_step = (
                4 * total + 4 * s + 4 * owned,
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

/// f16 parameters under loss scaling from a scale too large for f16: the scaled loss and its
/// gradients overflow in the model's dtype until the scale has backed off, and again after it
/// has grown.
/// The offloaded step and the device step skip exactly the same steps on every rank, and end
/// with the same scale, and parameters equal to f16's rounding.
#[test]
fn f16_with_loss_scaling_skips_the_same_steps_offloaded_as_on_the_device() {
    for stage in [1, 2] {
        let device = train_f16_scaled(stage, Place::Device);
        let offloaded = train_f16_scaled(stage, Place::Offloaded);
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

/// Two ranks, an f16 MLP on wgpu, 10 steps through a GradScaler starting at 2^18 (growth
/// every 2 clean steps). Per rank: the parameters, which steps were skipped, the final scale.
fn train_f16_scaled(stage: u8, place: Place) -> Vec<(Vec<Vec<f32>>, Vec<bool>, f32)> {
    burn_dist_kernels::testing::wgpu_client();
    let (world, f16) = (2, FloatDType::F16);
    let device = WgpuDevice::default();
    let comms = HostCommunicator::local_group(world, &CommConfig::default());
    run_ranks(comms, |rank, comm| {
        let mut ddp = Ddp::for_thread_staged::<Wgpu>(comm, DdpConfig::new(), &device);
        let model = Mlp::<OnWgpu>::new(&MLP_SIZES, 7, &device).map(&mut Cast(f16));
        let mut model = ddp.prepare(model).unwrap();
        let zero = ZeroAdamConfig::new()
            .with_stage(stage)
            .init::<OnWgpu, _>(&ddp, &model)
            .unwrap();
        let mut zero = place.apply(zero, &ddp, &device);
        let mut scaler = GradScalerConfig::new()
            .with_init_scale(262_144.0)
            .with_growth_interval(2)
            .init();
        let mut skipped = Vec::new();
        for step in 0..10 {
            let [input, .., output] = MLP_SIZES;
            let rows = shard_rows(GLOBAL_BATCH, rank, world);
            let x =
                synthetic_rows::<OnWgpu, 2>(0, step, [GLOBAL_BATCH, input], rows.clone(), &device);
            let y = synthetic_rows::<OnWgpu, 2>(1, step, [GLOBAL_BATCH, output], rows, &device);
            let loss = (model.forward(x.cast(f16)) - y.cast(f16))
                .powi_scalar(2)
                .mean();
            let grads = ddp
                .backward(scaler.scale_loss(loss), &model)
                .unwrap()
                .unwrap();
            let (next, report) = zero
                .step_scaled(LR, model, grads, &ddp, &mut scaler)
                .unwrap();
            model = next;
            skipped.push(report.skipped);
        }
        eprintln!("stage {stage}, {place:?}, rank {rank}: skipped {skipped:?}");
        (parameters::<OnWgpu, _>(&model), skipped, scaler.scale())
    })
}

/// A rank's end of [`resumed`]: its parameters, and whether the import was exact.
type Resumed = (Vec<Vec<f32>>, bool);

/// Two ranks at `stage`: 3 steps with the state at `first`, its export (each rank's shard)
/// imported into a fresh ZeroAdam at `then`, 3 more steps. Per rank: the final parameters,
/// and whether the state read back right after the import was the exported one exactly.
fn resumed(stage: u8, first: Place, then: Place) -> Vec<Resumed> {
    burn_dist_kernels::testing::wgpu_client();
    let (world, f32) = (2, FloatDType::F32);
    let device = WgpuDevice::default();
    let comms = HostCommunicator::local_group(world, &CommConfig::default());
    run_ranks(comms, |rank, comm| {
        let mut ddp = Ddp::for_thread_staged::<Wgpu>(comm, DdpConfig::new(), &device);
        let mut model = ddp
            .prepare(Mlp::<OnWgpu>::new(&MLP_SIZES, 7, &device))
            .unwrap();
        let config = ZeroAdamConfig::new().with_stage(stage);
        let build = |ddp: &Ddp, model: &Mlp<OnWgpu>, place: Place| {
            place.apply(config.init::<OnWgpu, _>(ddp, model).unwrap(), ddp, &device)
        };
        let mut zero = build(&ddp, &model, first);
        let step = |ddp: &mut Ddp, zero: &mut ZeroAdam, model, s| {
            zero_mlp_step(
                ddp,
                model,
                zero,
                (rank, world, s),
                (GLOBAL_BATCH, LR),
                f32,
                &device,
            )
        };
        for s in 0..3 {
            model = step(&mut ddp, &mut zero, model, s);
        }
        let saved = zero.export();
        let mut zero = build(&ddp, &model, then);
        zero.import(saved.clone()).unwrap();
        let exact = zero.export() == saved;
        for s in 3..6 {
            model = step(&mut ddp, &mut zero, model, s);
        }
        (parameters::<OnWgpu, _>(&model), exact)
    })
}

/// A state saved with offload loads without it (into device memory) and back: nothing of it
/// is lost on the way (the export after the import is the saved one, bit for bit), and the run
/// goes on as an uninterrupted run at the new place does (to the two steps' rounding), or bit
/// for bit when the place does not change.
#[test]
fn a_state_saved_offloaded_resumes_on_the_device_and_back() {
    use Place::{Device, Offloaded};
    for stage in [1, 2] {
        let what = |first: Place, then: Place| format!("stage {stage}, {first:?} then {then:?}");
        let runs: Vec<((Place, Place), Vec<Resumed>)> = [
            (Offloaded, Offloaded),
            (Offloaded, Device),
            (Device, Offloaded),
            (Device, Device),
        ]
        .into_iter()
        .map(|(a, b)| ((a, b), resumed(stage, a, b)))
        .collect();
        for ((first, then), ranks) in &runs {
            for (rank, (params, exact)) in ranks.iter().enumerate() {
                let what = what(*first, *then);
                assert!(*exact, "{what}: rank {rank}'s state changed on import");
                assert!(params == &ranks[0].0, "{what}: rank {rank} differs");
            }
        }
        let uninterrupted = |place| {
            train_staged(2, ZeroAdamConfig::new().with_stage(stage), place)
                .remove(0)
                .0
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

/// `world` ranks at `stage` with ZeroAdam at `place`: from a fresh model, or from the
/// checkpoint `from` (a sharded checkpoint of `burn_dist_zero::checkpoint`, of any world size),
/// the steps `steps` of the synthetic MLP task; with `save_to`, a checkpoint of the step after
/// the last one is written there. Per rank: the final parameters.
fn train_checkpointed(
    (world, stage, place): (usize, u8, Place),
    from: Option<&std::path::Path>,
    steps: std::ops::Range<usize>,
    save_to: Option<&std::path::Path>,
) -> Vec<Vec<Vec<f32>>> {
    use burn_dist_zero::{TrainingState, checkpoint};
    burn_dist_kernels::testing::wgpu_client();
    let device = WgpuDevice::default();
    let comms = HostCommunicator::local_group(world, &CommConfig::default());
    run_ranks(comms, |rank, comm| {
        let mut ddp = Ddp::for_thread_staged::<Wgpu>(comm, DdpConfig::new(), &device);
        let mut model = ddp
            .prepare(Mlp::<OnWgpu>::new(&MLP_SIZES, 7, &device))
            .unwrap();
        let zero = ZeroAdamConfig::new()
            .with_stage(stage)
            .init::<OnWgpu, _>(&ddp, &model)
            .unwrap();
        let mut zero = place.apply(zero, &ddp, &device);
        if let Some(dir) = from {
            let dir = checkpoint::latest(dir).unwrap().expect("a checkpoint");
            model = checkpoint::load::<OnWgpu, _>(dir, &ddp, model, &mut zero)
                .unwrap()
                .0;
        }
        let f32 = FloatDType::F32;
        let end = steps.end;
        for s in steps.clone() {
            model = zero_mlp_step(
                &mut ddp,
                model,
                &mut zero,
                (rank, world, s),
                (GLOBAL_BATCH, LR),
                f32,
                &device,
            );
        }
        if let Some(root) = save_to {
            let state = TrainingState::new(end as u64, (end * GLOBAL_BATCH) as u64);
            checkpoint::save(root, &ddp, &model, &zero, &state).unwrap();
        }
        parameters::<OnWgpu, _>(&model)
    })
}

/// A sharded checkpoint written offloaded at 2 ranks resumes at 1 and 3 ranks, with the state
/// in device memory or offloaded, and one written with the state in device memory resumes
/// offloaded: each run goes on as the uninterrupted 2-rank run (to the rounding of other
/// reductions and of the two steps' arithmetic), and at 2 ranks offloaded bit for bit.
#[test]
fn a_checkpoint_written_offloaded_resumes_at_other_world_sizes_with_and_without_offload() {
    use Place::{Device, Offloaded};
    for stage in [1, 2] {
        let uninterrupted = train_checkpointed((2, stage, Offloaded), None, 0..6, None);
        for written in [Offloaded, Device] {
            let root = tempfile::tempdir().unwrap();
            train_checkpointed((2, stage, written), None, 0..3, Some(root.path()));
            for (world, place) in [
                (2, Offloaded),
                (1, Device),
                (1, Offloaded),
                (3, Device),
                (3, Offloaded),
            ] {
                let resumed =
                    train_checkpointed((world, stage, place), Some(root.path()), 3..6, None);
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
/// `stage`, ZeroAdam offloaded.
fn rolled_back_offloaded(stage: u8, after_load: AfterLoad) -> Vec<RolledBack<()>> {
    burn_dist_kernels::testing::wgpu_client();
    let device = WgpuDevice::default();
    let comms = HostCommunicator::local_group(2, &CommConfig::default());
    run_ranks(comms, |rank, comm| {
        let mut ddp = Ddp::for_thread_staged::<Wgpu>(comm, DdpConfig::new(), &device);
        let model = ddp
            .prepare(Mlp::<OnWgpu>::new(&MLP_SIZES, 7, &device))
            .unwrap();
        let zero = ZeroAdamConfig::new()
            .with_stage(stage)
            .init::<OnWgpu, _>(&ddp, &model)
            .unwrap();
        let mut zero = Place::Offloaded.apply(zero, &ddp, &device);
        let f32 = FloatDType::F32;
        let step = |ddp: &mut Ddp, zero: &mut _, model, s| {
            zero_mlp_step(
                ddp,
                model,
                zero,
                (rank, 2, s),
                (GLOBAL_BATCH, LR),
                f32,
                &device,
            )
        };
        roll_back(&mut ddp, &mut zero, model, step, after_load, |_| ())
    })
}

/// A record kept in memory and loaded back into the model: the offloaded step takes the
/// loaded values (read from the device model) into its master weights on the host, and goes
/// on from them, bit for bit as a run whose master weights were set to them by an import.
#[test]
fn offloaded_step_goes_on_from_a_record_loaded_back_at_stages_1_and_2() {
    for stage in [1, 2] {
        assert_trained_on_from_the_load(
            &rolled_back_offloaded(stage, AfterLoad::TrainOn),
            &rolled_back_offloaded(stage, AfterLoad::ImportLoadedMaster),
            &format!("stage {stage}, offloaded on wgpu"),
        );
    }
}

/// The typed refusals: stage 3, a host-path `Ddp`, and a state placed twice.
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

    type Sharded = Autodiff<DistributedBackend<Wgpu, burn_dist::Sharded>>;
    let comm = HostCommunicator::local_group(1, &CommConfig::default()).remove(0);
    let mut ddp = Ddp::for_thread_staged::<Wgpu>(comm, DdpConfig::new(), &device);
    let model = ddp
        .prepare_sharded(Mlp::<Sharded>::new(&MLP_SIZES, 7, &device))
        .unwrap();
    let zero = ZeroAdamConfig::new()
        .with_stage(3)
        .init::<Sharded, _>(&ddp, &model)
        .unwrap();
    let error = zero
        .offloaded::<Wgpu>(&ddp, &device)
        .err()
        .expect("stage 3");
    assert!(matches!(error, ZeroError::OffloadStage3), "{error}");
    assert!(error.to_string().contains("stage 3"), "{error}");
}
