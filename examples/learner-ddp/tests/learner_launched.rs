//! Real processes through `burn-dist-run`, each training with burn-train's plain single-device
//! `Learner` on its shard of the data:
//! - 2 ranks with Burn's Adam end with the parameters of the one-process custom loop on the
//!   concatenated batch, and only rank 0 writes metrics, logs and checkpoints;
//! - with ZeroAdam (stages 1, 2 and 3) 2 ranks equal 1 rank, and a run resumed from the
//!   Learner's checkpoint, at the same and at another world size, equals the uninterrupted run
//!   (at stage 3 the checkpoints are taken without any rank but 0 holding the model);
//! - with ZeroAdam offloaded (`--backend wgpu --offload`, lavapipe here) at stages 1 to 3, the
//!   Learner follows ZeroAdam in device memory, and its checkpoint written with offload resumes
//!   without it and back; `--offload` without the device backend or ZeroAdam is refused;
//! - a `TrainStep` that forgets to mark the model fails at the first step, naming the fix.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::Duration;

use burn::backend::Autodiff;
use burn_dist::DistributedBackend;
use burn_dist_models::assert_close;
use burn_dist_models::processes::{
    assert_plain_logs, launch_command, launcher, scratch_dir, watch,
};
use burn_dist_models::step::read_params;
use burn_dist_zero::Placement;
use burn_flex::{Flex, FlexDevice};
use learner_ddp::Run;
use learner_ddp::reference::custom_loop;

type B = Autodiff<DistributedBackend<Flex>>;

const WORLD: usize = 2;
/// The whole launched run, debug build on 2 cores, takes a few seconds.
const TIMEOUT: Duration = Duration::from_secs(120);

fn run() -> Run {
    Run {
        samples: 64,
        valid_samples: 16,
        epochs: 2,
        batch: 4,
        lr: 1e-2,
    }
}

/// Runs `learner-ddp` on `WORLD` ranks; returns its exit status and its output (both streams,
/// every line prefixed by the launcher with its rank).
fn launch(artifacts: &Path, out: &Path) -> (ExitStatus, String) {
    launch_on(WORLD, run(), artifacts, out, &[])
}

/// Runs `learner-ddp` on `world` ranks, each with `run.batch` samples per step and `extra`
/// arguments. Killed after TIMEOUT without output: the launcher's ranks die with it.
fn launch_on(
    world: usize,
    run: Run,
    artifacts: &Path,
    out: &Path,
    extra: &[&str],
) -> (ExitStatus, String) {
    let mut child = Command::new(launcher())
        .args(["--nproc-per-node", &world.to_string(), "--master-port", "0"])
        .args(["--stop-grace-secs", "2", "--"])
        .arg(env!("CARGO_BIN_EXE_learner-ddp"))
        .arg("--artifact-dir")
        .arg(artifacts)
        .args(["--epochs", &run.epochs.to_string()])
        .args(["--batch-size", &run.batch.to_string()])
        .args(["--samples", &run.samples.to_string()])
        .args(["--valid-samples", &run.valid_samples.to_string()])
        .args(["--lr", &run.lr.to_string()])
        .arg("--out")
        .arg(out)
        .args(extra)
        .env("BURN_DIST_TIMEOUT_SECS", "60")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting burn-dist-run");
    let (status, transcript) = watch(&mut child, TIMEOUT, |_| {});
    (status, transcript.join("\n"))
}

/// Each rank's `learner directory: PATH` line, as (rank, path), in rank order.
fn learner_directories(transcript: &str) -> Vec<(usize, PathBuf)> {
    let mut dirs: Vec<(usize, PathBuf)> = transcript
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("[rank ")?;
            let (rank, rest) = rest.split_once("] ")?;
            let dir = rest.strip_prefix("learner directory: ")?;
            Some((rank.parse().ok()?, PathBuf::from(dir)))
        })
        .collect();
    dirs.sort();
    dirs
}

#[test]
fn two_learner_processes_equal_the_custom_loop_and_only_rank_0_writes_artifacts() {
    let root = scratch_dir("launched");
    let (artifacts, out) = (root.join("artifacts"), root.join("params.bin"));
    let (status, transcript) = launch(&artifacts, &out);
    assert!(
        status.success(),
        "learner-ddp failed: {status}\n{transcript}"
    );

    let got = read_params(&out).unwrap_or_else(|e| panic!("{}: {e}", out.display()));
    let run = run();
    let reference = custom_loop::<B>(&run, WORLD * run.batch, &FlexDevice);
    assert_close(
        &got,
        &reference,
        1e-5,
        "Learner on 2 processes vs custom loop",
    );

    // Rank 0 wrote what burn-train writes for one process...
    for file in [
        "experiment.log",
        "train/epoch-2/Loss.log",
        "valid/epoch-2/Loss.log",
        "checkpoint/model-2.mpk",
        "checkpoint/optim-2.mpk",
    ] {
        assert!(
            artifacts.join(file).is_file(),
            "rank 0 did not write {file}"
        );
    }
    // ...and every other rank was given a directory of its own, which would show any write
    // (a directory shared with rank 0 would hide them among rank 0's files), and wrote no file
    // there (its checkpointer only made its empty directory).
    let dirs = learner_directories(&transcript);
    assert_eq!(
        dirs.iter().map(|(rank, _)| *rank).collect::<Vec<_>>(),
        (0..WORLD).collect::<Vec<_>>(),
        "every rank reports its Learner directory once:\n{transcript}"
    );
    assert_eq!(dirs[0].1, artifacts, "rank 0's Learner directory");
    for (rank, dir) in &dirs[1..] {
        assert_ne!(dir, &artifacts, "rank {rank} shares rank 0's directory");
        let written = files_under(dir);
        assert!(written.is_empty(), "rank {rank} wrote {written:?}");
    }
    std::fs::remove_dir_all(&root).ok();
}

/// Every file under `dir` (none if it does not exist).
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .flat_map(|entry| {
            let path = entry.path();
            if path.is_dir() {
                files_under(&path)
            } else {
                vec![path]
            }
        })
        .collect()
}

/// Launches and returns rank 0's final parameters, failing with the transcript.
fn trained(world: usize, run: Run, artifacts: &Path, extra: &[&str]) -> Vec<Vec<f32>> {
    trained_saying(world, run, artifacts, extra).0
}

/// [`trained`], and the transcript.
fn trained_saying(
    world: usize,
    run: Run,
    artifacts: &Path,
    extra: &[&str],
) -> (Vec<Vec<f32>>, String) {
    let out = artifacts.with_extension(format!("w{world}.params"));
    let (status, transcript) = launch_on(world, run, artifacts, &out, extra);
    assert!(
        status.success(),
        "learner-ddp on {world} ranks {extra:?} failed: {status}\n{transcript}"
    );
    let params = read_params(&out).unwrap_or_else(|e| panic!("{}: {e}", out.display()));
    (params, transcript)
}

#[test]
fn zero_adam_under_the_learner_on_2_ranks_equals_1_rank_and_resumes_at_any_world_size() {
    let root = scratch_dir("zero");
    for stage in ["zero1", "zero2", "zero3"] {
        let optimizer = ["--optimizer", stage];
        // The same global batch of 8 samples per step on 2 and on 1 rank.
        let two = Run { batch: 4, ..run() };
        let one = Run { batch: 8, ..run() };
        let uninterrupted = trained(2, two.clone(), &root.join(format!("{stage}-2")), &optimizer);
        let alone = trained(1, one.clone(), &root.join(format!("{stage}-1")), &optimizer);
        assert_close(
            &alone,
            &uninterrupted,
            1e-5,
            &format!("{stage}: 1 rank vs 2 ranks"),
        );

        // Epoch 1 on 2 ranks, then epoch 2 from its checkpoint, on 2 ranks and on 1.
        let first = root.join(format!("{stage}-first"));
        let epoch_1 = trained(
            2,
            Run {
                epochs: 1,
                ..two.clone()
            },
            &first,
            &optimizer,
        );
        assert!(
            epoch_1 != uninterrupted,
            "{stage}: the second epoch changed nothing, so a resume could not be told apart"
        );
        let resume = [&optimizer[..], &["--resume", "1"]].concat();
        for (world, run) in [(2, two.clone()), (1, one.clone())] {
            let resumed = trained(world, run, &first, &resume);
            assert_close(
                &resumed,
                &uninterrupted,
                1e-5,
                &format!("{stage}: epoch 2 resumed on {world} ranks vs uninterrupted"),
            );
        }
    }
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn offloaded_zero_adam_under_the_learner_follows_it_on_the_device_and_resumes_across_offload() {
    burn_dist_kernels::testing::wgpu_client();
    let root = scratch_dir("offload");
    let run = Run { batch: 4, ..run() };
    let first_epoch = Run {
        epochs: 1,
        ..run.clone()
    };
    for stage in ["zero1", "zero2", "zero3"] {
        let on_device = ["--backend", "wgpu", "--optimizer", stage];
        let offloaded = [&on_device[..], &["--offload"]].concat();
        let dir = |what: &str| root.join(format!("{stage}-{what}"));
        // Offloaded, the host step updates the state: its arithmetic differs from the fused
        // kernels' in the last bits of a few operations (tests/offload.rs of burn-dist-zero).
        let (uninterrupted, said) =
            trained_saying(WORLD, run.clone(), &dir("offloaded"), &offloaded);
        let (reference, said_on_device) =
            trained_saying(WORLD, run.clone(), &dir("on-device"), &on_device);
        for (said, placement) in [
            (said, Placement::Offloaded),
            (said_on_device, Placement::Device),
        ] {
            assert!(
                said.contains(&format!("its state in {placement}")),
                "{stage}: ZeroAdam's state is not in {placement}:\n{said}"
            );
        }
        assert_close(
            &reference,
            &uninterrupted,
            1e-5,
            &format!("{stage}: the Learner offloaded vs on the device"),
        );
        // The Learner's checkpoint of epoch 1, written with and without offload, resumed the
        // other way.
        for (what, written, resumed_with) in [
            ("saved-offloaded", &offloaded[..], &on_device[..]),
            ("saved-on-device", &on_device[..], &offloaded[..]),
        ] {
            trained(WORLD, first_epoch.clone(), &dir(what), written);
            let resume = [resumed_with, &["--resume", "1"]].concat();
            let resumed = trained(WORLD, run.clone(), &dir(what), &resume);
            assert_close(
                &resumed,
                &uninterrupted,
                1e-5,
                &format!("{stage}: epoch 1 {what}, epoch 2 resumed {resumed_with:?}"),
            );
        }
    }
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn offload_without_a_device_backend_or_zero_adam_is_refused_by_name() {
    let root = scratch_dir("offload-refused");
    for extra in [
        &["--offload", "--optimizer", "zero1"][..],
        &["--offload", "--backend", "wgpu"],
    ] {
        let out = root.join("params.bin");
        let (status, transcript) = launch_on(1, run(), &root, &out, extra);
        assert!(!status.success(), "{extra:?} ran:\n{transcript}");
        assert!(
            transcript.contains("--offload needs --backend wgpu and a ZeroAdam --optimizer"),
            "{extra:?}: {transcript}"
        );
    }
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn a_forgotten_mark_under_the_learner_fails_at_the_first_step_naming_the_fix() {
    let root = scratch_dir("unmarked");
    for optimizer in ["adam", "zero1"] {
        let out = root.join("params.bin");
        let (status, transcript) = launch_on(
            WORLD,
            run(),
            &root.join(optimizer),
            &out,
            &["--optimizer", optimizer, "--skip-mark"],
        );
        assert!(
            !status.success(),
            "{optimizer}: trained without syncing:\n{transcript}"
        );
        assert!(
            transcript.contains("were not averaged over the ranks")
                && transcript.contains("burn_dist::mark_for_sync(self.clone())"),
            "{optimizer}: the failure does not name the fix:\n{transcript}"
        );
        assert!(!out.exists(), "{optimizer}: parameters were written");
    }
    std::fs::remove_dir_all(&root).ok();
}

/// Off a terminal the logs are plain text: with stdout and stderr redirected to files, rank
/// 1's logs (rank 0's go to burn-train's `experiment.log`, written without colour) and the
/// launcher's `[rank R]` prefixes carry no colour codes.
#[test]
fn logs_redirected_to_files_carry_no_colour_codes() {
    let root = scratch_dir("learner-plain-logs");
    let mut command = launch_command(2, env!("CARGO_BIN_EXE_learner-ddp").as_ref());
    command
        .arg("--artifact-dir")
        .arg(root.join("artifacts"))
        .args(["--epochs", "1", "--samples", "16", "--valid-samples", "8"]);
    let logs = assert_plain_logs(command, &root, "learner-ddp");
    assert!(
        logs.lines()
            .any(|l| l.starts_with("[rank 1] ") && l.contains("INFO")),
        "{logs}"
    );
    let log = std::fs::read(root.join("artifacts").join("experiment.log"))
        .expect("rank 0's experiment.log");
    assert!(!log.contains(&0x1b), "colour codes in experiment.log");
    let _ = std::fs::remove_dir_all(&root);
}
