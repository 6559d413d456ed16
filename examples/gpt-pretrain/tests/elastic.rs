//! An elastic GPT pretraining job: three single-rank "nodes" on loopback under
//! `burn-dist-run --nnodes 2:3 --max-restarts 2`, `gpt-pretrain --resume auto`. Rank 2 pauses
//! after step 5 (`--pause-after-step 5 --pause-rank 2`; the checkpoint of step 4 is the newest)
//! and its node's launcher is killed. The other two meet again as two nodes, resume from the
//! checkpoint of step 4 (written by 3 ranks, resharded for 2) with the same global batch and
//! data position, train every remaining step, and end with a validation loss within 0.02
//! nats/token of an uninterrupted run at world size 2.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use burn_dist_models::processes::{
    assert_survivors_met_again, launcher, scratch_dir, watch, watch_all_killing_first,
};
use gpt_pretrain::metrics;

/// The longest the job may go without printing a line (the second round of the rendezvous
/// waits 5 s for a third node that never comes).
const QUIET: Duration = Duration::from_secs(180);

/// 12 steps of 6 sequences (divisible by 3 and 2 ranks), a checkpoint every 2, resuming by
/// itself, validation at the end only.
fn gpt(command: &mut Command, run_dir: &Path, extra: &[&str]) {
    command
        .arg("--")
        .arg(env!("CARGO_BIN_EXE_gpt-pretrain"))
        .args(["--steps", "12", "--global-batch", "6", "--context", "16"])
        .args([
            "--synthetic-tokens",
            "20000",
            "--warmup",
            "2",
            "--eval-every",
            "0",
        ])
        .args([
            "--eval-sequences",
            "6",
            "--checkpoint-every",
            "2",
            "--no-plot",
        ])
        .args(["--resume", "auto", "--run-dir"])
        .arg(run_dir)
        .args(extra)
        .env("BURN_DIST_TIMEOUT_SECS", "60")
        .env_remove("BURN_DIST_RESTART_COUNT")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
}

fn node(port: &str, run_dir: &Path) -> Child {
    let mut command = Command::new(launcher());
    command
        .args(["--nnodes", "2:3", "--nproc-per-node", "1"])
        .args(["--master-addr", "127.0.0.1", "--master-port", port])
        .args(["--rdzv-last-call-secs", "5", "--max-restarts", "2"])
        .args(["--stop-grace-secs", "2"])
        .env("BURN_DIST_TOKEN", "elastic-gpt-test");
    gpt(
        &mut command,
        run_dir,
        &["--pause-after-step", "5", "--pause-rank", "2"],
    );
    command.spawn().expect("starting burn-dist-run")
}

fn final_val_loss(run_dir: &Path) -> f64 {
    let records = metrics::read(&run_dir.join("metrics.jsonl")).unwrap();
    let last = records.last().expect("metrics");
    assert_eq!(last.step, 12);
    last.val_loss.expect("the last step evaluates")
}

#[test]
fn a_lost_node_leaves_two_that_resume_resharded_within_0_02_nats_of_an_uninterrupted_run() {
    let root = scratch_dir("gpt-elastic");
    let straight = root.join("straight");
    let mut command = Command::new(launcher());
    command.args(["--standalone", "--nproc-per-node", "2"]);
    gpt(&mut command, &straight, &[]);
    let (status, lines) = watch(&mut command.spawn().unwrap(), QUIET, |_| {});
    assert!(
        status.success(),
        "world size 2, uninterrupted: {status}\n{lines:#?}"
    );

    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (port, elastic) = (port.to_string(), root.join("elastic"));
    let mut nodes: Vec<Child> = (0..3).map(|_| node(&port, &elastic)).collect();
    let announce = "[rank 2] paused after step 5 on rank 2";
    let (ended, victim) = watch_all_killing_first(&mut nodes, QUIET, announce);
    let host = ended
        .iter()
        .position(|(_, lines)| lines.iter().any(|l| l.starts_with("[rank 0] ")))
        .expect("a node ran rank 0");
    assert_survivors_met_again(&ended, victim, 3);
    let lines = &ended[host].1;
    let resumed = "[rank 0] restart 1: resumed at step 4";
    assert!(lines.iter().any(|l| l == resumed), "{lines:#?}");

    // The loss curve continues: every step has a record (those after step 4 from the resumed
    // start), and the data position goes on from the checkpoint's.
    let records = metrics::read(&elastic.join("metrics.jsonl")).unwrap();
    let steps: Vec<u64> = records.iter().map(|r| r.step).collect();
    assert_eq!(steps, (1..=12).collect::<Vec<_>>());
    let (got, want) = (final_val_loss(&elastic), final_val_loss(&straight));
    assert!(
        (got - want).abs() <= 0.02,
        "validation loss {got} vs {want} nats/token for the uninterrupted 2-rank run"
    );
    let _ = std::fs::remove_dir_all(&root);
}
