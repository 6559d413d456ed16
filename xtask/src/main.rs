//! `cargo xtask <task>`: the project's tasks, one command each, so that the README, CI and
//! developers run exactly the same thing.

use std::process::{Command, ExitCode};

const USAGE: &str = "\
usage: cargo xtask <task>

tasks:
  test          every test of the workspace (what CI runs)
  integration   the multi-process tests only (launcher, real ranks on loopback)
  demo          4 ranks all-reduce and verify 16 MiB through the launcher (release build)
  fuzz [SECS]   fuzz the TCP store's frame decoder for SECS seconds (default 600)
  bench         the criterion benches (figures in target/criterion; see docs/perf/)";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("test") => cargo(&["test", "--workspace", "--all-targets", "--locked"]),
        Some("integration") => cargo(&[
            "test",
            "-p",
            "burn-dist-run",
            "--test",
            "multiprocess",
            "--test",
            "launcher",
        ]),
        Some("demo") => demo(),
        Some("fuzz") => fuzz(args.get(1).map_or("600", String::as_str)),
        Some("bench") => cargo(&["bench", "-p", "burn-dist-benches"]),
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("xtask: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run(command: &mut Command) -> Result<(), String> {
    let shown = format!("{command:?}");
    let status = command
        .status()
        .map_err(|e| format!("cannot run {shown}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{shown} failed: {status}"))
    }
}

fn cargo(args: &[&str]) -> Result<(), String> {
    run(Command::new(env!("CARGO")).args(args))
}

/// The target directory cargo builds into, honouring CARGO_TARGET_DIR.
fn target_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(Into::into)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"))
}

fn demo() -> Result<(), String> {
    cargo(&["build", "--release", "-p", "burn-dist-run", "--bins"])?;
    let bin = target_dir().join("release");
    run(Command::new(bin.join("burn-dist-run"))
        .args(["--nproc-per-node", "4", "--master-port", "0", "--"])
        .arg(bin.join("burn-dist-check"))
        .args(["--mib", "16", "--iters", "20"]))
}

/// cargo-fuzz needs nightly flags; RUSTC_BOOTSTRAP lets the stable toolchain accept them.
fn fuzz(seconds: &str) -> Result<(), String> {
    let has_cargo_fuzz = Command::new(env!("CARGO"))
        .args(["fuzz", "--version"])
        .output();
    if !has_cargo_fuzz.is_ok_and(|o| o.status.success()) {
        cargo(&["install", "cargo-fuzz", "--locked"])?;
    }
    let crate_dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../crates/burn-dist-comm");
    run(Command::new(env!("CARGO"))
        .current_dir(crate_dir)
        .env("RUSTC_BOOTSTRAP", "1")
        .env("CARGO_TARGET_DIR", target_dir().join("fuzz"))
        .args(["fuzz", "run", "store_frame", "--", "-max_len=4096"])
        .arg(format!("-max_total_time={seconds}")))
}
