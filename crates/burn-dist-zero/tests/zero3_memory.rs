//! What ZeRO stage 3 holds, counted: each rank's pieces are exactly its part of the flat
//! layout; an op holds the parameters it gathered only while it runs, one layer at a time;
//! metadata and views never gather; backward gathers again what forward released; the gathers'
//! buffers are reused from the second step on, within what a step held at once. (With the
//! gathers on demand: what prefetching adds is bounded in zero3_prefetch.rs.)

use burn::backend::Autodiff;
use burn::module::Module;
use burn::tensor::{Tensor, TensorData};
use burn_dist::{
    Ddp, DdpConfig, DistributedBackend, FlatLayout, PrefetchConfig, SHARD_ALIGN, Sharded,
};
use burn_dist_comm::testing::run_ranks;
use burn_dist_comm::{CommConfig, HostCommunicator};
use burn_dist_testing::{MLP_SIZES, Mlp, shard_rows, synthetic_rows};
use burn_dist_zero::ZeroAdamConfig;
use burn_flex::{Flex, FlexDevice};

type S3 = Autodiff<DistributedBackend<Flex, Sharded>>;

const BATCH: usize = 12;

/// Elements of each of the MLP's parameters, in visit order (weight, bias per layer).
fn mlp_numels() -> Vec<usize> {
    MLP_SIZES
        .windows(2)
        .flat_map(|w| [w[0] * w[1], w[1]])
        .collect()
}

/// One step of the MLP on this rank's rows: forward, backward, ZeroAdam stage 3.
fn step(
    ddp: &mut Ddp,
    zero: &mut burn_dist_zero::ZeroAdam,
    model: Mlp<S3>,
    step: usize,
) -> Mlp<S3> {
    let rows = shard_rows(BATCH, ddp.rank(), ddp.world_size());
    let x = synthetic_rows::<S3, 2>(0, step, [BATCH, MLP_SIZES[0]], rows.clone(), &FlexDevice);
    let y = synthetic_rows::<S3, 2>(1, step, [BATCH, MLP_SIZES[3]], rows, &FlexDevice);
    let loss = (model.forward(x) - y).powi_scalar(2).mean();
    let grads = ddp.backward(loss, &model).unwrap().unwrap();
    zero.step(1e-2, model, grads, ddp).unwrap().0
}

#[test]
fn each_rank_holds_its_part_of_the_flat_layout_and_ops_hold_one_layer_at_a_time() {
    let numels = mlp_numels();
    let total: usize = numels.iter().sum();
    // Forward's `linear(x, weight, bias)` gathers a layer's weight and bias for one op; nothing
    // else holds more at once.
    let largest_layer_bytes = MLP_SIZES
        .windows(2)
        .map(|w| 4 * (w[0] * w[1] + w[1]))
        .max()
        .unwrap();
    for world in 1..=4 {
        let layout = FlatLayout::new(&numels, world, SHARD_ALIGN);
        let comms = HostCommunicator::local_group(world, &CommConfig::default());
        let stats = run_ranks(comms, |rank, comm| {
            let on_demand = DdpConfig::new().with_prefetch(PrefetchConfig::OFF);
            let mut ddp = Ddp::for_thread(comm, on_demand);
            let model = ddp
                .prepare_sharded(Mlp::<S3>::new(&MLP_SIZES, 7, &FlexDevice))
                .unwrap();
            let prepared = ddp.shard_stats().unwrap();
            let mut zero = ZeroAdamConfig::new()
                .with_stage(3)
                .init::<S3, _>(&ddp, &model)
                .unwrap();
            assert_eq!(
                zero.state_len(),
                3 * layout.shard_len,
                "rank {rank}: Adam state"
            );
            let mut model = model;
            let mut steps = Vec::new();
            for s in 0..3 {
                let before = ddp.shard_stats().unwrap();
                model = step(&mut ddp, &mut zero, model, s);
                steps.push((before, ddp.shard_stats().unwrap()));
            }
            (rank, prepared, steps)
        });
        for (rank, prepared, steps) in stats {
            // The real elements of this rank's shard of the flat vector, in f32.
            let shard = layout.shard(rank);
            let mine = total.min(shard.end).saturating_sub(shard.start);
            assert_eq!(
                prepared.shard_bytes,
                4 * mine,
                "{world} ranks, rank {rank}: pieces"
            );
            assert_eq!(
                (prepared.gathers, prepared.reads, prepared.live_bytes),
                (0, 0, 0),
                "{world} ranks, rank {rank}: preparing gathers nothing"
            );
            for (s, (before, after)) in steps.iter().enumerate() {
                let what = format!("{world} ranks, rank {rank}, step {s}");
                assert_eq!(after.live_bytes, 0, "{what}: nothing held between ops");
                assert_eq!(after.reads, 0, "{what}: no parameter read outside an op");
                assert_eq!(
                    after.last_step_peak_bytes, largest_layer_bytes,
                    "{what}: the most held at once is the largest layer"
                );
                // Forward gathers every parameter once; backward gathers again the weights
                // whose input gradient it needs (not the first layer's, whose input is data).
                let gathered = (after.gathered_bytes - before.gathered_bytes) as usize;
                assert!(
                    (4 * total..2 * 4 * total).contains(&gathered),
                    "{what}: gathered {gathered} bytes for a model of {} bytes",
                    4 * total
                );
                assert_eq!(after.shard_bytes, prepared.shard_bytes, "{what}: pieces");
                // The gathers' buffers: none kept through the first step, then reused, and
                // never more kept free than a step held at once.
                let reused = after.reused_buffers - before.reused_buffers;
                if s == 0 {
                    assert_eq!(reused, 0, "{what}: nothing to reuse in the first step");
                } else {
                    assert!(reused > 0, "{what}: no gather reused a buffer");
                }
                assert!(
                    after.pooled_bytes <= largest_layer_bytes,
                    "{what}: {} bytes kept free, more than the {largest_layer_bytes} held at once",
                    after.pooled_bytes
                );
            }
        }
    }
}

#[test]
fn metadata_and_views_never_gather_and_reads_are_counted_apart() {
    let comms = HostCommunicator::local_group(2, &CommConfig::default());
    run_ranks(comms, |rank, comm| {
        let mut ddp = Ddp::for_thread(comm, DdpConfig::new());
        let model = ddp
            .prepare_sharded(Mlp::<S3>::new(&MLP_SIZES, 7, &FlexDevice))
            .unwrap();
        let weight = model.layers[1].weight.val();
        // Metadata, flags, device moves and views: answered by the handle.
        assert_eq!(weight.dims(), [48, 48]);
        assert_eq!(weight.dtype(), burn::tensor::DType::F32);
        assert!(weight.is_require_grad());
        let _ = weight.device();
        let viewed = weight
            .clone()
            .transpose()
            .reshape([24, 96])
            .slice([0..12, 8..40])
            .to_device(&FlexDevice)
            .detach();
        assert_eq!(viewed.dims(), [12, 32]);
        let untouched = ddp.shard_stats().unwrap();
        assert_eq!(
            (untouched.gathers, untouched.reads, untouched.uses),
            (0, 0, 0),
            "rank {rank}: metadata and views gathered"
        );
        // Reading the view's values gathers the parameter once, outside any op, and replays
        // the views: the same values as the views of the whole parameter.
        let read: Vec<f32> = viewed.into_data().convert::<f32>().into_vec().unwrap();
        let whole: Vec<f32> = weight.into_data().convert::<f32>().into_vec().unwrap();
        let reference = Tensor::<Flex, 2>::from_data(TensorData::new(whole, [48, 48]), &FlexDevice)
            .transpose()
            .reshape([24, 96])
            .slice([0..12, 8..40]);
        assert_eq!(
            read,
            reference
                .into_data()
                .convert::<f32>()
                .into_vec::<f32>()
                .unwrap()
        );
        let after = ddp.shard_stats().unwrap();
        assert_eq!((after.gathers, after.reads), (0, 2), "rank {rank}");
        drop(model);
    });
}

/// A tied embedding alone: the head's `weight.transpose()`.
#[derive(Module, Debug)]
struct Tied<B: burn::tensor::backend::Backend> {
    embedding: burn::module::Param<Tensor<B, 2>>,
}

/// The tied head's `weight.transpose()` is a view: the matmul that consumes it gathers the
/// embedding, holds it while it runs, and autodiff saves a handle, so backward gathers it
/// again rather than keeping the full copy alive between forward and backward.
#[test]
fn a_parameter_used_through_a_view_is_held_only_inside_its_ops() {
    let comms = HostCommunicator::local_group(2, &CommConfig::default());
    run_ranks(comms, |_, comm| {
        let mut ddp = Ddp::for_thread(comm, DdpConfig::new());
        let values: Vec<f32> = (0..32 * 16).map(|i| (i as f32 * 0.37).sin()).collect();
        let embedding = Tensor::<S3, 2>::from_data(TensorData::new(values, [32, 16]), &FlexDevice)
            .require_grad();
        let model = ddp
            .prepare_sharded(Tied {
                embedding: burn::module::Param::from_tensor(embedding),
            })
            .unwrap();
        let bytes = 32 * 16 * 4;
        let x = Tensor::<S3, 2>::ones([4, 16], &FlexDevice).require_grad();
        let logits = x.matmul(model.embedding.val().transpose());
        let forward = ddp.shard_stats().unwrap();
        assert_eq!(forward.live_bytes, 0, "the matmul released the embedding");
        assert_eq!(
            forward.peak_live_bytes, bytes,
            "it held the whole embedding once"
        );
        assert_eq!(forward.gathers, 1);
        let grads = ddp.backward(logits.sum(), &model).unwrap().unwrap();
        drop(grads);
        let backward = ddp.shard_stats().unwrap();
        assert_eq!(
            backward.gathers, 2,
            "backward gathered the saved handle again"
        );
        assert_eq!(backward.live_bytes, 0);
        assert_eq!(backward.peak_live_bytes, bytes);
    });
}

/// An op that reads a parameter only for its shape gets a stand-in, not a gather: the
/// embedding's backward (`embedding_backward`'s `weights`, the generator's `METADATA_ONLY`
/// list) costs no gather, so an embedding is gathered once per step, by its forward. (That
/// the gradient is still right is what the bitwise GPT tests check.)
#[test]
fn the_embeddings_backward_reads_its_shape_only_and_gathers_nothing() {
    use burn::nn::{Embedding, EmbeddingConfig};
    use burn::tensor::Int;
    let comms = HostCommunicator::local_group(2, &CommConfig::default());
    run_ranks(comms, |rank, comm| {
        let mut ddp = Ddp::for_thread(comm, DdpConfig::new());
        let model: Embedding<S3> = ddp
            .prepare_sharded(EmbeddingConfig::new(50, 8).init(&FlexDevice))
            .unwrap();
        let tokens = Tensor::<S3, 2, Int>::from_data([[1, 2, 3], [4, 5, 1]], &FlexDevice);
        let loss = model.forward(tokens).powi_scalar(2).sum();
        assert_eq!(
            ddp.shard_stats().unwrap().gathers,
            1,
            "rank {rank}: forward"
        );
        let _grads = ddp.backward(loss, &model).unwrap().unwrap();
        let stats = ddp.shard_stats().unwrap();
        assert_eq!(
            stats.gathers, 1,
            "rank {rank}: backward gathered the embedding"
        );
        assert_eq!(stats.reads, 0);
    });
}
