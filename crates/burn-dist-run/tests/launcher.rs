//! The launcher as users see it: real processes (`sh -c` ranks), real signals, bounded waits.

mod support;

use std::collections::BTreeSet;
use std::os::unix::process::ExitStatusExt;

use support::{DescendantProbe, Launch, within};

/// A master address for multi-node launches: TEST-NET-1, never contacted (the ranks here are
/// shell scripts), and not loopback, which several nodes cannot share.
const REMOTE_MASTER: &str = "192.0.2.1";

/// `burn-dist-run OPTIONS... -- sh -c SCRIPT`.
fn sh<'a>(options: &[&'a str], script: &'a str) -> Vec<&'a str> {
    let mut args = options.to_vec();
    args.extend(["--", "sh", "-c", script]);
    args
}

/// Starts the launcher with a probe that sees every process it starts.
fn spawn_probed(args: &[&str]) -> (Launch, DescendantProbe) {
    let probe = DescendantProbe::new();
    let mut command = Launch::command(args, &[]);
    probe.pass_to(&mut command);
    (Launch::spawn_command(command), probe)
}

/// Waits until every rank in `0..n` has printed `ready`.
fn wait_ready(launch: &mut Launch, n: usize) {
    for rank in 0..n {
        let ready = format!("[rank {rank}] ready");
        launch.wait_for_line(|l| l == ready, within(30)).unwrap();
    }
}

/// The stdout lines of `rank`, without the prefix.
fn lines_of_rank(launch: &Launch, rank: usize) -> Vec<&str> {
    let prefix = format!("[rank {rank}] ");
    let lines = launch.stdout().into_iter();
    lines
        .filter_map(|l| l.strip_prefix(prefix.as_str()))
        .collect()
}

fn stderr_has(launch: &Launch, needle: &str) -> bool {
    launch.stderr().iter().any(|l| l.contains(needle))
}

#[test]
fn env_is_set_for_every_rank() {
    let script = "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK \
                  $MASTER_ADDR $MASTER_PORT $BURN_DIST_TOKEN";
    let mut launch = Launch::spawn(&sh(&["--nproc-per-node", "3"], script), &[]);
    let status = launch.wait_exit(within(30));
    assert!(status.success(), "{status}\n{}", launch.transcript());

    let (mut ports, mut tokens) = (BTreeSet::new(), BTreeSet::new());
    for rank in 0..3 {
        let lines = lines_of_rank(&launch, rank);
        assert_eq!(lines.len(), 1, "rank {rank}\n{}", launch.transcript());
        let fields: Vec<&str> = lines[0].split(' ').collect();
        let r = rank.to_string();
        assert_eq!(fields[..6], [&r, "3", &r, "3", "0", "127.0.0.1"]);
        ports.insert(fields[6].to_owned());
        tokens.insert(fields[7].to_owned());
    }
    assert_eq!(ports, BTreeSet::from(["29500".to_owned()]));
    assert_eq!(tokens.len(), 1, "one token for the whole job: {tokens:?}");
    let token = tokens.first().unwrap();
    assert_eq!(token.len(), 32, "{token}");
    assert!(token.bytes().all(|b| b.is_ascii_hexdigit()), "{token}");
}

/// What each rank of a node should get: `max(1, cores / ranks)`, computed here from the cores
/// this test may use (the launcher it starts inherits the same affinity and quota).
fn expected_share(ranks: usize) -> String {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / ranks).max(1).to_string()
}

/// The lines of the launcher's own stderr that announce the thread share.
fn share_lines(launch: &Launch) -> Vec<&str> {
    let lines = launch.stderr().into_iter();
    lines
        .filter(|l| l.starts_with("burn-dist-run: ") && l.contains("on this host share"))
        .collect()
}

/// A job of 2 ranks on this host, each printing its RAYON_NUM_THREADS and OMP_NUM_THREADS,
/// launched with `env` added, run to a successful end.
fn two_ranks_print_their_thread_counts(env: &[(&str, &str)]) -> Launch {
    let script = "echo $RAYON_NUM_THREADS $OMP_NUM_THREADS";
    let options = ["--nproc-per-node", "2", "--master-port", "0"];
    let mut launch = Launch::spawn(&sh(&options, script), env);
    let status = launch.wait_exit(within(30));
    assert!(status.success(), "{status}\n{}", launch.transcript());
    launch
}

#[test]
fn each_rank_gets_its_share_of_the_cores_and_the_launcher_says_so_once() {
    let launch = two_ranks_print_their_thread_counts(&[]);
    let share = expected_share(2);
    for rank in 0..2 {
        assert_eq!(
            lines_of_rank(&launch, rank),
            [format!("{share} {share}")],
            "rank {rank}\n{}",
            launch.transcript()
        );
    }
    let announced = share_lines(&launch);
    assert_eq!(announced.len(), 1, "{}", launch.transcript());
    let each = format!("each gets {share} thread");
    assert!(announced[0].contains(&each), "{}", announced[0]);
    assert!(
        announced[0].contains(&format!(
            "RAYON_NUM_THREADS={share} OMP_NUM_THREADS={share}"
        )),
        "{}",
        announced[0]
    );
}

#[test]
fn thread_counts_the_user_set_win_over_the_share() {
    let launch = two_ranks_print_their_thread_counts(&[("RAYON_NUM_THREADS", "3")]);
    let share = expected_share(2);
    for rank in 0..2 {
        assert_eq!(
            lines_of_rank(&launch, rank),
            [format!("3 {share}")],
            "rank {rank}: the user's RAYON_NUM_THREADS, the share for OMP_NUM_THREADS\n{}",
            launch.transcript()
        );
    }
    let announced = share_lines(&launch);
    assert_eq!(announced.len(), 1, "{}", launch.transcript());
    assert!(
        announced[0].contains("kept yours: RAYON_NUM_THREADS=3"),
        "{}",
        announced[0]
    );
}

#[test]
fn second_node_runs_the_ranks_after_the_first_nodes() {
    let options = [
        "--master-addr",
        REMOTE_MASTER,
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--nproc-per-node",
        "2",
    ];
    let script = "echo $RANK $WORLD_SIZE $LOCAL_RANK $GROUP_RANK $BURN_DIST_TOKEN";
    let mut launch = Launch::spawn(&sh(&options, script), &[("BURN_DIST_TOKEN", "tok-123")]);
    let status = launch.wait_exit(within(30));
    assert!(status.success(), "{status}\n{}", launch.transcript());
    let mut stdout = launch.stdout();
    stdout.sort();
    assert_eq!(
        stdout,
        ["[rank 2] 2 4 0 1 tok-123", "[rank 3] 3 4 1 1 tok-123"]
    );
}

#[test]
fn multi_node_without_token_is_refused() {
    let options = [
        "--master-addr",
        REMOTE_MASTER,
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--nproc-per-node",
        "2",
    ];
    let mut launch = Launch::spawn(&sh(&options, "echo started"), &[]);
    let status = launch.wait_exit(within(10));
    assert_eq!(status.code(), Some(2), "{}", launch.transcript());
    assert!(
        stderr_has(&launch, "export the same BURN_DIST_TOKEN on every node"),
        "{}",
        launch.transcript()
    );
    assert!(
        launch.stdout().is_empty(),
        "no rank may start\n{}",
        launch.transcript()
    );
}

#[test]
fn port_zero_picks_a_free_port() {
    let options = ["--nproc-per-node", "2", "--master-port", "0"];
    let mut launch = Launch::spawn(&sh(&options, "echo $MASTER_PORT"), &[]);
    let status = launch.wait_exit(within(30));
    assert!(status.success(), "{status}\n{}", launch.transcript());
    let ports: BTreeSet<&str> = (0..2).flat_map(|r| lines_of_rank(&launch, r)).collect();
    assert_eq!(ports.len(), 1, "every rank gets the same port: {ports:?}");
    let port: u16 = ports
        .first()
        .unwrap()
        .parse()
        .expect("MASTER_PORT is a port number");
    assert!(port > 0);
}

#[test]
fn first_failure_stops_the_others_and_is_named() {
    let script = r#"if [ "$RANK" = 1 ]; then exit 3; fi; exec sleep 1000"#;
    let options = ["--nproc-per-node", "4", "--stop-grace-secs", "1"];
    let (mut launch, mut probe) = spawn_probed(&sh(&options, script));

    let status = launch.wait_exit(within(30));
    assert_eq!(status.code(), Some(3), "{}", launch.transcript());
    let first = launch.wait_for_line(|l| l.contains("failed first:"), within(0));
    let first = first.unwrap();
    assert!(first.starts_with("burn-dist-run: rank 1 (pid "), "{first}");
    assert!(
        first.ends_with(": exited with code 3; stopping the other 3 ranks"),
        "{first}"
    );
    assert!(
        stderr_has(&launch, "summary: rank 1 (pid "),
        "{}",
        launch.transcript()
    );
    assert!(
        stderr_has(&launch, "exiting with code 3"),
        "{}",
        launch.transcript()
    );
    probe.wait_all_gone(within(10)).unwrap();
}

#[test]
fn processes_left_behind_by_the_failed_rank_are_stopped_too() {
    // Rank 1's `sleep` outlives its shell and keeps rank 1's output open.
    let script = r#"if [ "$RANK" = 1 ]; then sleep 1000 & exit 3; fi; exec sleep 1000"#;
    let options = ["--nproc-per-node", "2", "--stop-grace-secs", "1"];
    let (mut launch, mut probe) = spawn_probed(&sh(&options, script));
    let status = launch.wait_exit(within(30));
    assert_eq!(status.code(), Some(3), "{}", launch.transcript());
    probe.wait_all_gone(within(10)).unwrap();
}

#[test]
fn processes_left_behind_by_a_successful_rank_are_stopped() {
    let options = ["--stop-grace-secs", "1"];
    let (mut launch, mut probe) = spawn_probed(&sh(&options, "sleep 1000 & echo done"));
    let status = launch.wait_exit(within(30));
    assert!(status.success(), "{status}\n{}", launch.transcript());
    assert_eq!(launch.stdout(), ["[rank 0] done"]);
    assert!(
        stderr_has(&launch, "still hold their output open"),
        "{}",
        launch.transcript()
    );
    probe.wait_all_gone(within(10)).unwrap();
}

#[test]
fn kill_minus_9_of_launcher_kills_children() {
    let script = "echo ready; exec sleep 1000";
    let (mut launch, mut probe) = spawn_probed(&sh(&["--nproc-per-node", "3"], script));
    wait_ready(&mut launch, 3);
    launch.signal(libc::SIGKILL);
    probe.wait_all_gone(within(10)).unwrap();
    let status = launch.wait_exit(within(10));
    assert_eq!(status.signal(), Some(libc::SIGKILL));
}

#[test]
fn sigterm_to_launcher_stops_children_and_exits_143() {
    let script = "echo ready; exec sleep 1000";
    let (mut launch, mut probe) = spawn_probed(&sh(&["--nproc-per-node", "3"], script));
    wait_ready(&mut launch, 3);
    launch.signal(libc::SIGTERM);
    let status = launch.wait_exit(within(30));
    assert_eq!(status.code(), Some(143), "{}", launch.transcript());
    assert!(
        stderr_has(
            &launch,
            "sending SIGTERM to the process groups of ranks 0, 1, 2"
        ),
        "{}",
        launch.transcript()
    );
    probe.wait_all_gone(within(10)).unwrap();
}

#[test]
fn ranks_ignoring_sigterm_are_killed_after_the_grace_period() {
    // An ignored signal stays ignored across exec, so `sleep` ignores SIGTERM too.
    let script = r#"trap "" TERM; echo ready; exec sleep 1000"#;
    let options = ["--nproc-per-node", "2", "--stop-grace-secs", "1"];
    let (mut launch, mut probe) = spawn_probed(&sh(&options, script));
    wait_ready(&mut launch, 2);
    launch.signal(libc::SIGINT);
    let status = launch.wait_exit(within(30));
    assert_eq!(status.code(), Some(130), "{}", launch.transcript());
    assert!(
        stderr_has(&launch, "sending SIGKILL"),
        "{}",
        launch.transcript()
    );
    assert!(
        stderr_has(
            &launch,
            "killed by signal 9 (SIGKILL) (stopped by the launcher with SIGKILL)"
        ),
        "{}",
        launch.transcript()
    );
    probe.wait_all_gone(within(10)).unwrap();
}

#[test]
fn bad_input_is_refused_with_a_clear_message() {
    let cases: [(&[&str], &str); 7] = [
        (
            &["--nnodes", "2", "--node-rank", "2", "--", "true"],
            "--node-rank 2 is out of range",
        ),
        (
            &["--nnodes", "2", "--node-rank", "1", "--", "true"],
            "--master-addr 127.0.0.1 is a loopback address",
        ),
        (&["--nproc-per-node", "2"], "no command to run"),
        (&[], "no command to run"),
        (
            &["--nnodes", "2", "--master-port", "0", "--", "true"],
            "--master-port 0",
        ),
        (
            &["--nproc-per-node", "0", "--", "true"],
            "--nproc-per-node must be at least 1",
        ),
        (
            &["--", "/nonexistent/program"],
            "cannot start rank 0 (`/nonexistent/program`)",
        ),
    ];
    for (args, message) in cases {
        let mut launch = Launch::spawn(args, &[("BURN_DIST_TOKEN", "t")]);
        let status = launch.wait_exit(within(10));
        assert!(!status.success(), "{args:?}\n{}", launch.transcript());
        assert!(
            stderr_has(&launch, message),
            "{args:?}\n{}",
            launch.transcript()
        );
    }
}

#[test]
fn output_is_prefixed_per_stream_and_partial_lines_are_kept() {
    let script = "echo out-$RANK; echo err-$RANK >&2; printf partial-$RANK";
    let mut launch = Launch::spawn(&sh(&["--nproc-per-node", "2"], script), &[]);
    let status = launch.wait_exit(within(30));
    assert!(status.success(), "{status}\n{}", launch.transcript());
    for rank in 0..2 {
        let out = lines_of_rank(&launch, rank);
        assert_eq!(out, [format!("out-{rank}"), format!("partial-{rank}")]);
        let err = format!("[rank {rank}] err-{rank}");
        assert!(
            launch.stderr().contains(&err.as_str()),
            "{}",
            launch.transcript()
        );
    }
    // The ranks' two lines, and the launcher's own announcement of the thread share.
    assert_eq!(share_lines(&launch).len(), 1, "{}", launch.transcript());
    assert_eq!(launch.stderr().len(), 3, "{}", launch.transcript());
}

#[test]
fn lines_of_different_ranks_never_interleave() {
    let pad = "x".repeat(300);
    let script =
        format!(r#"i=0; while [ $i -lt 300 ]; do echo "$RANK-$i-{pad}"; i=$((i+1)); done"#);
    let mut launch = Launch::spawn(&sh(&["--nproc-per-node", "4"], &script), &[]);
    let status = launch.wait_exit(within(60));
    assert!(status.success(), "{status}");
    assert_eq!(launch.stdout().len(), 4 * 300);
    for rank in 0..4 {
        let expected: Vec<String> = (0..300).map(|i| format!("{rank}-{i}-{pad}")).collect();
        assert_eq!(lines_of_rank(&launch, rank), expected, "rank {rank}");
    }
}
