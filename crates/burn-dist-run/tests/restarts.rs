//! `--max-restarts` and `--local-ranks-filter` with `sh -c` ranks: which start a rank is told it
//! is in, when the launcher stops restarting, the exit summary, and where hidden output goes.
//! The restart of a real training job is tested in examples/synthetic-ddp/tests/restarts.rs.

mod support;

use support::{Launch, within};

/// `burn-dist-run OPTIONS... -- sh -c SCRIPT`.
fn sh<'a>(options: &[&'a str], script: &'a str) -> Vec<&'a str> {
    let mut args = options.to_vec();
    args.extend(["--", "sh", "-c", script]);
    args
}

/// How many lines of the launcher's stderr contain `needle`.
fn count(launch: &Launch, needle: &str) -> usize {
    launch
        .stderr()
        .iter()
        .filter(|l| l.contains(needle))
        .count()
}

/// Both ranks fail in the first two starts (each line naming its own pid, as a crash from
/// outside would leave different traces) and succeed in the third, which they know from
/// BURN_DIST_RESTART_COUNT.
#[test]
fn ranks_are_told_the_restart_and_the_job_finishes_after_two_restarts() {
    let script = r#"echo "rank $RANK start $BURN_DIST_RESTART_COUNT (pid $$)" >&2
        [ "$BURN_DIST_RESTART_COUNT" = 2 ] || exit 1"#;
    let options = ["--nproc-per-node", "2", "--max-restarts", "3"];
    let mut launch = Launch::spawn(&sh(&options, script), &[]);
    let status = launch.wait_exit(within(60));
    assert!(status.success(), "{}", launch.transcript());
    for start in 0..3 {
        for rank in 0..2 {
            let line = format!("[rank {rank}] rank {rank} start {start} (pid ");
            assert_eq!(count(&launch, &line), 1, "{}", launch.transcript());
        }
    }
    assert_eq!(count(&launch, "restart 1 of at most 3: rank "), 1);
    assert_eq!(count(&launch, "restart 2 of at most 3: rank "), 1);
    let summary: Vec<&str> = launch
        .stderr()
        .into_iter()
        .filter(|l| l.starts_with("burn-dist-run: summary: "))
        .filter(|l| !l.contains("summary: rank "))
        .collect();
    assert_eq!(summary.len(), 4, "{}", launch.transcript());
    assert!(summary[0].ends_with("3 starts, 2 restarts of at most 3"));
    assert!(
        summary[1].contains("summary: first start: rank ")
            && summary[1].contains("failed first: exited with code 1 (last error line: `rank ")
            && summary[1].ends_with("; restarted"),
        "{}",
        summary[1]
    );
    assert!(summary[2].contains("summary: restart 1: rank "));
    assert!(summary[3].ends_with("summary: restart 2: succeeded"));
}

/// A rank that fails the same way twice (same rank, same code, same last line) is not started
/// a third time, whatever restarts are left: the launcher names the failure and exits with it.
#[test]
fn a_failure_that_repeats_itself_stops_the_restarts() {
    let script = r#"echo "error: no such file: data.bin" >&2; exit 3"#;
    let options = ["--max-restarts", "5"];
    let mut launch = Launch::spawn(&sh(&options, script), &[]);
    let status = launch.wait_exit(within(60));
    assert_eq!(status.code(), Some(3), "{}", launch.transcript());
    assert_eq!(
        count(&launch, "[rank 0] error: no such file: data.bin"),
        2,
        "started twice, no more:\n{}",
        launch.transcript()
    );
    let named = "failed the same way as the start before (same rank, same end, same last \
                 error line): not restarting";
    assert_eq!(count(&launch, named), 2, "{}", launch.transcript());
    assert_eq!(
        count(
            &launch,
            "(last error line: `error: no such file: data.bin`)"
        ),
        3,
        "the restart notice and both summary lines quote it:\n{}",
        launch.transcript()
    );
    assert_eq!(count(&launch, "exiting with code 3"), 1);
}

/// A rank that ends in a panic with its backtrace (as Rust's hook writes it under
/// `RUST_BACKTRACE=1`): the restart notice and the summary quote the panic's message, not the
/// backtrace's closing note, which ends every panic alike.
#[test]
fn the_restart_line_quotes_a_panics_message_not_its_backtrace() {
    let script = r#"printf '%s\n' "thread 'main' panicked at src/main.rs:3:5:" \
            "rank $RANK start $BURN_DIST_RESTART_COUNT: the real error" 'stack backtrace:' \
            '   0: __rustc::rust_begin_unwind' \
            '             at /rustc/1/library/std/src/panicking.rs:697:5' \
            'note: Some details are omitted, run with `RUST_BACKTRACE=full` for a verbose backtrace.' >&2
        [ "$BURN_DIST_RESTART_COUNT" = 1 ] || exit 101"#;
    let mut launch = Launch::spawn(&sh(&["--max-restarts", "1"], script), &[]);
    let status = launch.wait_exit(within(60));
    assert!(status.success(), "{}", launch.transcript());
    let quoted =
        "failed first: exited with code 101 (last error line: `rank 0 start 0: the real error`)";
    assert_eq!(
        count(&launch, quoted),
        2,
        "the restart notice and the summary quote the message:\n{}",
        launch.transcript()
    );
    assert_eq!(count(&launch, "(last error line: `note: "), 0);
}

/// Without `--max-restarts`, a failure ends the job as before.
#[test]
fn no_restart_without_max_restarts() {
    let mut launch = Launch::spawn(&sh(&[], "echo once >&2; exit 4"), &[]);
    assert_eq!(launch.wait_exit(within(30)).code(), Some(4));
    assert_eq!(
        count(&launch, "[rank 0] once"),
        1,
        "{}",
        launch.transcript()
    );
    assert_eq!(count(&launch, "restart"), 0, "{}", launch.transcript());
}

/// `--local-ranks-filter 1`: rank 1's output is shown, rank 0's goes to its log file.
#[test]
fn filtered_ranks_write_to_their_log_files() {
    let dir = std::env::temp_dir().join(format!("burn-dist-run-logs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let log_dir = dir.to_str().unwrap();
    let options = [
        "--nproc-per-node",
        "2",
        "--local-ranks-filter",
        "1",
        "--log-dir",
        log_dir,
    ];
    let script = r#"echo "out $RANK"; echo "err $RANK" >&2"#;
    let mut launch = Launch::spawn(&sh(&options, script), &[]);
    assert!(
        launch.wait_exit(within(30)).success(),
        "{}",
        launch.transcript()
    );
    assert_eq!(
        launch.stdout(),
        ["[rank 1] out 1"],
        "{}",
        launch.transcript()
    );
    assert_eq!(
        count(&launch, "[rank 1] err 1"),
        1,
        "{}",
        launch.transcript()
    );
    assert_eq!(count(&launch, "[rank 0]"), 0, "{}", launch.transcript());
    assert_eq!(count(&launch, "the output of rank 0 goes to "), 1);
    let log = std::fs::read_to_string(dir.join("attempt-0").join("rank-0.log")).unwrap();
    let mut lines: Vec<&str> = log.lines().collect();
    lines.sort();
    assert_eq!(lines, ["err 0", "out 0"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A launcher of an elastic job waiting at the rendezvous for nodes that do not come leaves at
/// once when signalled, instead of waiting out the join timeout.
#[test]
fn a_signal_ends_the_wait_at_the_rendezvous() {
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = probe.local_addr().unwrap().port().to_string();
    drop(probe);
    let options = ["--nnodes", "2:3", "--master-port", &port];
    let mut launch = Launch::spawn(&sh(&options, "true"), &[("BURN_DIST_TOKEN", "t")]);
    let hosting = |l: &str| l.starts_with("burn-dist-run: hosting the elastic rendezvous on ");
    launch.wait_for_line(hosting, within(30)).unwrap();
    launch.signal(libc::SIGTERM);
    assert_eq!(launch.wait_exit(within(10)).code(), Some(143));
    assert_eq!(
        count(
            &launch,
            "the launcher received SIGTERM while waiting at the rendezvous"
        ),
        1
    );
}
