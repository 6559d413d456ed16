//! Scaffolding of the real-process tests (the launcher and the example programs on loopback):
//! where the launcher is, scratch directories, parameter files, and watching a job's output
//! line by line with a bound, so that no test waits forever or sleeps.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use burn_dist_comm::store::StoreClient;
use burn_dist_comm::testing::{TEST_TOKEN, test_store};
use burn_dist_comm::{CommConfig, HostCommunicator};

/// `burn-dist-run`, built by the same `cargo test --workspace` next to the test's binary.
pub fn launcher() -> PathBuf {
    workspace_binary("burn-dist-run")
}

/// A binary of the workspace (`burn-dist-run`, `burn-dist-check`, …), built by the same
/// `cargo test --workspace` next to the test's binary.
pub fn workspace_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target dir");
    let binary = dir.join(name);
    assert!(
        binary.exists(),
        "{} is missing: build it first (`cargo xtask test` and `cargo xtask integration` do)",
        binary.display()
    );
    binary
}

/// `burn-dist-run --nproc-per-node NPROC --master-port 0 -- PROGRAM`, each collective bounded
/// to 60 s: add the program's arguments.
pub fn launch_command(nproc: usize, program: &Path) -> std::process::Command {
    let mut command = std::process::Command::new(launcher());
    command
        .args([
            "--nproc-per-node",
            &nproc.to_string(),
            "--master-port",
            "0",
            "--",
        ])
        .arg(program)
        .env("BURN_DIST_TIMEOUT_SECS", "60");
    command
}

/// A fresh, empty directory for one test.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-dist-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The little-endian f32 values of a parameter file written with `--out`.
pub fn read_f32s(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// When `line` holds `announce` followed by a pid and `)` (a program's "paused at … (pid N)"),
/// kills that process with SIGKILL, as a crash would, and returns true.
pub fn kill_announced(line: &str, announce: &str) -> bool {
    let Some(at) = line.find(announce) else {
        return false;
    };
    let pid: i32 = line[at + announce.len()..]
        .trim_end_matches(')')
        .parse()
        .unwrap_or_else(|e| panic!("no pid after {announce:?} in {line:?}: {e}"));
    // SAFETY: kill(2) on a pid the child announced; no memory is touched.
    assert_eq!(
        unsafe { libc::kill(pid, libc::SIGKILL) },
        0,
        "kill -9 {pid}"
    );
    true
}

/// Reads every line `child` writes on its piped stdout and stderr (whichever are piped),
/// calling `on_line` as each arrives, until both close; then waits for it. Kills it and panics
/// with the transcript when no line arrives for `quiet`. Returns the exit status and every line.
pub fn watch(
    child: &mut Child,
    quiet: Duration,
    mut on_line: impl FnMut(&str),
) -> (ExitStatus, Vec<String>) {
    let mut ended = watch_all(std::slice::from_mut(child), quiet, |_, line| {
        on_line(line);
        false
    });
    ended.remove(0)
}

/// `burn-dist-run --nproc-per-node <nproc> --master-port 0 --stop-grace-secs 2 -- <program>`,
/// with a 60 s collective timeout; the caller adds the program's arguments.
pub fn launch(nproc: usize, program: &Path) -> std::process::Command {
    let mut command = std::process::Command::new(launcher());
    command
        .args(["--nproc-per-node", &nproc.to_string()])
        .args(["--master-port", "0", "--stop-grace-secs", "2", "--"])
        .arg(program)
        .env("BURN_DIST_TIMEOUT_SECS", "60");
    command
}

/// [`watch`] for several processes at once (the launchers of the nodes of one job): calls
/// `on_line(who, line)` with every line child `who` writes on its piped streams, as it arrives,
/// and kills child `who` (SIGKILL) when it returns true; until every stream has closed, then
/// waits for them all. Kills them all and panics with the transcripts when no line arrives for
/// `quiet`. Returns each child's exit status and lines.
pub fn watch_all(
    children: &mut [Child],
    quiet: Duration,
    mut on_line: impl FnMut(usize, &str) -> bool,
) -> Vec<(ExitStatus, Vec<String>)> {
    let (lines, seen) = mpsc::channel();
    for (who, child) in children.iter_mut().enumerate() {
        let streams: [Option<Box<dyn Read + Send>>; 2] = [
            child.stdout.take().map(|s| Box::new(s) as _),
            child.stderr.take().map(|s| Box::new(s) as _),
        ];
        for stream in streams.into_iter().flatten() {
            let lines = lines.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    if lines.send((who, line)).is_err() {
                        break;
                    }
                }
            });
        }
    }
    drop(lines);
    let mut transcripts = vec![Vec::new(); children.len()];
    loop {
        match seen.recv_timeout(quiet) {
            Ok((who, line)) => {
                if on_line(who, &line) {
                    let _ = children[who].kill();
                }
                transcripts[who].push(line);
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                children.iter_mut().for_each(|c| _ = c.kill());
                panic!("no output for {quiet:?}:\n{transcripts:#?}");
            }
        }
    }
    let statuses = children
        .iter_mut()
        .map(|c| c.wait().expect("waiting for a child"));
    statuses.zip(transcripts).collect()
}

/// [`watch_all`] for an elastic job that loses a node: kills (SIGKILL) the first node whose
/// output has a line starting with `announce`, and returns every node's exit status and lines,
/// and which node it killed. Panics with the transcripts when no node announced.
pub fn watch_all_killing_first(
    children: &mut [Child],
    quiet: Duration,
    announce: &str,
) -> (Vec<(ExitStatus, Vec<String>)>, usize) {
    let mut victim = None;
    let ended = watch_all(children, quiet, |who, line| {
        let kill = victim.is_none() && line.starts_with(announce);
        if kill {
            victim = Some(who);
        }
        kill
    });
    let victim = victim.unwrap_or_else(|| panic!("no node wrote `{announce}`:\n{ended:#?}"));
    (ended, victim)
}

/// Every node but `victim` succeeded after two rendezvous rounds, the first at world size
/// `first_world` and the second at `first_world - 1` (each node runs one rank), and wrote no
/// terminal colour codes.
pub fn assert_survivors_met_again(
    ended: &[(ExitStatus, Vec<String>)],
    victim: usize,
    first_world: usize,
) {
    let round = "burn-dist-run: rendezvous: this is node ";
    for (who, (status, lines)) in ended.iter().enumerate() {
        if who == victim {
            continue;
        }
        assert!(status.success(), "node {who}: {status}\n{lines:#?}");
        // A launcher's output goes to pipes and log files: the ranks' logs (here the
        // survivors' errors about the lost peer) must carry no terminal colour codes.
        let coloured: Vec<&String> = lines.iter().filter(|l| l.contains('\u{1b}')).collect();
        assert!(
            coloured.is_empty(),
            "node {who}: colour codes in {coloured:#?}"
        );
        let rounds: Vec<&String> = lines.iter().filter(|l| l.starts_with(round)).collect();
        assert_eq!(rounds.len(), 2, "node {who}: {lines:#?}");
        for (r, world) in rounds.iter().zip([first_world, first_world - 1]) {
            let expected = format!(" of {world} (world size {world})");
            assert!(r.contains(&expected), "node {who}: {r}");
        }
    }
}

/// Runs `command` (a program or the launcher with its ranks) with `RUST_LOG=info` and its
/// stdout and stderr redirected to files under `dir`, as a launcher or a batch system does.
/// Asserts that it succeeds, that its logs reached the file (a line with `INFO`, so that the
/// check below has something to look at), and that neither file holds an escape byte:
/// colour codes belong on a terminal only. Returns the stderr file's text.
pub fn assert_plain_logs(mut command: std::process::Command, dir: &Path, what: &str) -> String {
    let (out, err) = (
        dir.join(format!("{what}.stdout")),
        dir.join(format!("{what}.stderr")),
    );
    let file = |path: &Path| std::fs::File::create(path).expect("creating a log file");
    let status = command
        .env("RUST_LOG", "info")
        .env_remove("NO_COLOR")
        .stdout(file(&out))
        .stderr(file(&err))
        .status()
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let read = |path: &Path| std::fs::read(path).expect("reading a log file");
    let (stdout, stderr) = (read(&out), read(&err));
    let text = String::from_utf8_lossy(&stderr).into_owned();
    assert!(
        status.success(),
        "{what}: {status}\n{}{text}",
        String::from_utf8_lossy(&stdout)
    );
    assert!(
        text.lines().any(|l| l.contains("INFO")),
        "{what}: no log line reached stderr:\n{text}"
    );
    for (name, bytes) in [("stdout", &stdout), ("stderr", &stderr)] {
        assert!(
            !bytes.contains(&0x1b),
            "{what}: an escape byte in its {name}:\n{}",
            String::from_utf8_lossy(bytes)
        );
    }
    text
}

/// Set in the children of [`run_this_test_as_ranks`]: the child's rank, the world size, and
/// the store to join.
const TEST_RANK_VAR: &str = "BURN_DIST_TEST_RANK";
const TEST_WORLD_VAR: &str = "BURN_DIST_TEST_WORLD";
const TEST_STORE_VAR: &str = "BURN_DIST_TEST_STORE";

/// Runs test `test` of this test binary again in `world` child processes, one rank each, which
/// join through a store this process hosts ([`join_as_test_rank`] in the test), with `env`
/// added: ranks that share no autodiff graph, no allocator and no thread, as under a launcher.
/// Watched as [`watch_all`], with `quiet`; returns each rank's exit status and lines.
pub fn run_this_test_as_ranks(
    test: &str,
    world: usize,
    config: &CommConfig,
    env: &[(&str, &str)],
    quiet: Duration,
) -> Vec<(ExitStatus, Vec<String>)> {
    let store = test_store(world, config);
    let mut children: Vec<Child> = (0..world)
        .map(|rank| {
            this_test_again(test)
                .env(TEST_RANK_VAR, rank.to_string())
                .env(TEST_WORLD_VAR, world.to_string())
                .env(TEST_STORE_VAR, store.local_addr().to_string())
                .envs(env.iter().copied())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("starting a rank of this test")
        })
        .collect();
    let ended = watch_all(&mut children, quiet, |_, _| false);
    drop(store);
    ended
}

/// A command that runs test `test` (its full path) of this test binary again, alone, in a
/// child process: `--exact`, its output not captured, one test thread.
pub fn this_test_again(test: &str) -> std::process::Command {
    let mut command =
        std::process::Command::new(std::env::current_exe().expect("this test binary"));
    command.args(["--exact", test, "--nocapture", "--test-threads", "1"]);
    command
}

/// In a child of [`run_this_test_as_ranks`]: its rank and its communicator, joined with
/// `config`; `None` when the test runs as itself (it has nothing to do then).
pub fn join_as_test_rank(config: &CommConfig) -> Option<(usize, HostCommunicator)> {
    let var = |name: &str| std::env::var(name).ok();
    let rank: usize = var(TEST_RANK_VAR)?.parse().expect("a rank");
    let world: usize = var(TEST_WORLD_VAR)?.parse().expect("a world size");
    let store = var(TEST_STORE_VAR)?.parse().expect("the store's address");
    let client = StoreClient::connect(store, TEST_TOKEN, rank, config).expect("joining the store");
    let comm = burn_dist_comm::connect(rank, world, &client, TEST_TOKEN, config)
        .expect("joining the mesh");
    Some((rank, comm))
}
