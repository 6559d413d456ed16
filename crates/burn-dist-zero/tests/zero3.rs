//! ZeRO stage 3 (parameters sharded too, gathered by the ops that use them) computes what
//! stage 2 computes, bit for bit, on every model shape whose parameters reach their ops
//! differently (linear layers, attention, a convolution with batch normalization, RMS
//! normalization's unsqueezed gain); it equals one rank with the whole batch; and Burn's
//! gradient checkpointing changes no bit of it, nor of DDP or stage 2.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn_dist::{DistributedAutodiff, DistributedBackend, Sharded};
use burn_dist_testing::{
    BurnAdam, BurnAdamW, OptimizerKind, Synthetic, assert_close, small_bucket_config, train_ranks,
};
use burn_dist_zero::ZeroAdamConfig;
use burn_flex::{Flex, FlexDevice};

type Replicated = Autodiff<DistributedBackend<Flex>>;
type Stage3 = Autodiff<DistributedBackend<Flex, Sharded>>;

const LR: f64 = 1e-2;
/// Divisible by every world size times 2 micro-batches used here.
const GLOBAL_BATCH: usize = 24;

const TASKS: [Synthetic; 4] = [
    Synthetic::Mlp,
    Synthetic::Transformer,
    Synthetic::ConvBatchNorm,
    Synthetic::RmsNorm,
];

/// Every rank's final parameters after `steps` steps of `task` on `world` thread ranks.
fn train<B: DistributedAutodiff<Device = burn_flex::FlexDevice>>(
    task: Synthetic,
    world: usize,
    accumulation: usize,
    optimizer: &(impl OptimizerKind + Sync),
    steps: usize,
) -> Vec<Vec<Vec<f32>>> {
    let ranks = train_ranks::<B>(
        world,
        &small_bucket_config(accumulation),
        task,
        optimizer,
        steps,
        GLOBAL_BATCH,
        LR,
        &FlexDevice,
    );
    for (rank, params) in ranks.iter().enumerate() {
        assert!(
            synchronized(task, params) == synchronized(task, &ranks[0]),
            "{task:?}, {world} ranks: rank {rank} ends with other parameters than rank 0"
        );
    }
    ranks
}

/// The tensors every rank must agree on: all but batch normalization's running statistics,
/// which each rank keeps from its own data (they are not synchronized, as in PyTorch without
/// `SyncBatchNorm`; `ConvNorm`'s visit order puts them 5th and 6th).
fn synchronized(task: Synthetic, params: &[Vec<f32>]) -> Vec<&Vec<f32>> {
    let statistics = match task {
        Synthetic::ConvBatchNorm => 4..6,
        _ => 0..0,
    };
    (0..params.len())
        .filter(|i| !statistics.contains(i))
        .map(|i| &params[i])
        .collect()
}

fn stage(stage: u8) -> ZeroAdamConfig {
    ZeroAdamConfig::new().with_stage(stage)
}

#[test]
fn stage_three_equals_stage_two_bitwise() {
    for task in TASKS {
        for world in 2..=4 {
            let two = train::<Replicated>(task, world, 1, &stage(2), 20);
            let three = train::<Stage3>(task, world, 1, &stage(3), 20);
            assert!(
                two == three,
                "{task:?}, {world} ranks: stage 3 differs from stage 2"
            );
        }
    }
}

#[test]
fn stage_three_equals_one_rank_with_the_whole_batch_with_and_without_accumulation() {
    for task in [Synthetic::Mlp, Synthetic::Transformer] {
        let reference = train::<Replicated>(task, 1, 1, &BurnAdamW, 50).remove(0);
        for (world, accumulation) in [(2, 1), (4, 1), (2, 2), (4, 2)] {
            let three = train::<Stage3>(task, world, accumulation, &stage(3), 50);
            assert_close(
                &three[0],
                &reference,
                1e-5,
                &format!(
                    "{task:?}, stage 3 on {world} ranks × {accumulation} micro-batches vs Burn's AdamW on 1"
                ),
            );
        }
    }
}

#[test]
fn gradient_checkpointing_changes_no_bit_of_ddp_stage_two_or_stage_three() {
    type Checkpointed = Autodiff<DistributedBackend<Flex>, BalancedCheckpointing>;
    type Stage3Checkpointed = Autodiff<DistributedBackend<Flex, Sharded>, BalancedCheckpointing>;
    for task in [Synthetic::Transformer, Synthetic::RmsNorm] {
        let world = 2;
        let ddp = train::<Replicated>(task, world, 1, &BurnAdam, 10);
        let ddp_checkpointed = train::<Checkpointed>(task, world, 1, &BurnAdam, 10);
        assert!(ddp == ddp_checkpointed, "{task:?}: DDP under checkpointing");
        let two = train::<Replicated>(task, world, 1, &stage(2), 10);
        let two_checkpointed = train::<Checkpointed>(task, world, 1, &stage(2), 10);
        assert!(
            two == two_checkpointed,
            "{task:?}: stage 2 under checkpointing"
        );
        let three = train::<Stage3>(task, world, 1, &stage(3), 10);
        let three_checkpointed = train::<Stage3Checkpointed>(task, world, 1, &stage(3), 10);
        assert!(
            three == three_checkpointed,
            "{task:?}: stage 3 under checkpointing"
        );
        assert!(two == three, "{task:?}: stage 3 vs stage 2");
    }
}

/// A full Burn record (here of a model trained replicated, through Burn's recorder, as a user's
/// saved `.bin` would be) loaded into a sharded model is resharded by preparing it again: the
/// parameters are the record's, and the optimizer built for the earlier preparation refuses
/// the model instead of stepping pieces that no longer serve it.
#[test]
fn a_full_record_loaded_into_a_sharded_model_is_resharded_by_preparing_it_again() {
    use burn::module::Module;
    use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
    use burn_dist::Ddp;
    use burn_dist_comm::testing::run_ranks;
    use burn_dist_comm::{CommConfig, HostCommunicator};
    use burn_dist_testing::{MLP_SIZES, Mlp, parameters};

    let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
    let trained = train::<Replicated>(Synthetic::Mlp, 1, 1, &stage(2), 5).remove(0);
    // The trained values, as a record: a fresh replicated model given them.
    let source = Mlp::<Replicated>::new(&MLP_SIZES, 7, &FlexDevice)
        .map(&mut burn_dist_testing::SetValues::new(trained.clone()));
    let bytes = recorder.record(source.into_record(), ()).unwrap();

    let comms = HostCommunicator::local_group(2, &CommConfig::default());
    let outcomes = run_ranks(comms, |_, comm| {
        let mut ddp = Ddp::for_thread(comm, small_bucket_config(1));
        let model = ddp
            .prepare_sharded(Mlp::<Stage3>::new(&MLP_SIZES, 99, &FlexDevice))
            .unwrap();
        let mut stale = stage(3).init::<Stage3, _>(&ddp, &model).unwrap();
        let record = recorder
            .load::<<Mlp<Stage3> as Module<Stage3>>::Record>(bytes.clone(), &FlexDevice)
            .unwrap();
        let model = ddp.prepare_sharded(model.load_record(record)).unwrap();
        let values = parameters::<Stage3, _>(&model);
        let refused = stale
            .step(LR, model, burn::optim::GradientsParams::new(), &ddp)
            .err()
            .map(|e| e.to_string());
        (values, refused)
    });
    for (rank, (values, refused)) in outcomes.into_iter().enumerate() {
        assert!(
            values == trained,
            "rank {rank}: the resharded values are not the record's"
        );
        let refused = refused.expect("the stale optimizer stepped");
        assert!(
            refused.contains("build its optimizer again"),
            "rank {rank}: {refused}"
        );
    }
}
