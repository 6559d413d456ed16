//! Host collectives between real processes on loopback: results, deaths, bad tokens and bad
//! environments. The ranks run `burn-dist-check`, under the launcher or started by hand.

mod support;

use std::net::TcpListener;
use std::process::Command;

use burn_dist_comm::Link;
use support::{Launch, within};

const CHECK: &str = env!("CARGO_BIN_EXE_burn-dist-check");
/// Variables a rank reads; removed from the inherited environment so that tests are hermetic.
const RANK_VARS: [&str; 11] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "BURN_DIST_TOKEN",
    "BURN_DIST_TIMEOUT_SECS",
    "BURN_DIST_SHM",
    "BURN_DIST_GATHER_LANE",
    "SLURM_PROCID",
];

/// `burn-dist-run --nproc-per-node N --master-port 0 -- burn-dist-check ARGS...`, with the
/// ranks' data over shared memory (`Link::SharedMemory`, the default on one host) or over
/// loopback TCP (`BURN_DIST_SHM=0`).
fn launch_check(nproc: usize, link: Link, check_args: &[&str]) -> Launch {
    let nproc = nproc.to_string();
    let mut args = vec![
        "--nproc-per-node",
        &nproc,
        "--master-port",
        "0",
        "--",
        CHECK,
    ];
    args.extend_from_slice(check_args);
    let shm = if link == Link::SharedMemory { "1" } else { "0" };
    Launch::spawn(
        &args,
        &[("BURN_DIST_TIMEOUT_SECS", "60"), ("BURN_DIST_SHM", shm)],
    )
}

/// Waits for every rank's first line and checks that it reaches every peer over `link`;
/// returns the ranks' process ids.
fn wait_joined(launch: &mut Launch, nproc: usize, link: Link) -> Vec<i32> {
    (0..nproc)
        .map(|rank| {
            let joined = format!("[rank {rank}] rank {rank}: pid ");
            let line = launch
                .wait_for_line(|l| l.starts_with(&joined), within(60))
                .unwrap();
            let want: Vec<String> = (0..nproc)
                .filter(|&peer| peer != rank)
                .map(|peer| format!("{peer} {link}"))
                .collect();
            let want = format!("; data links: {}", want.join(", "));
            assert!(
                line.ends_with(&want),
                "rank {rank}: {line}, expected {want}"
            );
            let pid = &line[joined.len()..];
            pid[..pid.find(' ').unwrap()].parse().unwrap()
        })
        .collect()
}

/// `burn-dist-check` as one rank started by hand, with exactly `env` set.
fn rank_by_hand(env: &[(&str, &str)]) -> Launch {
    let mut command = Command::new(CHECK);
    command.args(["--mib", "0.01", "--iters", "1"]);
    RANK_VARS.iter().for_each(|v| _ = command.env_remove(v));
    command.envs(env.iter().copied());
    Launch::spawn_command(command)
}

fn free_port() -> String {
    let probe = TcpListener::bind("127.0.0.1:0").unwrap();
    probe.local_addr().unwrap().port().to_string()
}

fn all_reduce_matches_reference_on(nproc: usize, link: Link) {
    let mut launch = launch_check(nproc, link, &["--mib", "4", "--iters", "3"]);
    wait_joined(&mut launch, nproc, link);
    let status = launch.wait_exit(within(120));
    assert!(status.success(), "{status}\n{}", launch.transcript());
    for rank in 0..nproc {
        let done = format!("[rank {rank}] rank {rank}: 3 all_reduces of 4.0 MiB verified");
        assert!(
            launch.stdout().iter().any(|l| l.starts_with(&done)),
            "{}",
            launch.transcript()
        );
    }
}

#[test]
fn all_reduce_of_4_mib_matches_reference_on_2_processes() {
    all_reduce_matches_reference_on(2, Link::SharedMemory);
}

#[test]
fn all_reduce_of_4_mib_matches_reference_on_2_processes_over_tcp() {
    all_reduce_matches_reference_on(2, Link::Tcp);
}

#[test]
fn all_reduce_of_4_mib_matches_reference_on_4_processes() {
    all_reduce_matches_reference_on(4, Link::SharedMemory);
}

#[test]
fn kill_9_of_a_rank_mid_all_reduce_fails_every_rank_naming_it() {
    kill_9_of_a_rank_mid_all_reduce(Link::SharedMemory);
}

#[test]
fn kill_9_of_a_rank_mid_all_reduce_over_tcp_fails_every_rank_naming_it() {
    kill_9_of_a_rank_mid_all_reduce(Link::Tcp);
}

fn kill_9_of_a_rank_mid_all_reduce(link: Link) {
    let mut launch = launch_check(4, link, &["--mib", "16", "--iters", "1000000"]);
    let pids = wait_joined(&mut launch, 4, link);
    for rank in 0..4 {
        let verified = format!("[rank {rank}] rank {rank}: first all_reduce verified");
        launch.wait_for_line(|l| l == verified, within(60)).unwrap();
    }
    // Every rank is now looping over 16 MiB all-reduces.
    assert_eq!(unsafe { libc::kill(pids[1], libc::SIGKILL) }, 0);

    let status = launch.wait_exit(within(30));
    assert!(!status.success(), "{}", launch.transcript());
    let stderr = launch.stderr();
    assert!(
        stderr
            .iter()
            .any(|l| l.contains("rank 1 (pid") && l.contains("failed first: killed by signal 9")),
        "launcher does not name rank 1:\n{}",
        launch.transcript()
    );
    for survivor in [0, 2, 3] {
        let prefix = format!("[rank {survivor}] rank {survivor}: error:");
        let error = stderr.iter().find(|l| l.starts_with(&prefix));
        let error = error.unwrap_or_else(|| {
            panic!(
                "rank {survivor} reported no error:\n{}",
                launch.transcript()
            )
        });
        assert!(
            error.contains("rank 1"),
            "rank {survivor} does not name rank 1: {error}"
        );
    }
}

#[test]
fn peer_with_a_wrong_job_token_is_rejected() {
    let port = free_port();
    let common = [
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", &port),
        ("BURN_DIST_TIMEOUT_SECS", "5"),
    ];
    let rank0 = [&common[..], &[("RANK", "0"), ("BURN_DIST_TOKEN", "right")]].concat();
    let rank1 = [&common[..], &[("RANK", "1"), ("BURN_DIST_TOKEN", "wrong")]].concat();
    let mut first = rank_by_hand(&rank0);
    let mut second = rank_by_hand(&rank1);

    let status = second.wait_exit(within(30));
    assert!(!status.success());
    let rejected = second
        .stderr()
        .iter()
        .any(|l| l.contains("refused to let rank 1 join: wrong job token"));
    assert!(rejected, "{}", second.transcript());

    let status = first.wait_exit(within(30));
    assert!(!status.success());
    let named = first
        .stderr()
        .iter()
        .any(|l| l.contains("waiting for every rank to join: rank 1 did not join within 5 s"));
    assert!(named, "{}", first.transcript());
}

/// Runs one rank by hand with `env` and returns its stderr; it must fail within seconds.
fn fails_fast(env: &[(&str, &str)]) -> String {
    let mut rank = rank_by_hand(env);
    let status = rank.wait_exit(within(10));
    assert!(!status.success(), "{}", rank.transcript());
    rank.stderr().join("\n")
}

#[test]
fn rank_not_below_world_size_is_a_clear_error() {
    let port = free_port();
    let err = fails_fast(&[
        ("RANK", "4"),
        ("WORLD_SIZE", "4"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", &port),
    ]);
    assert!(err.contains("RANK: 4 is not below WORLD_SIZE=4"), "{err}");
}

#[test]
fn missing_master_addr_is_a_clear_error() {
    let err = fails_fast(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_PORT", "29500")]);
    assert!(err.contains("MASTER_ADDR: is not set"), "{err}");
}

#[test]
fn master_port_in_use_is_a_clear_error() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let err = fails_fast(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", &port),
    ]);
    assert!(
        err.contains("cannot bind") && err.contains("Address already in use"),
        "{err}"
    );
}

/// RANK=1 given to two processes of a job of 3 (rank 2 never comes): all three fail at join
/// within seconds, each naming rank 1, instead of waiting out the 60 s timeout.
#[test]
fn rank_given_twice_fails_every_rank_at_join_naming_it() {
    let port = free_port();
    let common = [
        ("WORLD_SIZE", "3"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", &port),
        ("BURN_DIST_TOKEN", "job"),
        ("BURN_DIST_TIMEOUT_SECS", "60"),
    ];
    let mut ranks: Vec<Launch> = ["0", "1", "1"]
        .into_iter()
        .map(|rank| rank_by_hand(&[&common[..], &[("RANK", rank)]].concat()))
        .collect();
    for rank in &mut ranks {
        let status = rank.wait_exit(within(30));
        assert!(!status.success(), "{}", rank.transcript());
        let named = rank
            .stderr()
            .iter()
            .any(|l| l.contains("rank 1 joined the job twice"));
        assert!(named, "{}", rank.transcript());
    }
}

/// Torchrun-style variables (as under Slurm) with the store on a non-loopback address and no
/// token: refused before anything listens. 192.0.2.1 (TEST-NET-1) is never contacted.
#[test]
fn empty_token_off_loopback_is_refused() {
    let err = fails_fast(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "192.0.2.1"),
        ("MASTER_PORT", "29500"),
    ]);
    assert!(
        err.contains("BURN_DIST_TOKEN is not set, and the store at 192.0.2.1:29500 is reachable")
            && err.contains("export BURN_DIST_TOKEN="),
        "{err}"
    );
}
