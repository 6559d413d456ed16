//! Misuses a caller may want to handle come back as typed `DistError` variants carrying the
//! data, not as a message to parse.

use burn::backend::Autodiff;
use burn::nn::LinearConfig;
use burn::tensor::Tensor;
use burn_dist::{Ddp, DdpConfig, DistError, DistributedBackend, FlatLayout};
use burn_dist_comm::{CommConfig, HostCommunicator};
use burn_flex::{Flex, FlexDevice};

type B = Autodiff<DistributedBackend<Flex>>;

fn one_rank() -> Ddp {
    one_rank_with(DdpConfig::new())
}

fn one_rank_with(config: DdpConfig) -> Ddp {
    let comm = HostCommunicator::local_group(1, &CommConfig::default()).remove(0);
    Ddp::for_thread(comm, config)
}

#[test]
fn backward_or_sharding_before_prepare_is_not_prepared() {
    let mut ddp = one_rank();
    let model = LinearConfig::new(2, 1).init::<B>(&FlexDevice);
    let loss = model
        .forward(Tensor::<B, 2>::ones([1, 2], &FlexDevice))
        .sum();
    match ddp.backward(loss, &model) {
        Err(DistError::NotPrepared {
            call: "Ddp::backward",
        }) => {}
        other => panic!("{:?}", other.map(|_| ())),
    }
    match ddp.shard_gradients(FlatLayout::new(&[3], 1, 1)) {
        Err(DistError::NotPrepared {
            call: "Ddp::shard_gradients",
        }) => {}
        other => panic!("{other:?}"),
    }
}

#[test]
fn sharding_misuses_name_what_is_wrong() {
    let mut ddp = one_rank();
    // Weight 2×1 and bias 1: two parameters of 2 and 1 elements.
    ddp.prepare(LinearConfig::new(2, 1).init::<B>(&FlexDevice))
        .unwrap();
    match ddp.take_gradient_shard() {
        Err(DistError::NotSharded) => {}
        other => panic!("{:?}", other.map(|_| ())),
    }
    match ddp.shard_gradients(FlatLayout::new(&[2], 1, 1)) {
        Err(
            error @ DistError::LayoutMismatch {
                layout_params: 1,
                layout_ranks: 1,
                model_params: 2,
                model_ranks: 1,
            },
        ) => assert_eq!(
            error.to_string(),
            "the flat layout to shard gradients over (1 parameters, 1 ranks) does not match the \
             prepared model (2 parameters, 1 ranks): build it from `Ddp::params` of this `Ddp`"
        ),
        other => panic!("{other:?}"),
    }
    // The right parameters over another world size.
    match ddp.shard_gradients(FlatLayout::new(&[2, 1], 2, 1)) {
        Err(DistError::LayoutMismatch {
            layout_params: 2,
            layout_ranks: 2,
            model_params: 2,
            model_ranks: 1,
        }) => {}
        other => panic!("{other:?}"),
    }
    ddp.shard_gradients(FlatLayout::new(&[2, 1], 1, 1)).unwrap();
    match ddp.take_gradient_shard() {
        Err(error @ DistError::NoGradientShard { on_device: false }) => {
            // The message names the fix, in one line of single spaces.
            assert_eq!(
                error.to_string(),
                "no reduced gradient shard: run `Ddp::backward` to the end of an accumulation \
                 window before each optimizer step, and take the shard once per window"
            );
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
}

#[test]
fn sharding_between_micro_batches_is_sharding_mid_window() {
    let mut ddp = one_rank_with(DdpConfig::new().with_accumulation_steps(2));
    let model = ddp
        .prepare(LinearConfig::new(2, 1).init::<B>(&FlexDevice))
        .unwrap();
    let model = ddp.mark(model);
    let loss = model
        .forward(Tensor::<B, 2>::ones([1, 2], &FlexDevice))
        .sum();
    // The first of two micro-batches: accumulated, not yet reduced.
    assert!(ddp.backward(loss, &model).unwrap().is_none());
    match ddp.shard_gradients(FlatLayout::new(&[2, 1], 1, 1)) {
        Err(DistError::ShardingMidWindow) => {}
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_bucket_order_that_is_not_a_permutation_is_bad_bucket_order() {
    let mut ddp = one_rank();
    ddp.prepare(LinearConfig::new(2, 1).init::<B>(&FlexDevice))
        .unwrap();
    match ddp.adopt_bucket_order(&[0, 0, 1]) {
        Err(DistError::BadBucketOrder { params: 2, got: 3 }) => {}
        other => panic!("{other:?}"),
    }
    ddp.adopt_bucket_order(&[1, 0]).unwrap();
}

/// As documented: an empty order, and any order once gradients are sharded (ZeRO-2's layout
/// is frozen to flat ranges), are ignored rather than refused or applied.
#[test]
fn an_empty_bucket_order_or_one_under_sharding_is_ignored() {
    let mut ddp = one_rank();
    ddp.prepare(LinearConfig::new(2, 1).init::<B>(&FlexDevice))
        .unwrap();
    let before = ddp.next_layout();
    ddp.adopt_bucket_order(&[]).unwrap();
    assert_eq!(ddp.next_layout(), before, "an empty order");
    ddp.shard_gradients(FlatLayout::new(&[2, 1], 1, 1)).unwrap();
    let sharded = ddp.next_layout();
    ddp.adopt_bucket_order(&[1, 0]).unwrap();
    assert_eq!(ddp.next_layout(), sharded, "an order under sharding");
}
