//! Optimizer-state bytes per rank: ZeroAdam at N = 1, 2, 4 next to replicated Adam, read from
//! the allocated buffers. `cargo bench -p burn-dist-zero --bench state_bytes`.
//!
//! Replicated Adam with fp32 master weights keeps master, m and v for every parameter on every
//! rank: 3 × P × 4 bytes. ZeroAdam keeps them for one shard: 3 × shard_len × 4 bytes, with
//! shard_len = ceil(P / N) rounded up to the kernels' vector width.

use burn::backend::Autodiff;
use burn_dist::testing::TransformerBlock;
use burn_dist::{Ddp, DdpConfig, DistributedBackend};
use burn_dist_comm::testing::run_ranks;
use burn_dist_comm::{CommConfig, HostCommunicator};
use burn_dist_zero::ZeroAdamConfig;
use burn_flex::{Flex, FlexDevice};

type B = Autodiff<DistributedBackend<Flex>>;

fn main() {
    // `cargo test --benches` runs this with --bench absent; the table is cheap either way.
    let config = ZeroAdamConfig::new();
    println!(
        "{:>4} {:>14} {:>14} {:>16} {:>8}",
        "N", "params P", "shard_len", "bytes per rank", "ratio"
    );
    let mut replicated = 0;
    for world in [1, 2, 4] {
        let per_rank = run_ranks(
            HostCommunicator::local_group(world, &CommConfig::default()),
            |_, comm| {
                let mut ddp = Ddp::for_thread(comm, DdpConfig::new());
                let model = ddp
                    .prepare(TransformerBlock::<B>::new(256, 8, 1, &FlexDevice))
                    .expect("prepare");
                let zero = config.init::<B, _>(&ddp, &model).expect("ZeroAdam");
                let layout = zero.layout();
                let expected_shard =
                    layout.total.div_ceil(world).div_ceil(config.align) * config.align;
                assert_eq!(layout.shard_len, expected_shard);
                assert_eq!(
                    zero.state_len(),
                    3 * layout.shard_len,
                    "master, m and v of one shard"
                );
                (layout.total, layout.shard_len, zero.state_len() * 4)
            },
        );
        let (total, shard_len, bytes) = per_rank[0];
        assert!(
            per_rank.iter().all(|&r| r == per_rank[0]),
            "every rank holds the same amount"
        );
        if world == 1 {
            replicated = 3 * total * 4;
            println!(
                "{:>4} {total:>14} {:>14} {replicated:>16} {:>8}",
                "repl", "-", "1"
            );
        }
        let ratio = bytes as f64 / replicated as f64;
        println!("{world:>4} {total:>14} {shard_len:>14} {bytes:>16} {ratio:>8.4}");
    }
}
