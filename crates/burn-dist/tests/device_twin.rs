//! The device path's CPU twin: `Autodiff<DistributedBackend<Wgpu>>` (Burn's default `Wgpu`,
//! fusion on) and burn-cubecl without fusion, on Mesa's lavapipe, with the gradients kept in
//! device memory and reduced in place by the staged device collectives, against the host path
//! on Flex with one rank and the whole batch. The NCCL path runs the same reducer code above
//! the same interface (`burn_dist_device`), so what is proven here holds there except for the
//! collectives themselves (docs/testing.md).

use burn::backend::Autodiff;
use burn_cubecl::CubeBackend;
use burn_dist::{BucketConfig, Ddp, DdpConfig, DistributedBackend, ReducerStats};
use burn_dist_testing::{BurnAdam, Synthetic, train_ranks, train_ranks_with};
use burn_flex::{Flex, FlexDevice};
use burn_wgpu::{Wgpu, WgpuDevice, WgpuRuntime};

/// Burn's `Wgpu` without fusion.
type WgpuPlain = CubeBackend<WgpuRuntime, f32, i32, u32>;

const STEPS: usize = 4;
const LR: f64 = 1e-2;
/// Divisible by 1, 2, 3 and 4.
const GLOBAL_BATCH: usize = 12;
/// lavapipe's f32 kernels sum in another order than Flex's.
const TOLERANCE: f64 = 1e-4;

/// Buckets small enough that the test models span several of them.
fn config() -> DdpConfig {
    DdpConfig::new().with_buckets(
        BucketConfig::new()
            .with_first_bucket_bytes(1024)
            .with_bucket_bytes(4096),
    )
}

/// The host path on Flex, one rank, the whole batch: the reference.
fn reference(task: Synthetic, config: &DdpConfig) -> Vec<Vec<f32>> {
    let ranks = train_ranks::<Autodiff<DistributedBackend<Flex>>>(
        1,
        config,
        task,
        &BurnAdam,
        STEPS,
        GLOBAL_BATCH,
        LR,
        &FlexDevice,
    );
    ranks.into_iter().next().expect("one rank")
}

/// `world` ranks on backend `D`'s device memory, with the staged device collectives.
fn on_device<D: burn_dist::CubeResident<Device = WgpuDevice>>(
    task: Synthetic,
    world: usize,
    config: &DdpConfig,
) -> Vec<(Vec<Vec<f32>>, ReducerStats)> {
    burn_dist_kernels::testing::wgpu_client();
    let device = WgpuDevice::default();
    train_ranks_with::<Autodiff<DistributedBackend<D>>>(
        world,
        |comm| Ddp::for_thread_staged::<D>(comm, config.clone(), &device),
        task,
        &BurnAdam,
        STEPS,
        GLOBAL_BATCH,
        LR,
        &device,
    )
}

/// Which gradients the device store copies before it reduces them (`ReducerStats::private_copies`).
#[derive(Clone, Copy)]
enum Copies {
    /// Fusion's gradients share their memory with fusion's own handle: each one the hook
    /// hands over, every micro-batch, is copied.
    Every { micro_batches: u64 },
    /// burn-cubecl without fusion hands over gradients that nothing else holds: reduced where
    /// they are.
    None,
}

/// Every rank ends on the reference's parameters, bitwise like every other rank, having
/// reduced on the device: each step stages every gradient down and up exactly once, receives
/// every reduced element once, and copies the gradients `copies` says.
fn assert_twin(
    ranks: &[(Vec<Vec<f32>>, ReducerStats)],
    reference: &[Vec<f32>],
    copies: Copies,
    what: &str,
) {
    // Elements and f32 bytes of the model's parameters, each moved once a step.
    let elements = reference.iter().map(Vec::len).sum::<usize>() as u64;
    let bytes = 4 * elements;
    let copies_per_step = match copies {
        Copies::Every { micro_batches } => micro_batches * reference.len() as u64,
        Copies::None => 0,
    };
    for (rank, (params, stats)) in ranks.iter().enumerate() {
        burn_dist_testing::assert_close(
            params,
            reference,
            TOLERANCE,
            &format!("{what}, rank {rank}"),
        );
        assert!(
            params == &ranks[0].0,
            "{what}: rank {rank}'s parameters differ from rank 0's"
        );
        assert_eq!(
            (stats.bytes_to_host, stats.bytes_to_device),
            (STEPS as u64 * bytes, STEPS as u64 * bytes),
            "{what}, rank {rank}: the staged path moves each gradient down and up once per step"
        );
        assert!(
            stats.device_launches > 0,
            "{what}, rank {rank}: reduced on the host path"
        );
        assert_eq!(
            stats.reduced_elements_received,
            STEPS as u64 * elements,
            "{what}, rank {rank}: every bucket's reduction delivers all its elements each step"
        );
        assert_eq!(
            stats.private_copies,
            STEPS as u64 * copies_per_step,
            "{what}, rank {rank}: gradients copied before their reduction"
        );
    }
}

#[test]
fn wgpu_with_fusion_on_the_device_path_equals_flex_mlp_1_to_4_ranks() {
    let reference = reference(Synthetic::Mlp, &config());
    for world in 1..=4 {
        let ranks = on_device::<Wgpu>(Synthetic::Mlp, world, &config());
        assert_twin(
            &ranks,
            &reference,
            Copies::Every { micro_batches: 1 },
            &format!("MLP, Wgpu (fusion), {world} ranks"),
        );
    }
}

#[test]
fn wgpu_with_fusion_on_the_device_path_equals_flex_transformer_block() {
    let reference = reference(Synthetic::Transformer, &config());
    for world in [1, 3] {
        let ranks = on_device::<Wgpu>(Synthetic::Transformer, world, &config());
        assert_twin(
            &ranks,
            &reference,
            Copies::Every { micro_batches: 1 },
            &format!("transformer, Wgpu (fusion), {world} ranks"),
        );
    }
}

#[test]
fn wgpu_without_fusion_on_the_device_path_equals_flex() {
    let reference = reference(Synthetic::Transformer, &config());
    let ranks = on_device::<WgpuPlain>(Synthetic::Transformer, 2, &config());
    assert_twin(
        &ranks,
        &reference,
        Copies::None,
        "transformer, Wgpu (no fusion), 2 ranks",
    );
}

#[test]
fn accumulation_on_the_device_path_equals_one_step_on_the_whole_batch() {
    let reference = reference(Synthetic::Mlp, &config());
    let ranks = on_device::<Wgpu>(Synthetic::Mlp, 2, &config().with_accumulation_steps(3));
    assert_twin(
        &ranks,
        &reference,
        Copies::Every { micro_batches: 3 },
        "MLP, Wgpu (fusion), 2 ranks × 3 micro-batches",
    );
}

#[test]
fn a_flex_gradient_on_a_wgpu_device_reducer_fails_naming_both_backends() {
    use burn_dist_testing::{MLP_SIZES, Mlp};
    burn_dist_kernels::testing::wgpu_client();
    let comm = burn_dist_comm::HostCommunicator::local_group(1, &Default::default())
        .pop()
        .expect("one rank");
    let mut ddp = Ddp::for_thread_staged::<Wgpu>(comm, config(), &WgpuDevice::default());
    type F = Autodiff<DistributedBackend<Flex>>;
    let model = ddp
        .prepare(Mlp::<F>::new(&MLP_SIZES, 7, &FlexDevice))
        .expect("prepare");
    let x = burn::tensor::Tensor::<F, 2>::ones([2, MLP_SIZES[0]], &FlexDevice);
    let err = ddp
        .backward(model.forward(x).sum(), &model)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("the device reducer was set up for gradients of"),
        "{err}"
    );
    assert!(
        err.contains("FusionTensor") && err.contains("FlexTensor"),
        "{err}"
    );
}

/// A parameter that one rank does not use gets device zeros from it and the averaged gradient
/// everywhere; one that no rank uses gets no gradient anywhere: as on the host path (Flex, one
/// process) on the device path.
#[test]
fn unused_parameters_on_the_device_path_are_averaged_or_left_without_gradient() {
    use burn_dist_testing::train_with_unused;
    burn_dist_kernels::testing::wgpu_client();
    let device = WgpuDevice::default();
    let make = |comm| Ddp::for_thread_staged::<Wgpu>(comm, config(), &device);
    let host = |comm| Ddp::for_thread(comm, config());
    type Host = Autodiff<DistributedBackend<Flex>>;
    type OnWgpu = Autodiff<DistributedBackend<Wgpu>>;
    for (world, unused_on) in [
        (3, &(|v: usize| v == 1) as &(dyn Fn(usize) -> bool + Sync)),
        (2, &|_| true),
    ] {
        let reference = train_with_unused::<Host>(1, world, unused_on, host, &FlexDevice).remove(0);
        let ranks = train_with_unused::<OnWgpu>(world, world, unused_on, make, &device);
        let everywhere_unused = world == 2;
        for (rank, (params, got)) in ranks.iter().enumerate() {
            let what = format!("{world} ranks, rank {rank}");
            burn_dist_testing::assert_close(params, &reference.0, TOLERANCE, &what);
            assert!(params == &ranks[0].0, "{what}: differs from rank 0");
            assert_eq!(
                *got, !everywhere_unused,
                "{what}: the second branch's gradient"
            );
        }
    }
}

/// f16 parameters are reduced in f16 on the device path: their gradients stay f16 in Burn's
/// container, each element crosses to the host and back as 2 bytes (not widened to f32), and
/// the two ranks' average is the one-rank gradient of the whole batch to f16's rounding.
#[test]
fn f16_gradients_are_reduced_in_f16_on_the_device_path() {
    use burn::module::Module;
    use burn::tensor::backend::AutodiffBackend;
    use burn::tensor::{DType, FloatDType};
    use burn_dist_testing::{Cast, MLP_SIZES, Mlp, shard_rows, synthetic_rows};
    type B = Autodiff<DistributedBackend<Wgpu>>;
    const BATCH: usize = 12;
    burn_dist_kernels::testing::wgpu_client();
    let device = WgpuDevice::default();
    let gradients = |world: usize| {
        let comms = burn_dist_comm::HostCommunicator::local_group(world, &Default::default());
        burn_dist_comm::testing::run_ranks(comms, |rank, comm| {
            let mut ddp = Ddp::for_thread_staged::<Wgpu>(comm, config(), &device);
            let mlp = Mlp::<B>::new(&MLP_SIZES, 7, &device).map(&mut Cast(FloatDType::F16));
            let model = ddp.prepare(mlp).expect("prepare");
            let rows = shard_rows(BATCH, rank, world);
            let x = synthetic_rows::<B, 2>(0, 0, [BATCH, MLP_SIZES[0]], rows, &device)
                .cast(FloatDType::F16);
            let grads = ddp
                .backward(model.forward(x).powi_scalar(2).mean(), &model)
                .expect("backward")
                .expect("a window of one");
            let weights: Vec<_> = model
                .layers
                .iter()
                .map(|layer| {
                    let grad = grads
                        .get::<<B as AutodiffBackend>::InnerBackend, 2>(layer.weight.id)
                        .expect("every weight has a gradient");
                    let dtype = grad.dtype();
                    let values = grad.cast(FloatDType::F32).into_data().to_vec::<f32>();
                    (dtype, values.expect("f32 values"))
                })
                .collect();
            (weights, ddp.stats())
        })
    };
    let reference: Vec<Vec<f32>> = gradients(1)
        .remove(0)
        .0
        .into_iter()
        .map(|(_, values)| values)
        .collect();
    let elements = MLP_SIZES
        .windows(2)
        .map(|w| w[0] * w[1] + w[1])
        .sum::<usize>() as u64;
    for (rank, (weights, stats)) in gradients(2).into_iter().enumerate() {
        for (layer, (dtype, _)) in weights.iter().enumerate() {
            assert_eq!(*dtype, DType::F16, "rank {rank}, layer {layer}'s gradient");
        }
        assert_eq!(
            (stats.bytes_to_host, stats.bytes_to_device),
            (2 * elements, 2 * elements),
            "rank {rank}: the f16 gradients staged down and up, 2 bytes an element"
        );
        let values: Vec<Vec<f32>> = weights.into_iter().map(|(_, values)| values).collect();
        burn_dist_testing::assert_close(&values, &reference, 1e-2, &format!("rank {rank}"));
    }
}

/// The copies worked out in `burn_dist_models::SharedGradients`: without fusion, a gradient
/// that is a transposed view and both parameters of an add (whose backward hands both parents
/// one `dy`, still shared when each hook fires) are copied before their reduction, three in
/// all (nothing pads rows on wgpu); the gradients equal the unsynchronized model's.
#[test]
fn shared_and_strided_gradients_are_copied_and_both_parents_of_an_add_are_shared() {
    use burn_dist::{Ddp, DistributedAutodiff};
    use burn_dist_comm::{CommConfig, HostCommunicator};
    use burn_dist_testing::SharedGradients;
    type D = Autodiff<DistributedBackend<WgpuPlain>>;
    burn_dist_kernels::testing::wgpu_client();
    let device = WgpuDevice::default();
    let comm = HostCommunicator::local_group(1, &CommConfig::default()).remove(0);
    let mut ddp = Ddp::for_thread_staged::<WgpuPlain>(comm, DdpConfig::new(), &device);
    let model = D::prepare_model(&mut ddp, SharedGradients::<D>::new(&device)).unwrap();
    let before = ddp.stats();
    let grads = ddp
        .backward(model.loss(SharedGradients::<D>::input(&device)), &model)
        .unwrap()
        .expect("gradients");
    let stats = ddp.stats();
    assert_eq!(
        (
            stats.private_copies - before.private_copies,
            stats.pitched_copies - before.pitched_copies
        ),
        (SharedGradients::<D>::UNPITCHED_COPIES, 0),
        "private and pitched copies"
    );
    let plain = SharedGradients::<Autodiff<WgpuPlain>>::new(&device);
    let x = SharedGradients::<Autodiff<WgpuPlain>>::input(&device);
    let reference = burn::optim::GradientsParams::from_grads(plain.loss(x).backward(), &plain);
    let pairs = [
        (model.a.id, plain.a.id),
        (model.p1.id, plain.p1.id),
        (model.p2.id, plain.p2.id),
        (model.q.id, plain.q.id),
    ];
    for (name, (synced, unsynced)) in ["a", "p1", "p2", "q"].into_iter().zip(pairs) {
        let got = grads
            .get::<DistributedBackend<WgpuPlain>, 2>(synced)
            .expect("a gradient")
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        let want = reference
            .get::<WgpuPlain, 2>(unsynced)
            .expect("a gradient")
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        assert_eq!(got, want, "{name}'s gradient after Ddp::backward");
    }
}
