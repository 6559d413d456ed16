//! ZeRO stage 3 on the device path: the CPU twin of the GPU path. The model trains on Burn's
//! `Wgpu` (fusion on) over Mesa's lavapipe with `DistributedBackend<Wgpu, Sharded>`; each rank's
//! pieces of the parameters live in device memory, every op's gather fills fresh device
//! buffers (staged through the host communicator's gather lane), gradients are reduce-scattered
//! in device memory, and ZeroAdam's fused kernels update the pieces in place. It equals the
//! host path on Flex, at 1 to 3 ranks, and what crosses between host and device is counted to
//! the byte.

use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use burn_dist::{Ddp, DistributedBackend, FlatLayout, ReducerStats, ShardStats, Sharded};
use burn_dist_comm::{CommConfig, HostCommunicator};
use burn_dist_testing::{
    OptimizerKind, Stepper, Synthetic, assert_close, small_bucket_config, train_ranks,
    train_synthetic,
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

/// ZeroAdam at stage 3, moved into the wgpu device memory once built.
struct OnDevice;

impl OptimizerKind for OnDevice {
    fn build<A, M>(&self, ddp: &Ddp, model: &M) -> Box<dyn Stepper<A, M>>
    where
        A: AutodiffBackend,
        M: AutodiffModule<A> + 'static,
    {
        let zero = ZeroAdamConfig::new()
            .with_stage(3)
            .init::<A, M>(ddp, model)
            .and_then(|zero| zero.on_device::<Wgpu>(ddp, &WgpuDevice::default()))
            .expect("ZeroAdam at stage 3 on the wgpu device");
        Box::new(zero)
    }
}

/// One rank's result on the device path.
struct Rank {
    params: Vec<Vec<f32>>,
    reducer: ReducerStats,
    shards: ShardStats,
}

/// `world` thread ranks training `task` at stage 3 on wgpu.
fn train_on_device(world: usize, task: Synthetic) -> Vec<Rank> {
    burn_dist_kernels::testing::wgpu_client();
    let device = WgpuDevice::default();
    let comms = HostCommunicator::local_group(world, &CommConfig::default());
    burn_dist_comm::testing::run_ranks(comms, |_, comm| {
        let mut ddp = Ddp::for_thread_staged::<Wgpu>(comm, small_bucket_config(1), &device);
        let params = train_synthetic::<OnWgpu>(
            &mut ddp,
            task,
            &OnDevice,
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
    for world in [1, 3] {
        let flat = FlatLayout::new(&numels, world, burn_dist::SHARD_ALIGN);
        let shard_bytes = 4 * flat.shard_len as u64;
        for (rank, r) in train_on_device(world, Synthetic::Mlp).iter().enumerate() {
            let shard = flat.shard(rank);
            let owned = 4 * total.min(shard.end).saturating_sub(shard.start) as u64;
            assert_eq!(
                r.shards.reads,
                numels.len() as u64,
                "one read per parameter"
            );
            let gathered = r.shards.gathered_bytes + gradient_bytes;
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
