//! Under ZeRO stage 3 the collectives follow the user's program, so ranks whose programs
//! differ must fail, every one of them, within seconds, naming the parameter (or, where a rank
//! waits on the other lane, the collective it waits in): never a hang, never a gather that
//! pairs two different parameters. Every group here has the default collective timeout (10
//! minutes) and must fail within 15 s.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::time::{Duration, Instant};

use burn::backend::Autodiff;
use burn::module::{AutodiffModule, Module, ModuleMapper, Param};
use burn::tensor::Tensor;
use burn_dist::{Ddp, DdpConfig, DistError, DistributedBackend, PrefetchConfig, Sharded};
use burn_dist_comm::testing::run_ranks;
use burn_dist_comm::{CommConfig, Communicator, HostCommunicator};
use burn_dist_models::processes::{join_as_test_rank, run_this_test_as_ranks};
use burn_dist_testing::{MLP_SIZES, Mlp, shard_rows, synthetic_rows};
use burn_dist_zero::checkpoint::{self, TrainingState};
use burn_dist_zero::{ZeroAdam, ZeroAdamConfig, ZeroError};
use burn_flex::{Flex, FlexDevice};

type S3 = Autodiff<DistributedBackend<Flex, Sharded>>;

const BATCH: usize = 12;
/// Every rank must have failed within this, with the default collective timeout.
const DEADLINE: Duration = Duration::from_secs(15);

/// Runs `body` on 2 thread ranks linked by channels with the default collective timeout and
/// returns what each rank failed with (see [`failure_of`]). Every rank must fail, within
/// [`DEADLINE`].
fn every_rank_fails(body: impl Fn(usize, &mut Ddp) -> Result<(), String> + Sync) -> Vec<String> {
    every_rank_fails_with(|_| DdpConfig::new(), body)
}

/// [`every_rank_fails`], each rank's `Ddp` with `config(rank)`.
fn every_rank_fails_with(
    config: impl Fn(usize) -> DdpConfig + Sync,
    body: impl Fn(usize, &mut Ddp) -> Result<(), String> + Sync,
) -> Vec<String> {
    let comms = HostCommunicator::local_group(2, &CommConfig::default());
    let started = Instant::now();
    let failures = run_ranks(comms, |rank, comm| {
        let mut ddp = Ddp::for_thread(comm, config(rank));
        failure_of(rank, || body(rank, &mut ddp))
    });
    assert!(
        started.elapsed() < DEADLINE,
        "the ranks took {:?} to fail",
        started.elapsed()
    );
    failures
}

/// What `body` failed with: an error it returned or the message of a panic (an op cannot
/// return an error, so a failed gather panics). Panics if it did not fail.
fn failure_of(rank: usize, body: impl FnOnce() -> Result<(), String>) -> String {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => panic!("rank {rank} did not fail"),
        Ok(Err(error)) => error,
        Err(panic) => panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default(),
    }
}

/// Every rank's failure contains `text`.
fn assert_mention(failures: &[String], text: &str) {
    for (rank, failure) in failures.iter().enumerate() {
        assert!(
            failure.contains(text),
            "rank {rank} does not say `{text}`: {failure}"
        );
    }
}

fn zero_adam(ddp: &Ddp, model: &Mlp<S3>) -> ZeroAdam {
    ZeroAdamConfig::new()
        .with_stage(3)
        .init::<S3, _>(ddp, model)
        .unwrap()
}

/// This rank's loss on step 0's rows.
fn loss(model: &Mlp<S3>, ddp: &Ddp) -> Tensor<S3, 1> {
    let (x, y) = batch(ddp);
    (model.forward(x) - y).powi_scalar(2).mean()
}

/// One training step: forward, `Ddp::backward`, ZeroAdam's step.
fn train_step(ddp: &mut Ddp, zero: &mut ZeroAdam, model: Mlp<S3>) -> Result<Mlp<S3>, String> {
    let loss = loss(&model, ddp);
    let grads = ddp.backward(loss, &model).map_err(|e| e.to_string())?;
    let grads = grads.expect("no accumulation: every backward communicates");
    let (model, _) = zero
        .step(1e-2, model, grads, ddp)
        .map_err(|e| e.to_string())?;
    Ok(model)
}

/// A divergence between the lanes, as one rank's program would cause it: one rank ends up
/// waiting on the gather lane, the other on the main lane (`rank`, its `Ddp`, a scratch
/// directory shared by the ranks).
type Scenario = fn(usize, &mut Ddp, &Path) -> Result<(), String>;

/// Each scenario by name, for the ranks in child processes.
const SCENARIOS: [(&str, Scenario); 5] = [
    ("read", read_between_backward_and_step),
    ("record", record_on_rank_0_before_a_checkpoint),
    ("evaluation", evaluation_on_rank_0_before_a_barrier),
    ("skipped-backward", backward_skipped_on_rank_0),
    ("no-parameter", loss_reaching_no_parameter_on_rank_0),
];

/// Which scenario a child process runs.
const SCENARIO_VAR: &str = "ZERO3_DIVERGENCE_SCENARIO";
const REPORT: &str = "zero3-divergence-report: ";

/// The body of the ranks that [`every_process_fails`] starts: runs the named scenario as one
/// rank and reports its failure on one line. Does nothing when run as itself.
#[test]
fn rank_of_a_scenario_in_its_own_process() {
    let Some((rank, comm)) = join_as_test_rank(&CommConfig::default()) else {
        return;
    };
    let name = std::env::var(SCENARIO_VAR).expect("a scenario");
    let dir = std::env::var("ZERO3_DIVERGENCE_DIR").expect("a scratch directory");
    let (_, scenario) = SCENARIOS
        .iter()
        .find(|(n, _)| *n == name)
        .expect("a known scenario");
    let mut ddp = Ddp::for_thread(comm, DdpConfig::new());
    let failure = failure_of(rank, || scenario(rank, &mut ddp, Path::new(&dir)));
    println!("{REPORT}{}", failure.replace('\n', " "));
}

/// Runs scenario `name` on 2 ranks in processes of their own, joined as `init` joins them on one
/// host (loopback TCP and shared-memory lanes, TCP control connections), with the default
/// collective timeout. Every rank must report a failure, all within [`DEADLINE`] of their
/// start. Threads of one process share Burn's autodiff graphs, whose clean-up after a backward
/// locks every graph of the process, so a thread rank whose backward waits can hold up a peer
/// outside any collective: processes are how users run, and what every scenario runs as.
fn every_process_fails(name: &str) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path().to_str().expect("a UTF-8 path");
    let env = [(SCENARIO_VAR, name), ("ZERO3_DIVERGENCE_DIR", dir)];
    let started = Instant::now();
    let ended = run_this_test_as_ranks(
        "rank_of_a_scenario_in_its_own_process",
        2,
        &CommConfig::default(),
        &env,
        Duration::from_secs(60),
    );
    let elapsed = started.elapsed();
    assert!(elapsed < DEADLINE, "{name}: the ranks took {elapsed:?}");
    ended
        .into_iter()
        .enumerate()
        .map(|(rank, (status, lines))| {
            assert!(
                status.success(),
                "{name}, rank {rank}: {status}\n{lines:#?}"
            );
            lines
                .iter()
                .find_map(|line| line.split_once(REPORT).map(|(_, r)| r.to_string()))
                .unwrap_or_else(|| panic!("{name}, rank {rank}: no report\n{lines:#?}"))
        })
        .collect()
}

/// Scenario `name` on thread ranks linked by channels (where Burn's shared graphs do not get in
/// the way) and in processes of their own: each finds the other's wait its own way (reading
/// the peer's progress, or asking over the control connection). Every rank's failures.
fn on_threads_and_processes(name: &str) -> Vec<Vec<String>> {
    let (_, scenario) = SCENARIOS.iter().find(|(n, _)| *n == name).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let on_threads = every_rank_fails(|rank, ddp| scenario(rank, ddp, dir.path()));
    vec![on_threads, every_process_fails(name)]
}

fn mlp(ddp: &mut Ddp, seed: u64) -> Mlp<S3> {
    ddp.prepare_sharded(Mlp::<S3>::new(&MLP_SIZES, seed, &FlexDevice))
        .unwrap()
}

/// This rank's rows of step 0.
fn batch(ddp: &Ddp) -> (Tensor<S3, 2>, Tensor<S3, 2>) {
    let rows = shard_rows(BATCH, ddp.rank(), ddp.world_size());
    (
        synthetic_rows::<S3, 2>(0, 0, [BATCH, MLP_SIZES[0]], rows.clone(), &FlexDevice),
        synthetic_rows::<S3, 2>(1, 0, [BATCH, MLP_SIZES[3]], rows, &FlexDevice),
    )
}

fn assert_names(failures: &[String], names: &[&str]) {
    for (rank, failure) in failures.iter().enumerate() {
        for name in names {
            assert!(
                failure.contains(&format!("`{name}`")),
                "rank {rank} does not name `{name}`: {failure}"
            );
        }
    }
}

#[test]
fn a_rank_that_takes_an_extra_branch_fails_every_rank_naming_the_parameter() {
    let failures = every_rank_fails(|rank, ddp| {
        let branches = vec![
            Mlp::<S3>::new(&MLP_SIZES, 7, &FlexDevice),
            Mlp::<S3>::new(&MLP_SIZES, 8, &FlexDevice),
        ];
        let model = ddp.prepare_sharded(branches).unwrap();
        let (x, y) = batch(ddp);
        let mut out = model[0].forward(x.clone());
        if rank == 1 {
            out = out + model[1].forward(x);
        }
        let loss = (out - y).powi_scalar(2).mean();
        ddp.backward(loss, &model)
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    // Rank 1 gathers the second branch's first weight while rank 0 has gone on to backward:
    // both name it, and each the parameter it was gathering.
    assert_names(&failures, &["1.layers.0.weight"]);
    assert!(
        failures[0].contains("rank 0 gathering sharded parameter"),
        "{}",
        failures[0]
    );
    assert!(
        failures[1].contains("rank 1 gathering sharded parameter"),
        "{}",
        failures[1]
    );
}

#[test]
fn rank_0_reading_a_weight_alone_fails_every_rank_naming_it() {
    let failures = every_rank_fails(|rank, ddp| {
        let model = mlp(ddp, 7);
        if rank == 0 {
            // Printing a weight reads it: under stage 3 a read is a gather.
            println!("{}", model.layers[2].weight.val());
        }
        let (x, y) = batch(ddp);
        let loss = (model.forward(x) - y).powi_scalar(2).mean();
        ddp.backward(loss, &model)
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    assert_names(&failures, &["layers.2.weight", "layers.0.weight"]);
}

/// Replaces the first layer's weight by a full local tensor, as a `ModuleMapper` that stores
/// new values would.
struct Overwrite;

impl ModuleMapper<S3> for Overwrite {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<S3, D>>) -> Param<Tensor<S3, D>> {
        if param.val().dims().as_slice() != [MLP_SIZES[0], MLP_SIZES[1]] {
            return param;
        }
        param.map(|weight| weight.zeros_like().require_grad())
    }
}

#[test]
fn a_write_into_a_sharded_parameter_on_every_rank_is_reported_by_backward() {
    let failures = every_rank_fails(|_, ddp| {
        let model = mlp(ddp, 7).map(&mut Overwrite);
        let (x, y) = batch(ddp);
        let loss = (model.forward(x) - y).powi_scalar(2).mean();
        match ddp.backward(loss, &model) {
            Err(error @ DistError::ShardReplaced { .. }) => Err(error.to_string()),
            other => panic!("expected ShardReplaced, got {:?}", other.map(|_| ())),
        }
    });
    assert_names(&failures, &["layers.0.weight"]);
}

#[test]
fn a_write_between_backward_and_the_step_is_refused_by_the_step() {
    let failures = every_rank_fails(|_, ddp| {
        let model = mlp(ddp, 7);
        let mut zero = ZeroAdamConfig::new()
            .with_stage(3)
            .init::<S3, _>(ddp, &model)
            .unwrap();
        let (x, y) = batch(ddp);
        let loss = (model.forward(x) - y).powi_scalar(2).mean();
        let grads = ddp.backward(loss, &model).unwrap().unwrap();
        let model = model.map(&mut Overwrite);
        match zero.step(1e-2, model, grads, ddp) {
            Err(ZeroError::Dist(error @ DistError::ShardReplaced { .. })) => Err(error.to_string()),
            other => panic!("expected ShardReplaced, got {:?}", other.map(|_| ())),
        }
    });
    assert_names(&failures, &["layers.0.weight"]);
}

#[test]
fn a_write_on_one_rank_fails_every_rank_naming_the_parameter() {
    let failures = every_rank_fails(|rank, ddp| {
        let mut model = mlp(ddp, 7);
        if rank == 0 {
            // Slice-assign returns a new, full tensor: the layer holds it instead of its shard.
            let weight = &mut model.layers[0].weight;
            *weight = weight.clone().map(|w| {
                w.clone()
                    .slice_assign([0..1, 0..1], Tensor::zeros([1, 1], &FlexDevice))
            });
        }
        let (x, y) = batch(ddp);
        let loss = (model.forward(x) - y).powi_scalar(2).mean();
        ddp.backward(loss, &model)
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    // The slice-assign gathered the weight on rank 0 while rank 1's forward gathered it, so
    // the sequences still pair up; rank 0's backward finds the full tensor where its shard
    // was and stops the group, naming it.
    assert_names(&failures, &["layers.0.weight"]);
    assert!(
        failures[0].contains("was replaced by a full local tensor"),
        "{}",
        failures[0]
    );
    assert!(
        failures[1].contains("rank 0 aborted the group"),
        "{}",
        failures[1]
    );
}

#[test]
fn ranks_whose_uses_differ_fail_the_step_naming_the_rank() {
    let failures = every_rank_fails(|rank, ddp| {
        let model = mlp(ddp, 7);
        let mut zero = ZeroAdamConfig::new()
            .with_stage(3)
            .init::<S3, _>(ddp, &model)
            .unwrap();
        let (x, y) = batch(ddp);
        let loss = (model.forward(x) - y).powi_scalar(2).mean();
        let grads = ddp.backward(loss, &model).unwrap().unwrap();
        if rank == 1 {
            // A use that needed no collective (what a prefetched gather will be): only the
            // step's agreement can see it.
            ddp.param_shards().unwrap().inject_use(3);
        }
        match zero.step(1e-2, model, grads, ddp) {
            Err(ZeroError::Dist(error @ DistError::UseSequence { .. })) => Err(error.to_string()),
            other => panic!("expected UseSequence, got {:?}", other.map(|_| ())),
        }
    });
    for failure in &failures {
        assert!(
            failure.contains("rank 1 used the sharded parameters"),
            "{failure}"
        );
    }
}

/// Rank 0 prints a weight between backward and the step: a read gather on the gather lane,
/// while rank 1 waits in the step's agreement on the main lane.
fn read_between_backward_and_step(rank: usize, ddp: &mut Ddp, _: &Path) -> Result<(), String> {
    let model = mlp(ddp, 7);
    let mut zero = zero_adam(ddp, &model);
    let loss = loss(&model, ddp);
    let grads = ddp.backward(loss, &model).map_err(|e| e.to_string())?;
    if rank == 0 {
        println!("{}", model.layers[2].weight.val());
    }
    zero.step(1e-2, model, grads.unwrap(), ddp)
        .map(drop)
        .map_err(|e| e.to_string())
}

/// Rank 0 takes a model record alone (`into_record` gathers every parameter to rank 0, on every
/// rank) before `checkpoint::save`, which rank 1 starts at once.
fn record_on_rank_0_before_a_checkpoint(
    rank: usize,
    ddp: &mut Ddp,
    root: &Path,
) -> Result<(), String> {
    let model = mlp(ddp, 7);
    let zero = zero_adam(ddp, &model);
    if rank == 0 {
        let _record = model.clone().into_record();
    }
    checkpoint::save::<S3, _>(root, ddp, &model, &zero, &TrainingState::new(0, 0))
        .map(drop)
        .map_err(|e| e.to_string())
}

/// Rank 0 evaluates alone (`model.valid()`: the evaluation's gathers) while rank 1 has gone on
/// to a barrier.
fn evaluation_on_rank_0_before_a_barrier(
    rank: usize,
    ddp: &mut Ddp,
    _: &Path,
) -> Result<(), String> {
    let model = mlp(ddp, 7);
    if rank == 0 {
        let (x, _) = batch(ddp);
        let _ = model.valid().forward(x.inner());
    }
    ddp.communicator()
        .barrier()
        .wait()
        .map_err(|e| e.to_string())
}

/// After a first step (the schedule agreed), rank 0's loss is not finite, as a NaN would make
/// it, and it skips backward and the step: its next forward gathers while rank 1's backward
/// waits for its gradients' reduction on the main lane.
fn backward_skipped_on_rank_0(rank: usize, ddp: &mut Ddp, _: &Path) -> Result<(), String> {
    let mut model = mlp(ddp, 7);
    let mut zero = zero_adam(ddp, &model);
    for step in 0..3 {
        if rank == 0 && step == 1 {
            let _not_finite = loss(&model, ddp);
            continue;
        }
        model = train_step(ddp, &mut zero, model)?;
    }
    Ok(())
}

/// Rank 0's loss reaches no parameter (its model's output is detached): Burn calls no hook, so
/// rank 0 takes part in the gradients' reduction with zeros on the main lane, while rank 1's
/// backward gathers the last layer's weight on the gather lane.
fn loss_reaching_no_parameter_on_rank_0(
    rank: usize,
    ddp: &mut Ddp,
    _: &Path,
) -> Result<(), String> {
    let model = mlp(ddp, 7);
    let (x, y) = batch(ddp);
    let mut out = model.forward(x);
    if rank == 0 {
        out = out.detach() + Tensor::zeros([1, 1], &FlexDevice).require_grad();
    }
    let loss = (out - y).powi_scalar(2).mean();
    ddp.backward(loss, &model)
        .map(drop)
        .map_err(|e| e.to_string())
}

#[test]
fn a_read_between_backward_and_the_step_fails_every_rank_naming_the_weight_and_the_collective() {
    for failures in on_threads_and_processes("read") {
        assert_names(&failures, &["layers.2.weight"]);
        assert_mention(&failures, "rank 1 waits in all_gather");
        assert_mention(&failures, "on the main lane");
    }
}

#[test]
fn a_record_taken_on_rank_0_alone_before_a_checkpoint_fails_every_rank_naming_the_weight() {
    for failures in on_threads_and_processes("record") {
        assert_names(&failures, &["layers.0.weight"]);
        assert_mention(&failures, "on the main lane");
    }
}

#[test]
fn an_evaluation_on_one_rank_fails_every_rank_naming_the_weight_and_the_barrier() {
    for failures in on_threads_and_processes("evaluation") {
        assert_names(&failures, &["layers.0.weight"]);
        assert_mention(&failures, "rank 1 waits in barrier");
    }
}

/// In processes only: see [`every_process_fails`].
#[test]
fn a_backward_skipped_on_one_rank_fails_every_rank_naming_the_weight_and_the_collective() {
    let failures = every_process_fails("skipped-backward");
    assert_names(&failures, &["layers.0.weight"]);
    assert_mention(&failures, "rank 1 waits in reduce_scatter");
    assert_mention(&failures, "on the main lane");
}

/// In processes only: see [`every_process_fails`].
#[test]
fn a_loss_that_reaches_no_parameter_on_one_rank_fails_every_rank_naming_the_weight() {
    let failures = every_process_fails("no-parameter");
    assert_names(&failures, &["layers.2.weight"]);
    assert_mention(&failures, "rank 0 waits in");
    assert_mention(&failures, "on the main lane");
}

/// The window of gathers ahead decides which gathers each rank issues: ranks given different
/// ones are refused when they prepare the model, naming the setting.
#[test]
fn ranks_with_different_prefetch_settings_fail_naming_the_setting() {
    let failures = every_rank_fails_with(
        |rank| match rank {
            0 => DdpConfig::new(),
            _ => DdpConfig::new().with_prefetch(PrefetchConfig::OFF),
        },
        |_, ddp| {
            ddp.prepare_sharded(Mlp::<S3>::new(&MLP_SIZES, 7, &FlexDevice))
                .map(drop)
                .map_err(|e| e.to_string())
        },
    );
    assert_mention(&failures, "`DdpConfig::prefetch`");
    assert_mention(&failures, "gathers: 0");
    assert_mention(&failures, "on rank 1");
}

/// With no schedule (`PrefetchConfig::OFF`), a gather pairs with any gather of the same
/// parameter: a read on one rank with an op's use on the other, an evaluation's use with a
/// training one. Only the step's digest, which hashes how each use was served and its phase,
/// tells them apart: every rank fails the step naming rank 1.
#[test]
fn uses_that_differ_only_in_their_kind_or_phase_fail_the_step() {
    for differ_in_phase in [false, true] {
        let failures = every_rank_fails_with(
            |_| DdpConfig::new().with_prefetch(PrefetchConfig::OFF),
            |rank, ddp| {
                let model = mlp(ddp, 7);
                let mut zero = zero_adam(ddp, &model);
                let weight = || model.layers[0].weight.val();
                match (differ_in_phase, rank) {
                    (false, 0) => drop(weight().into_data()),
                    (true, 0) => drop(model.valid().layers[0].weight.val().sum()),
                    _ => drop(weight().sum()),
                }
                let loss = loss(&model, ddp);
                let grads = ddp.backward(loss, &model).map_err(|e| e.to_string())?;
                match zero.step(1e-2, model, grads.unwrap(), ddp) {
                    Err(ZeroError::Dist(e @ DistError::UseSequence { rank: 1, .. })) => {
                        Err(e.to_string())
                    }
                    other => panic!("expected UseSequence, got {:?}", other.map(|_| ())),
                }
            },
        );
        assert_mention(&failures, "rank 1 used the sharded parameters");
    }
}
