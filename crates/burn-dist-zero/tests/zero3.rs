//! ZeRO stage 3: parameters sharded too, gathered by the ops that use them.

use burn::backend::Autodiff;
use burn_dist::{BucketConfig, DdpConfig, DistributedBackend, Sharded};
use burn_dist_testing::{Synthetic, train_ranks};
use burn_dist_zero::ZeroAdamConfig;
use burn_flex::{Flex, FlexDevice};

type Replicated = Autodiff<DistributedBackend<Flex>>;
type Sharded3 = Autodiff<DistributedBackend<Flex, Sharded>>;

const STEPS: usize = 20;
const LR: f64 = 1e-2;
const GLOBAL_BATCH: usize = 12;

fn ddp_config() -> DdpConfig {
    let buckets = BucketConfig::new()
        .with_first_bucket_bytes(1024)
        .with_bucket_bytes(4096);
    DdpConfig::new().with_buckets(buckets)
}

#[test]
fn stage_three_equals_stage_two_bitwise() {
    for task in [Synthetic::Mlp, Synthetic::Transformer] {
        for world in 2..=4 {
            let two = train_ranks::<Replicated>(
                world,
                &ddp_config(),
                task,
                &ZeroAdamConfig::new().with_stage(2),
                STEPS,
                GLOBAL_BATCH,
                LR,
                &FlexDevice,
            );
            let three = train_ranks::<Sharded3>(
                world,
                &ddp_config(),
                task,
                &ZeroAdamConfig::new().with_stage(3),
                STEPS,
                GLOBAL_BATCH,
                LR,
                &FlexDevice,
            );
            assert!(
                two == three,
                "{task:?}, {world} ranks: stage 3 differs from stage 2"
            );
        }
    }
}
