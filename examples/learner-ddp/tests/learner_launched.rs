//! Two real processes through `burn-dist-run`, each training with burn-train's plain
//! single-device `Learner` on its shard of the data, end with the parameters of the one-process
//! custom loop on the concatenated batch; only rank 0 writes metrics, logs and checkpoints.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::Duration;

use burn::backend::Autodiff;
use burn_dist::DistributedBackend;
use burn_dist_models::assert_close;
use burn_dist_models::processes::{launcher, scratch_dir, watch};
use burn_dist_models::step::read_params;
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
/// every line prefixed by the launcher with its rank). Killed after TIMEOUT without output: the
/// launcher's ranks die with it.
fn launch(artifacts: &Path, out: &Path) -> (ExitStatus, String) {
    let run = run();
    let mut child = Command::new(launcher())
        .args(["--nproc-per-node", &WORLD.to_string(), "--master-port", "0"])
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
    // (a directory shared with rank 0 would hide them among rank 0's files), and wrote nothing
    // there.
    let dirs = learner_directories(&transcript);
    assert_eq!(
        dirs.iter().map(|(rank, _)| *rank).collect::<Vec<_>>(),
        (0..WORLD).collect::<Vec<_>>(),
        "every rank reports its Learner directory once:\n{transcript}"
    );
    assert_eq!(dirs[0].1, artifacts, "rank 0's Learner directory");
    for (rank, dir) in &dirs[1..] {
        assert_ne!(dir, &artifacts, "rank {rank} shares rank 0's directory");
        assert!(!dir.exists(), "rank {rank} wrote into {}", dir.display());
    }
    std::fs::remove_dir_all(&root).ok();
}
