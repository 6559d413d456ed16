//! A rank killed with SIGKILL inside a checkpoint write (after its shard is written, before any
//! manifest) leaves the previous checkpoint the newest loadable one, and resuming from it ends
//! bitwise where an uninterrupted run ends. Real processes through `burn-dist-run`. The
//! uninterrupted run uses ZeRO stage 1 and the crashed and resumed runs stage 2, which must
//! give bit for bit the same parameters.
//!
//! The steps before the checkpoint train with another learning rate than the resumed run's
//! (`--early-lr`), so a resumed run that ignored the checkpoint and trained from step 0 would
//! end elsewhere; and the resumed run's first step must be the checkpoint's: its data position
//! and its loss (bitwise) are the uninterrupted run's at step 2.

use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::time::Duration;

use burn_dist_testing::processes::{kill_announced, launcher, read_f32s, scratch_dir, watch};
use burn_dist_zero::checkpoint;

const TIMEOUT: Duration = Duration::from_secs(120);

/// The first steps of the runs that reach the checkpoint of step 2 train at this learning rate
/// instead of the default 1e-2.
const EARLY: [&str; 4] = ["--early-steps", "2", "--early-lr", "0.05"];

/// `burn-dist-run --nproc-per-node 2 -- synthetic-zero ...` at ZeRO `stage` with `args` and
/// `env`; calls `on_line` with every output line as it arrives; returns the exit status
/// (bounded by TIMEOUT) and rank 0's steps.
fn train(
    stage: &str,
    dir: &Path,
    out: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    on_line: impl FnMut(&str),
) -> (ExitStatus, Vec<Step>) {
    let mut child = Command::new(launcher())
        .args([
            "--nproc-per-node",
            "2",
            "--master-port",
            "0",
            "--stop-grace-secs",
            "2",
            "--",
        ])
        .arg(env!("CARGO_BIN_EXE_synthetic-zero"))
        .args([
            "--steps",
            "6",
            "--checkpoint-every",
            "2",
            "--zero-stage",
            stage,
            "--checkpoint-dir",
        ])
        .arg(dir)
        .arg("--out")
        .arg(out)
        .args(args)
        .env("BURN_DIST_TIMEOUT_SECS", "60")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting burn-dist-run");
    let (status, lines) = watch(&mut child, TIMEOUT, on_line);
    (
        status,
        lines.iter().filter_map(|l| Step::parse(l)).collect(),
    )
}

/// One step as rank 0 prints it: `[rank 0] step S samples N loss BITS (LOSS)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Step {
    step: u64,
    samples: u64,
    /// The f32 bits of rank 0's loss.
    loss: u32,
}

impl Step {
    fn parse(line: &str) -> Option<Step> {
        let words: Vec<&str> = line.strip_prefix("[rank 0] ")?.split_whitespace().collect();
        match words[..] {
            ["step", step, "samples", samples, "loss", bits, _] => Some(Step {
                step: step.parse().ok()?,
                samples: samples.parse().ok()?,
                loss: u32::from_str_radix(bits, 16).ok()?,
            }),
            _ => None,
        }
    }
}

#[test]
fn sigkill_inside_a_checkpoint_write_leaves_the_previous_checkpoint_loadable() {
    let root = scratch_dir("ckpt-crash");
    let (straight, crashed) = (root.join("straight"), root.join("crashed"));
    let (status, straight_steps) = train(
        "1",
        &straight,
        &root.join("straight.bin"),
        &EARLY,
        &[],
        |_| {},
    );
    assert!(status.success(), "uninterrupted run: {status}");
    assert_eq!(
        straight_steps.iter().map(|s| s.step).collect::<Vec<_>>(),
        (0..6).collect::<Vec<_>>(),
        "uninterrupted run's steps: {straight_steps:?}"
    );

    // Every rank pauses once its shard of step 4 is durable; rank 1 is killed there.
    let mut killed = false;
    let (status, _) = train(
        "2",
        &crashed,
        &root.join("unused.bin"),
        &EARLY,
        &[(checkpoint::PAUSE_VAR, "after-shard:4")],
        |line| killed |= kill_announced(line, "paused at after-shard on rank 1 (pid "),
    );
    assert!(killed, "rank 1 never reached the fault point");
    assert!(!status.success(), "the job must fail when a rank dies");
    let latest = checkpoint::latest(&crashed)
        .unwrap()
        .expect("a complete checkpoint");
    assert_eq!(
        latest,
        checkpoint::step_dir(&crashed, 2),
        "step 4 has no manifest: it must not count"
    );
    checkpoint::verify(&latest).expect("step 2 verifies");

    // Resumed without `EARLY`: only the checkpoint carries the early steps' training. Its first
    // step is step 2 of the uninterrupted run: the same data position and the same loss.
    let (status, resumed_steps) = train("2", &crashed, &root.join("resumed.bin"), &[], &[], |_| {});
    assert!(status.success(), "resumed run: {status}");
    assert_eq!(
        resumed_steps.first(),
        Some(&straight_steps[2]),
        "the resumed run's first step must start from the checkpoint of step 2 (data \
         position, loss bits): {resumed_steps:?}"
    );
    // And it follows the uninterrupted run step by step to the same end.
    assert_eq!(resumed_steps, straight_steps[2..], "steps 2 to 5");
    assert_eq!(
        read_f32s(&root.join("resumed.bin")),
        read_f32s(&root.join("straight.bin"))
    );
    let _ = std::fs::remove_dir_all(&root);
}
