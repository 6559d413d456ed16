//! `checkpoint::AsyncSaver`: checkpoints written by a background thread while training goes
//! on. The checkpoint is byte for byte the synchronous save's and training ends bitwise where
//! a run saving synchronously ends, at stages 1 to 3; a resume from it is exact; a disk that
//! fails during a background write fails every rank at a later poll or wait, naming the file,
//! and leaves no checkpoint that looks complete; the snapshot's memory is what its files hold.

use std::path::Path;

use burn_dist_zero::checkpoint::{self, MANIFEST, MODEL_FILE, SaveStage};

use super::disk::{assert_step_4_failed_everywhere, save_twice_in};
use super::{Plan, SEED, train};

/// 2 ranks at `stage` save after steps 2 and 4 under `root`, synchronously or not, and train
/// to step 6.
fn saving(root: &Path, stage: u8, asynchronous: bool) -> Vec<super::Outcome> {
    train(Plan {
        world: 2,
        seed: SEED,
        save: Some((root, &[2, 4])),
        until: 6,
        stage,
        asynchronous,
        ..Default::default()
    })
}

/// Every file of `dir`, by name, with its bytes.
fn files_of(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| {
            let entry = entry.unwrap();
            let name = entry.file_name().into_string().unwrap();
            (name, std::fs::read(entry.path()).unwrap())
        })
        .collect();
    files.sort();
    files
}

#[test]
fn an_asynchronous_save_writes_the_synchronous_checkpoint_and_changes_no_bit_of_training() {
    for stage in [1, 2, 3] {
        let (sync_root, async_root) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let sync = saving(sync_root.path(), stage, false);
        let asynchronous = saving(async_root.path(), stage, true);
        for (rank, (a, s)) in asynchronous.iter().zip(&sync).enumerate() {
            assert!(
                a.save_failure.is_none(),
                "rank {rank}: {:?}",
                a.save_failure
            );
            assert!(
                a.params == s.params && a.shard == s.shard && a.scaler == s.scaler,
                "stage {stage}, rank {rank}: training saving asynchronously ends elsewhere"
            );
        }
        for step in [2, 4] {
            let (s, a) = (
                checkpoint::step_dir(sync_root.path(), step),
                checkpoint::step_dir(async_root.path(), step),
            );
            let files = files_of(&a);
            assert!(
                files.iter().any(|(name, _)| name == MANIFEST),
                "stage {stage}: step {step} was never committed"
            );
            assert!(
                files == files_of(&s),
                "stage {stage}: the asynchronous checkpoint of step {step} differs from the \
                 synchronous one"
            );
        }
        checkpoint::verify(async_root.path()).unwrap();
        // Resumed from the asynchronous checkpoint of step 4: the uninterrupted run's end.
        let step_4 = checkpoint::step_dir(async_root.path(), 4);
        let resumed = train(Plan {
            world: 2,
            seed: super::OTHER_SEED,
            resume: Some(&step_4),
            until: 6,
            stage,
            ..Default::default()
        });
        for (rank, (r, s)) in resumed.iter().zip(&sync).enumerate() {
            assert!(
                r.params == s.params,
                "stage {stage}, rank {rank}: resumed from the asynchronous checkpoint"
            );
        }
    }
}

#[test]
fn the_snapshot_holds_what_its_files_hold_one_save_at_a_time() {
    let root = tempfile::tempdir().unwrap();
    let outcomes = saving(root.path(), 2, true);
    for (rank, outcome) in outcomes.iter().enumerate() {
        let expected: Vec<(Option<u64>, u64)> = [2, 4]
            .into_iter()
            .map(|step| {
                let dir = checkpoint::step_dir(root.path(), step);
                let size = |name: &str| std::fs::metadata(dir.join(name)).unwrap().len();
                let model = if rank == 0 { size(MODEL_FILE) } else { 0 };
                (Some(step), size(&checkpoint::shard_file_name(rank)) + model)
            })
            .collect();
        assert_eq!(
            outcome.snapshot_bytes, expected,
            "rank {rank}: (pending step, snapshot bytes) after each save"
        );
    }
}

#[test]
fn a_disk_failing_during_a_background_write_fails_every_rank_naming_the_file() {
    for (fault, stage, needles) in [
        (
            (1, "shard:4:1:ENOSPC"),
            SaveStage::Write,
            ["optim-rank-00001.bin", "No space left on device"],
        ),
        (
            (0, "model:4:0:EIO"),
            SaveStage::Write,
            ["model.safetensors", "Input/output error"],
        ),
        (
            (0, "manifest:4:0:ENOSPC"),
            SaveStage::Commit,
            ["manifest.json", "No space left on device"],
        ),
    ] {
        let root = tempfile::tempdir().unwrap();
        let outcomes = save_twice_in(root.path(), fault, true);
        assert_step_4_failed_everywhere(root.path(), &outcomes, stage, &needles);
    }
}
