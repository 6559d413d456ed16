//! An elastic job (`burn-dist-run --nnodes 2:3`): three single-rank "nodes" on loopback, each
//! its own launcher, numbered by the rendezvous. One node's launcher is killed (SIGKILL) in the
//! middle of the run; the other two meet again, now two, and go on at world size 2 from the
//! newest checkpoint (written at world size 3, resharded on load) with the same global batch
//! and data position. The run ends where an uninterrupted run at world size 2 ends, up to the
//! rounding of the first steps' different sharding.
//!
//! The victim is the rank 2 of the first start: it pauses after step 5 (`--pause-after 0:2:5`,
//! the checkpoint of step 4 being the newest), announces it, and its launcher is killed then.
//! The three launchers start at once; the one that binds the rendezvous address first hosts it
//! and is node 0 in every round, so rank 0 is there and rank 2 is elsewhere.
//!
//! The same job at ZeRO stage 3 (`--zero-stage 3`) loses rank 2 while the others are inside
//! the next step's forward, waiting for it in a parameter's gather: each survivor says so in
//! its first error line, once, naming rank 2, with no advice about diverged programs and no
//! backtrace (`RUST_BACKTRACE=1` is set), and its launcher's restart line quotes that line.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, ExitStatus};
use std::time::Duration;

use burn_dist_testing::processes::{
    assert_survivors_met_again, launcher, read_f32s, scratch_dir, watch, watch_all_killing_first,
};
use common::synthetic_zero;

mod common;

/// The longest the job may go without printing a line before the test calls it hung (the
/// second round waits `LAST_CALL` for a third node that never comes; the first closes at once
/// when all three have joined).
const QUIET: Duration = Duration::from_secs(120);
const LAST_CALL: &str = "5";
const STEPS: &str = "12";

fn program(command: &mut Command, dir: &Path, out: &Path, extra: &[&str]) {
    synthetic_zero(command, STEPS, dir, out, extra);
}

/// One node: `burn-dist-run --nnodes 2:3 --nproc-per-node 1` at the rendezvous on `port`,
/// running `synthetic-zero` with rank 2 pausing after step 5 and `extra`.
fn node(port: &str, dir: &Path, out: &Path, extra: &[&str]) -> Child {
    let mut command = Command::new(launcher());
    command
        .args(["--nnodes", "2:3", "--nproc-per-node", "1"])
        .args(["--master-addr", "127.0.0.1", "--master-port", port])
        .args(["--rdzv-last-call-secs", LAST_CALL, "--max-restarts", "2"])
        .args(["--stop-grace-secs", "2"])
        .env("BURN_DIST_TOKEN", "elastic-test-token")
        // As a user chasing a failure would: a panic would print its backtrace.
        .env("RUST_BACKTRACE", "1");
    let mut args = vec!["--pause-after", "0:2:5"];
    args.extend_from_slice(extra);
    program(&mut command, dir, out, &args);
    command.spawn().expect("starting burn-dist-run")
}

/// Three nodes of `node(.., extra)`, rank 2's launcher killed once rank 2 paused after step 5:
/// every node's exit status and lines, and which node was killed.
fn lose_rank_2(root: &Path, extra: &[&str]) -> (Vec<(ExitStatus, Vec<String>)>, usize) {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let port = port.to_string();
    let (dir, out) = (root.join("elastic"), root.join("elastic.bin"));
    // Whichever launcher binds the rendezvous first hosts it and is node 0, with rank 0.
    let mut nodes: Vec<Child> = (0..3).map(|_| node(&port, &dir, &out, extra)).collect();
    let announce = "[rank 2] paused after step 5 on rank 2 (pid ";
    watch_all_killing_first(&mut nodes, QUIET, announce)
}

/// A step line of rank 0: `[rank 0] step S samples N loss BITS (LOSS)` as (S, N, LOSS).
fn step_of(line: &str) -> Option<(u64, u64, f32)> {
    let words: Vec<&str> = line
        .strip_prefix("[rank 0] step ")?
        .split_whitespace()
        .collect();
    match words[..] {
        [step, "samples", samples, "loss", bits, _] => Some((
            step.parse().ok()?,
            samples.parse().ok()?,
            f32::from_bits(u32::from_str_radix(bits, 16).ok()?),
        )),
        _ => None,
    }
}

fn validation_loss(lines: &[String]) -> f32 {
    let line = lines
        .iter()
        .find_map(|l| l.strip_prefix("[rank 0] validation loss "))
        .expect("a validation loss");
    f32::from_bits(u32::from_str_radix(&line[..8], 16).unwrap())
}

#[test]
fn a_lost_node_leaves_two_that_go_on_at_world_size_2_from_the_newest_checkpoint() {
    let root = scratch_dir("elastic");
    let straight_out = root.join("straight.bin");
    let mut straight = Command::new(launcher());
    straight.args(["--standalone", "--nproc-per-node", "2"]);
    program(&mut straight, &root.join("straight"), &straight_out, &[]);
    let (status, straight_lines) = watch(&mut straight.spawn().unwrap(), QUIET, |_| {});
    assert!(status.success(), "world size 2, uninterrupted: {status}");
    let straight_steps: Vec<_> = straight_lines.iter().filter_map(|l| step_of(l)).collect();

    let (dir, out) = (root.join("elastic"), root.join("elastic.bin"));
    let (ended, victim) = lose_rank_2(&root, &[]);
    let host = ended
        .iter()
        .position(|(_, lines)| {
            lines
                .iter()
                .any(|l| l.starts_with("burn-dist-run: hosting the elastic rendezvous"))
        })
        .expect("a launcher hosts the rendezvous");
    assert_ne!(victim, host, "the hosting launcher is node 0, never rank 2");
    assert_survivors_met_again(&ended, victim, 3);

    // Rank 0 (on the hosting node) trained steps 0 to 5 at world size 3, then resumed from the
    // checkpoint of step 4 at world size 2: the same data position, and the loss of step 4 that
    // the uninterrupted run at world size 2 had (up to the first steps' rounding).
    let lines = &ended[host].1;
    let resumed = format!(
        "[rank 0] resumed from {}/step-0000000004 at step 4",
        dir.display()
    );
    assert!(lines.contains(&resumed), "{lines:#?}");
    let steps: Vec<_> = lines.iter().filter_map(|l| step_of(l)).collect();
    let order: Vec<u64> = steps.iter().map(|s| s.0).collect();
    assert_eq!(
        order,
        [0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 8, 9, 10, 11],
        "{lines:#?}"
    );
    let (step, samples, loss) = steps[6];
    assert_eq!(
        (step, samples),
        (4, 48),
        "the data position continues from the checkpoint's"
    );
    let reference = straight_steps[4].2;
    assert!(
        (loss - reference).abs() <= 1e-4 * reference.abs(),
        "step 4 loss {loss} vs {reference}"
    );

    let (got, want) = (validation_loss(lines), validation_loss(&straight_lines));
    assert!(
        (got - want).abs() <= 0.02,
        "validation loss {got} vs {want}"
    );
    let (got, want) = (read_f32s(&out), read_f32s(&straight_out));
    let diff = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).powi(2))
        .sum::<f32>()
        .sqrt();
    let norm = want.iter().map(|v| v * v).sum::<f32>().sqrt();
    assert!(
        diff <= 1e-4 * norm,
        "final parameters: relative difference {}",
        diff / norm
    );
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_rank_lost_in_a_stage_3_forward_is_named_in_the_first_error_line_of_every_survivor() {
    let root = scratch_dir("elastic-zero3");
    let (ended, victim) = lose_rank_2(&root, &["--zero-stage", "3"]);
    assert_survivors_met_again(&ended, victim, 3);
    for (node, (_, lines)) in ended.iter().enumerate().filter(|(n, _)| *n != victim) {
        let transcript = || lines.join("\n");
        // The survivor's lines of the first start: those before its launcher restarted it.
        let restart = lines
            .iter()
            .position(|l| l.starts_with("burn-dist-run: restart 1 of at most 2: "))
            .unwrap_or_else(|| panic!("node {node} was not restarted:\n{}", transcript()));
        let first_start = &lines[..restart];
        let rank = first_start
            .iter()
            .find_map(|l| l.strip_prefix("[rank ")?.split(']').next())
            .expect("a line of the node's rank");
        let own: Vec<&str> = first_start
            .iter()
            .filter_map(|l| l.strip_prefix(&format!("[rank {rank}] ")))
            .collect();
        let error = own
            .iter()
            .find(|l| l.contains("error") || l.contains("panicked"))
            .unwrap_or_else(|| panic!("rank {rank} reported no error:\n{}", transcript()));
        assert!(
            error.contains("rank 2") && error.contains("(did the process die?)"),
            "rank {rank}'s first error line does not name the lost rank 2: {error}\n{}",
            transcript()
        );
        for wrong in [
            "same order",
            "stack backtrace",
            "RUST_BACKTRACE",
            "panicked at",
        ] {
            assert!(
                !own.iter().any(|l| l.contains(wrong)),
                "rank {rank} wrote `{wrong}`:\n{}",
                transcript()
            );
        }
        let causes = own.iter().filter(|l| l.contains("(did the process die?)"));
        assert_eq!(
            causes.count(),
            1,
            "rank {rank}: the cause once:\n{}",
            transcript()
        );
        // The launcher's line quotes it as the last error line.
        let quoted = format!("(last error line: `{error}`)");
        assert!(
            lines[restart].contains(&format!("rank {rank} (pid "))
                && lines[restart].contains(&quoted),
            "node {node}'s restart line does not quote rank {rank}'s error:\n{}",
            transcript()
        );
    }
    let _ = std::fs::remove_dir_all(&root);
}
