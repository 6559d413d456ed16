//! `DistributedBackend<Flex>` in a world-size-1 group changes nothing: 5 Adam steps of the bench
//! transformer from the deterministic init give bitwise the same parameters as plain
//! `Autodiff<Flex>`, with the reducer fully active (every gradient copied out, all-reduced and
//! written back; `ddp_params` asserts that after every step).
//!
//! Plain `Autodiff<Flex>` cannot be compiled in this workspace (burn-dist turns on Burn's
//! `distributed` feature), so its half is `plain_params` from the separate workspace
//! benches/plain, built here by a nested cargo in its own target dir (`<target>/plain`): the
//! outer cargo may still hold this workspace's build lock, and the two builds must not unify
//! features. Both halves are built with this test's profile.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use burn_dist_models::step::read_params;

const STEPS: &str = "5";
/// A cold build of the plain workspace takes a few minutes on 2 cores; a build that has not
/// finished by then is stuck (or waiting on another cargo) and the test says so.
const BUILD_LIMIT: Duration = Duration::from_secs(30 * 60);
const RUN_LIMIT: Duration = Duration::from_secs(10 * 60);

/// Runs `command` with output captured to files (pipes could fill and block it), killing it
/// after `limit`. Panics with `what` and the end of its output unless it succeeds.
fn run_bounded(mut command: Command, limit: Duration, what: &str, scratch: &Path) {
    let name: String = what
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let log = scratch.join(format!("{name}.log"));
    let file = std::fs::File::create(&log).expect("log file");
    let mut child = command
        .stdout(file.try_clone().expect("log file"))
        .stderr(file)
        .stdin(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{what}: cannot start {command:?}: {e}"));
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break Some(status);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let output = std::fs::read_to_string(&log).unwrap_or_default();
    let tail: String = output
        .lines()
        .rev()
        .take(40)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect::<Vec<_>>()
        .join("\n");
    match status {
        Some(s) if s.success() => eprintln!("{what}: done in {:.1?}", start.elapsed()),
        Some(s) => panic!("{what} failed ({s}): {command:?}\n--- last output ---\n{tail}"),
        None => panic!(
            "{what} did not finish within {limit:?}, killed: {command:?}\n--- last output ---\n{tail}"
        ),
    }
}

/// This build's target dir (honours CARGO_TARGET_DIR): the parent of CARGO_TARGET_TMPDIR.
fn target_dir() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("target dir")
        .to_path_buf()
}

#[test]
fn world_size_1_ddp_is_bitwise_plain_flex_after_5_adam_steps() {
    let scratch = Path::new(env!("CARGO_TARGET_TMPDIR")).join("plain_equivalence");
    std::fs::create_dir_all(&scratch).expect("scratch dir");
    let (ddp_file, init_file, plain_file) = (
        scratch.join("ddp.bin"),
        scratch.join("init.bin"),
        scratch.join("plain.bin"),
    );

    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| env!("CARGO").into());
    let plain_target = target_dir().join("plain");
    let release = !cfg!(debug_assertions);
    let mut build = Command::new(cargo);
    build
        .args([
            "build",
            "--locked",
            "--bin",
            "plain_params",
            "--manifest-path",
        ])
        .arg(
            std::path::PathBuf::from(
                std::env::var_os("CARGO_MANIFEST_DIR")
                    .expect("cargo sets CARGO_MANIFEST_DIR when it runs a test"),
            )
            .join("plain/Cargo.toml"),
        )
        .env("CARGO_TARGET_DIR", &plain_target);
    if release {
        build.arg("--release");
    }
    run_bounded(build, BUILD_LIMIT, "building benches/plain", &scratch);

    let profile = if release { "release" } else { "debug" };
    let mut plain = Command::new(plain_target.join(profile).join("plain_params"));
    plain.arg(&plain_file).arg(STEPS);
    run_bounded(plain, RUN_LIMIT, "plain_params", &scratch);
    let mut ddp = Command::new(env!("CARGO_BIN_EXE_ddp_params"));
    ddp.arg(&ddp_file).arg(STEPS);
    run_bounded(ddp, RUN_LIMIT, "ddp_params", &scratch);
    let mut init = Command::new(env!("CARGO_BIN_EXE_ddp_params"));
    init.arg(&init_file).arg("0");
    run_bounded(init, RUN_LIMIT, "ddp_params at step 0", &scratch);

    let read = |p: &Path| read_params(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let (plain, ddp, init) = (read(&plain_file), read(&ddp_file), read(&init_file));
    assert_ne!(ddp, init, "the steps must have changed the parameters");
    assert_eq!(plain.len(), ddp.len(), "tensor count differs");
    for (i, (p, d)) in plain.iter().zip(&ddp).enumerate() {
        assert_eq!(p.len(), d.len(), "tensor {i} (visit order) differs in size");
        let differing: Vec<usize> = (0..p.len())
            .filter(|&j| p[j].to_bits() != d[j].to_bits())
            .collect();
        if let Some(&j) = differing.first() {
            panic!(
                "tensor {i} (visit order, {} elements) differs in {} elements; first at {j}: \
                 plain {:e} vs ddp {:e}; relative error of the tensor {:e}",
                p.len(),
                differing.len(),
                p[j],
                d[j],
                burn_dist_models::relative_error(d, p),
            );
        }
    }
}
