//! Ranks that `burn-dist-run` did not start (Slurm, torchrun, by hand) get their share of the
//! host's cores in rayon's global pool, the one Flex computes on, when they join: real processes
//! on loopback, each reporting its pool after `Ddp::init`.
//!
//! Each case runs this test binary twice more, as the two ranks of a job, with only the
//! `rank_reports_its_pool` test selected and `CHILD_VAR` saying what it should do.

use std::net::TcpListener;
use std::process::{Command, Stdio};

use burn_dist::{Ddp, DdpConfig, PoolSize};

/// Set only in the ranks this file starts: what the rank does before joining.
const CHILD_VAR: &str = "BURN_DIST_THREAD_SHARE_CHILD";
/// Precedes a rank's report on its stdout.
const REPORT: &str = "thread-share report: ";

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Not a test of its own: the body of a rank started by `run_two_ranks`.
#[test]
fn rank_reports_its_pool() {
    let Ok(mode) = std::env::var(CHILD_VAR) else {
        return;
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter("warn")
        .init();
    if mode == "pool-before-init" {
        // What a tensor operation before `Ddp::init` does: build the default pool.
        let _ = rayon::current_num_threads();
    }
    let ddp = Ddp::init(DdpConfig::new()).expect("joining");
    // After a marker: the test harness prints `test rank_reports_its_pool ... ` on the same line.
    println!(
        "{REPORT}pool {:?} threads {}",
        ddp.thread_pool().expect("a joined rank reports its pool"),
        rayon::current_num_threads()
    );
}

/// Starts two ranks of one job on this host, as Slurm or torchrun would (no launcher), with
/// `env` added; returns each rank's report line and its stderr.
fn run_two_ranks(mode: &str, env: &[(&str, &str)]) -> Vec<(String, String)> {
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
        .to_string();
    let exe = std::env::current_exe().expect("this test binary");
    let children: Vec<_> = (0..2)
        .map(|rank| {
            let mut command = Command::new(&exe);
            command
                .args(["--exact", "rank_reports_its_pool", "--nocapture"])
                .args(["--test-threads", "1"])
                .env_remove("RAYON_NUM_THREADS")
                .env_remove("OMP_NUM_THREADS")
                .env(CHILD_VAR, mode)
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("LOCAL_WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("BURN_DIST_TIMEOUT_SECS", "30")
                .envs(env.iter().copied())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            command.spawn().expect("starting a rank")
        })
        .collect();
    children
        .into_iter()
        .enumerate()
        .map(|(rank, child)| {
            // Bounded: every wait of `Ddp::init` times out after BURN_DIST_TIMEOUT_SECS.
            let out = child.wait_with_output().expect("waiting for a rank");
            let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
            let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
            assert!(out.status.success(), "rank {rank}: {stdout}{stderr}");
            let line = stdout
                .lines()
                .find_map(|l| l.split_once(REPORT).map(|(_, report)| report))
                .unwrap_or_else(|| panic!("rank {rank} reported no pool: {stdout}{stderr}"));
            (line.to_string(), stderr)
        })
        .collect()
}

#[test]
fn ranks_started_without_the_launcher_get_their_share_of_the_cores() {
    let share = (cores() / 2).max(1);
    for (rank, (line, _)) in run_two_ranks("plain", &[]).iter().enumerate() {
        let expected = format!("pool {:?} threads {share}", PoolSize::Shared(share));
        assert_eq!(line, &expected, "rank {rank}");
    }
}

#[test]
fn rayon_num_threads_set_by_the_user_wins() {
    let ranks = run_two_ranks("plain", &[("RAYON_NUM_THREADS", "3")]);
    for (rank, (line, _)) in ranks.iter().enumerate() {
        let expected = format!("pool {:?} threads 3", PoolSize::Chosen(3));
        assert_eq!(line, &expected, "rank {rank}");
    }
}

#[test]
fn a_pool_built_before_init_is_kept_and_reported() {
    let (all, share) = (cores(), (cores() / 2).max(1));
    for (rank, (line, stderr)) in run_two_ranks("pool-before-init", &[]).iter().enumerate() {
        let pool = PoolSize::AlreadyBuilt {
            threads: all,
            share,
        };
        assert_eq!(line, &format!("pool {pool:?} threads {all}"), "rank {rank}");
        if all != share {
            assert!(
                stderr.contains("built before Ddp::init")
                    && stderr.contains(&format!("RAYON_NUM_THREADS={share}")),
                "rank {rank}: {stderr}"
            );
        }
    }
}
