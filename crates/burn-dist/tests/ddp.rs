//! Data-parallel training with in-process ranks (threads) on `Autodiff<DistributedBackend<Flex>>`
//! against a one-rank reference on the concatenated batch.

use std::sync::{Arc, Mutex};

use burn::backend::Autodiff;
use burn::optim::{AdamConfig, Optimizer};
use burn::tensor::Tensor;
use burn_dist::{BucketConfig, Ddp, DdpConfig, DistError, DistributedBackend, ReducerEvent};
use burn_dist_comm::testing::run_ranks;
use burn_dist_comm::{CommConfig, HostCommunicator};
use burn_dist_testing::step::{StepConfig, transformer_step};
use burn_dist_testing::{
    BurnAdam, MLP_SIZES as MLP, Mlp, Synthetic, TRANSFORMER_WIDTH, TransformerBlock, parameters,
    shard_rows, synthetic_rows, train_ranks,
};
use burn_flex::{Flex, FlexDevice};

type B = Autodiff<DistributedBackend<Flex>>;

const STEPS: usize = 20;
const LR: f64 = 1e-2;
const TOLERANCE: f64 = 1e-5;
/// Divisible by 1, 2, 3 and 4.
const GLOBAL_BATCH: usize = 12;

/// Buckets small enough that the test models span several of them.
fn config() -> DdpConfig {
    DdpConfig::new().with_buckets(
        BucketConfig::new()
            .with_first_bucket_bytes(1024)
            .with_bucket_bytes(4096),
    )
}

fn comms(world: usize) -> Vec<HostCommunicator> {
    HostCommunicator::local_group(world, &CommConfig::default())
}

fn rows<const D: usize>(
    stream: usize,
    step: usize,
    shape: [usize; D],
    rows: std::ops::Range<usize>,
) -> Tensor<B, D> {
    synthetic_rows::<B, D>(stream, step, shape, rows, &FlexDevice)
}

fn shard(rank: usize, world: usize) -> std::ops::Range<usize> {
    shard_rows(GLOBAL_BATCH, rank, world)
}

/// Trains `task` with `world` ranks and returns each rank's final parameters.
fn train(task: Synthetic, world: usize, ddp_config: DdpConfig) -> Vec<Vec<Vec<f32>>> {
    train_ranks::<B>(
        world,
        &ddp_config,
        task,
        &BurnAdam,
        STEPS,
        GLOBAL_BATCH,
        LR,
        &FlexDevice,
    )
}

fn assert_close(got: &[Vec<f32>], reference: &[Vec<f32>], what: &str) {
    burn_dist_testing::assert_close(got, reference, TOLERANCE, what);
}

fn assert_replicas_identical(ranks: &[Vec<Vec<f32>>]) {
    for (rank, params) in ranks.iter().enumerate() {
        assert!(
            params == &ranks[0],
            "rank {rank}'s parameters differ from rank 0's"
        );
    }
}

#[test]
fn n_ranks_equal_one_rank_on_the_concatenated_batch_mlp() {
    let reference = train(Synthetic::Mlp, 1, config()).remove(0);
    for world in 2..=4 {
        let ranks = train(Synthetic::Mlp, world, config());
        assert_replicas_identical(&ranks);
        assert_close(&ranks[0], &reference, &format!("MLP, {world} ranks"));
    }
}

#[test]
fn n_ranks_equal_one_rank_on_the_concatenated_batch_transformer() {
    let reference = train(Synthetic::Transformer, 1, config()).remove(0);
    for world in 2..=4 {
        let ranks = train(Synthetic::Transformer, world, config());
        assert_replicas_identical(&ranks);
        assert_close(
            &ranks[0],
            &reference,
            &format!("transformer, {world} ranks"),
        );
    }
}

#[test]
fn transformer_block_spans_at_least_3_buckets() {
    let comm = comms(1).remove(0);
    let mut ddp = Ddp::for_thread(comm, config());
    ddp.prepare(TransformerBlock::<B>::new(
        TRANSFORMER_WIDTH,
        2,
        11,
        &FlexDevice,
    ))
    .unwrap();
    assert!(
        ddp.layout().buckets.len() >= 3,
        "{} buckets",
        ddp.layout().buckets.len()
    );
}

#[test]
fn accumulation_of_4_micro_batches_equals_one_step_on_4_times_the_batch() {
    let reference = train(Synthetic::Mlp, 1, config()).remove(0);
    let ranks = train(Synthetic::Mlp, 3, config().with_accumulation_steps(4));
    assert_replicas_identical(&ranks);
    assert_close(&ranks[0], &reference, "3 ranks x 4 micro-batches");
}

#[test]
fn collectives_are_issued_only_on_the_last_micro_batch() {
    let counts = run_ranks(comms(2), |rank, comm| {
        let mut ddp = Ddp::for_thread(comm, config().with_accumulation_steps(4));
        let mut model = ddp.prepare(Mlp::<B>::new(&MLP, 7, &FlexDevice)).unwrap();
        let mut counts = Vec::new();
        for m in 0..4 {
            model = ddp.mark(model);
            let before = ddp.stats().collectives;
            let x = rows(0, m, [GLOBAL_BATCH, MLP[0]], shard(rank, 2));
            let returned = ddp
                .backward(model.forward(x).mean(), &model)
                .unwrap()
                .is_some();
            counts.push((ddp.stats().collectives - before, returned));
        }
        (counts, ddp.layout().buckets.len())
    });
    for (counts, buckets) in counts {
        assert_eq!(
            &counts[..3],
            &[(0, false); 3],
            "micro-batches 1-3 must not communicate"
        );
        // Last one: every bucket, the usage bitmap, and the one-time ready-order broadcast.
        assert_eq!(counts[3], (buckets as u64 + 2, true));
    }
}

#[test]
fn bucket_layout_is_identical_everywhere_and_rebuilt_from_rank_0_after_step_1() {
    const WORLD: usize = 3;
    let layouts = run_ranks(comms(WORLD), |rank, comm| {
        let mut ddp = Ddp::for_thread(comm, config());
        let branches: Vec<Mlp<B>> = (0..2).map(|i| Mlp::new(&MLP, 7 + i, &FlexDevice)).collect();
        let mut model = ddp.prepare(branches).unwrap();
        let initial = ddp.layout();
        let order = Arc::new(Mutex::new(Vec::new()));
        let seen = order.clone();
        ddp.set_observer(move |_, ReducerEvent::Gradient { param, .. }| {
            seen.lock().unwrap().push(param)
        });
        // Burn's backward visits the graph breadth first from the loss, left operand first, so
        // the branches' gradients interleave in an order that depends on which branch is
        // added first: rank 0 adds branch 0 first, the other ranks branch 1.
        let x = || rows(0, 0, [GLOBAL_BATCH, MLP[0]], shard(rank, WORLD));
        let [first, second] = if rank == 0 { [0, 1] } else { [1, 0] };
        let out = model[first].forward(x()) + model[second].forward(x());
        let grads = ddp.backward(out.mean(), &model).unwrap().unwrap();
        model = AdamConfig::new().init().step(LR, model, grads);
        let rebuilt = ddp.next_layout();
        let observed = order.lock().unwrap().clone();
        drop(model);
        (initial, rebuilt, observed, ddp.stats().layout_rebuilds)
    });
    let numels: Vec<usize> = (0..MLP.len() - 1)
        .flat_map(|i| [MLP[i] * MLP[i + 1], MLP[i + 1]])
        .collect();
    let numels = [numels.clone(), numels].concat();
    let layout_of = |observed: &[usize]| {
        let order = burn_dist::bucket::complete_order(observed, numels.len());
        burn_dist::bucket::Layout::build(&numels, &order, &config().buckets)
    };
    let expected = layout_of(&layouts[0].2);
    // The test means something only if the ranks' own orders lead to other layouts.
    for (rank, (_, _, observed, _)) in layouts.iter().enumerate().skip(1) {
        assert_ne!(
            observed, &layouts[0].2,
            "rank {rank} observed rank 0's order: the test cannot tell whose order was used"
        );
        assert_ne!(layout_of(observed), expected, "rank {rank}'s own layout");
    }
    for (rank, (initial, rebuilt, _, rebuilds)) in layouts.iter().enumerate() {
        assert_eq!(initial, &layouts[0].0, "rank {rank}'s initial layout");
        assert_eq!(
            rebuilt, &expected,
            "rank {rank}: rebuilt from rank 0's observed order"
        );
        assert_eq!(*rebuilds, 1);
    }
    assert!(expected.buckets.len() >= 3);
}

/// What the observer saw in one backward: for each bucket that became complete in a hook that
/// was not the last, whether it was launched by then and its reduction completed there.
#[derive(Debug, Default)]
struct Overlap {
    /// (bucket, launched and reduced in that hook, gradients still to come after it).
    early_buckets: Vec<(usize, bool, usize)>,
    /// Gradient hooks seen, in order.
    hooks: usize,
    /// The hooks (counted from 1) whose event said `last`.
    last_hooks: Vec<usize>,
    /// Whether every hook ran on the thread that called `backward`.
    on_backward_thread: bool,
}

#[test]
fn first_bucket_is_reduced_before_the_last_gradient_hook_fires() {
    let overlapped = run_ranks(comms(2), |rank, comm| {
        let mut ddp = Ddp::for_thread(comm, config());
        let model = ddp.prepare(Mlp::<B>::new(&MLP, 7, &FlexDevice)).unwrap();
        let layout = ddp.layout();
        let seen = Arc::new(Mutex::new(Overlap {
            on_backward_thread: true,
            ..Overlap::default()
        }));
        let out = seen.clone();
        let backward_thread = std::thread::current().id();
        let mut arrived = vec![false; layout.slot.len()];
        let mut complete = vec![false; layout.buckets.len()];
        // In each gradient hook, on the backward thread, while later gradients are still to
        // come: a bucket whose gradients are all in must have been launched already, and its
        // reduction must complete (the peer, also still in its backward, serves it).
        ddp.set_observer(move |reducer, event| {
            let ReducerEvent::Gradient { param, last } = event;
            let mut seen = out.lock().unwrap();
            seen.hooks += 1;
            if last {
                let hook = seen.hooks;
                seen.last_hooks.push(hook);
            }
            seen.on_backward_thread &= std::thread::current().id() == backward_thread;
            arrived[param] = true;
            for (b, bucket) in layout.buckets.iter().enumerate() {
                if complete[b] || !bucket.params.iter().all(|&p| arrived[p]) {
                    continue;
                }
                complete[b] = true;
                if !last {
                    let reduced = reducer.wait_bucket(b).unwrap();
                    let to_come = arrived.iter().filter(|&&a| !a).count();
                    seen.early_buckets.push((b, reduced, to_come));
                }
            }
        });
        let x = rows(0, 0, [GLOBAL_BATCH, MLP[0]], shard(rank, 2));
        ddp.backward(model.forward(x).mean(), &model).unwrap();
        let buckets = ddp.layout().buckets.len();
        let seen = std::mem::take(&mut *seen.lock().unwrap());
        (seen, buckets)
    });
    for (rank, (seen, buckets)) in overlapped.into_iter().enumerate() {
        assert!(buckets >= 3, "{buckets} buckets");
        assert!(
            seen.on_backward_thread,
            "rank {rank}: a hook ran off the backward thread"
        );
        assert_eq!(
            seen.hooks,
            2 * (MLP.len() - 1),
            "rank {rank}: one hook per parameter"
        );
        assert_eq!(
            seen.last_hooks,
            [seen.hooks],
            "rank {rank}: the event says `last` in the last hook only"
        );
        // Bucket 0 holds the last layer, whose gradients come first: it is complete while the
        // other layers' gradients are still to come.
        let first = seen.early_buckets.first().map(|&(b, _, _)| b);
        assert_eq!(first, Some(0), "rank {rank}: {seen:?}");
        for &(b, reduced, to_come) in &seen.early_buckets {
            assert!(to_come > 0, "rank {rank}: bucket {b} seen in the last hook");
            assert!(
                reduced,
                "rank {rank}: bucket {b} was complete with {to_come} gradients still to come \
                 but had not been launched: its reduction waits for a later hook"
            );
        }
    }
}

/// `burn_dist_testing::train_with_unused` on the host path (Flex).
fn train_with_unused(
    world: usize,
    virtual_ranks: usize,
    unused_on: &(dyn Fn(usize) -> bool + Sync),
) -> Vec<(Vec<Vec<f32>>, bool)> {
    let make = |comm| Ddp::for_thread(comm, config());
    burn_dist_testing::train_with_unused::<B>(world, virtual_ranks, unused_on, make, &FlexDevice)
}

#[test]
fn parameter_unused_on_one_rank_gets_the_averaged_gradient_everywhere() {
    let reference = train_with_unused(1, 3, &|rank| rank == 1).remove(0).0;
    let ranks = train_with_unused(3, 3, &|rank| rank == 1);
    let params: Vec<_> = ranks.iter().map(|(p, _)| p.clone()).collect();
    assert_replicas_identical(&params);
    assert_close(&params[0], &reference, "second branch unused on rank 1");
    assert!(
        ranks.iter().all(|(_, got)| *got),
        "every rank must get the second branch's gradient"
    );
}

#[test]
fn parameter_unused_on_every_rank_gets_no_gradient_anywhere() {
    let reference = train_with_unused(1, 2, &|_| true).remove(0).0;
    let ranks = train_with_unused(2, 2, &|_| true);
    let params: Vec<_> = ranks.iter().map(|(p, _)| p.clone()).collect();
    assert_replicas_identical(&params);
    assert_close(&params[0], &reference, "second branch unused everywhere");
    assert!(
        ranks.iter().all(|(_, got)| !*got),
        "no rank used it, so no rank gets a gradient"
    );
    // And it was not updated: still its initial values.
    let initial = parameters::<B, _>(&Mlp::<B>::new(&MLP, 8, &FlexDevice));
    assert_eq!(&params[0][initial.len()..], &initial[..]);
}

#[test]
fn mismatched_models_fail_naming_the_first_differing_parameter() {
    let errors = run_ranks(comms(3), |rank, comm| {
        let mut ddp = Ddp::for_thread(comm, config());
        let sizes: &[usize] = if rank == 2 { &[16, 48, 40, 8] } else { &MLP };
        ddp.prepare(Mlp::<B>::new(sizes, 7, &FlexDevice))
            .err()
            .map(|e| e.to_string())
    });
    for error in errors {
        let error = error.expect("every rank must fail");
        assert!(
            error.contains("tensor #2 is `param layers.1.weight [48, 40] F32` on rank 2 but `param layers.1.weight [48, 48] F32` on rank 0"),
            "{error}"
        );
    }
}

#[test]
fn start_up_copies_rank_0_weights_to_every_rank() {
    let ranks = run_ranks(comms(3), |rank, comm| {
        let mut ddp = Ddp::for_thread(comm, config());
        // Different seeds on purpose: prepare must make them equal.
        let model = ddp
            .prepare(Mlp::<B>::new(&MLP, rank as u64, &FlexDevice))
            .unwrap();
        parameters::<B, _>(&model)
    });
    assert_replicas_identical(&ranks);
    assert_eq!(
        ranks[0],
        parameters::<B, _>(&Mlp::<B>::new(&MLP, 0, &FlexDevice))
    );
}

#[test]
fn forgetting_to_mark_micro_batches_is_an_error_not_a_silent_divergence() {
    let errors = run_ranks(comms(2), |rank, comm| {
        let mut ddp = Ddp::for_thread(comm, config().with_accumulation_steps(2));
        let model = ddp.prepare(Mlp::<B>::new(&MLP, 7, &FlexDevice)).unwrap();
        let x = || rows(0, 0, [GLOBAL_BATCH, MLP[0]], shard(rank, 2));
        ddp.backward(model.forward(x()).mean(), &model).unwrap();
        // No `ddp.mark(model)`: Burn consumed the marks in the first backward.
        ddp.backward(model.forward(x()).mean(), &model).err()
    });
    for error in errors {
        assert!(
            matches!(error, Some(DistError::NotMarked { .. })),
            "{error:?}"
        );
    }
}

/// A model that `prepare` never saw, marked for sync, and its loss on one batch.
fn stranger_and_loss() -> (Mlp<B>, Tensor<B, 1>) {
    let stranger = burn_dist::mark_for_sync(Mlp::<B>::new(&MLP, 8, &FlexDevice));
    let loss = stranger
        .forward(rows(0, 0, [GLOBAL_BATCH, MLP[0]], 0..GLOBAL_BATCH))
        .mean();
    (stranger, loss)
}

#[test]
fn a_hook_error_comes_back_from_ddp_backward() {
    let comm = comms(1).remove(0);
    let mut ddp = Ddp::for_thread(comm, config());
    ddp.prepare(Mlp::<B>::new(&MLP, 7, &FlexDevice)).unwrap();
    let (stranger, loss) = stranger_and_loss();
    let error = ddp.backward(loss, &stranger).err();
    assert!(
        matches!(error, Some(DistError::UnknownParameter { .. })),
        "{error:?}"
    );
}

#[test]
fn a_hook_error_in_a_plain_backward_panics_naming_it() {
    // A thread of its own: the panic unwinds out of Burn's backward.
    let panic = std::thread::spawn(|| {
        let comm = comms(1).remove(0);
        let mut ddp = Ddp::for_thread(comm, config());
        ddp.prepare(Mlp::<B>::new(&MLP, 7, &FlexDevice)).unwrap();
        let (_stranger, loss) = stranger_and_loss();
        let _ = loss.backward();
    })
    .join()
    .expect_err("a plain backward with a hook error did not panic");
    let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(
        message.contains("gradient synchronization failed")
            && message.contains("is not registered with the reducer"),
        "{message}"
    );
}

#[test]
fn the_host_path_counts_every_gradient_byte_it_reads_and_writes_back() {
    let comm = comms(1).remove(0);
    let mut ddp = Ddp::for_thread(comm, config());
    let model = ddp.prepare(Mlp::<B>::new(&MLP, 7, &FlexDevice)).unwrap();
    let loss = model
        .forward(rows(0, 0, [GLOBAL_BATCH, MLP[0]], 0..GLOBAL_BATCH))
        .mean();
    ddp.backward(loss, &model).unwrap().unwrap();
    let f32_bytes: u64 = ddp.params().iter().map(|p| 4 * p.numel() as u64).sum();
    let stats = ddp.stats();
    assert_eq!(
        (
            stats.bytes_to_host,
            stats.bytes_copied,
            stats.bytes_to_device
        ),
        (f32_bytes, f32_bytes, f32_bytes),
        "each gradient read once, copied into its bucket once, and its average written back once"
    );
}

#[test]
fn module_without_ddp_is_untouched_by_the_hooks() {
    // No reducer installed on this thread: hooks do nothing and backward is plain Burn's.
    let model = Mlp::<B>::new(&MLP, 7, &FlexDevice);
    let x = rows(0, 0, [GLOBAL_BATCH, MLP[0]], 0..GLOBAL_BATCH);
    let grads = model.forward(x).mean().backward();
    assert!(model.layers[0].weight.grad(&grads).is_some());
}

#[test]
fn dropout_is_reproducible_and_differs_across_ranks_and_steps() {
    use burn::nn::DropoutConfig;
    let run = |world: usize| {
        run_ranks(comms(world), |_, comm| {
            let ddp = Ddp::for_thread(comm, config());
            ddp.seed(5);
            let dropout = DropoutConfig::new(0.5).init();
            let x = Tensor::<B, 2>::ones([4, 64], &FlexDevice);
            (0..2)
                .map(|step| {
                    ddp.set_step(step);
                    dropout
                        .forward(x.clone())
                        .into_data()
                        .to_vec::<f32>()
                        .unwrap()
                })
                .collect::<Vec<_>>()
        })
    };
    let two = run(2);
    assert_eq!(two, run(2), "same seed, same masks");
    assert_ne!(two[0], two[1], "ranks must draw different masks");
    assert_ne!(two[0][0], two[0][1], "steps must draw different masks");
    assert_eq!(
        two[0],
        run(1)[0],
        "rank 0's stream does not depend on the world size"
    );
    let kept = two[0][0].iter().filter(|&&v| v != 0.0).count();
    assert!(
        (64..=192).contains(&kept),
        "about half of 256 kept, got {kept}"
    );
}

#[test]
fn grad_scaler_unscales_exactly_and_all_ranks_agree_on_overflow() {
    use burn_dist::GradScalerConfig;
    use burn_dist_testing::overflow_on_this_rank;
    let results = run_ranks(comms(2), |rank, comm| {
        let mut ddp = Ddp::for_thread(comm, config());
        let model = ddp.prepare(Mlp::<B>::new(&MLP, 7, &FlexDevice)).unwrap();
        let scaler = GradScalerConfig::new().init();
        let loss = |model: &Mlp<B>| {
            model
                .forward(rows(0, 0, [GLOBAL_BATCH, MLP[0]], shard(rank, 2)))
                .mean()
        };
        let weight = model.layers[0].weight.id;
        let read = |g: &burn::optim::GradientsParams| {
            g.get::<DistributedBackend<Flex>, 2>(weight)
                .unwrap()
                .into_data()
                .to_vec::<f32>()
                .unwrap()
        };
        let plain = read(&ddp.backward(loss(&model), &model).unwrap().unwrap());
        let model = ddp.mark(model);
        let scaled = ddp
            .backward(scaler.scale_loss(loss(&model)), &model)
            .unwrap()
            .unwrap();
        let unscaled = read(
            &scaler
                .unscale(scaled, &model, ddp.communicator())
                .unwrap()
                .unwrap(),
        );
        let model = ddp.mark(model);
        // Only rank 1 overflows, after the average (so the average cannot spread it): rank 0's
        // gradients are finite, and it must still learn of the overflow from rank 1.
        let grads = ddp
            .backward(scaler.scale_loss(loss(&model)), &model)
            .unwrap()
            .unwrap();
        let grads = if rank == 1 {
            overflow_on_this_rank(&ddp, grads, &model, f32::INFINITY)
        } else {
            grads
        };
        let finite_here = read(&grads).iter().all(|g| g.is_finite());
        let skipped = scaler
            .unscale(grads, &model, ddp.communicator())
            .unwrap()
            .is_none();
        (plain == unscaled, finite_here, skipped)
    });
    assert_eq!(
        results,
        [(true, true, true), (true, false, true)],
        "(unscaled exactly, finite on this rank, step skipped) per rank"
    );
}

#[test]
fn burns_backend_all_reduce_reduces_over_the_ranks() {
    use burn::tensor::backend::distributed::{DistributedBackend as _, ReduceOperation};
    type Inner = DistributedBackend<Flex>;
    let results = run_ranks(comms(3), |rank, comm| {
        let _ddp = Ddp::for_thread(comm, config());
        let tensor = Tensor::<Inner, 1>::from_floats([rank as f32, 1.0], &FlexDevice);
        let sum = Inner::all_reduce(
            tensor.clone().into_primitive().tensor(),
            ReduceOperation::Sum,
            vec![],
        );
        let mean = Inner::all_reduce(
            tensor.into_primitive().tensor(),
            ReduceOperation::Mean,
            vec![],
        );
        let read = |c: burn::tensor::backend::distributed::CollectiveTensor<Inner>| {
            Tensor::<Inner, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(c.resolve()))
                .into_data()
                .to_vec::<f32>()
                .unwrap()
        };
        (read(sum), read(mean))
    });
    for (sum, mean) in results {
        assert_eq!(sum, [3.0, 3.0]);
        assert_eq!(mean, [1.0, 1.0]);
    }
}

/// A `Ddp` dropped after a newer one of the same rank was built leaves the newer one serving
/// the hooks (the device check builds one `Ddp` on a thread of its own and drops it while the
/// main one trains).
#[test]
fn dropping_an_older_ddp_keeps_the_newer_one_in_place() {
    let comm = comms(2);
    run_ranks(comm, |rank, comm| {
        let older = Ddp::for_thread(comm, config());
        let newer_comm = comms(1).remove(0);
        let mut newer = Ddp::for_thread(newer_comm, config());
        drop(older);
        let model = newer.prepare(Mlp::<B>::new(&MLP, 7, &FlexDevice)).unwrap();
        let x = rows::<2>(0, 0, [1, MLP[0]], 0..1);
        let grads = newer.backward(model.forward(x).mean(), &model).unwrap();
        assert!(grads.is_some(), "rank {rank}: no gradients");
        assert_eq!(
            newer.stats().backwards,
            1,
            "rank {rank}: the newer Ddp's reducer saw no backward"
        );
    });
}

/// One `Ddp` prepares a second model after training the first (the device check prepares a
/// small model, then the timed one): the second trains as a plain model on the same batches
/// does, with none of the first model's bucket layout (rebuilt after its first backward)
/// left to swap in.
#[test]
fn a_ddp_prepared_again_trains_the_new_model_with_its_own_layout() {
    let comm = comms(2);
    run_ranks(comm, |rank, comm| {
        let mut ddp = Ddp::for_thread(comm, config());
        let first = ddp.prepare(Mlp::<B>::new(&MLP, 7, &FlexDevice)).unwrap();
        let x = rows::<2>(0, 0, [1, MLP[0]], 0..1);
        ddp.backward(first.forward(x).mean(), &first).unwrap();

        let step = StepConfig {
            d_model: TRANSFORMER_WIDTH,
            heads: 2,
            batch: 2,
            seq: 3,
            seed: 11,
        };
        let mut synced = ddp.prepare(step.model::<B>(&FlexDevice)).unwrap();
        let mut plain = step.model::<B>(&FlexDevice);
        assert!(
            parameters(&synced).len() > parameters(&first).len(),
            "the second model must have more parameter tensors than the first to catch a stale \
             layout"
        );
        let (mut synced_optim, mut plain_optim) =
            (AdamConfig::new().init(), AdamConfig::new().init());
        for s in 0..3 {
            // The same batch on every rank: the mean over ranks is each rank's gradient.
            let (x, y) = step.batch::<B>(s, &FlexDevice);
            synced = transformer_step(synced, &mut synced_optim, x.clone(), y.clone(), LR).0;
            plain = transformer_step(plain, &mut plain_optim, x, y, LR).0;
        }
        assert_eq!(
            ddp.stats().backwards,
            4,
            "rank {rank}: backwards seen by the reducer"
        );
        assert_close(
            &parameters(&synced),
            &parameters(&plain),
            &format!("rank {rank}: the second model"),
        );
    });
}
