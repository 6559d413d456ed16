//! `burn-dist-run --max-restarts 3` heals a job whose ranks are killed twice: every start
//! resumes from the newest complete checkpoint by itself, and the final parameters are bitwise
//! those of an uninterrupted run (same world size, CPU). Real processes on loopback; each
//! victim pauses after a given step of a given start (`--pause-after`) and is killed there, so
//! which checkpoint is the newest at each kill is known and the test needs no timing.

use std::path::Path;
use std::process::{Command, ExitStatus};
use std::time::Duration;

use burn_dist_testing::processes::{kill_announced, launcher, read_f32s, scratch_dir, watch};
use burn_dist_zero::checkpoint;
use common::synthetic_zero;

mod common;

/// The longest the job may go without printing a line before the test calls it hung.
const QUIET: Duration = Duration::from_secs(120);

/// `burn-dist-run --nproc-per-node 2 LAUNCHER_ARGS -- synthetic-zero` for 8 steps with a
/// checkpoint every 2; calls `on_line` with every output line; returns the status and lines.
fn job(
    launcher_args: &[&str],
    program_args: &[&str],
    dir: &Path,
    out: &Path,
    on_line: impl FnMut(&str),
) -> (ExitStatus, Vec<String>) {
    job_with(launcher_args, program_args, &[], dir, out, on_line)
}

/// [`job`] with `env` set for every rank.
fn job_with(
    launcher_args: &[&str],
    program_args: &[&str],
    env: &[(&str, &str)],
    dir: &Path,
    out: &Path,
    on_line: impl FnMut(&str),
) -> (ExitStatus, Vec<String>) {
    let mut command = Command::new(launcher());
    command
        .args(["--nproc-per-node", "2", "--master-port", "0"])
        .args(["--stop-grace-secs", "2"])
        .args(launcher_args);
    let mut child = synthetic_zero(&mut command, "8", dir, out, program_args)
        .envs(env.iter().copied())
        .spawn()
        .expect("starting burn-dist-run");
    watch(&mut child, QUIET, on_line)
}

/// The job uninterrupted, saving synchronously, under `root`; its final parameters' file.
fn uninterrupted(root: &Path) -> std::path::PathBuf {
    let straight = root.join("straight.bin");
    let (status, lines) = job(&[], &[], &root.join("straight"), &straight, |_| {});
    assert!(
        status.success(),
        "uninterrupted run: {status}\n{}",
        lines.join("\n")
    );
    straight
}

fn count(lines: &[String], needle: &str) -> usize {
    lines.iter().filter(|l| l.contains(needle)).count()
}

#[test]
fn a_rank_killed_twice_under_max_restarts_ends_bitwise_equal_to_an_uninterrupted_run() {
    let root = scratch_dir("restarts");
    let (straight, healed) = (uninterrupted(&root), root.join("healed.bin"));

    // Rank 1 dies after step 3 of the first start (the checkpoint of step 2 is the newest
    // complete one), rank 0 after step 5 of the first restart (step 4 is).
    let pauses = ["--pause-after", "0:1:3", "--pause-after", "1:0:5"];
    let mut kills = 0;
    let (status, lines) = job(
        &["--max-restarts", "3"],
        &pauses,
        &root.join("healed"),
        &healed,
        |line| {
            // The ranks' own lines only: the launcher quotes a dead rank's last line.
            let killed = line.starts_with("[rank ")
                && kill_announced(line, "paused after step 3 on rank 1 (pid ")
                || line.starts_with("[rank ")
                    && kill_announced(line, "paused after step 5 on rank 0 (pid ");
            kills += usize::from(killed);
        },
    );
    let transcript = lines.join("\n");
    assert_eq!(kills, 2, "both kills happened\n{transcript}");
    assert!(status.success(), "the healed job: {status}\n{transcript}");
    assert_eq!(
        count(
            &lines,
            "burn-dist-run: restart 1 of at most 3: rank 1 (pid "
        ),
        1
    );
    assert_eq!(
        count(
            &lines,
            "burn-dist-run: restart 2 of at most 3: rank 0 (pid "
        ),
        1
    );
    assert_eq!(
        count(
            &lines,
            "burn-dist-run: summary: 3 starts, 2 restarts of at most 3"
        ),
        1,
        "{transcript}"
    );
    // Each rank was told which start it is in, and every restart resumed from a checkpoint.
    for restart in 0..3 {
        let told = format!("rank 1: restart {restart} (pid ");
        assert_eq!(count(&lines, &told), 1, "{transcript}");
    }
    for step in [2, 4] {
        let resumed = format!("[rank 0] resumed from {}", root.join("healed").display());
        let resumed = format!("{resumed}/step-{step:010} at step {step}");
        assert_eq!(count(&lines, &resumed), 1, "{transcript}");
    }
    let bits = |path: &Path| {
        read_f32s(path)
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>()
    };
    let (healed, straight) = (bits(&healed), bits(&straight));
    assert_eq!(healed.len(), straight.len(), "parameter counts");
    let first_difference = healed.iter().zip(&straight).position(|(a, b)| a != b);
    assert_eq!(first_difference, None, "final parameters differ bitwise");
    let _ = std::fs::remove_dir_all(&root);
}

/// `--checkpoint-async`: rank 1's background writer pauses once its shard of step 4 is
/// durable, while training goes on, and rank 1 is killed there. Step 4 never got its
/// manifest, so the launcher's restart resumes from step 2, and the job ends bitwise where an
/// uninterrupted run saving synchronously ends.
#[test]
fn a_rank_killed_during_a_background_checkpoint_write_restarts_from_the_previous_one() {
    let root = scratch_dir("restarts-async");
    let (straight, healed) = (uninterrupted(&root), root.join("healed.bin"));

    let pause = [(checkpoint::PAUSE_VAR, "after-shard:4:1:0")];
    let mut killed = false;
    let (status, lines) = job_with(
        &["--max-restarts", "1"],
        &["--checkpoint-async"],
        &pause,
        &root.join("healed"),
        &healed,
        |line| {
            killed |= line.starts_with("[rank 1] ")
                && kill_announced(line, "paused at after-shard on rank 1 (pid ");
        },
    );
    let transcript = lines.join("\n");
    assert!(killed, "rank 1's writer never paused\n{transcript}");
    assert!(status.success(), "the healed job: {status}\n{transcript}");
    assert_eq!(
        count(
            &lines,
            "burn-dist-run: restart 1 of at most 1: rank 1 (pid "
        ),
        1,
        "{transcript}"
    );
    let resumed = format!("[rank 0] resumed from {}", root.join("healed").display());
    let resumed = format!("{resumed}/step-{:010} at step 2", 2);
    assert_eq!(count(&lines, &resumed), 1, "{transcript}");
    assert_eq!(
        checkpoint::latest(root.join("healed")).unwrap(),
        Some(checkpoint::step_dir(root.join("healed"), 8)),
        "the restarted start saves on to the end"
    );
    assert_eq!(read_f32s(&healed), read_f32s(&straight), "final parameters");
    let _ = std::fs::remove_dir_all(&root);
}
