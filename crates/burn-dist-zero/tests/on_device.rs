//! ZeroAdam with its state in device memory (`ZeroAdam::on_device`): the CPU twin of the GPU
//! path. The model trains on Burn's `Wgpu` (fusion on) over Mesa's lavapipe, the reducer keeps
//! the gradients on the device (staged device collectives), the fused kernels update the shard
//! in place, and the new parameters are all-gathered device to device. It equals the host path
//! on Flex and Burn's AdamW, at ZeRO stages 1 and 2, with clipping; only the step's scalars and
//! what the staging must move cross to the host, counted to the byte.

use burn::backend::Autodiff;
use burn_dist::{Ddp, DdpConfig, DistributedBackend, FlatLayout, ReducerStats};
use burn_dist_testing::placed::{Place, Placed, placed_ranks, train_placed};
use burn_dist_testing::roll_back::{
    AfterLoad, RolledBack, assert_trained_on_from_the_load, roll_back,
};
use burn_dist_testing::{BurnAdamW, OptimizerKind, Synthetic, assert_close, train_ranks};
use burn_dist_zero::ZeroAdamConfig;
use burn_flex::{Flex, FlexDevice};
use burn_wgpu::{Wgpu, WgpuDevice};

/// The host path: the reference.
type B = Autodiff<DistributedBackend<Flex>>;
/// The device path's twin.
type OnWgpu = Autodiff<DistributedBackend<Wgpu>>;

const STEPS: usize = 8;
const LR: f64 = 1e-2;
const GLOBAL_BATCH: usize = 12;
/// lavapipe's f32 kernels sum in another order than Flex's.
const TOLERANCE: f64 = 1e-4;

fn train(world: usize, optimizer: &(impl OptimizerKind + Sync)) -> Vec<Vec<Vec<f32>>> {
    train_accumulating(world, 1, optimizer)
}

fn train_accumulating(
    world: usize,
    accumulation: usize,
    optimizer: &(impl OptimizerKind + Sync),
) -> Vec<Vec<Vec<f32>>> {
    train_ranks::<B>(
        world,
        &DdpConfig::new().with_accumulation_steps(accumulation),
        Synthetic::Mlp,
        optimizer,
        STEPS,
        GLOBAL_BATCH,
        LR,
        &FlexDevice,
    )
}

/// `world` ranks on wgpu: the reducer and ZeroAdam on the device path.
fn train_on_device(world: usize, config: ZeroAdamConfig) -> Vec<(Vec<Vec<f32>>, ReducerStats)> {
    train_on_device_accumulating(world, 1, config)
}

fn train_on_device_accumulating(
    world: usize,
    accumulation: usize,
    config: ZeroAdamConfig,
) -> Vec<(Vec<Vec<f32>>, ReducerStats)> {
    burn_dist_kernels::testing::wgpu_client();
    let placed = Placed::<Wgpu> {
        config,
        place: Place::Device,
        device: WgpuDevice::default(),
    };
    let ddp_config = DdpConfig::new().with_accumulation_steps(accumulation);
    train_placed::<OnWgpu, Wgpu>(world, &ddp_config, &placed, STEPS, GLOBAL_BATCH, LR)
}

#[test]
fn device_step_equals_the_host_path_and_burn_adamw_at_stages_1_and_2() {
    let burn = train(1, &BurnAdamW).remove(0);
    for stage in [1, 2] {
        for world in [1, 2, 3, 4] {
            let config = ZeroAdamConfig::new().with_stage(stage);
            let host = train(world, &config.clone());
            let device = train_on_device(world, config);
            let what = format!("stage {stage}, {world} ranks");
            for (rank, (params, stats)) in device.iter().enumerate() {
                assert!(
                    params == &device[0].0,
                    "{what}: rank {rank} differs from rank 0"
                );
                assert!(
                    stats.device_launches > 0,
                    "{what}: the reducer ran on the host"
                );
            }
            assert_close(
                &device[0].0,
                &host[0],
                TOLERANCE,
                &format!("{what}: device vs host"),
            );
            assert_close(
                &device[0].0,
                &burn,
                TOLERANCE,
                &format!("{what}: device vs Burn"),
            );
        }
    }
}

/// The staged path, per step and rank. The reducer stages every gradient down; at stage 1 it
/// writes every reduced gradient back up, at stage 2 only this rank's pieces, which it adds
/// into its device shard. ZeroAdam moves its scalars (down: the shard's sum of squares and
/// found-inf; up: `1 / scale`, the agreed totals and nine hyper-parameters), and the
/// all-gather of the new parameters stages this rank's pieces of them down and the others'
/// pieces up (padding never moves: each parameter is gathered into a buffer of its own).
/// Nothing else crosses: the gradient shard is copied on the device (stage 1) or is the
/// reducer's device shard (stage 2), and the parameters come from device memory.
#[test]
fn device_step_moves_only_scalars_besides_what_the_staging_must() {
    let reference = train(1, &BurnAdamW).remove(0);
    let numels: Vec<usize> = reference.iter().map(Vec::len).collect();
    let total: usize = numels.iter().sum();
    let gradient_bytes = 4 * total as u64;
    let (scalars_down, scalars_up) = (8, 4 + 8 + 36);
    for (stage, world) in [(1, 1), (1, 3), (2, 1), (2, 3)] {
        let flat = FlatLayout::new(&numels, world, 4);
        let ranks = train_on_device(world, ZeroAdamConfig::new().with_stage(stage));
        for (rank, (_, stats)) in ranks.iter().enumerate() {
            let shard = flat.shard(rank);
            let owned = 4 * total.min(shard.end).saturating_sub(shard.start) as u64;
            let written_back = if stage == 1 { gradient_bytes } else { owned };
            let per_step = (
                gradient_bytes + scalars_down + owned,
                written_back + scalars_up + gradient_bytes - owned,
            );
            assert_eq!(
                (stats.bytes_to_host, stats.bytes_to_device),
                (STEPS as u64 * per_step.0, STEPS as u64 * per_step.1),
                "stage {stage}, {world} ranks, rank {rank}: bytes between host and device"
            );
            // The call plan: the MLP's gradients fit one bucket, and it is one device
            // collective (at ZeRO-2 a grouped reduce-scatter of all its parameters' pieces,
            // where one per parameter would be 6), then ZeroAdam's all-gather of the new
            // parameters: two per step.
            assert_eq!(
                stats.device_calls,
                2 * STEPS as u64,
                "stage {stage}, {world} ranks, rank {rank}: device collectives ({} parameters)",
                numels.len()
            );
        }
    }
}

#[test]
fn device_step_with_accumulation_equals_the_host_path() {
    for stage in [1, 2] {
        let config = ZeroAdamConfig::new().with_stage(stage);
        let host = train_accumulating(2, 3, &config.clone());
        let device = train_on_device_accumulating(2, 3, config);
        let what = format!("stage {stage}, 2 ranks × 3 micro-batches");
        assert!(device[1].0 == device[0].0, "{what}: ranks differ");
        assert_close(
            &device[0].0,
            &host[0],
            TOLERANCE,
            &format!("{what}: device vs host"),
        );
    }
}

/// GPT-2's decay rule on the device (the kernels' per-element decay mask) equals it on the
/// host: the MLP's weights decay, its biases do not. The decay is large, so that a bias that
/// decayed would differ from the host's by far more than the tolerance (checked against the
/// host path decaying everything).
#[test]
fn device_step_applies_the_decay_rule_like_the_host_path() {
    use burn_dist_testing::relative_error;
    use burn_dist_zero::DecayRule;
    let config = |rule| {
        ZeroAdamConfig::new()
            .with_weight_decay(0.5)
            .with_decay(rule)
            .with_stage(2)
    };
    let host = train(2, &config(DecayRule::Matrices));
    let device = train_on_device(2, config(DecayRule::Matrices));
    assert_close(
        &device[0].0,
        &host[0],
        TOLERANCE,
        "decay rule, device vs host",
    );
    let decays_all = train(2, &config(DecayRule::All));
    let bias = 1; // the first layer's bias
    assert!(
        relative_error(&host[0][bias], &decays_all[0][bias]) > 100.0 * TOLERANCE,
        "the rule must change the biases for this test to tell"
    );
}

#[test]
fn device_step_clips_like_the_host_path() {
    // Far below the gradient norm: every step clips.
    let config = ZeroAdamConfig::new()
        .with_max_grad_norm(Some(1e-3))
        .with_stage(2);
    let host = train(2, &config.clone());
    let device = train_on_device(2, config);
    assert_close(&device[0].0, &host[0], TOLERANCE, "clipped, device vs host");
}

/// A job of one rank (this thread) on the wgpu device path and the test MLP, prepared.
fn one_rank_mlp_on_wgpu() -> (Ddp, burn_dist_testing::Mlp<OnWgpu>, WgpuDevice) {
    use burn_dist_comm::{CommConfig, HostCommunicator};
    use burn_dist_testing::{MLP_SIZES, Mlp};
    burn_dist_kernels::testing::wgpu_client();
    let device = WgpuDevice::default();
    let comm = HostCommunicator::local_group(1, &CommConfig::default()).remove(0);
    let mut ddp = Ddp::for_thread_staged::<Wgpu>(comm, DdpConfig::new(), &device);
    let model = ddp
        .prepare(Mlp::<OnWgpu>::new(&MLP_SIZES, 7, &device))
        .unwrap();
    (ddp, model, device)
}

#[test]
fn device_state_exports_and_imports_exactly() {
    use burn_dist_testing::MLP_SIZES;
    let (mut ddp, model, device) = one_rank_mlp_on_wgpu();
    let host = ZeroAdamConfig::new()
        .init::<OnWgpu, _>(&ddp, &model)
        .unwrap();
    let mut shard = host.export();
    // A state no fresh optimizer has: distinct values everywhere, 5 steps taken.
    for (i, x) in shard.master.iter_mut().enumerate() {
        *x = i as f32 * 0.25 - 3.0;
    }
    shard.m = shard.master.iter().map(|x| x * 0.5).collect();
    shard.v = shard.master.iter().map(|x| x * x).collect();
    shard.time.fill(5);
    let mut on_device = ZeroAdamConfig::new()
        .init::<OnWgpu, _>(&ddp, &model)
        .unwrap()
        .on_device::<Wgpu>(&ddp, &device)
        .unwrap();
    assert_eq!(on_device.state_len(), host.state_len());
    // The device step counts on the reducer's counter (the staged collectives'), so that
    // `traffic` (what the device check's bytes per step read) sees the whole step.
    assert_eq!(
        host.traffic(),
        None,
        "a host-path ZeroAdam reports device traffic"
    );
    let marked = ddp.mark(model.clone());
    let input = burn::tensor::Tensor::ones([2, MLP_SIZES[0]], &device);
    let grads = ddp
        .backward(marked.forward(input).mean(), &marked)
        .unwrap()
        .unwrap();
    on_device.step(LR, marked, grads, &ddp).unwrap();
    let traffic = on_device
        .traffic()
        .expect("a device ZeroAdam reports no traffic");
    let stats = ddp.stats();
    assert!(traffic.to_host > 0, "a device step counted nothing");
    assert_eq!(
        (traffic.to_host, traffic.to_device),
        (stats.bytes_to_host, stats.bytes_to_device),
        "ZeroAdam's traffic and the reducer's"
    );
    on_device.import(shard.clone()).unwrap();
    assert!(
        on_device.export() == shard,
        "the device round trip changed the state"
    );

    // As a Burn record, through a recorder's bytes: into a fresh host optimizer and a fresh
    // device one.
    use burn::optim::Optimizer;
    use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
    type Model = burn_dist_testing::Mlp<OnWgpu>;
    let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
    let record = <burn_dist_zero::ZeroAdam as Optimizer<Model, OnWgpu>>::to_record(&on_device);
    let bytes = Recorder::<OnWgpu>::record(&recorder, record, ()).unwrap();
    let fresh = || {
        ZeroAdamConfig::new()
            .init::<OnWgpu, _>(&ddp, &model)
            .unwrap()
    };
    let load = |zero| {
        let record = Recorder::<OnWgpu>::load(&recorder, bytes.clone(), &device).unwrap();
        <burn_dist_zero::ZeroAdam as Optimizer<Model, OnWgpu>>::load_record(zero, record)
    };
    assert!(
        load(fresh()).export() == shard,
        "device record into the host"
    );
    let device_again = load(fresh().on_device::<Wgpu>(&ddp, &device).unwrap());
    assert!(
        device_again.export() == shard,
        "device record into the device"
    );

    // Uneven per-parameter step counts cannot live in the device's single counter.
    shard.time[0] = 4;
    let error = on_device.import(shard).unwrap_err().to_string();
    assert!(error.contains("one count for all"), "{error}");
}

#[test]
fn a_host_path_ddp_is_refused_by_name() {
    use burn_dist_comm::{CommConfig, HostCommunicator};
    use burn_dist_testing::{MLP_SIZES, Mlp};
    let comm = HostCommunicator::local_group(1, &CommConfig::default()).remove(0);
    let mut ddp = Ddp::for_thread(comm, DdpConfig::new());
    let model = ddp
        .prepare(Mlp::<B>::new(&MLP_SIZES, 7, &FlexDevice))
        .unwrap();
    let zero = ZeroAdamConfig::new().init::<B, _>(&ddp, &model).unwrap();
    let error = zero
        .on_device::<Wgpu>(&ddp, &WgpuDevice::default())
        .err()
        .expect("a host-path Ddp has no device collectives")
        .to_string();
    assert!(error.contains("Ddp::init_staged"), "{error}");
}

/// A device state imported from a checkpoint keeps the decay rule (the kernels' mask is the
/// layout's and the rule's, not the state's): after `import`, a step on a zero gradient, where
/// only the decay moves anything, shrinks the MLP's weights by exactly `1 − lr·decay` and
/// leaves its biases as they were.
#[test]
fn an_imported_device_state_keeps_the_decay_rule() {
    use burn_dist_testing::{MLP_SIZES, parameters};
    use burn_dist_zero::DecayRule;
    let (mut ddp, model, device) = one_rank_mlp_on_wgpu();
    let decay = 0.5;
    let mut zero = ZeroAdamConfig::new()
        .with_weight_decay(decay)
        .with_decay(DecayRule::Matrices)
        .init::<OnWgpu, _>(&ddp, &model)
        .unwrap()
        .on_device::<Wgpu>(&ddp, &device)
        .unwrap();
    let state = zero.export();
    zero.import(state).unwrap();
    let before = parameters::<OnWgpu, _>(&model);
    let marked = ddp.mark(model);
    let input = burn::tensor::Tensor::ones([2, MLP_SIZES[0]], &device);
    let grads = ddp
        .backward(marked.forward(input).mean() * 0.0, &marked)
        .unwrap()
        .unwrap();
    let (model, _) = zero.step(LR, marked, grads, &ddp).unwrap();
    let after = parameters::<OnWgpu, _>(&model);
    let factor = (1.0 - f64::from(LR as f32) * f64::from(decay)) as f32;
    for (i, (before, after)) in before.iter().zip(&after).enumerate() {
        // Burn's Linear: weight then bias, per layer.
        let want: Vec<f32> = if i % 2 == 0 {
            before.iter().map(|p| p * factor).collect()
        } else {
            before.clone()
        };
        assert!(
            after == &want,
            "tensor {i} (a {})",
            if i % 2 == 0 { "weight" } else { "bias" }
        );
    }
}

/// "Roll back to the best model" (`burn_dist_testing::roll_back`) on 2 ranks on wgpu at
/// `stage`, ZeroAdam's state in device memory.
fn rolled_back_on_device(stage: u8, after_load: AfterLoad) -> Vec<RolledBack<()>> {
    use burn_dist_testing::zero_mlp_step;
    burn_dist_kernels::testing::wgpu_client();
    let device = WgpuDevice::default();
    let f32 = burn::tensor::FloatDType::F32;
    placed_ranks::<OnWgpu, Wgpu, _>(
        2,
        &DdpConfig::new(),
        (stage, Place::Device),
        f32,
        &device,
        &|rank, ddp, model, zero| {
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
            roll_back(ddp, zero, model, step, after_load, |_| ())
        },
    )
}

/// A record kept in memory and loaded back: the device step takes the loaded values into its
/// master weights in device memory, and goes on from them, bit for bit as a run whose master
/// weights were set to them by an import.
#[test]
fn device_step_goes_on_from_a_record_loaded_back_at_stages_1_and_2() {
    for stage in [1, 2] {
        assert_trained_on_from_the_load(
            &rolled_back_on_device(stage, AfterLoad::TrainOn),
            &rolled_back_on_device(stage, AfterLoad::ImportLoadedMaster),
            &format!("stage {stage} on wgpu"),
        );
    }
}
