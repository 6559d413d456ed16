//! ZeRO stage 3 on the device path: the CPU twin of the GPU path. The model trains on Burn's
//! `Wgpu` (fusion on) over Mesa's lavapipe with `DistributedBackend<Wgpu, Sharded>`; each rank's
//! pieces of the parameters live in device memory, every op's gather fills fresh device
//! buffers (staged through the host communicator's gather lane), gradients are reduce-scattered
//! in device memory, and ZeroAdam's fused kernels update the pieces in place. It equals the
//! host path on Flex, at 1 to 3 ranks, and what crosses between host and device is counted to
//! the byte.

use burn::backend::Autodiff;
use burn::tensor::backend::AutodiffBackend;
use burn_dist::{
    Ddp, DistributedBackend, FlatLayout, PrefetchConfig, ReducerStats, ShardStats, Sharded,
};
use burn_dist_comm::{CommConfig, HostCommunicator};
use burn_dist_testing::placed::{Place, Placed, RankBody, placed_ranks};
use burn_dist_testing::{
    Synthetic, assert_close, small_bucket_config, train_ranks, train_synthetic,
};
use burn_dist_zero::ZeroAdamConfig;
use burn_flex::FlexDevice;
use burn_wgpu::{Wgpu, WgpuDevice};

/// The host path's stage 3: the reference.
type OnFlex = Autodiff<DistributedBackend<burn_flex::Flex, Sharded>>;
/// The device path's twin.
type OnWgpu = Autodiff<DistributedBackend<Wgpu, Sharded>>;

const STEPS: usize = 6;
const LR: f64 = 1e-2;
const GLOBAL_BATCH: usize = 12;
/// lavapipe's f32 kernels sum in another order than Flex's.
const TOLERANCE: f64 = 1e-4;

/// One rank's result on the device path.
struct Rank {
    params: Vec<Vec<f32>>,
    reducer: ReducerStats,
    shards: ShardStats,
}

/// `world` thread ranks training `task` at stage 3 on wgpu.
fn train_on_device(world: usize, task: Synthetic) -> Vec<Rank> {
    train_on_device_with(world, task, PrefetchConfig::new())
}

/// [`train_on_device`] with `prefetch`.
fn train_on_device_with(world: usize, task: Synthetic, prefetch: PrefetchConfig) -> Vec<Rank> {
    burn_dist_kernels::testing::wgpu_client();
    let device = WgpuDevice::default();
    let comms = HostCommunicator::local_group(world, &CommConfig::default());
    burn_dist_comm::testing::run_ranks(comms, |_, comm| {
        let config = small_bucket_config(1).with_prefetch(prefetch);
        let mut ddp = Ddp::for_thread_staged::<Wgpu>(comm, config, &device);
        let params = train_synthetic::<OnWgpu>(
            &mut ddp,
            task,
            &Placed::<Wgpu> {
                config: ZeroAdamConfig::new().with_stage(3),
                place: Place::Device,
                device: device.clone(),
            },
            STEPS,
            GLOBAL_BATCH,
            LR,
            &device,
            |_, _| {},
        )
        .expect("training at stage 3 on the device");
        Rank {
            params,
            reducer: ddp.stats(),
            shards: ddp.shard_stats().expect("a sharded model"),
        }
    })
}

/// The host path at stage 3 on Flex.
fn train_on_host(world: usize, task: Synthetic) -> Vec<Vec<f32>> {
    train_ranks::<OnFlex>(
        world,
        &small_bucket_config(1),
        task,
        &ZeroAdamConfig::new().with_stage(3),
        STEPS,
        GLOBAL_BATCH,
        LR,
        &FlexDevice,
    )
    .remove(0)
}

#[test]
fn stage_three_on_wgpu_equals_the_host_path_at_one_to_three_ranks() {
    // The MLP at 1 to 3 ranks; the transformer block (attention's transposed and reshaped
    // parameters, layer normalization) at 2.
    let runs = [
        (Synthetic::Mlp, 1),
        (Synthetic::Mlp, 2),
        (Synthetic::Mlp, 3),
        (Synthetic::Transformer, 2),
    ];
    for (task, world) in runs {
        let one_rank = train_on_host(1, task);
        let host = train_on_host(world, task);
        let device = train_on_device(world, task);
        for (rank, r) in device.iter().enumerate() {
            assert!(
                r.params == device[0].params,
                "{task:?}, {world} ranks: rank {rank} differs from rank 0"
            );
            assert!(
                r.reducer.device_launches > 0,
                "{task:?}, {world} ranks: the reducer ran on the host"
            );
            assert!(
                r.shards.gathers > 0,
                "{task:?}, {world} ranks: nothing was gathered"
            );
        }
        let what = format!("{task:?}, {world} ranks");
        assert_close(
            &device[0].params,
            &host,
            TOLERANCE,
            &format!("{what}: device vs host"),
        );
        assert_close(
            &device[0].params,
            &one_rank,
            TOLERANCE,
            &format!("{what}: device vs one rank on the host"),
        );
    }
}

/// What crosses between host and device on the staged path, per rank, to the byte:
/// - once, when the model is prepared: this rank's shard of the pieces, up; when ZeroAdam is
///   built: the same shard down (its master weights, before `on_device` hands it the pieces);
/// - per step: every local gradient down for the staged reduce-scatter and this rank's
///   reduced pieces up; ZeroAdam's scalars (8 bytes down, 48 up);
/// - per gather (an op's use, counted in `ShardStats::gathered_bytes`, and the reads that take
///   the final parameters): this rank's piece down and the others' up, the parameter's bytes
///   in all: nothing is padded or gathered twice.
#[test]
fn stage_three_on_wgpu_moves_exactly_what_the_staging_needs() {
    let reference = train_on_host(1, Synthetic::Mlp);
    let numels: Vec<usize> = reference.iter().map(Vec::len).collect();
    let total: usize = numels.iter().sum();
    let gradient_bytes = 4 * total as u64;
    // The default keeps the largest weight from forward to backward (no gather there); with
    // nothing kept, backward's unit of the weights around it carries a bias it does not use.
    let kept = PrefetchConfig::new();
    let none_kept = PrefetchConfig::new().with_reuse_bytes(Some(0));
    for (world, prefetch) in [(1, kept), (3, kept), (1, none_kept), (3, none_kept)] {
        let flat = FlatLayout::new(&numels, world, burn_dist::SHARD_ALIGN);
        let shard_bytes = 4 * flat.shard_len as u64;
        let ranks = train_on_device_with(world, Synthetic::Mlp, prefetch);
        for (rank, r) in ranks.iter().enumerate() {
            let shard = flat.shard(rank);
            let owned = 4 * total.min(shard.end).saturating_sub(shard.start) as u64;
            assert_eq!(
                r.shards.reads,
                numels.len() as u64,
                "one read per parameter"
            );
            // A gather moves its whole unit, what no use took included; a use served by a
            // kept tensor moves nothing.
            let (served_again, unused) = (r.shards.served_again, r.shards.unused_bytes);
            assert!(
                (served_again > 0) == (prefetch == kept) && (unused > 0) == (prefetch != kept),
                "{world} ranks, rank {rank}: {served_again} served by kept tensors, {unused} \
                 bytes unused"
            );
            let gathered = r.shards.gathered_bytes + r.shards.unused_bytes + gradient_bytes;
            let expected = 2 * shard_bytes + STEPS as u64 * (gradient_bytes + owned + 8 + 48);
            assert_eq!(
                r.reducer.bytes_to_host + r.reducer.bytes_to_device,
                expected + gathered,
                "{world} ranks, rank {rank}: bytes between host and device ({} down, {} up)",
                r.reducer.bytes_to_host,
                r.reducer.bytes_to_device,
            );
        }
    }
}

/// ZeroAdam's device state at stage 3 steps the model's pieces in place, so they must be in
/// device memory: a model prepared on the host path is refused, by name.
#[test]
fn stage_three_on_device_needs_the_pieces_in_device_memory() {
    burn_dist_kernels::testing::wgpu_client();
    let device = WgpuDevice::default();
    let comm = HostCommunicator::local_group(1, &CommConfig::default()).remove(0);
    // The host path's Ddp on the wgpu backend: the pieces stay in host memory.
    let mut ddp = Ddp::for_thread(comm, small_bucket_config(1));
    let model = ddp
        .prepare_sharded(burn_dist_testing::Mlp::<OnWgpu>::new(
            &burn_dist_testing::MLP_SIZES,
            7,
            &device,
        ))
        .unwrap();
    let error = ZeroAdamConfig::new()
        .with_stage(3)
        .init::<OnWgpu, _>(&ddp, &model)
        .unwrap()
        .on_device::<Wgpu>(&ddp, &device)
        .err()
        .expect("pieces in host memory")
        .to_string();
    assert!(
        error.contains("needs the model's pieces in device memory"),
        "{error}"
    );
}

/// One step of the test MLP on this rank's rows of batch `step`, in the model's dtype.
fn mlp_step<B: AutodiffBackend>(
    ddp: &mut Ddp,
    model: burn_dist_testing::Mlp<B>,
    zero: &mut burn_dist_zero::ZeroAdam,
    at: (usize, usize, usize),
    dtype: burn::tensor::FloatDType,
    device: &B::Device,
) -> burn_dist_testing::Mlp<B> {
    burn_dist_testing::zero_mlp_step(ddp, model, zero, at, (GLOBAL_BATCH, LR), dtype, device)
}

/// `world` thread ranks on wgpu at stage 3, ZeroAdam in device memory, each running `body` on
/// its MLP cast to `dtype`.
fn on_device_ranks<T: Send>(
    world: usize,
    dtype: burn::tensor::FloatDType,
    body: RankBody<'_, OnWgpu, T>,
) -> Vec<T> {
    burn_dist_kernels::testing::wgpu_client();
    let device = WgpuDevice::default();
    placed_ranks::<OnWgpu, Wgpu, _>(
        world,
        &small_bucket_config(1),
        (3, Place::Device),
        dtype,
        &device,
        body,
    )
}

/// The state of ZeroAdam at stage 3 on the device round-trips exactly, and importing an earlier
/// state resumes bitwise as if the later steps had not happened: in f32 the import writes the
/// master weights into the model's pieces in place, which the next step must still update.
#[test]
fn stage_three_on_the_device_resumes_from_an_imported_state_bitwise() {
    use burn::tensor::FloatDType;
    use burn_dist_testing::parameters;
    let world = 2;
    let device = WgpuDevice::default();
    let train = |resume: bool| {
        on_device_ranks(world, FloatDType::F32, &|rank, ddp, mut model, zero| {
            let f32 = FloatDType::F32;
            for s in 0..3 {
                model = mlp_step(ddp, model, zero, (rank, world, s), f32, &device);
            }
            let saved = zero.export();
            if resume {
                // One step more, then back to the state after step 3.
                model = mlp_step(ddp, model, zero, (rank, world, 3), f32, &device);
                zero.import(saved.clone()).unwrap();
                assert!(
                    zero.export() == saved,
                    "rank {rank}: the import did not round-trip"
                );
                let pieces = ddp.param_shards().unwrap().shard_values();
                assert!(
                    pieces == saved.master,
                    "rank {rank}: the model's pieces are not the imported master weights"
                );
            }
            for s in 3..5 {
                model = mlp_step(ddp, model, zero, (rank, world, s), f32, &device);
            }
            parameters::<OnWgpu, _>(&model)
        })
    };
    let uninterrupted = train(false);
    let resumed = train(true);
    for (rank, (a, b)) in uninterrupted.iter().zip(&resumed).enumerate() {
        assert!(
            a == b,
            "rank {rank}: the resumed run differs from the uninterrupted one"
        );
    }
}

/// f16 parameters at stage 3 on the device: the pieces are f16 in device memory, ZeroAdam keeps
/// f32 master weights and writes its rounded copy into them; the run follows the host path's
/// stage 3 on Flex in f16 to f16's rounding.
#[test]
fn stage_three_on_the_device_trains_f16_parameters_like_the_host_path() {
    use burn::module::Module;
    use burn::tensor::FloatDType;
    use burn_dist_testing::{Cast, MLP_SIZES, Mlp, parameters};
    let (world, steps, f16) = (2, 4, FloatDType::F16);
    let device = WgpuDevice::default();
    let on_device = on_device_ranks(world, f16, &|rank, ddp, mut model, zero| {
        for s in 0..steps {
            model = mlp_step(ddp, model, zero, (rank, world, s), f16, &device);
        }
        parameters::<OnWgpu, _>(&model)
    });
    let comms = HostCommunicator::local_group(world, &CommConfig::default());
    let on_host = burn_dist_comm::testing::run_ranks(comms, |rank, comm| {
        let mut ddp = Ddp::for_thread(comm, small_bucket_config(1));
        let model = Mlp::<OnFlex>::new(&MLP_SIZES, 7, &FlexDevice).map(&mut Cast(f16));
        let mut model = ddp.prepare_sharded(model).unwrap();
        let mut zero = ZeroAdamConfig::new()
            .with_stage(3)
            .init::<OnFlex, _>(&ddp, &model)
            .unwrap();
        for s in 0..steps {
            model = mlp_step(
                &mut ddp,
                model,
                &mut zero,
                (rank, world, s),
                f16,
                &FlexDevice,
            );
        }
        parameters::<OnFlex, _>(&model)
    });
    assert!(on_device[1] == on_device[0], "the ranks differ");
    // f16's own rounding, and the two backends' f16 kernels round differently.
    assert_close(
        &on_device[0],
        &on_host[0],
        1e-2,
        "f16 at stage 3, device vs host",
    );
}

/// A model of another backend than the device path's is refused when it is prepared, naming
/// both, instead of failing in its first op's gather.
#[test]
fn a_model_of_another_backend_than_the_device_paths_is_refused_by_name() {
    type WithoutFusion = Autodiff<
        DistributedBackend<
            burn_cubecl::CubeBackend<burn_wgpu::WgpuRuntime, f32, i32, u32>,
            Sharded,
        >,
    >;
    burn_dist_kernels::testing::wgpu_client();
    let device = WgpuDevice::default();
    let comm = HostCommunicator::local_group(1, &CommConfig::default()).remove(0);
    // The device path of Burn's `Wgpu` (fusion on).
    let mut ddp = Ddp::for_thread_staged::<Wgpu>(comm, small_bucket_config(1), &device);
    let model =
        burn_dist_testing::Mlp::<WithoutFusion>::new(&burn_dist_testing::MLP_SIZES, 7, &device);
    let error = ddp.prepare_sharded(model).expect_err("refused").to_string();
    assert!(
        error.contains("FusionTensor") && error.contains("CubeTensor"),
        "{error}"
    );
}

/// f16 parameters at stage 3 on the device, a record kept in memory and loaded back: the load
/// writes the pieces (the device state's model copy), and the next step takes them into its
/// f32 master weights in device memory and goes on from them, bit for bit as a run whose
/// master weights were set to them by an import. (In f32 the pieces are the master weights.)
#[test]
fn stage_three_on_the_device_goes_on_from_a_record_loaded_back_in_f16() {
    use burn::tensor::FloatDType;
    use burn_dist_testing::roll_back::{AfterLoad, assert_trained_on_from_the_load, roll_back};
    let (world, f16) = (2, FloatDType::F16);
    let device = WgpuDevice::default();
    let run = |after_load| {
        on_device_ranks(world, f16, &|rank, ddp, model, zero| {
            let step = |ddp: &mut Ddp, zero: &mut _, model, s| {
                mlp_step(ddp, model, zero, (rank, world, s), f16, &device)
            };
            roll_back(ddp, zero, model, step, after_load, |_| ())
        })
    };
    assert_trained_on_from_the_load(
        &run(AfterLoad::TrainOn),
        &run(AfterLoad::ImportLoadedMaster),
        "f16 at stage 3 on wgpu",
    );
}
