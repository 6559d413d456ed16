//! A failing disk is reported as a disk problem: a write that fails on one rank fails the save
//! on every rank naming the stage, the step, the rank and the file, removes the half-written
//! step directory and leaves the previous checkpoint the newest. Ranks that do not share the
//! checkpoint directory fail at the first save. Disk faults are injected with
//! `checkpoint::inject_fault_on_this_thread` (`FAULT_VAR`'s syntax) on one rank's thread.

use std::path::Path;

use burn_dist_zero::checkpoint::{self, SaveStage};

use super::{Outcome, Plan, SEED, train};

/// 2 ranks save after steps 2 and 4 under `root`, with `fault` on one rank.
fn save_twice(root: &Path, fault: (usize, &str)) -> Vec<Outcome> {
    save_twice_in(root, fault, false)
}

/// [`save_twice`], through `checkpoint::AsyncSaver` when `asynchronous`, training on to step
/// 6: the failure of the background write of step 4 is reported by a later poll, or by the
/// wait at the end.
pub(super) fn save_twice_in(root: &Path, fault: (usize, &str), asynchronous: bool) -> Vec<Outcome> {
    train(Plan {
        world: 2,
        seed: SEED,
        save: Some((root, &[2, 4])),
        until: if asynchronous { 6 } else { 4 },
        fault: Some(fault),
        asynchronous,
        ..Default::default()
    })
}

/// Every rank's save of step 4 failed at `stage`, its message naming `needles`; the step-4
/// directory is gone and step 2 is still the newest complete checkpoint, and it loads.
pub(super) fn assert_step_4_failed_everywhere(
    root: &Path,
    outcomes: &[Outcome],
    stage: SaveStage,
    needles: &[&str],
) {
    for (rank, outcome) in outcomes.iter().enumerate() {
        let failure = outcome
            .save_failure
            .as_ref()
            .unwrap_or_else(|| panic!("rank {rank}: the save of step 4 did not fail"));
        assert_eq!((failure.stage, failure.step), (stage, 4), "rank {rank}");
        for needle in ["checkpoint save of step 4 failed while", needles[0]]
            .iter()
            .chain(needles)
        {
            assert!(
                failure.message.contains(needle),
                "rank {rank}: `{}` does not mention `{needle}`",
                failure.message
            );
        }
    }
    assert!(
        !checkpoint::step_dir(root, 4).exists(),
        "the half-written step directory is removed"
    );
    assert_eq!(
        checkpoint::latest(root).unwrap(),
        Some(checkpoint::step_dir(root, 2))
    );
    checkpoint::verify(root).unwrap();
}

#[test]
fn a_full_disk_on_one_rank_fails_every_rank_naming_it() {
    let root = tempfile::tempdir().unwrap();
    let outcomes = save_twice(root.path(), (1, "shard:4:1:ENOSPC"));
    assert_step_4_failed_everywhere(
        root.path(),
        &outcomes,
        SaveStage::Write,
        &["optim-rank-00001.bin", "No space left on device"],
    );
    // The other rank names the failing one.
    let rank_0 = &outcomes[0].save_failure.as_ref().unwrap().message;
    assert!(rank_0.contains(": rank 1: checkpoint file "), "{rank_0}");
}

#[test]
fn an_io_error_in_rank_0s_model_or_manifest_fails_every_rank() {
    let root = tempfile::tempdir().unwrap();
    let outcomes = save_twice(root.path(), (0, "model:4:0:EIO"));
    assert_step_4_failed_everywhere(
        root.path(),
        &outcomes,
        SaveStage::Write,
        &["model.safetensors", "Input/output error"],
    );

    let root = tempfile::tempdir().unwrap();
    let outcomes = save_twice(root.path(), (0, "manifest:4:0:ENOSPC"));
    assert_step_4_failed_everywhere(
        root.path(),
        &outcomes,
        SaveStage::Commit,
        &["manifest.json", "No space left on device"],
    );
}

#[test]
fn ranks_without_a_shared_directory_fail_at_the_first_save() {
    let root = tempfile::tempdir().unwrap();
    let outcomes = train(Plan {
        world: 2,
        seed: SEED,
        save: Some((root.path(), &[2, 4])),
        until: 4,
        private_roots: true,
        ..Default::default()
    });
    let rank_0_dir = checkpoint::step_dir(root.path().join("rank-0"), 2);
    let rank_1_dir = checkpoint::step_dir(root.path().join("rank-1"), 2);
    for (rank, outcome) in outcomes.iter().enumerate() {
        let failure = outcome.save_failure.as_ref().unwrap();
        assert_eq!((failure.stage, failure.step), (SaveStage::Prepare, 2));
        for needle in [
            &format!(
                "rank 1 does not see rank 0's checkpoint directory {}",
                rank_1_dir.display()
            ),
            "no such directory here",
            "a filesystem all nodes share",
        ] {
            assert!(
                failure.message.contains(needle),
                "rank {rank}: {}",
                failure.message
            );
        }
    }
    assert!(!rank_0_dir.exists(), "rank 0 removes what it created");
    assert!(
        checkpoint::latest(root.path().join("rank-1"))
            .unwrap()
            .is_none()
    );
}

#[test]
fn a_timeout_during_a_save_says_how_to_raise_it() {
    use burn_dist_comm::{CommError, Lane, OpDesc, OpKind};
    let error = checkpoint::CheckpointError::Save {
        step: 4,
        stage: SaveStage::Write,
        dir: checkpoint::step_dir("ckpt", 4),
        source: Box::new(
            CommError::Timeout {
                peer: 0,
                op: OpDesc {
                    kind: OpKind::AllGather,
                    seq: 12,
                    lane: Lane::Main,
                    tag: 0,
                    tag_labels: None,
                    dtype: None,
                    reduce: None,
                    bytes: 16,
                },
                timeout: std::time::Duration::from_secs(30),
            }
            .into(),
        ),
    };
    let message = error.to_string();
    for needle in [
        "checkpoint save of step 4 failed while writing the optimizer shards",
        "ckpt/step-0000000004",
        "rank 0 did not answer within 30 s",
        "raise the timeout with BURN_DIST_TIMEOUT_SECS=<seconds>",
    ] {
        assert!(message.contains(needle), "`{message}` lacks `{needle}`");
    }
}
