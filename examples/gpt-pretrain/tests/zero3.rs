//! The GPT with its tied embedding (the token embedding is also the LM head, through
//! `weight.transpose()`) trains bit for bit alike at ZeRO stages 2 and 3, at 2, 3 and 4 ranks
//! (threads of this process), with global-norm clipping active, in f32 and in bf16.

use burn::backend::Autodiff;
use burn::module::Module;
use burn::tensor::{FloatDType, Int, Tensor, TensorData};
use burn_dist::{BucketConfig, Ddp, DdpConfig, DistributedAutodiff, DistributedBackend, Sharded};
use burn_dist_comm::testing::run_ranks;
use burn_dist_comm::{CommConfig, HostCommunicator};
use burn_dist_models::Cast;
use burn_dist_models::step::float_params;
use burn_dist_zero::ZeroAdamConfig;
use burn_flex::{Flex, FlexDevice};
use gpt_pretrain::model::GptConfig;

const VOCAB: usize = 64;
const CONTEXT: usize = 16;
/// Sequences per step, over all ranks.
const GLOBAL_BATCH: usize = 12;
const STEPS: usize = 4;

/// Tokens of sequence `row` of step `step`: the same on every rank and in every run.
fn sequence(step: usize, row: usize) -> Vec<i64> {
    (0..=CONTEXT)
        .map(|t| ((step * 131 + row * 31 + t * t * 7) % VOCAB) as i64)
        .collect()
}

/// Every rank's parameters after [`STEPS`] steps of ZeroAdam at `stage` (clipping at 0.5,
/// which these gradients exceed), the model in `dtype`.
fn train<B: DistributedAutodiff<Device = FlexDevice>>(
    world: usize,
    stage: u8,
    dtype: FloatDType,
) -> Vec<Vec<Vec<f32>>> {
    let comms = HostCommunicator::local_group(world, &CommConfig::default());
    run_ranks(comms, |rank, comm| {
        let buckets = BucketConfig::new()
            .with_first_bucket_bytes(4096)
            .with_bucket_bytes(16384);
        let mut ddp = Ddp::for_thread(comm, DdpConfig::new().with_buckets(buckets));
        let mut config = GptConfig::tiny(VOCAB);
        config.context = CONTEXT;
        assert!(config.tie_weights, "the LM head is the token embedding");
        let model = config.init::<B>(3, &FlexDevice).map(&mut Cast(dtype));
        let mut model = B::prepare_model(&mut ddp, model).unwrap();
        let mut zero = ZeroAdamConfig::new()
            .with_stage(stage)
            .with_max_grad_norm(Some(0.5))
            .init::<B, _>(&ddp, &model)
            .unwrap();
        let per_rank = GLOBAL_BATCH / world;
        for step in 0..STEPS {
            let rows = rank * per_rank..(rank + 1) * per_rank;
            let tokens: Vec<i64> = rows.flat_map(|row| sequence(step, row)).collect();
            let tokens = Tensor::<B, 2, Int>::from_data(
                TensorData::new(tokens, [per_rank, CONTEXT + 1]),
                &FlexDevice,
            );
            let inputs = tokens.clone().slice([0..per_rank, 0..CONTEXT]);
            let targets = tokens.slice([0..per_rank, 1..CONTEXT + 1]);
            let loss = model.loss(inputs, targets);
            let grads = ddp.backward(loss, &model).unwrap().unwrap();
            let (stepped, report) = zero.step(3e-3, model, grads, &ddp).unwrap();
            assert!(report.clip < 1.0, "clipping is active");
            model = stepped;
        }
        float_params::<B, _>(&model)
    })
}

#[test]
fn the_tied_gpt_at_stage_three_equals_stage_two_bitwise() {
    for dtype in [FloatDType::F32, FloatDType::BF16] {
        for world in 2..=4 {
            let two = train::<Autodiff<DistributedBackend<Flex>>>(world, 2, dtype);
            let three = train::<Autodiff<DistributedBackend<Flex, Sharded>>>(world, 3, dtype);
            for rank in 1..world {
                assert!(
                    three[rank] == three[0],
                    "{dtype:?}, {world} ranks: rank {rank}"
                );
            }
            assert!(
                two == three,
                "{dtype:?}, {world} ranks: stage 3 differs from stage 2"
            );
        }
    }
}
