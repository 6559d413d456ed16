//! A run killed with SIGKILL mid-training and resumed from its last checkpoint ends with
//! parameters bitwise equal to an uninterrupted run at the same world size. Real processes
//! through `burn-dist-run`; the kill happens at a step the program announces on stdout. The
//! resumed run keeps its last 2 checkpoints (`--keep-last 2`) and writes them in the background
//! (`--checkpoint-async`).

use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::time::Duration;

use burn_dist_models::processes::{kill_announced, launcher, scratch_dir, watch};
use burn_dist_models::step::read_params;
use gpt_pretrain::metrics;

mod common;

use common::assert_same_model;

const TIMEOUT: Duration = Duration::from_secs(120);

/// `world` ranks, 7 steps, a checkpoint every 2 steps under `dir/checkpoints`; calls `on_line`
/// with every stdout line as it arrives; returns the exit status (no output for TIMEOUT fails
/// the test).
fn train(dir: &Path, world: usize, extra: &[&str], on_line: impl FnMut(&str)) -> ExitStatus {
    let mut child = Command::new(launcher())
        .args([
            "--nproc-per-node",
            &world.to_string(),
            "--master-port",
            "0",
            "--stop-grace-secs",
            "2",
            "--",
        ])
        .arg(env!("CARGO_BIN_EXE_gpt-pretrain"))
        .args([
            "--steps",
            "7",
            "--global-batch",
            "4",
            "--context",
            "16",
            "--synthetic-tokens",
            "20000",
            "--warmup",
            "2",
            "--eval-every",
            "0",
            "--eval-sequences",
            "4",
            "--checkpoint-every",
            "2",
            "--no-plot",
        ])
        .arg("--run-dir")
        .arg(dir)
        .args(extra)
        .env("BURN_DIST_TIMEOUT_SECS", "60")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting burn-dist-run");
    watch(&mut child, TIMEOUT, on_line).0
}

#[test]
fn killed_and_resumed_run_ends_bitwise_equal_to_the_uninterrupted_one() {
    let root = scratch_dir("gpt-resume");
    let (straight, crashed) = (root.join("straight"), root.join("crashed"));
    let out = |name: &str| root.join(name).to_str().unwrap().to_string();

    let status = train(&straight, 2, &["--out", &out("straight.bin")], |_| {});
    assert!(status.success(), "uninterrupted run: {status}");

    // Every rank stops after step 5 (checkpoints exist for steps 2 and 4); rank 1 is killed.
    let mut killed = false;
    let status = train(&crashed, 2, &["--pause-after-step", "5"], |line| {
        killed |= kill_announced(line, "paused after step 5 on rank 1 (pid ");
    });
    assert!(killed, "rank 1 never announced step 5");
    assert!(!status.success(), "the job fails when a rank is killed");

    let ckpt = crashed.join("checkpoints");
    let resume = ckpt.to_str().unwrap().to_string();
    let mut resumed_at = None;
    let mut removed = Vec::new();
    // With --keep-last 2 and --checkpoint-async (neither changes the result; retention
    // applies as each background checkpoint completes).
    let status = train(
        &crashed,
        2,
        &[
            "--resume",
            &resume,
            "--out",
            &out("resumed.bin"),
            "--keep-last",
            "2",
            "--checkpoint-async",
        ],
        |line| {
            if line.contains("resumed at step") {
                resumed_at = line.rsplit(' ').next().map(str::to_string);
            }
            if line.contains("removed ")
                && line.contains("step-")
                && line.ends_with(" (--keep-last 2)")
            {
                removed.push(line.to_string());
            }
        },
    );
    assert!(status.success(), "resumed run: {status}");
    assert_eq!(
        resumed_at.as_deref(),
        Some("4"),
        "the newest checkpoint before the kill"
    );
    // Saves at 6 and 7 keep the two newest complete checkpoints: 2, then 4, are removed.
    assert_eq!(removed.len(), 2, "{removed:?}");
    let mut left: Vec<String> = std::fs::read_dir(&ckpt)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_str().unwrap().to_string())
        .collect();
    left.sort();
    assert_eq!(left, ["step-0000000006", "step-0000000007"]);

    let bits = |name: &str| -> Vec<Vec<u32>> {
        read_params(&root.join(name))
            .unwrap()
            .iter()
            .map(|t| t.iter().map(|x| x.to_bits()).collect())
            .collect()
    };
    assert_eq!(bits("resumed.bin"), bits("straight.bin"));
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_checkpoint_of_two_ranks_resumes_on_one_and_four_to_the_same_model() {
    let root = scratch_dir("gpt-reshard");
    let out = |name: &str| root.join(name).to_str().unwrap().to_string();
    let status = train(
        &root.join("straight"),
        2,
        &["--out", &out("straight.bin")],
        |_| {},
    );
    assert!(status.success(), "uninterrupted run: {status}");
    let reference = read_params(&root.join("straight.bin")).unwrap();
    let straight_curve = metrics::read(&root.join("straight/metrics.jsonl")).unwrap();
    // 1 or 4 ranks finish the run from its step-4 checkpoint: the same data, the same optimizer
    // state (resharded), so the same model up to the rounding of the reductions.
    for world in [1, 4] {
        let name = format!("resumed-{world}.bin");
        let resume = root.join("straight/checkpoints/step-0000000004");
        let status = train(
            &root.join(format!("run-{world}")),
            world,
            &["--resume", resume.to_str().unwrap(), "--out", &out(&name)],
            |_| {},
        );
        assert!(status.success(), "resumed on {world} ranks: {status}");
        let got = read_params(&root.join(&name)).unwrap();
        // 1e-5: they agree to about 1e-7 (see `assert_same_model` for the one exception).
        assert_same_model(&got, &reference, 1e-5, &format!("resumed on {world} ranks"));
        let resumed = metrics::read(&root.join(format!("run-{world}/metrics.jsonl"))).unwrap();
        assert_eq!(
            resumed.iter().map(|r| r.step).collect::<Vec<_>>(),
            [5, 6, 7]
        );
        for r in &resumed {
            let s = &straight_curve[r.step as usize - 1];
            assert!(
                (r.loss - s.loss).abs() <= 1e-4 * s.loss,
                "resumed on {world} ranks: step {} loss {} vs {}",
                r.step,
                r.loss,
                s.loss
            );
        }
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// ZeRO stage 3 saves with no rank holding the model: a checkpoint of 4 ranks at stage 3
/// resumes on 2 ranks at stage 3 and on 1 rank at stage 1 to the same model.
#[test]
fn a_stage_3_checkpoint_of_four_ranks_resumes_on_two_at_stage_3_and_on_one_at_stage_1() {
    let root = scratch_dir("gpt-stage3-reshard");
    let out = |name: &str| root.join(name).to_str().unwrap().to_string();
    let status = train(
        &root.join("straight"),
        4,
        &["--zero-stage", "3", "--out", &out("straight.bin")],
        |_| {},
    );
    assert!(status.success(), "uninterrupted run: {status}");
    let reference = read_params(&root.join("straight.bin")).unwrap();
    let resume = root.join("straight/checkpoints/step-0000000004");
    for (world, stage) in [(2, "3"), (1, "1")] {
        let name = format!("resumed-{world}.bin");
        let status = train(
            &root.join(format!("run-{world}")),
            world,
            &[
                "--zero-stage",
                stage,
                "--resume",
                resume.to_str().unwrap(),
                "--out",
                &out(&name),
            ],
            |_| {},
        );
        assert!(
            status.success(),
            "resumed on {world} ranks at stage {stage}: {status}"
        );
        let got = read_params(&root.join(&name)).unwrap();
        let what = format!("resumed on {world} ranks at stage {stage}");
        assert_same_model(&got, &reference, 1e-5, &what);
    }
    let _ = std::fs::remove_dir_all(&root);
}
