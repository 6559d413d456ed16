//! ZeroAdam offloaded: how much of the gradient shard's trip to the host hides behind backward.
//! `cargo bench -p burn-dist-zero --bench offload_overlap` (figures in docs/perf/offload.md).
//!
//! Two thread ranks on Burn's `Wgpu` (fusion on; Mesa's lavapipe on a machine without a GPU),
//! the staged device collectives, an MLP of about 4.5 M parameters in f32, ZeroAdam offloaded at
//! stages 2 and 3. Each configuration runs with the gradient shard streamed to the host during
//! backward (`Ddp::stream_gradient_shard_to_host(true)`, what ZeroAdam sets) and read at once
//! after backward (`false`), alternately, `ROUNDS` times, so that the load of a shared machine
//! falls on both. Per step, rank 0's:
//! - **wait**: what taking the shard waited for its values (`ReducerStats::shard_wait_nanos`):
//!   the device time the offloaded step cannot start its host step before;
//! - **backward** (`Ddp::backward`) and **step** (`ZeroAdam::step`: the wait, the host step,
//!   the write-back) wall times, and their sum.
//!
//! Each figure is the median over rounds of the round's median step. Without `--bench` (as
//! `cargo test --benches` runs it) one short round checks that it works.

use std::time::Instant;

use burn::backend::Autodiff;
use burn::tensor::backend::AutodiffBackend;
use burn_dist::{
    BucketConfig, Ddp, DdpConfig, DistributedAutodiff, DistributedBackend, ReducerStats, Sharded,
};
use burn_dist_comm::testing::run_ranks;
use burn_dist_comm::{CommConfig, HostCommunicator};
use burn_dist_testing::{Mlp, shard_rows, synthetic_rows};
use burn_dist_zero::ZeroAdamConfig;
use burn_wgpu::{Wgpu, WgpuDevice};

type OnWgpu = Autodiff<DistributedBackend<Wgpu>>;
type ShardedOnWgpu = Autodiff<DistributedBackend<Wgpu, Sharded>>;

const WORLD: usize = 2;
/// Layer widths: 4 × (1024 × 1024) weights and their biases, about 4.5 M parameters.
const SIZES: [usize; 6] = [256, 1024, 1024, 1024, 1024, 256];
const GLOBAL_BATCH: usize = 16;
/// 2 MiB buckets, so that the ~9 MiB of each rank's gradient shard comes in several ranges.
const BUCKET_BYTES: usize = 2 << 20;
const LR: f64 = 1e-3;

/// One run's per-step figures on rank 0, in ms: (wait, backward, step).
type Steps = Vec<(f64, f64, f64)>;

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let (rounds, warmup, timed) = if full { (3, 2, 8) } else { (1, 1, 1) };
    println!(
        "{:>5} {:>24} {:>9} {:>11} {:>9} {:>9}",
        "stage", "gradient shard to host", "wait ms", "backward ms", "step ms", "total ms"
    );
    for stage in [2u8, 3] {
        let mut by_mode: [Vec<Steps>; 2] = [Vec::new(), Vec::new()];
        for round in 0..rounds {
            // Who goes first swaps every round.
            for i in 0..2 {
                let stream = (i + round) % 2 == 0;
                let steps = match stage {
                    3 => run::<ShardedOnWgpu>(stage, stream, warmup, timed),
                    _ => run::<OnWgpu>(stage, stream, warmup, timed),
                };
                by_mode[usize::from(!stream)].push(steps);
            }
        }
        for (mode, runs) in ["during backward", "at once after backward"]
            .iter()
            .zip(&by_mode)
        {
            let figure = |f: fn(&(f64, f64, f64)) -> f64| {
                median(
                    runs.iter()
                        .map(|r| median(r.iter().map(f).collect()))
                        .collect(),
                )
            };
            let (wait, backward, step) = (figure(|s| s.0), figure(|s| s.1), figure(|s| s.2));
            println!(
                "{stage:>5} {mode:>24} {wait:>9.2} {backward:>11.1} {step:>9.1} {:>9.1}",
                backward + step
            );
        }
    }
}

/// `warmup` then `timed` steps of the MLP on `WORLD` thread ranks at `stage`, ZeroAdam
/// offloaded, the shard streamed or not; rank 0's timed steps.
fn run<B: DistributedAutodiff<Device = WgpuDevice>>(
    stage: u8,
    stream: bool,
    warmup: usize,
    timed: usize,
) -> Steps {
    let device = WgpuDevice::default();
    let comms = HostCommunicator::local_group(WORLD, &CommConfig::default());
    let ranks = run_ranks(comms, |rank, comm| {
        let buckets = BucketConfig::new()
            .with_first_bucket_bytes(BUCKET_BYTES)
            .with_bucket_bytes(BUCKET_BYTES);
        let config = DdpConfig::new().with_buckets(buckets);
        let mut ddp = Ddp::for_thread_staged::<Wgpu>(comm, config, &device);
        let model = Mlp::<B>::new(&SIZES, 7, &device);
        let mut model = B::prepare_model(&mut ddp, model).expect("the MLP prepared");
        let zero = ZeroAdamConfig::new()
            .with_stage(stage)
            .init::<B, _>(&ddp, &model)
            .expect("ZeroAdam built");
        let mut zero = zero
            .offloaded::<Wgpu>(&ddp, &device)
            .expect("ZeroAdam offloaded");
        ddp.stream_gradient_shard_to_host(stream);
        let mut steps = Vec::new();
        for step in 0..warmup + timed {
            let waited = ddp.stats().shard_wait_nanos;
            let started = Instant::now();
            let loss = mse(&model, (rank, step), &device);
            let grads = ddp.backward(loss, &model).unwrap().unwrap();
            let backward = started.elapsed();
            let stepped = Instant::now();
            model = zero.step(LR, model, grads, &ddp).unwrap().0;
            let step_time = stepped.elapsed();
            let ReducerStats {
                shard_wait_nanos, ..
            } = ddp.stats();
            if step >= warmup {
                steps.push((
                    (shard_wait_nanos - waited) as f64 / 1e6,
                    backward.as_secs_f64() * 1e3,
                    step_time.as_secs_f64() * 1e3,
                ));
            }
        }
        steps
    });
    ranks.into_iter().next().expect("rank 0")
}

/// The mean squared error of the MLP on this rank's rows of the step's synthetic batch.
fn mse<B: AutodiffBackend>(
    model: &Mlp<B>,
    (rank, step): (usize, usize),
    device: &B::Device,
) -> burn::tensor::Tensor<B, 1> {
    let (input, output) = (SIZES[0], SIZES[SIZES.len() - 1]);
    let rows = shard_rows(GLOBAL_BATCH, rank, WORLD);
    let x = synthetic_rows::<B, 2>(0, step, [GLOBAL_BATCH, input], rows.clone(), device);
    let y = synthetic_rows::<B, 2>(1, step, [GLOBAL_BATCH, output], rows, device);
    (model.forward(x) - y).powi_scalar(2).mean()
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}
