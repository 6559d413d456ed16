//! `Ddp::init` in a process that no launcher started: a job of one rank, which says so in the
//! log and trains; a partial set of launcher variables is an error naming the missing one.
//!
//! Each case runs this test binary again, with only `one_rank_body` selected, the launcher
//! variables removed from its environment and `CHILD_VAR` set, so that the test process's own
//! environment is never changed.

use std::process::{Command, Output};

use burn::backend::Autodiff;
use burn::nn::LinearConfig;
use burn::tensor::{Tensor, TensorData};
use burn_dist::{Ddp, DdpConfig, DistributedBackend, LAUNCHER_VARS, ReduceOp};
use burn_flex::{Flex, FlexDevice};

type B = Autodiff<DistributedBackend<Flex>>;

/// Set only in the processes this file starts.
const CHILD_VAR: &str = "BURN_DIST_ONE_RANK_CHILD";
/// Precedes the child's report on its stdout.
const REPORT: &str = "one-rank report: ";

/// Not a test of its own: the body of a process started by `run_child`.
#[test]
fn one_rank_body() {
    if std::env::var_os(CHILD_VAR).is_none() {
        return;
    }
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter("info")
        .init();
    let mut ddp = match Ddp::init(DdpConfig::new()) {
        Ok(ddp) => ddp,
        Err(e) => {
            println!("{REPORT}error: {e}");
            return;
        }
    };
    let model = LinearConfig::new(2, 1).init::<B>(&FlexDevice);
    let model = ddp.prepare(model).expect("prepare");
    let x = Tensor::<B, 2>::from_data(TensorData::new(vec![1.0f32, 2.0], [1, 2]), &FlexDevice);
    let loss = model.forward(x).sum();
    let grads = ddp.backward(loss, &model).expect("backward");
    let mean = ddp.all_reduce_f64(2.5, ReduceOp::Avg).expect("all-reduce");
    println!(
        "{REPORT}rank {} world {} main {} pool {} grads {} mean {mean}",
        ddp.rank(),
        ddp.world_size(),
        ddp.is_main(),
        ddp.thread_pool().is_some(),
        grads.map_or(0, |g| g.len()),
    );
}

/// Runs `one_rank_body` in a child process without any launcher variable, plus `env`; returns
/// its report and its stderr.
fn run_child(env: &[(&str, &str)]) -> (String, String) {
    let exe = std::env::current_exe().expect("this test binary");
    let mut command = Command::new(exe);
    command
        .args([
            "--exact",
            "one_rank_body",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(CHILD_VAR, "1")
        .env_remove("RUST_LOG");
    for var in LAUNCHER_VARS {
        command.env_remove(var);
    }
    let Output {
        status,
        stdout,
        stderr,
    } = command
        .envs(env.iter().copied())
        .output()
        .expect("the child");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&stdout).into_owned(),
        String::from_utf8_lossy(&stderr).into_owned(),
    );
    assert!(status.success(), "{stdout}{stderr}");
    let report = stdout
        .lines()
        .find_map(|l| l.split_once(REPORT).map(|(_, r)| r.to_string()))
        .unwrap_or_else(|| panic!("no report: {stdout}{stderr}"));
    (report, stderr)
}

#[test]
fn without_a_launcher_init_is_a_job_of_one_rank_that_says_so() {
    let (report, log) = run_child(&[]);
    assert_eq!(
        report, "rank 0 world 1 main true pool true grads 2 mean 2.5",
        "{log}"
    );
    assert!(log.contains("running as a job of one rank"), "{log}");
}

#[test]
fn a_partial_set_of_launcher_variables_is_an_error_naming_the_missing_one() {
    let (report, _) = run_child(&[("WORLD_SIZE", "2")]);
    assert!(report.starts_with("error: RANK: not set"), "{report}");
}
