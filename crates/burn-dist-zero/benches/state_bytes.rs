//! Optimizer-state bytes per rank: ZeroAdam at N = 1, 2, 4 next to replicated Adam, read from
//! the allocated buffers. `cargo bench -p burn-dist-zero --bench state_bytes`.
//!
//! Replicated Adam with fp32 master weights keeps master, m and v for every parameter on every
//! rank: 3 × P × 4 bytes. ZeroAdam keeps them for one shard: 3 × shard_len × 4 bytes, with
//! shard_len = ceil(P / N) rounded up to the kernels' vector width.
//!
//! Next to it, the gradient floats the reducer holds after one backward
//! (`Ddp::gradient_elements_held`): the whole model at stage 1, one shard at stage 2.

use burn::backend::Autodiff;
use burn_dist::{Ddp, DdpConfig, DistributedBackend};
use burn_dist_comm::testing::run_ranks;
use burn_dist_comm::{CommConfig, HostCommunicator};
use burn_dist_testing::{TransformerBlock, shard_rows, synthetic_rows};
use burn_dist_zero::ZeroAdamConfig;
use burn_flex::{Flex, FlexDevice};

type B = Autodiff<DistributedBackend<Flex>>;

fn main() {
    // `cargo test --benches` runs this with --bench absent; the table is cheap either way.
    println!(
        "{:>4} {:>14} {:>14} {:>16} {:>8} {:>16} {:>16}",
        "N", "params P", "shard_len", "bytes per rank", "ratio", "grad B stage 1", "grad B stage 2"
    );
    let mut replicated = 0;
    for world in [1, 2, 4] {
        let stage = |stage: u8| {
            run_ranks(
                HostCommunicator::local_group(world, &CommConfig::default()),
                |rank, comm| measure(world, rank, comm, stage),
            )
        };
        let (per_rank, stage_2) = (stage(1), stage(2));
        let (total, shard_len, bytes, grad_1) = per_rank[0];
        let grad_2 = stage_2[0].3;
        assert!(
            per_rank.iter().all(|&r| r == per_rank[0]),
            "every rank holds the same amount"
        );
        assert_eq!(grad_1, total * 4, "stage 1 keeps every bucket in full");
        assert_eq!(
            grad_2,
            shard_len * 4,
            "stage 2 keeps one shard of the gradient"
        );
        if world == 1 {
            replicated = 3 * total * 4;
            println!(
                "{:>4} {total:>14} {:>14} {replicated:>16} {:>8} {:>16} {:>16}",
                "repl", "-", "1", "-", "-"
            );
        }
        let ratio = bytes as f64 / replicated as f64;
        println!(
            "{world:>4} {total:>14} {shard_len:>14} {bytes:>16} {ratio:>8.4} {grad_1:>16} {grad_2:>16}"
        );
    }
}

/// One rank at ZeRO `stage`: (P, shard_len, optimizer-state bytes, gradient bytes held by the
/// reducer after one backward).
fn measure(
    world: usize,
    rank: usize,
    comm: HostCommunicator,
    stage: u8,
) -> (usize, usize, usize, usize) {
    const WIDTH: usize = 256;
    const BATCH: usize = 4;
    let config = ZeroAdamConfig::new().with_stage(stage);
    let mut ddp = Ddp::for_thread(comm, DdpConfig::new());
    let model = ddp
        .prepare(TransformerBlock::<B>::new(WIDTH, 8, 1, &FlexDevice))
        .expect("prepare");
    let zero = config.init::<B, _>(&ddp, &model).expect("ZeroAdam");
    let rows = shard_rows(BATCH, rank, world);
    let x = synthetic_rows::<B, 3>(0, 0, [BATCH, 2, WIDTH], rows, &FlexDevice);
    let loss = model.forward(x).powi_scalar(2).mean();
    ddp.backward(loss, &model).expect("backward");
    let grad_bytes = ddp.gradient_elements_held() * 4;
    let layout = zero.layout();
    let expected_shard = layout.total.div_ceil(world).div_ceil(config.align) * config.align;
    assert_eq!(layout.shard_len, expected_shard);
    assert_eq!(
        zero.state_len(),
        3 * layout.shard_len,
        "master, m and v of one shard"
    );
    (
        layout.total,
        layout.shard_len,
        zero.state_len() * 4,
        grad_bytes,
    )
}
