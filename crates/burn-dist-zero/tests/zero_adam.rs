//! ZeroAdam at 1–4 ranks, ZeRO stages 1 and 2, equals Burn's AdamW (and Adam) on one rank over
//! 50 steps; stage 2 equals stage 1 and keeps only its shard of the gradient.

use burn::backend::Autodiff;
use burn_dist::{Ddp, DdpConfig, DistributedBackend};
use burn_dist_comm::testing::run_ranks;
use burn_dist_comm::{CommConfig, HostCommunicator};
use burn_dist_testing::{
    BurnAdamW, OptimizerKind, Synthetic, assert_close, relative_error, train_ranks,
};
use burn_dist_zero::ZeroAdamConfig;
use burn_flex::{Flex, FlexDevice};

type B = Autodiff<DistributedBackend<Flex>>;

const STEPS: usize = 50;
const LR: f64 = 1e-2;
const GLOBAL_BATCH: usize = 12;

fn train(
    task: Synthetic,
    world: usize,
    optimizer: &(impl OptimizerKind + Sync),
) -> Vec<Vec<Vec<f32>>> {
    train_accumulating(task, world, 1, optimizer)
}

fn train_accumulating(
    task: Synthetic,
    world: usize,
    accumulation: usize,
    optimizer: &(impl OptimizerKind + Sync),
) -> Vec<Vec<Vec<f32>>> {
    let config = burn_dist_testing::small_bucket_config(accumulation);
    train_ranks::<B>(
        world,
        &config,
        task,
        optimizer,
        STEPS,
        GLOBAL_BATCH,
        LR,
        &FlexDevice,
    )
}

fn assert_matches(task: Synthetic, zero: ZeroAdamConfig, burn: &(impl OptimizerKind + Sync)) {
    let reference = train(task, 1, burn).remove(0);
    for stage in [1, 2] {
        let zero = zero.clone().with_stage(stage);
        for world in 1..=4 {
            let ranks = train(task, world, &zero);
            for (rank, params) in ranks.iter().enumerate() {
                assert!(
                    params == &ranks[0],
                    "{task:?}, stage {stage}, {world} ranks: rank {rank} differs from rank 0"
                );
            }
            assert_close(
                &ranks[0],
                &reference,
                1e-5,
                &format!("{task:?}, stage {stage}, {world} ranks vs Burn"),
            );
        }
    }
}

#[test]
fn zero_adamw_equals_burn_adamw_mlp() {
    assert_matches(Synthetic::Mlp, ZeroAdamConfig::new(), &BurnAdamW);
}

#[test]
fn zero_adamw_equals_burn_adamw_transformer() {
    assert_matches(Synthetic::Transformer, ZeroAdamConfig::new(), &BurnAdamW);
}

#[test]
fn optimizer_state_per_rank_is_one_nth_plus_padding() {
    use burn_dist_testing::{MLP_SIZES, Mlp};
    let lens = run_ranks(
        HostCommunicator::local_group(3, &CommConfig::default()),
        |_, comm| {
            let mut ddp = Ddp::for_thread(comm, DdpConfig::new());
            let model = ddp
                .prepare(Mlp::<B>::new(&MLP_SIZES, 7, &FlexDevice))
                .unwrap();
            let zero = ZeroAdamConfig::new().init::<B, _>(&ddp, &model).unwrap();
            (zero.state_len(), zero.layout().total)
        },
    );
    for (state, total) in lens {
        let per_rank = total.div_ceil(3).div_ceil(4) * 4;
        assert_eq!(state, 3 * per_rank, "master, m and v of one shard");
        assert!(
            3 * per_rank * 3 - 3 * total < 3 * 4 * 3,
            "padding stays below one vector per rank"
        );
    }
}

/// Burn's `Adam` defaults: no weight decay.
fn zero_adam() -> ZeroAdamConfig {
    ZeroAdamConfig::new()
        .with_decoupled_weight_decay(false)
        .with_weight_decay(0.0)
}

#[test]
fn zero_adam_without_decoupled_decay_equals_burn_adam_mlp() {
    assert_matches(Synthetic::Mlp, zero_adam(), &burn_dist_testing::BurnAdam);
}

#[test]
fn zero_adam_without_decoupled_decay_equals_burn_adam_transformer() {
    assert_matches(
        Synthetic::Transformer,
        zero_adam(),
        &burn_dist_testing::BurnAdam,
    );
}

#[test]
fn global_norm_clipping_does_not_depend_on_the_sharding() {
    // A max norm far below the gradient norm, so every step clips.
    let clipped = ZeroAdamConfig::new().with_max_grad_norm(Some(1e-3));
    let reference = train(Synthetic::Mlp, 1, &clipped).remove(0);
    let unclipped = train(Synthetic::Mlp, 1, &ZeroAdamConfig::new()).remove(0);
    assert!(
        reference
            .iter()
            .zip(&unclipped)
            .any(|(a, b)| relative_error(a, b) > 1e-3),
        "clipping must change the result"
    );
    for (stage, world) in [(1, 2), (1, 3), (1, 4), (2, 2), (2, 3), (2, 4)] {
        let ranks = train(Synthetic::Mlp, world, &clipped.clone().with_stage(stage));
        assert_close(
            &ranks[0],
            &reference,
            1e-5,
            &format!("stage {stage}, {world} ranks vs 1 rank"),
        );
    }
}

#[test]
fn stage_two_equals_stage_one() {
    for task in [Synthetic::Mlp, Synthetic::Transformer] {
        for world in 2..=4 {
            let one = train(task, world, &ZeroAdamConfig::new().with_stage(1));
            let two = train(task, world, &ZeroAdamConfig::new().with_stage(2));
            // The same rank-order sums: each element is folded exactly as the all-reduce does.
            assert!(
                one == two,
                "{task:?}, {world} ranks: stage 2 differs from stage 1"
            );
        }
    }
}

#[test]
fn stage_two_reduces_every_micro_batch_into_the_owners_shard() {
    // 12 rows over 2 ranks in 3 micro-batches of 2. Stage 1 sums the window locally, then
    // all-reduces once; stage 2 reduces each micro-batch to the owners and sums the shards:
    // the same mean, summed in another order.
    let one = train_accumulating(Synthetic::Mlp, 2, 3, &ZeroAdamConfig::new().with_stage(1));
    let two = train_accumulating(Synthetic::Mlp, 2, 3, &ZeroAdamConfig::new().with_stage(2));
    assert_close(&two[0], &one[0], 1e-5, "accumulating, stage 2 vs stage 1");
    assert!(two[0] == two[1], "ranks agree");
}

/// What one rank's gradients occupied around a backward (see the test below).
#[derive(Debug)]
struct GradientMemory {
    /// The most gradient elements the reducer held in any gradient hook of the backward.
    peak_in_backward: usize,
    /// What it holds once the backward is over.
    after_backward: usize,
    /// Reduced elements the rank's bucket reductions delivered to it.
    received: u64,
    /// Gradients `Ddp::backward` returned.
    returned: usize,
    /// Elements allocated under the gradients in Burn's own container (storage, not shape).
    in_burn: usize,
    /// Whether every value read from Burn's container is zero.
    in_burn_zero: bool,
    /// Whether, in every hook, the reducer's flat layout was ZeroAdam's at stage 2 and none at
    /// stage 1.
    reducer_shards_over_zero_layout: bool,
    /// Parameters, and their elements.
    params: usize,
    total: usize,
    /// This rank's shard: its length (padding included), and its elements that are real.
    shard_len: usize,
    shard_real: usize,
    /// The largest bucket, in elements.
    largest_bucket: usize,
}

#[test]
fn after_backward_each_rank_holds_only_its_gradient_shard() {
    use burn_dist_testing::{MLP_SIZES, Mlp, shard_rows, synthetic_rows};
    use std::sync::{Arc, Mutex};
    const WORLD: usize = 3;
    let [input, .., output] = MLP_SIZES;
    for stage in [1, 2] {
        let ranks = run_ranks(
            HostCommunicator::local_group(WORLD, &CommConfig::default()),
            |rank, comm| {
                let mut ddp = Ddp::for_thread(comm, burn_dist_testing::small_bucket_config(1));
                let model = ddp
                    .prepare(Mlp::<B>::new(&MLP_SIZES, 7, &FlexDevice))
                    .unwrap();
                let mut zero = ZeroAdamConfig::new()
                    .with_stage(stage)
                    .init::<B, _>(&ddp, &model)
                    .unwrap();
                // The reducer's holdings and flat layout in every gradient hook, while backward
                // runs.
                let peak = Arc::new(Mutex::new(0));
                let same_layout = Arc::new(Mutex::new(true));
                let (seen, seen_layout) = (peak.clone(), same_layout.clone());
                let zero_layout = (stage == 2).then(|| zero.layout().clone());
                ddp.set_observer(move |reducer, _| {
                    let mut peak = seen.lock().unwrap();
                    *peak = (*peak).max(reducer.gradient_elements_held());
                    *seen_layout.lock().unwrap() &= reducer.flat_layout() == zero_layout.as_ref();
                });
                let rows = shard_rows(GLOBAL_BATCH, rank, WORLD);
                let x =
                    synthetic_rows::<B, 2>(0, 0, [GLOBAL_BATCH, input], rows.clone(), &FlexDevice);
                let y = synthetic_rows::<B, 2>(1, 0, [GLOBAL_BATCH, output], rows, &FlexDevice);
                // Burn's own container after a backward: at stage 2 each local gradient was
                // released as soon as it was in its bucket.
                let loss = (model.forward(x.clone()) - y.clone()).powi_scalar(2).mean();
                let in_burn = BurnGradients::of(&model, loss.backward());
                let model = ddp.mark(model);
                let loss = (model.forward(x) - y).powi_scalar(2).mean();
                let received_before = ddp.stats().reduced_elements_received;
                let grads = ddp.backward(loss, &model).unwrap().unwrap();
                let layout = zero.layout().clone();
                let shard = layout.shard(rank);
                let memory = GradientMemory {
                    peak_in_backward: *peak.lock().unwrap(),
                    after_backward: ddp.gradient_elements_held(),
                    received: ddp.stats().reduced_elements_received - received_before,
                    returned: grads.len(),
                    in_burn: in_burn.allocated,
                    in_burn_zero: in_burn.all_zero,
                    reducer_shards_over_zero_layout: *same_layout.lock().unwrap(),
                    params: in_burn.params,
                    total: layout.total,
                    shard_len: layout.shard_len,
                    shard_real: layout.total.min(shard.end).saturating_sub(shard.start),
                    largest_bucket: ddp.layout().buckets.iter().map(|b| b.len).max().unwrap(),
                };
                zero.step(LR, model, grads, &ddp).unwrap();
                memory
            },
        );
        for (rank, m) in ranks.into_iter().enumerate() {
            assert!(
                m.reducer_shards_over_zero_layout,
                "stage {stage}, rank {rank}: the reducer's flat layout is not ZeroAdam's: {m:?}"
            );
            if stage == 2 {
                assert!(m.shard_len * WORLD < m.total + 4 * WORLD, "{m:?}");
                assert_eq!(
                    m.after_backward, m.shard_len,
                    "stage 2, rank {rank}: only its shard"
                );
                // While backward ran: the shard and the bucket being filled, never all of them.
                assert!(
                    m.peak_in_backward <= m.shard_len + m.largest_bucket,
                    "stage 2, rank {rank}: held {} gradient elements during backward; at most \
                     its shard and one bucket: {m:?}",
                    m.peak_in_backward
                );
                // Each bucket was reduced straight to its owners: the rank received its own
                // segments and nothing else (an all-reduce would deliver every element).
                assert_eq!(
                    m.received, m.shard_real as u64,
                    "stage 2, rank {rank}: received reduced elements beyond its shard: {m:?}"
                );
                assert_eq!(
                    m.returned, 0,
                    "stage 2, rank {rank}: no full gradient returned"
                );
                // Burn's container: one element of storage per released gradient, whatever
                // its shape.
                assert_eq!(
                    m.in_burn, m.params,
                    "stage 2, rank {rank}: local gradients still allocated in Burn's container: \
                     {m:?}"
                );
                assert!(
                    m.in_burn_zero,
                    "stage 2, rank {rank}: released gradients read as 0"
                );
            } else {
                assert_eq!(
                    m.after_backward, m.total,
                    "stage 1, rank {rank}: every bucket"
                );
                assert_eq!(m.peak_in_backward, m.total, "stage 1, rank {rank}: {m:?}");
                assert_eq!(
                    m.received, m.total as u64,
                    "stage 1, rank {rank}: all-reduced"
                );
                assert_eq!(
                    m.in_burn, m.total,
                    "stage 1, rank {rank}: Burn keeps the gradients"
                );
                assert!(!m.in_burn_zero, "stage 1, rank {rank}: real gradients");
            }
        }
    }
}

/// Multiplies every gradient in `grads` by `factor`.
struct ScaleGrads<'a> {
    grads: &'a mut burn::optim::GradientsParams,
    factor: f32,
    sum_sq: f64,
}

impl burn::module::ModuleVisitor<B> for ScaleGrads<'_> {
    fn visit_float<const D: usize>(
        &mut self,
        param: &burn::module::Param<burn::tensor::Tensor<B, D>>,
    ) {
        if let Some(grad) = self.grads.remove::<DistributedBackend<Flex>, D>(param.id) {
            let values = grad.clone().into_data().to_vec::<f32>().unwrap();
            self.sum_sq += values
                .iter()
                .map(|&g| f64::from(g) * f64::from(g))
                .sum::<f64>();
            self.grads.register(param.id, grad.mul_scalar(self.factor));
        }
    }
}

#[test]
fn clipping_equals_clipping_the_concatenated_gradient() {
    use burn::module::Module;
    use burn::optim::{AdamWConfig, Optimizer};
    use burn_dist_testing::{MLP_SIZES, Mlp, parameters, shard_rows, synthetic_rows};
    const MAX_NORM: f32 = 0.05;
    let [input, .., output] = MLP_SIZES;
    let results = run_ranks(
        HostCommunicator::local_group(3, &CommConfig::default()),
        |rank, comm| {
            let mut ddp = Ddp::for_thread(comm, DdpConfig::new());
            let model = ddp
                .prepare(Mlp::<B>::new(&MLP_SIZES, 7, &FlexDevice))
                .unwrap();
            let loss = |model: &Mlp<B>| {
                let rows = shard_rows(GLOBAL_BATCH, rank, 3);
                let x =
                    synthetic_rows::<B, 2>(0, 0, [GLOBAL_BATCH, input], rows.clone(), &FlexDevice);
                let y = synthetic_rows::<B, 2>(1, 0, [GLOBAL_BATCH, output], rows, &FlexDevice);
                (model.forward(x) - y).powi_scalar(2).mean()
            };
            // Reference: the whole averaged gradient (every rank has it in stage 1), its norm in
            // f64, scaled by the clip factor, then Burn's AdamW.
            let mut grads = ddp.backward(loss(&model), &model).unwrap().unwrap();
            let mut norm = ScaleGrads {
                grads: &mut grads,
                factor: 1.0,
                sum_sq: 0.0,
            };
            model.visit(&mut norm);
            let reference_norm = norm.sum_sq.sqrt();
            let clip = burn_dist_kernels::clip_factor(norm.sum_sq, Some(MAX_NORM));
            assert!(clip < 0.5, "the test must clip ({clip})");
            model.visit(&mut ScaleGrads {
                grads: &mut grads,
                factor: clip,
                sum_sq: 0.0,
            });
            let reference =
                parameters::<B, _>(&AdamWConfig::new().init().step(LR, model.clone(), grads));
            // ZeroAdam clips across shards.
            let model = ddp.mark(model);
            let grads = ddp.backward(loss(&model), &model).unwrap().unwrap();
            let mut zero = ZeroAdamConfig::new()
                .with_max_grad_norm(Some(MAX_NORM))
                .init::<B, _>(&ddp, &model)
                .unwrap();
            let (model, report) = zero.step(LR, model, grads, &ddp).unwrap();
            (
                reference_norm,
                report.grad_norm,
                parameters::<B, _>(&model),
                reference,
            )
        },
    );
    for (reference_norm, norm, params, reference) in results {
        assert!(
            (norm - reference_norm).abs() / reference_norm <= 1e-6,
            "{norm} vs {reference_norm}"
        );
        assert_close(
            &params,
            &reference,
            1e-6,
            "clipping the concatenated gradient",
        );
    }
}

/// The gradients in Burn's own container: the elements their storage allocates (not their
/// shapes': a zero-stride view of one zero allocates one), and whether every value is zero.
struct BurnGradients {
    grads: burn::optim::GradientsParams,
    params: usize,
    allocated: usize,
    all_zero: bool,
}

impl BurnGradients {
    fn of<M: burn::module::AutodiffModule<B>>(
        model: &M,
        raw: <B as burn::tensor::backend::AutodiffBackend>::Gradients,
    ) -> Self {
        let mut visitor = BurnGradients {
            grads: burn::optim::GradientsParams::from_grads(raw, model),
            params: 0,
            allocated: 0,
            all_zero: true,
        };
        model.visit(&mut visitor);
        visitor
    }
}

impl burn::module::ModuleVisitor<B> for BurnGradients {
    fn visit_float<const D: usize>(
        &mut self,
        param: &burn::module::Param<burn::tensor::Tensor<B, D>>,
    ) {
        if let Some(grad) = self.grads.get::<DistributedBackend<Flex>, D>(param.id) {
            self.params += 1;
            let storage = grad.clone().into_primitive().tensor();
            self.allocated += storage.bytes().len() / storage.dtype().size();
            let values = grad.into_data().convert::<f32>().to_vec::<f32>().unwrap();
            self.all_zero &= values.iter().all(|&g| g == 0.0);
        }
    }
}

/// A job of one rank (this thread) and the test MLP, prepared.
fn one_rank_mlp() -> (Ddp, burn_dist_testing::Mlp<B>) {
    use burn_dist_testing::{MLP_SIZES, Mlp};
    let comm = HostCommunicator::local_group(1, &CommConfig::default()).remove(0);
    let mut ddp = Ddp::for_thread(comm, DdpConfig::new());
    let model = ddp
        .prepare(Mlp::<B>::new(&MLP_SIZES, 7, &FlexDevice))
        .unwrap();
    (ddp, model)
}

#[test]
fn a_shard_of_another_rank_or_layout_is_refused() {
    use burn_dist_zero::ZeroError;
    let (ddp, model) = one_rank_mlp();
    let mut zero = ZeroAdamConfig::new().init::<B, _>(&ddp, &model).unwrap();
    let own = zero.export();
    let mut other_rank = own.clone();
    other_rank.rank = 1;
    let mut other_layout = own.clone();
    other_layout.layout.world = 2;
    for (what, shard) in [("rank", other_rank), ("layout", other_layout)] {
        let error = zero.import(shard).expect_err(what);
        assert!(
            matches!(error, ZeroError::ShardMismatch { .. }),
            "another {what}: {error:?}"
        );
    }
    zero.import(own).expect("this rank's own shard");
}

/// `ZeroAdamConfig::init` at `stage` on a replicated one-rank MLP must fail, its message
/// containing `names`.
fn stage_refused(stage: u8, names: &str) {
    let (ddp, model) = one_rank_mlp();
    let Err(error) = ZeroAdamConfig::new()
        .with_stage(stage)
        .init::<B, _>(&ddp, &model)
    else {
        panic!("stage {stage} must be refused here");
    };
    assert!(error.to_string().contains(names), "{error}");
}

#[test]
fn an_unknown_stage_is_refused_by_name() {
    stage_refused(4, "ZeRO stage 4 is not supported");
}

/// Stage 3 needs a sharded model: a model `Ddp::prepare` prepared (replicated) is refused,
/// naming the call that shards it.
#[test]
fn stage_three_on_a_replicated_model_is_refused_naming_prepare_sharded() {
    stage_refused(3, "Ddp::prepare_sharded");
}

#[test]
fn the_host_steps_own_thread_pool_gives_the_same_parameters() {
    let global_pool = train(Synthetic::Mlp, 2, &ZeroAdamConfig::new());
    let own_pool = train(
        Synthetic::Mlp,
        2,
        &ZeroAdamConfig::new().with_host_threads(Some(3)),
    );
    assert!(
        own_pool == global_pool,
        "host_threads Some(3) against rayon's global pool"
    );
}

#[test]
fn zero_host_threads_are_refused_by_name() {
    use burn_dist_zero::ZeroError;
    let (ddp, model) = one_rank_mlp();
    let Err(error) = ZeroAdamConfig::new()
        .with_host_threads(Some(0))
        .init::<B, _>(&ddp, &model)
    else {
        panic!("0 host threads must be refused");
    };
    assert!(
        matches!(error, ZeroError::HostThreads { threads: 0, .. }),
        "{error:?}"
    );
    assert!(
        error.to_string().contains("host_threads = Some(0)"),
        "{error}"
    );
}

/// The GPU check's `ddp-step` runs ZeRO-2 (`shard_gradients`) on its `Ddp` before it prepares
/// the timed models with it: preparing again must end the sharding, so that the next backward
/// hands back every full gradient, as without ZeRO-2.
#[test]
fn preparing_again_ends_the_gradient_sharding() {
    use burn_dist_testing::{MLP_SIZES, Mlp};
    let (mut ddp, model) = one_rank_mlp();
    let numels: Vec<usize> = ddp.params().iter().map(|p| p.numel()).collect();
    ddp.shard_gradients(burn_dist::FlatLayout::new(&numels, 1, 4))
        .unwrap();
    let x = || burn::tensor::Tensor::<B, 2>::ones([4, MLP_SIZES[0]], &FlexDevice);
    let loss = |model: &Mlp<B>| model.forward(x()).powi_scalar(2).mean();
    let sharded = ddp.backward(loss(&model), &model).unwrap().unwrap();
    assert!(
        sharded.is_empty(),
        "under ZeRO-2 the gradients live in the reducer"
    );
    ddp.take_gradient_shard().unwrap();

    let model = ddp
        .prepare(Mlp::<B>::new(&MLP_SIZES, 7, &FlexDevice))
        .unwrap();
    let full = ddp.backward(loss(&model), &model).unwrap().unwrap();
    assert_eq!(full.len(), numels.len(), "every gradient, in full");
}
