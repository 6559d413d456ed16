//! A rank killed with SIGKILL inside a checkpoint write (after its shard is written, before any
//! manifest) leaves the previous checkpoint the newest loadable one, and resuming from it ends
//! bitwise where an uninterrupted run ends. Real processes through `burn-dist-run`. The
//! uninterrupted run uses ZeRO stage 1 and the crashed and resumed runs stage 2, which must
//! give bit for bit the same parameters.

use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::time::Duration;

use burn_dist::testing::processes::{kill_announced, launcher, read_f32s, scratch_dir, watch};
use burn_dist_zero::checkpoint;

const TIMEOUT: Duration = Duration::from_secs(120);

/// `burn-dist-run --nproc-per-node 2 -- synthetic-zero ...` at ZeRO `stage` with `env`; calls
/// `on_line` with every stderr line as it arrives; returns the exit status (bounded by TIMEOUT).
fn train(
    stage: &str,
    dir: &Path,
    out: &Path,
    env: &[(&str, &str)],
    on_line: impl FnMut(&str),
) -> ExitStatus {
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
        .env("BURN_DIST_TIMEOUT_SECS", "60")
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting burn-dist-run");
    watch(&mut child, TIMEOUT, on_line).0
}

#[test]
fn sigkill_inside_a_checkpoint_write_leaves_the_previous_checkpoint_loadable() {
    let root = scratch_dir("ckpt-crash");
    let (straight, crashed) = (root.join("straight"), root.join("crashed"));
    let status = train("1", &straight, &root.join("straight.bin"), &[], |_| {});
    assert!(status.success(), "uninterrupted run: {status}");

    // Every rank pauses once its shard of step 4 is durable; rank 1 is killed there.
    let mut killed = false;
    let status = train(
        "2",
        &crashed,
        &root.join("unused.bin"),
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

    // Resuming from step 2 ends exactly where the uninterrupted run ended.
    let status = train("2", &crashed, &root.join("resumed.bin"), &[], |_| {});
    assert!(status.success(), "resumed run: {status}");
    assert_eq!(
        read_f32s(&root.join("resumed.bin")),
        read_f32s(&root.join("straight.bin"))
    );
    let _ = std::fs::remove_dir_all(&root);
}
