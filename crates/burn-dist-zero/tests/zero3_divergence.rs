//! Under ZeRO stage 3 the collectives follow the user's program, so ranks whose programs
//! differ must fail, every one of them, within the timeout, naming the parameter: never a
//! hang, never a gather that pairs two different parameters.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant};

use burn::backend::Autodiff;
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::Tensor;
use burn_dist::{Ddp, DdpConfig, DistError, DistributedBackend, Sharded};
use burn_dist_comm::testing::run_ranks;
use burn_dist_comm::{CommConfig, HostCommunicator};
use burn_dist_testing::{MLP_SIZES, Mlp, shard_rows, synthetic_rows};
use burn_dist_zero::{ZeroAdamConfig, ZeroError};
use burn_flex::{Flex, FlexDevice};

type S3 = Autodiff<DistributedBackend<Flex, Sharded>>;

const BATCH: usize = 12;
const TIMEOUT: Duration = Duration::from_secs(20);

/// Runs `body` on 2 thread ranks with the collective timeout [`TIMEOUT`] and returns what
/// each rank failed with: an error it returned or the message of a panic (an op cannot return
/// an error, so a failed gather panics). Every rank must fail, within the timeout.
fn every_rank_fails(body: impl Fn(usize, &mut Ddp) -> Result<(), String> + Sync) -> Vec<String> {
    let config = CommConfig::default().with_timeout(TIMEOUT);
    let started = Instant::now();
    let failures = run_ranks(HostCommunicator::local_group(2, &config), |rank, comm| {
        let mut ddp = Ddp::for_thread(comm, DdpConfig::new());
        match catch_unwind(AssertUnwindSafe(|| body(rank, &mut ddp))) {
            Ok(Ok(())) => panic!("rank {rank} did not fail"),
            Ok(Err(error)) => error,
            Err(panic) => panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default(),
        }
    });
    assert!(
        started.elapsed() < TIMEOUT,
        "the ranks took {:?} to fail",
        started.elapsed()
    );
    failures
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
