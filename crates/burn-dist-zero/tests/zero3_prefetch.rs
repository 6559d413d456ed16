//! ZeRO stage 3's gather schedule: the first step records the order of the parameters' uses,
//! rank 0's is checked against every rank's, and later steps gather ahead of use. It changes no
//! bit of training (recomputation and accumulation included), a use off the schedule re-records
//! it, evaluation keeps its own, a layer's weight and bias are one gather, what it holds ahead
//! stays within its window, and a weight used last in forward and first in backward is
//! gathered once.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::module::AutodiffModule;
use burn::tensor::Tensor;
use burn_dist::{
    Ddp, DdpConfig, DistError, DistributedAutodiff, DistributedBackend, Phase, PrefetchConfig,
    ShardStats, Sharded,
};
use burn_dist_comm::testing::run_ranks;
use burn_dist_comm::{CommConfig, CommError, HostCommunicator};
use burn_dist_testing::{
    MLP_SIZES, Mlp, Synthetic, parameters, shard_rows, small_bucket_config, synthetic_rows,
};
use burn_dist_zero::{ZeroAdam, ZeroAdamConfig, ZeroError};
use burn_flex::{Flex, FlexDevice};

type Stage3 = Autodiff<DistributedBackend<Flex, Sharded>>;
type Stage3Checkpointed = Autodiff<DistributedBackend<Flex, Sharded>, BalancedCheckpointing>;
type Inner = DistributedBackend<Flex, Sharded>;

const LR: f64 = 1e-2;
const GLOBAL_BATCH: usize = 12;

/// Small buckets (the reduce-scatters interleave with the gathers), `accumulation`
/// micro-batches, and `prefetch`.
fn config(accumulation: usize, prefetch: PrefetchConfig) -> DdpConfig {
    small_bucket_config(accumulation).with_prefetch(prefetch)
}

/// A rank's stage-3 job on `model`: its `Ddp`, the sharded model and ZeroAdam at stage 3.
fn start<M: AutodiffModule<Stage3>>(
    comm: HostCommunicator,
    prefetch: PrefetchConfig,
    model: M,
) -> (Ddp, M, ZeroAdam) {
    let mut ddp = Ddp::for_thread(comm, config(1, prefetch));
    let model = ddp.prepare_sharded(model).unwrap();
    let zero = ZeroAdamConfig::new()
        .with_stage(3)
        .init::<Stage3, _>(&ddp, &model)
        .unwrap();
    (ddp, model, zero)
}

/// One training step on this rank's rows of the MLP's synthetic data, `forward` mapping the
/// input to the output.
fn mlp_step<M: AutodiffModule<Stage3>>(
    ddp: &mut Ddp,
    zero: &mut ZeroAdam,
    model: M,
    step: usize,
    forward: impl Fn(&M, Tensor<Stage3, 2>) -> Tensor<Stage3, 2>,
) -> M {
    try_mlp_step(ddp, zero, model, step, forward).unwrap()
}

/// [`mlp_step`], returning what the optimizer step returned.
fn try_mlp_step<M: AutodiffModule<Stage3>>(
    ddp: &mut Ddp,
    zero: &mut ZeroAdam,
    model: M,
    step: usize,
    forward: impl Fn(&M, Tensor<Stage3, 2>) -> Tensor<Stage3, 2>,
) -> Result<M, ZeroError> {
    let rows = shard_rows(GLOBAL_BATCH, ddp.rank(), ddp.world_size());
    let [input, .., output] = MLP_SIZES;
    let x = synthetic_rows::<Stage3, 2>(0, step, [GLOBAL_BATCH, input], rows.clone(), &FlexDevice);
    let y = synthetic_rows::<Stage3, 2>(1, step, [GLOBAL_BATCH, output], rows, &FlexDevice);
    let loss = (forward(&model, x) - y).powi_scalar(2).mean();
    let grads = ddp.backward(loss, &model).unwrap().unwrap();
    Ok(zero.step(LR, model, grads, ddp)?.0)
}

/// Every rank's final parameters and shard counters after `steps` ZeroAdam stage-3 steps.
fn train<B: DistributedAutodiff<Device = FlexDevice>>(
    task: Synthetic,
    world: usize,
    accumulation: usize,
    prefetch: PrefetchConfig,
    steps: usize,
) -> Vec<(Vec<Vec<f32>>, ShardStats)> {
    let config = CommConfig::default();
    train_counted::<B>(task, world, accumulation, prefetch, steps, &config)
        .into_iter()
        .map(|(params, stats, _)| (params, stats))
        .collect()
}

/// [`train`] on communicators made with `comm_config`, with the collectives each rank issued
/// on its main lane and on its gather lane.
fn train_counted<B: DistributedAutodiff<Device = FlexDevice>>(
    task: Synthetic,
    world: usize,
    accumulation: usize,
    prefetch: PrefetchConfig,
    steps: usize,
    comm_config: &CommConfig,
) -> Vec<(Vec<Vec<f32>>, ShardStats, [u64; 2])> {
    let comms = HostCommunicator::local_group(world, comm_config);
    run_ranks(comms, |_, comm| {
        let mut ddp = Ddp::for_thread(comm, config(accumulation, prefetch));
        let optimizer = ZeroAdamConfig::new().with_stage(3);
        let params = burn_dist_testing::train_synthetic::<B>(
            &mut ddp,
            task,
            &optimizer,
            steps,
            GLOBAL_BATCH,
            LR,
            &FlexDevice,
            |_, _| {},
        )
        .expect("training");
        let comm = ddp.comm();
        let issued = [comm.issued(), comm.gather_lane().issued()];
        (params, ddp.shard_stats().expect("stage 3"), issued)
    })
}

fn params_of(ranks: &[(Vec<Vec<f32>>, ShardStats)]) -> Vec<&Vec<Vec<f32>>> {
    ranks.iter().map(|(params, _)| params).collect()
}

/// The default window, keeping no gathered tensor for a later use but the use right after:
/// by default these small models keep up to their largest parameter's bytes from forward to
/// backward, and the tests that use this follow gathers ahead.
fn gathered_ahead() -> PrefetchConfig {
    PrefetchConfig::new().with_reuse_bytes(Some(0))
}

#[test]
fn gathering_ahead_changes_no_bit_of_stage_three() {
    let tasks = [
        Synthetic::Mlp,
        Synthetic::Transformer,
        Synthetic::ConvBatchNorm,
        Synthetic::RmsNorm,
    ];
    for task in tasks {
        for (world, accumulation) in [(2, 1), (3, 1), (2, 2), (3, 2)] {
            let what = format!("{task:?}, {world} ranks × {accumulation} micro-batches");
            let on_demand = train::<Stage3>(task, world, accumulation, PrefetchConfig::OFF, 6);
            let gathered = train::<Stage3>(task, world, accumulation, gathered_ahead(), 6);
            let kept = train::<Stage3>(task, world, accumulation, PrefetchConfig::new(), 6);
            assert!(
                params_of(&gathered) == params_of(&on_demand),
                "{what}: prefetching changed the parameters"
            );
            assert!(
                params_of(&kept) == params_of(&on_demand),
                "{what}: keeping gathered tensors for later uses changed the parameters"
            );
            for (rank, (_, stats)) in kept.iter().enumerate() {
                assert!(
                    stats.served_again > 0 && stats.off_schedule == 0,
                    "{what}, rank {rank}: nothing served by a kept tensor"
                );
            }
            for (rank, (_, stats)) in gathered.iter().enumerate() {
                assert_eq!(
                    stats.schedules, 1,
                    "{what}, rank {rank}: one schedule agreed"
                );
                assert_eq!(
                    stats.off_schedule, 0,
                    "{what}, rank {rank}: steps 2 on follow it"
                );
                assert!(
                    stats.prefetched > 0,
                    "{what}, rank {rank}: nothing gathered ahead"
                );
            }
            for (rank, (_, stats)) in on_demand.iter().enumerate() {
                assert_eq!(
                    (stats.schedules, stats.prefetched),
                    (0, 0),
                    "{what}, rank {rank}: off means off"
                );
            }
        }
    }
}

/// Parameter gathers, ahead or on demand, run on the communicator's gather lane and nothing else
/// does: with the lane, the main lane carries exactly what one lane carries less the gathers,
/// and no bit changes.
#[test]
fn gathers_run_on_their_own_lane_and_change_no_bit() {
    let one_lane = CommConfig::default().with_gather_lane(false);
    let two_lanes = CommConfig::default();
    for prefetch in [PrefetchConfig::OFF, PrefetchConfig::new()] {
        let run =
            |config| train_counted::<Stage3>(Synthetic::Transformer, 2, 2, prefetch, 4, config);
        let (one, two) = (run(&one_lane), run(&two_lanes));
        for (rank, ((p1, _, [main1, gather1]), (p2, stats, [main2, gather2]))) in
            one.iter().zip(&two).enumerate()
        {
            let what = format!("{prefetch:?}, rank {rank}");
            assert!(p1 == p2, "{what}: the lane changed the parameters");
            assert_eq!(main1, gather1, "{what}: one lane is its own gather lane");
            assert!(
                *gather2 >= stats.prefetched && *gather2 > 0,
                "{what}: {gather2} gathers"
            );
            assert_eq!(
                main2 + gather2,
                *main1,
                "{what}: only gathers moved to the lane"
            );
        }
    }
}

/// Recomputation in backward (Burn's gradient checkpointing) gathers the recomputed layers
/// again: those uses are in the schedule like any other.
#[test]
fn the_schedule_includes_the_gathers_of_recomputation() {
    let on_demand =
        train::<Stage3Checkpointed>(Synthetic::Transformer, 2, 1, PrefetchConfig::OFF, 5);
    let ahead = train::<Stage3Checkpointed>(Synthetic::Transformer, 2, 1, gathered_ahead(), 5);
    assert!(params_of(&ahead) == params_of(&on_demand));
    let plain = train::<Stage3>(Synthetic::Transformer, 2, 1, gathered_ahead(), 5);
    for ((_, checkpointed), (_, plain)) in ahead.iter().zip(&plain) {
        assert_eq!(checkpointed.off_schedule, 0);
        assert!(checkpointed.prefetched > 0);
        // Per step, the recomputed forward's gathers come on top of the plain backward's.
        assert!(
            checkpointed.gathers > plain.gathers,
            "recomputation gathered nothing more ({} vs {})",
            checkpointed.gathers,
            plain.gathers
        );
    }
}

/// Two branches, used in the order `order(step)` says: a step that changes the order
/// meets a use its schedule does not expect.
fn train_branches(
    world: usize,
    prefetch: PrefetchConfig,
    order: impl Fn(usize) -> [usize; 2] + Sync,
    steps: usize,
) -> Vec<(Vec<Vec<f32>>, Vec<ShardStats>)> {
    let comms = HostCommunicator::local_group(world, &CommConfig::default());
    run_ranks(comms, |_, comm| {
        let branches: Vec<Mlp<Stage3>> = (0..2)
            .map(|i| Mlp::new(&MLP_SIZES, 7 + i, &FlexDevice))
            .collect();
        let (mut ddp, mut model, mut zero) = start(comm, prefetch, branches);
        let mut per_step = Vec::new();
        for step in 0..steps {
            let [first, second] = order(step);
            model = mlp_step(&mut ddp, &mut zero, model, step, |model, x| {
                model[first].forward(x.clone()) + model[second].forward(x)
            });
            per_step.push(ddp.shard_stats().unwrap());
        }
        (parameters::<Stage3, _>(&model), per_step)
    })
}

#[test]
fn a_use_off_the_schedule_gathers_on_demand_and_the_step_records_the_schedule_again() {
    // Steps 0–2 use branch 0 first; step 3 branch 1 first; steps 4–6 branch 0 first again.
    let order = |step: usize| if step == 3 { [1, 0] } else { [0, 1] };
    let world = 2;
    let on_demand = train_branches(world, PrefetchConfig::OFF, order, 7);
    let ahead = train_branches(world, gathered_ahead(), order, 7);
    let final_params = |ranks: &[(Vec<Vec<f32>>, Vec<ShardStats>)]| {
        ranks.iter().map(|(p, _)| p.clone()).collect::<Vec<_>>()
    };
    assert!(
        final_params(&ahead) == final_params(&on_demand),
        "a broken schedule changed the parameters"
    );
    for (rank, (_, steps)) in ahead.iter().enumerate() {
        let at = |step: usize| (steps[step].schedules, steps[step].off_schedule);
        assert_eq!(
            at(0),
            (1, 0),
            "rank {rank}: step 0 records the first schedule"
        );
        assert_eq!(at(2), (1, 0), "rank {rank}: steps 1–2 follow it");
        assert_eq!(
            at(3),
            (2, 1),
            "rank {rank}: step 3 leaves it and records its own"
        );
        assert_eq!(
            at(4),
            (3, 2),
            "rank {rank}: step 4 leaves step 3's and records again"
        );
        assert_eq!(at(6), (3, 2), "rank {rank}: steps 5–6 follow step 4's");
        assert!(
            steps[6].prefetched > steps[4].prefetched,
            "rank {rank}: the new schedule gathers ahead"
        );
    }
}

/// Evaluation (`model.valid()`, between steps, on every rank) follows its own schedule: it
/// neither breaks training's nor is broken by it, and gives the same outputs as on demand.
#[test]
fn evaluation_keeps_its_own_schedule() {
    let run = |prefetch: PrefetchConfig| {
        let comms = HostCommunicator::local_group(2, &CommConfig::default());
        run_ranks(comms, |rank, comm| {
            let mlp = Mlp::<Stage3>::new(&MLP_SIZES, 7, &FlexDevice);
            let (mut ddp, mut model, mut zero) = start(comm, prefetch, mlp);
            let mut evaluations = Vec::new();
            for step in 0..6 {
                model = mlp_step(&mut ddp, &mut zero, model, step, |model, x| {
                    model.forward(x)
                });
                let valid: Mlp<Inner> = model.valid();
                let rows = shard_rows(GLOBAL_BATCH, rank, 2);
                let shape = [GLOBAL_BATCH, MLP_SIZES[0]];
                let x = synthetic_rows::<Inner, 2>(2, step, shape, rows, &FlexDevice);
                let out: Tensor<Inner, 2> = valid.forward(x);
                evaluations.push(out.into_data().convert::<f32>().into_vec::<f32>().unwrap());
            }
            let shards = ddp.param_shards().unwrap();
            let plans = (shards.schedule(Phase::Train), shards.schedule(Phase::Eval));
            (evaluations, ddp.shard_stats().unwrap(), plans)
        })
    };
    let on_demand = run(PrefetchConfig::OFF);
    let ahead = run(PrefetchConfig::new());
    for (rank, ((evaluations, stats, (train, eval)), (reference, ..))) in
        ahead.into_iter().zip(on_demand).enumerate()
    {
        assert!(evaluations == reference, "rank {rank}: evaluation outputs");
        assert_eq!(
            stats.schedules, 2,
            "rank {rank}: one for training, one for evaluation"
        );
        assert_eq!(
            stats.off_schedule, 0,
            "rank {rank}: neither broke the other"
        );
        let (train, _) = train.expect("a training schedule");
        let (eval, _) = eval.expect("an evaluation schedule");
        assert_eq!(
            eval,
            [0, 1, 2, 3, 4, 5],
            "rank {rank}: evaluation is a forward"
        );
        assert!(
            train.len() > eval.len(),
            "rank {rank}: training has a backward too"
        );
    }
}

/// With units of one layer, each layer's weight and bias are one gather, and the most held at
/// once is the layer being used plus the window's two layers ahead: more than on demand
/// (the window is counted), never more than the window allows.
#[test]
fn a_layer_is_one_gather_and_what_is_held_ahead_stays_within_the_window() {
    let layer_bytes: Vec<usize> = MLP_SIZES
        .windows(2)
        .map(|w| 4 * (w[0] * w[1] + w[1]))
        .collect();
    let largest = *layer_bytes.iter().max().unwrap();
    let window = gathered_ahead().with_unit_bytes(largest);
    let comms = HostCommunicator::local_group(2, &CommConfig::default());
    let ranks = run_ranks(comms, |_, comm| {
        let mlp = Mlp::<Stage3>::new(&MLP_SIZES, 7, &FlexDevice);
        let (mut ddp, mut model, mut zero) = start(comm, window, mlp);
        let mut peaks = Vec::new();
        for step in 0..4 {
            model = mlp_step(&mut ddp, &mut zero, model, step, |model, x| {
                model.forward(x)
            });
            peaks.push(ddp.shard_stats().unwrap().last_step_peak_bytes);
        }
        let (order, units) = ddp.param_shards().unwrap().schedule(Phase::Train).unwrap();
        (peaks, order, units, ddp.shard_stats().unwrap())
    });
    for (rank, (peaks, order, units, stats)) in ranks.into_iter().enumerate() {
        // Forward: each layer's linear(x, weight, bias); backward: the weights whose input
        // gradient it needs, last layer first (not the first layer's: its input is data).
        assert_eq!(
            order,
            [0, 1, 2, 3, 4, 5, 4, 2],
            "rank {rank}: the order of uses"
        );
        assert_eq!(
            units,
            [0..2, 2..4, 4..6, 4..5, 2..3],
            "rank {rank}: a layer's weight and bias are one gather"
        );
        assert_eq!(peaks[0], largest, "rank {rank}: step 0 gathers on demand");
        let bound = 3 * largest;
        for (step, &peak) in peaks.iter().enumerate().skip(1) {
            assert!(
                largest < peak && peak <= bound,
                "rank {rank}, step {step}: held {peak} bytes at most, outside ({largest}, {bound}]"
            );
        }
        assert_eq!(
            stats.live_bytes, 0,
            "rank {rank}: nothing held between steps"
        );
    }
}

/// With the default unit size the MLP's forward is one gather, and backward's two weights
/// (last layer first) one more, which also carries the bias between them that backward does
/// not use; once the unit is done with, that bias is no longer held either.
#[test]
fn backward_gathers_its_weights_in_reverse_as_one_unit() {
    let comms = HostCommunicator::local_group(2, &CommConfig::default());
    let ranks = run_ranks(comms, |_, comm| {
        let mlp = Mlp::<Stage3>::new(&MLP_SIZES, 7, &FlexDevice);
        let (mut ddp, mut model, mut zero) = start(comm, gathered_ahead(), mlp);
        for step in 0..3 {
            model = mlp_step(&mut ddp, &mut zero, model, step, |model, x| {
                model.forward(x)
            });
        }
        let (_, units) = ddp.param_shards().unwrap().schedule(Phase::Train).unwrap();
        (units, ddp.shard_stats().unwrap())
    });
    for (rank, (units, stats)) in ranks.into_iter().enumerate() {
        assert_eq!(units, [0..6, 2..5], "rank {rank}: the gathers' parameters");
        assert_eq!(stats.off_schedule, 0, "rank {rank}");
        assert_eq!(
            stats.live_bytes, 0,
            "rank {rank}: nothing held between steps"
        );
    }
}

/// A use waiting for its gather leaves the scheduler to the rank's other threads: one of them
/// asks it for the window while rank 0's forward waits for rank 1, which starts its step only
/// once that answer came. A scheduler locked through the wait would stall both ranks until the
/// collective timeout, and the gather would fail. Step 1 gathers each parameter alone, step 2
/// its unit on demand by the schedule.
#[test]
fn a_use_waiting_for_its_gather_leaves_the_scheduler_to_other_threads() {
    let comm_config = CommConfig::default().with_timeout(std::time::Duration::from_secs(5));
    let comms = HostCommunicator::local_group(2, &comm_config);
    let answered = std::sync::Barrier::new(2);
    run_ranks(comms, |rank, comm| {
        let mlp = Mlp::<Stage3>::new(&MLP_SIZES, 7, &FlexDevice);
        let (mut ddp, mut model, mut zero) = start(comm, gathered_ahead(), mlp);
        let forward = |model: &Mlp<Stage3>, x| model.forward(x);
        for step in 0..2 {
            if rank == 1 {
                answered.wait();
                model = mlp_step(&mut ddp, &mut zero, model, step, forward);
                continue;
            }
            let shards = ddp.param_shards().unwrap();
            let held = shards.stats().live_bytes;
            model = std::thread::scope(|scope| {
                scope.spawn(|| {
                    // The step's first gather is issued: the forward waits for rank 1 now.
                    while shards.stats().live_bytes == held {
                        std::thread::yield_now();
                    }
                    assert_eq!(shards.prefetch(), gathered_ahead());
                    answered.wait();
                });
                mlp_step(&mut ddp, &mut zero, model, step, forward)
            });
        }
    });
}

/// Each rank checks its own recorded order against rank 0's. The step's digests agree first,
/// so only a digest collision (injected here: a use recorded on rank 1 alone) gets this far;
/// the rank whose order differs is named with the first entry where it does, and both sides,
/// and it aborts the group, so that rank 0 fails too, naming it, and no rank adopts anything.
#[test]
fn a_rank_whose_order_differs_from_rank_zeros_is_named_with_the_first_difference() {
    let comms = HostCommunicator::local_group(2, &CommConfig::default());
    let outcomes = run_ranks(comms, |rank, comm| {
        let mut ddp = Ddp::for_thread(comm, config(1, PrefetchConfig::new()));
        let model = ddp
            .prepare_sharded(Mlp::<Stage3>::new(&MLP_SIZES, 7, &FlexDevice))
            .unwrap();
        let _ = model.layers[0].weight.val().mul_scalar(2.0);
        let shards = ddp.param_shards().unwrap();
        if rank == 1 {
            shards.inject_recorded_use(2);
        }
        // What ZeroAdam's step does once the digests agreed: share and adopt the orders.
        shards.end_step();
        let adopted = shards.adopt_schedules();
        (
            adopted,
            shards.schedule(Phase::Train).map(|(order, _)| order),
        )
    });
    match &outcomes[1].0 {
        Err(DistError::Schedule {
            rank: 1,
            phase: Phase::Train,
            position: 1,
            here,
            rank0,
        }) => {
            assert_eq!(here, "`layers.1.weight`");
            assert_eq!(rank0, "nothing");
        }
        other => panic!("rank 1: {other:?}"),
    }
    match &outcomes[0].0 {
        Err(DistError::Comm(CommError::Aborted { by: 1, reason })) => {
            assert!(reason.contains("differs from rank 0's"), "{reason}");
        }
        other => panic!("rank 0: {other:?}"),
    }
    for (rank, (_, adopted)) in outcomes.iter().enumerate() {
        assert_eq!(*adopted, None, "rank {rank} adopted a schedule");
    }
}

/// Which phases have a new schedule to share is agreed in the step's agreement, before any is
/// shared: a rank whose window was turned off alone (`set_prefetch`) records nothing, and
/// every rank fails the step naming it, rather than rank 0 sharing a schedule rank 1 does not
/// expect.
#[test]
fn ranks_that_differ_in_which_schedules_they_recorded_fail_the_step_naming_the_rank() {
    let comms = HostCommunicator::local_group(2, &CommConfig::default());
    let outcomes = run_ranks(comms, |rank, comm| {
        let mlp = Mlp::<Stage3>::new(&MLP_SIZES, 7, &FlexDevice);
        let (mut ddp, model, mut zero) = start(comm, PrefetchConfig::new(), mlp);
        if rank == 1 {
            let shards = ddp.param_shards().unwrap();
            shards.set_prefetch(PrefetchConfig::OFF);
        }
        try_mlp_step(&mut ddp, &mut zero, model, 0, |model, x| model.forward(x)).map(drop)
    });
    for (rank, outcome) in outcomes.iter().enumerate() {
        match outcome {
            Err(ZeroError::Dist(DistError::NewSchedules {
                rank: 1,
                phase: Phase::Train,
                here: false,
            })) => {}
            other => panic!("rank {rank}: {other:?}"),
        }
    }
}

/// Burn's attention applies its query, key and value projections one after the other: their
/// six tensors, next to each other in the layout, are one gather.
#[test]
fn the_query_key_and_value_projections_are_one_gather() {
    let comms = HostCommunicator::local_group(2, &CommConfig::default());
    let units = run_ranks(comms, |_, comm| {
        let mut ddp = Ddp::for_thread(comm, config(1, PrefetchConfig::new()));
        let optimizer = ZeroAdamConfig::new().with_stage(3);
        burn_dist_testing::train_synthetic::<Stage3>(
            &mut ddp,
            Synthetic::Transformer,
            &optimizer,
            2,
            GLOBAL_BATCH,
            LR,
            &FlexDevice,
            |_, _| {},
        )
        .unwrap();
        let shards = ddp.param_shards().unwrap();
        let (_, units) = shards.schedule(Phase::Train).unwrap();
        let names = |unit: std::ops::Range<usize>| -> Vec<String> {
            unit.map(|i| shards.params()[i].name.clone()).collect()
        };
        units.into_iter().map(names).collect::<Vec<_>>()
    });
    let first = &units[0][0];
    let projections: Vec<String> = ["query", "key", "value"]
        .iter()
        .flat_map(|p| ["weight", "bias"].map(|t| format!("encoder.layers.0.mha.{p}.{t}")))
        .collect();
    assert!(
        first.starts_with(&projections),
        "the first gather is {first:?}"
    );
    assert!(
        units.iter().all(|u| *u == units[0]),
        "every rank has the same units"
    );
}

/// A `[rows, cols]` weight of fixed values, the same on every rank.
fn fixed_weight(rows: usize, cols: usize) -> burn::module::Param<Tensor<Stage3, 2>> {
    let values: Vec<f32> = (0..rows * cols)
        .map(|i| 0.3 * (i as f32 * 0.37).sin())
        .collect();
    let data = burn::tensor::TensorData::new(values, [rows, cols]);
    burn::module::Param::from_tensor(Tensor::from_data(data, &FlexDevice))
}

/// A hidden layer, then `h · head`: the head's weight is forward's last use and backward's
/// first, as a tied LM head's is.
#[derive(burn::module::Module, Debug)]
struct Head<B: burn::tensor::backend::Backend> {
    hidden: Mlp<B>,
    head: burn::module::Param<Tensor<B, 2>>,
}

/// From step 2 on, the schedule serves backward's use of the head with the tensor forward's
/// use made: the head is gathered once a step, not twice, and no bit changes.
#[test]
fn a_weight_used_last_in_forward_and_first_in_backward_is_gathered_once_a_step() {
    const HIDDEN: usize = 12;
    const STEPS: usize = 4;
    let [input, .., output] = MLP_SIZES;
    let head_bytes = 4 * HIDDEN * output;
    let train = |prefetch: PrefetchConfig| {
        let comms = HostCommunicator::local_group(2, &CommConfig::default());
        run_ranks(comms, move |_, comm| {
            let model = Head {
                hidden: Mlp::new(&[input, HIDDEN], 7, &FlexDevice),
                head: fixed_weight(HIDDEN, output),
            };
            let (mut ddp, mut model, mut zero) = start(comm, prefetch, model);
            for step in 0..STEPS {
                model = mlp_step(&mut ddp, &mut zero, model, step, |model, x| {
                    model.hidden.forward(x).tanh().matmul(model.head.val())
                });
            }
            let stats = ddp.shard_stats().unwrap();
            (parameters(&model), stats)
        })
    };
    let on_demand = train(PrefetchConfig::OFF);
    let ahead = train(PrefetchConfig::new());
    assert!(
        params_of(&ahead) == params_of(&on_demand),
        "serving the head again changed the parameters"
    );
    for (rank, ((_, ahead), (_, on_demand))) in ahead.iter().zip(&on_demand).enumerate() {
        assert_eq!(
            on_demand.served_again, 0,
            "rank {rank}: no schedule, no repeat"
        );
        assert_eq!(
            ahead.served_again,
            STEPS as u64 - 1,
            "rank {rank}: once a step from step 2"
        );
        assert_eq!(
            ahead.gathered_bytes + (STEPS as u64 - 1) * head_bytes as u64,
            on_demand.gathered_bytes,
            "rank {rank}: the head's second gather is spared"
        );
        assert_eq!(
            ahead.live_bytes, 0,
            "rank {rank}: nothing kept past the step"
        );
    }
}

/// `x · tied`, a hidden layer, and the mean of `tied` added to the output: the tied weight is
/// forward's first use and its last, as a tied token embedding is (the LM head at the end).
#[derive(burn::module::Module, Debug)]
struct Tied<B: burn::tensor::backend::Backend> {
    tied: burn::module::Param<Tensor<B, 2>>,
    hidden: Mlp<B>,
}

/// From step 2 on, forward's last use of a weight it used first is served by the tensor its
/// first use kept, within `PrefetchConfig::reuse_bytes` (by default the largest parameter's
/// bytes): gathered once a step, not twice, and no bit changes. With one byte less the hidden weight (smaller), which backward uses, is
/// kept instead, from forward to backward: the budget decides, in the order of first uses.
#[test]
fn a_weight_used_first_and_last_in_forward_is_kept_between_within_the_reuse_bytes() {
    const STEPS: usize = 4;
    let [input, .., output] = MLP_SIZES;
    let tied_bytes = 4 * input * input;
    let hidden_bytes = 4 * input * output;
    let train = |prefetch: PrefetchConfig| {
        let comms = HostCommunicator::local_group(2, &CommConfig::default());
        run_ranks(comms, move |_, comm| {
            let model = Tied {
                tied: fixed_weight(input, input),
                hidden: Mlp::new(&[input, output], 7, &FlexDevice),
            };
            let (mut ddp, mut model, mut zero) = start(comm, prefetch, model);
            for step in 0..STEPS {
                model = mlp_step(&mut ddp, &mut zero, model, step, |model, x| {
                    let hidden = model.hidden.forward(x.matmul(model.tied.val()));
                    hidden + model.tied.val().mean().unsqueeze::<2>()
                });
            }
            let stats = ddp.shard_stats().unwrap();
            (parameters(&model), stats)
        })
    };
    let on_demand = train(PrefetchConfig::OFF);
    // The default: the largest parameter's bytes, the tied weight's.
    let kept = train(PrefetchConfig::new());
    let too_small = train(PrefetchConfig::new().with_reuse_bytes(Some(tied_bytes - 1)));
    assert!(
        params_of(&kept) == params_of(&on_demand) && params_of(&too_small) == params_of(&on_demand),
        "keeping the tied weight changed the parameters"
    );
    for (rank, (((_, kept), (_, too_small)), (_, on_demand))) in
        kept.iter().zip(&too_small).zip(&on_demand).enumerate()
    {
        assert_eq!(
            kept.served_again,
            STEPS as u64 - 1,
            "rank {rank}: once a step from step 2"
        );
        assert_eq!(
            kept.gathered_bytes + (STEPS as u64 - 1) * tied_bytes as u64,
            on_demand.gathered_bytes,
            "rank {rank}: the tied weight's second gather is spared"
        );
        assert_eq!(
            (too_small.served_again, too_small.gathered_bytes),
            (
                STEPS as u64 - 1,
                on_demand.gathered_bytes - (STEPS as u64 - 1) * hidden_bytes as u64
            ),
            "rank {rank}: over reuse_bytes, the tied weight is gathered twice, the hidden kept"
        );
        assert_eq!(
            kept.live_bytes, 0,
            "rank {rank}: nothing kept past the step"
        );
    }
}
