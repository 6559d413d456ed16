//! A disk that fails during a checkpoint write, with real processes. Rank 1's shard of step 4
//! fails with ENOSPC (injected with `BURN_DIST_CHECKPOINT_FAULT`): every rank exits naming the
//! step, the stage and rank 1's file; the half-written step directory is gone, and step 2 stays
//! the newest complete checkpoint. A rank stuck in its write (`BURN_DIST_CHECKPOINT_PAUSE` on
//! rank 0 only): the other rank's timeout names the stage and says how to raise it.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use burn_dist_testing::processes::{launch, scratch_dir, watch};
use burn_dist_zero::checkpoint;

/// `synthetic-zero` on 2 ranks through the launcher, 6 steps, a checkpoint every 2 in `ckpt`;
/// the caller adds the fault and spawns it.
fn two_ranks_saving_every_2_of_6_steps(ckpt: &Path) -> Command {
    let mut command = launch(2, Path::new(env!("CARGO_BIN_EXE_synthetic-zero")));
    command
        .args([
            "--steps",
            "6",
            "--checkpoint-every",
            "2",
            "--checkpoint-dir",
        ])
        .arg(ckpt)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    command
}

/// Synchronously, and with `--checkpoint-async`, where the write that fails is the background
/// writer's and every rank names it at a later step or at the end.
#[test]
fn a_full_disk_on_one_rank_fails_every_rank_naming_the_file() {
    for extra in [&[][..], &["--checkpoint-async"]] {
        a_full_disk_on_one_rank_fails_every_rank_naming_the_file_with(extra);
    }
}

fn a_full_disk_on_one_rank_fails_every_rank_naming_the_file_with(extra: &[&str]) {
    let root = scratch_dir("ckpt-disk");
    let ckpt = root.join("ckpt");
    let mut child = two_ranks_saving_every_2_of_6_steps(&ckpt)
        .args(extra)
        .env(checkpoint::FAULT_VAR, "shard:4:1:ENOSPC")
        .spawn()
        .expect("starting burn-dist-run");
    let (status, lines) = watch(&mut child, Duration::from_secs(120), |_| {});
    assert!(!status.success(), "{extra:?}: the job must fail");
    let transcript = lines.join("\n");
    for rank in 0..2 {
        let error = lines
            .iter()
            .find(|l| {
                l.contains(&format!(
                    "error: rank {rank}: checkpoint save of step 4 failed"
                ))
            })
            .unwrap_or_else(|| panic!("no error line of rank {rank}:\n{transcript}"));
        for needle in [
            "while writing the optimizer shards",
            "optim-rank-00001.bin",
            "No space left on device",
        ] {
            assert!(
                error.contains(needle),
                "rank {rank} lacks `{needle}`: {error}"
            );
        }
    }
    assert!(
        !checkpoint::step_dir(&ckpt, 4).exists(),
        "the half-written step directory is removed:\n{transcript}"
    );
    assert_eq!(
        checkpoint::latest(&ckpt).unwrap(),
        Some(checkpoint::step_dir(&ckpt, 2))
    );
    checkpoint::verify(&ckpt).unwrap();
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_rank_stuck_writing_makes_the_others_name_the_stage_and_the_timeout_variable() {
    let root = scratch_dir("ckpt-slow-disk");
    let ckpt = root.join("ckpt");
    // Rank 0 stops inside the write stage of step 4 (its shard written, the model not): rank 1
    // waits for it in the stage's agreement until the 3 s collective timeout.
    let mut child = two_ranks_saving_every_2_of_6_steps(&ckpt)
        .env(checkpoint::PAUSE_VAR, "after-shard:4:0")
        .env("BURN_DIST_TIMEOUT_SECS", "3")
        .spawn()
        .expect("starting burn-dist-run");
    let (status, lines) = watch(&mut child, Duration::from_secs(120), |_| {});
    assert!(!status.success(), "the job must fail");
    let transcript = lines.join("\n");
    assert!(
        transcript.contains("paused at after-shard on rank 0"),
        "{transcript}"
    );
    assert!(
        !transcript.contains("paused at after-shard on rank 1"),
        "{transcript}"
    );
    let error = lines
        .iter()
        .find(|l| l.contains("error: rank 1: checkpoint save of step 4 failed"))
        .unwrap_or_else(|| panic!("no error line of rank 1:\n{transcript}"));
    for needle in [
        "while writing the optimizer shards (optim-rank-NNNNN.bin) and model.safetensors",
        "rank 0 did not answer within 3 s",
        "raise the timeout with BURN_DIST_TIMEOUT_SECS=<seconds>",
    ] {
        assert!(error.contains(needle), "rank 1 lacks `{needle}`: {error}");
    }
    assert_eq!(
        checkpoint::latest(&ckpt).unwrap(),
        Some(checkpoint::step_dir(&ckpt, 2))
    );
    let _ = std::fs::remove_dir_all(&root);
}
