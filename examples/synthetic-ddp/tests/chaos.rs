//! Chaos: a random rank of a real 3-process job is killed with SIGKILL at a random point (during
//! set-up, inside a step and its collectives, between steps, inside a checkpoint write), over
//! and over. Every time:
//! - the launcher and every other rank exit within 30 s, the launcher naming the dead rank, and
//!   a surviving rank that reports an error names it too (or the rank it lost because of it,
//!   or was stopped by the launcher);
//! - no process of the job is left running;
//! - no shared-memory ring file of the job is left in `/dev/shm` once the next job on this host
//!   has set up (a rank killed during set-up leaves its rings; the next job sweeps them);
//! - the newest complete checkpoint verifies, and resuming from it ends bitwise equal to an
//!   uninterrupted run.
//!
//! The victim of a timed kill holds after its last step (`--pause-after`) until it is killed: a
//! delay longer than the rest of the job (a fast machine runs a step in a few milliseconds)
//! would otherwise kill a process that had already finished, and the job would succeed.
//!
//! `chaos_short` (in `cargo xtask test`) runs one trial of each kind of point; `chaos_long`
//! (`cargo xtask soak`) runs random trials for `BURN_DIST_CHAOS_SECS` (default 600). The choice
//! of rank, point and delay comes from a seed printed first; `BURN_DIST_SEED` replays it (the
//! kill's exact moment still depends on timing: that is the point).

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use burn_dist_kernels::testing::Rng;
use burn_dist_testing::processes::{kill_announced, launch, read_f32s, scratch_dir, watch};
use burn_dist_zero::checkpoint;

const WORLD: usize = 3;
const STEPS: u64 = 6;
const CHECKPOINT_EVERY: u64 = 2;
/// The longest a job may go without printing a line before the test calls it hung.
const QUIET: Duration = Duration::from_secs(120);
/// From the kill to the launcher's exit, every process included.
const EXIT_LIMIT: Duration = Duration::from_secs(30);

/// Where the victim dies.
#[derive(Debug, Clone, Copy)]
enum Point {
    /// `delay_us` after the victim announced its start: in the rendezvous, the mesh and
    /// shared-memory set-up, or the broadcast of the weights.
    SetUp { delay_us: u64 },
    /// `delay_us` after the victim announced the end of `step`: in the next step's forward,
    /// backward and collectives, or in a checkpoint write (0: right between two steps).
    AfterStep { step: u64, delay_us: u64 },
    /// Paused inside the checkpoint write of `step`, its shard durable, no manifest yet, while
    /// the other ranks wait for it in the save's collective.
    InCheckpoint { step: u64 },
}

/// The random choices of the trials: seeded from `BURN_DIST_SEED` or the clock, printed.
struct Chaos(Rng);

impl Chaos {
    fn fresh() -> Chaos {
        let seed = Rng::fresh_seed();
        println!("chaos seed {seed} (replay the choices with BURN_DIST_SEED={seed})");
        Chaos(Rng::new(seed))
    }

    fn below(&mut self, n: u64) -> u64 {
        self.0.next_u64() % n
    }

    /// A point of `kind` (0 set-up, 1 right after a step, 2 some time after a step, 3 inside a
    /// checkpoint write), with the step and delay drawn here.
    fn point(&mut self, kind: u64) -> Point {
        // Steps that leave work after them, so the victim is still running when it is killed.
        let step = 1 + self.below(STEPS - 2);
        match kind {
            0 => Point::SetUp {
                delay_us: self.below(40_000),
            },
            1 => Point::AfterStep { step, delay_us: 0 },
            2 => Point::AfterStep {
                step,
                delay_us: self.below(20_000),
            },
            _ => Point::InCheckpoint {
                step: CHECKPOINT_EVERY * (1 + self.below(STEPS / CHECKPOINT_EVERY - 1)),
            },
        }
    }
}

/// `burn-dist-run --nproc-per-node 3 -- synthetic-zero …`, calling `on_line` with every output
/// line as it arrives; returns the exit status and every line.
fn job(
    dir: &Path,
    out: &Path,
    env: &[(&str, &str)],
    args: &[String],
    on_line: impl FnMut(&str),
) -> (ExitStatus, Vec<String>) {
    let mut child = launch(WORLD, Path::new(env!("CARGO_BIN_EXE_synthetic-zero")))
        .args(args)
        .args(["--steps", &STEPS.to_string()])
        .args(["--checkpoint-every", &CHECKPOINT_EVERY.to_string()])
        .arg("--checkpoint-dir")
        .arg(dir)
        .arg("--out")
        .arg(out)
        .env("BURN_DIST_TIMEOUT_SECS", "20")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting burn-dist-run");
    watch(&mut child, QUIET, on_line)
}

/// The pid in a line ending with "(pid N)".
fn announced_pid(line: &str) -> Option<i32> {
    let at = line.rfind("(pid ")?;
    line[at + 5..].strip_suffix(')')?.parse().ok()
}

/// Whether `pid` is still a running process (a zombie waiting for its reaper is not).
fn running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        let state = stat.rsplit(')').next().unwrap_or("").trim_start();
        !state.starts_with('Z') && !state.starts_with('X')
    })
}

/// Ring files in `/dev/shm` created by any of `pids`.
fn rings_of(pids: &[i32]) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir("/dev/shm") else {
        return Vec::new();
    };
    entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            pids.iter()
                .any(|pid| name.starts_with(&format!("burn-dist-{pid}-")))
        })
        .collect()
}

/// One trial: a fresh checkpoint dir, the victim killed at `point`, the checks, then the resume.
fn trial(root: &Path, n: usize, victim: usize, point: Point, straight: &[f32]) {
    println!("trial {n}: rank {victim} killed at {point:?}");
    let dir = root.join(format!("trial-{n}"));
    let out = root.join(format!("trial-{n}.bin"));
    let mut pids = Vec::new();
    let mut killed_at: Option<Instant> = None;
    // Where the victim waits for its kill: paused inside the checkpoint write, or, for a timed
    // kill, held after its last step (first start of the job), so that a kill however late
    // finds it alive.
    let (pause, hold) = match point {
        Point::InCheckpoint { step } => (Some(format!("after-shard:{step}:{victim}")), vec![]),
        _ => (
            None,
            vec!["--pause-after".to_string(), format!("0:{victim}:{STEPS}")],
        ),
    };
    let env: Vec<(&str, &str)> = pause
        .iter()
        .map(|pause| (checkpoint::PAUSE_VAR, pause.as_str()))
        .collect();
    let victim_tag = format!("[rank {victim}] ");
    let (status, lines) = job(&dir, &out, &env, &hold, |line| {
        pids.extend(announced_pid(line).filter(|p| !pids.contains(p)));
        if killed_at.is_some() || !line.starts_with(&victim_tag) {
            return;
        }
        let (announce, delay_us) = match point {
            Point::SetUp { delay_us } => (": starting (pid ".to_string(), delay_us),
            Point::AfterStep { step, delay_us } => (format!(": step {step} done (pid "), delay_us),
            Point::InCheckpoint { .. } => {
                (format!(" paused at after-shard on rank {victim} (pid "), 0)
            }
        };
        if line.contains(&announce) {
            // The delay picks the moment of the crash, it waits for nothing.
            std::thread::sleep(Duration::from_micros(delay_us));
            assert!(kill_announced(line, &announce));
            killed_at = Some(Instant::now());
        }
    });
    let transcript = || lines.join("\n");
    let killed_at = killed_at.unwrap_or_else(|| {
        panic!(
            "trial {n}: rank {victim} never reached {point:?}:\n{}",
            transcript()
        )
    });
    assert!(
        killed_at.elapsed() <= EXIT_LIMIT,
        "trial {n}: the job took {:?} to end after the kill:\n{}",
        killed_at.elapsed(),
        transcript()
    );
    assert!(
        !status.success(),
        "trial {n}: the job must fail:\n{}",
        transcript()
    );
    assert!(
        lines.iter().any(
            |l| l.contains(&format!("rank {victim} (pid ")) && l.contains("killed by signal 9")
        ),
        "trial {n}: the launcher does not name rank {victim}:\n{}",
        transcript()
    );
    // A survivor that reports an error names the dead rank, or the rank it lost instead, whose
    // own error names the dead rank (rank 0 fails first and takes the store with it), or it was
    // stopped by the launcher, whose summary names the dead rank (a rank killed before it
    // joined is known to nobody else: the others wait for it until the launcher stops them).
    let errors: Vec<Option<&str>> = (0..WORLD)
        .map(|r| {
            let prefix = format!("[rank {r}] error: ");
            lines.iter().find_map(|l| l.strip_prefix(&prefix))
        })
        .collect();
    let names = |r: usize, k: usize| errors[r].is_some_and(|e| e.contains(&format!("rank {k}")));
    for survivor in (0..WORLD).filter(|&r| r != victim) {
        if let Some(error) = errors[survivor] {
            let through = (0..WORLD)
                .filter(|&k| k != survivor && k != victim)
                .any(|k| names(survivor, k) && names(k, victim));
            let summary = format!("burn-dist-run: summary: rank {survivor} (pid ");
            let stopped = lines
                .iter()
                .any(|l| l.starts_with(&summary) && l.contains("(stopped by the launcher"));
            assert!(
                names(survivor, victim) || through || stopped,
                "trial {n}: rank {survivor} failed without naming rank {victim}: {error}\n{}",
                transcript()
            );
        }
    }
    assert_eq!(pids.len(), WORLD, "trial {n}: every rank announces its pid");
    let alive: Vec<_> = pids.iter().filter(|&&p| running(p)).collect();
    assert!(alive.is_empty(), "trial {n}: still running: {alive:?}");

    // The newest complete checkpoint, if the job got that far, verifies.
    let latest = checkpoint::latest(&dir).expect("listing the checkpoints");
    if let Some(latest) = &latest {
        checkpoint::verify(latest).unwrap_or_else(|e| panic!("trial {n}: {e}"));
    }
    if let Point::InCheckpoint { step } = point {
        assert_eq!(
            latest,
            (step > CHECKPOINT_EVERY).then(|| checkpoint::step_dir(&dir, step - CHECKPOINT_EVERY)),
            "trial {n}: step {step} has no manifest and must not count"
        );
    }

    // The next job on this host resumes from it, ends where the uninterrupted run ended, and
    // has swept the rings a rank killed during set-up left behind.
    let (status, resumed) = job(&dir, &out, &[], &[], |_| {});
    assert!(
        status.success(),
        "trial {n}: resume:\n{}",
        resumed.join("\n")
    );
    if let Some(latest) = &latest {
        let line = format!("resumed from {}", latest.display());
        assert!(
            resumed.iter().any(|l| l.contains(&line)),
            "trial {n}: the resumed job did not start from {}:\n{}",
            latest.display(),
            resumed.join("\n")
        );
    }
    assert!(
        read_f32s(&out) == straight,
        "trial {n}: resumed run differs from the uninterrupted one"
    );
    let left = rings_of(&pids);
    assert!(
        left.is_empty(),
        "trial {n}: ring files left in /dev/shm: {left:?}"
    );
}

/// The uninterrupted run every trial must end on.
fn straight_run(root: &Path) -> Vec<f32> {
    let out = root.join("straight.bin");
    let (status, lines) = job(&root.join("straight"), &out, &[], &[], |_| {});
    assert!(status.success(), "uninterrupted run:\n{}", lines.join("\n"));
    read_f32s(&out)
}

#[test]
fn chaos_short() {
    let root = scratch_dir("chaos-short");
    let straight = straight_run(&root);
    let mut rng = Chaos::fresh();
    for kind in 0..4 {
        let victim = rng.below(WORLD as u64) as usize;
        let point = rng.point(kind);
        trial(&root, kind as usize, victim, point, &straight);
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// Random trials until `BURN_DIST_CHAOS_SECS` (default 600) have passed (`cargo xtask soak`).
#[test]
#[ignore = "long: run by `cargo xtask soak`"]
fn chaos_long() {
    let budget = Duration::from_secs(
        std::env::var("BURN_DIST_CHAOS_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(600),
    );
    let root = scratch_dir("chaos-long");
    let straight = straight_run(&root);
    let mut rng = Chaos::fresh();
    let start = Instant::now();
    let mut n = 0;
    while start.elapsed() < budget {
        let victim = rng.below(WORLD as u64) as usize;
        let kind = rng.below(4);
        let point = rng.point(kind);
        trial(&root, n, victim, point, &straight);
        let _ = std::fs::remove_dir_all(root.join(format!("trial-{n}")));
        n += 1;
    }
    println!("chaos: {n} trials in {:?}, all passed", start.elapsed());
    let _ = std::fs::remove_dir_all(&root);
}
