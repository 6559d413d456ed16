//! `cargo xtask <task>`: the project's tasks, one command each, so that the README, CI and
//! developers run exactly the same thing.

use std::process::{Command, ExitCode};

mod checkpoint_bench;
mod collectives_bench;
mod gpt;
mod gpu_check;
mod host_step;
mod kernel_pack;
mod mutants;
mod prerequisites;
mod zero3_bench;

const USAGE: &str = "\
usage: cargo xtask <task>

tasks:
  pretrain [ARGS]
                the README's main command: 2 processes pretrain the tiny GPT on the
                synthetic corpus through the launcher (release; extra ARGS go to
                gpt-pretrain; see docs/gpt-pretrain.md)
  test          every test of the workspace (what CI runs); installs Mesa's lavapipe
                (Vulkan on the CPU, for the kernel tests) with apt-get if it is missing;
                then the packaging check (`package`)
  package       `cargo package` of the library crates, together (they depend on each
                other and are unpublished), each verified by a build of its own
                (docs/testing.md, Packaging)
  rehearse      the README's two commands as a newcomer runs them: a fresh clone in a
                fresh Debian root (debootstrap + chroot) with only the Rust toolchain
                and an empty cargo home (root; ~30 min; see docs/testing.md)
  integration   the multi-process tests only (launcher, real ranks on loopback)
  mutants [--shard K/N] [GROUP...]
                cargo-mutants on the files behind the claims (groups: scaler,
                checkpoint-reader, zero-adam, reducer, kernels-reference, kernels-gpu;
                default all, hours on 2 cores: run a group, or the K-th of N slices of
                it, at a time; installs cargo-mutants; docs/testing.md)
  demo          2 processes train a transformer block data-parallel through the launcher
                (release build; the smallest end-to-end run)
  fuzz [SECS]   fuzz the TCP store's frame decoder for SECS seconds (default 600)
  bench         the criterion benches (figures in target/criterion; see docs/perf/)
  soak [SECS]   8 ranks × 1000 small GPT steps: no hang, resident memory flat (release);
                then random rank kills in a 3-process job for SECS (default 600): every
                process ends naming the dead rank, the resume is bitwise (see docs/testing.md)
  gpu-check [--cuda-version NNNNN] | --import-pack DIR
                build the GPU device check (release, CUDA feature) into target-gpu/ and
                print the device command that runs it; or check the kernel pack a device
                call returned and put it where it is committed (see docs/gpu.md)
  bench-overhead [ROUNDS]
                DDP overhead at world size 1: the same transformer step on plain
                Autodiff<Flex> and under DDP, interleaved ROUNDS times (default 6), release
                (see docs/perf/ddp-overhead.md)
  bench-host-step [--rounds N] [--sizes N,..] [--threads T,..] [--reps R]
                ZeroAdam's host step (vectorized, multi-threaded) beside PyTorch's CPU
                AdamW (foreach and fused), same sizes and threads, alternately N times
                (default 3); installs torch from PyPI into a venv when missing; never in
                CI (see docs/perf/host-step.md)
  bench-collectives
                the host collectives (all-reduce, all-gather; shared memory and TCP)
                beside memcpy and PyTorch's gloo, in one run; installs torch from PyPI
                into a venv when missing; never in CI (docs/perf/host-all-reduce.md)
  bench-zero3 [--steps N] [--rounds R]
                the GPT-2 124M shape on 4 ranks: peak memory per rank and step time of
                Burn's AdamW, ZeroAdam stages 1, 2 and 3, and PyTorch FSDP2 (torch from
                PyPI in a venv), one after the other; with --rounds R, only stage 2,
                stage 3 and FSDP2, alternately R times, each round's ratios and their
                medians; never in CI (docs/perf/zero3.md)
  bench-checkpoint [--steps N] [--every K] [--rounds R] [--zero-stage S]
                the GPT-2 124M shape on 4 ranks: the step time a checkpoint costs, saved
                synchronously and in the background (--checkpoint-async), beside no
                checkpoint, in rotated rounds; never in CI (docs/perf/checkpoint.md)";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("test") => prerequisites::ensure_vulkan_driver()
            .and_then(|()| cargo(&["test", "--workspace", "--all-targets", "--locked"]))
            .and_then(|()| package()),
        Some("package") => package(),
        Some("integration") => integration(),
        Some("mutants") => mutants::mutants(&args[1..]),
        Some("rehearse") => run(Command::new("bash")
            .arg(workspace_root().join("xtask/rehearse.sh"))
            .args(&args[1..])),
        Some("demo") => demo(),
        Some("fuzz") => fuzz(args.get(1).map_or("600", String::as_str)),
        Some("bench") => prerequisites::ensure_vulkan_driver()
            .and_then(|()| cargo(&["bench", "-p", "burn-dist-benches"])),
        Some("gpu-check") => gpu_check::gpu_check(&args[1..]),
        Some("bench-host-step") => host_step::bench_host_step(&args[1..]),
        Some("bench-zero3") => zero3_bench::bench_zero3(&args[1..]),
        Some("bench-checkpoint") => checkpoint_bench::bench_checkpoint(&args[1..]),
        Some("bench-collectives") => collectives_bench::bench_collectives(&args[1..]),
        Some("pretrain") => gpt::pretrain(&args[1..]),
        Some("soak") => gpt::soak().and_then(|()| chaos(args.get(1).map_or("600", String::as_str))),
        Some("bench-overhead") => match args.get(1).map_or(Ok(6), |r| r.parse::<usize>()) {
            Ok(rounds) if rounds > 0 => bench_overhead(rounds),
            _ => Err("bench-overhead: ROUNDS must be a positive number".into()),
        },
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

/// The workspace this run of xtask belongs to. Read when it runs (`cargo run` sets
/// CARGO_MANIFEST_DIR), not when it was compiled: a target dir shared by two checkouts reuses
/// one xtask binary for both, whose compiled-in path names the other checkout (seen 2026-12-02,
/// when `cargo xtask mutants` cloned a checkout that no longer existed).
fn workspace_root() -> std::path::PathBuf {
    let xtask_dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into());
    xtask_dir
        .parent()
        .map_or_else(|| xtask_dir.join(".."), std::path::Path::to_path_buf)
}

/// The target directory cargo builds into, honouring CARGO_TARGET_DIR.
fn target_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(Into::into)
        .unwrap_or_else(|| workspace_root().join("target"))
}

/// The crates meant for crates.io, packaged in one `cargo package` so that each one's path
/// dependencies on the others resolve to the packages being made.
const PUBLISHED: [&str; 6] = [
    "burn-dist-comm",
    "burn-dist-device",
    "burn-dist-kernels",
    "burn-dist",
    "burn-dist-zero",
    "burn-dist-run",
];

/// `cargo package` of [`PUBLISHED`], each verified by building it from its `.crate` in the
/// shared target dir (measured on 2 shared cores: 2.3 min cold, 25 s warm). It checks that every
/// dependency has a version, that the metadata crates.io requires is there, that the packaged
/// files build on their own, and that no dependency outside dev-dependencies is unpublished.
/// `--allow-dirty`: a developer runs it with uncommitted work.
fn package() -> Result<(), String> {
    forget_earlier_packages()?;
    let mut args = vec!["package", "--locked", "--allow-dirty"];
    for name in PUBLISHED {
        args.extend(["-p", name]);
    }
    cargo(&args)
}

/// Makes cargo unpack and build [`PUBLISHED`] afresh when it verifies them.
///
/// To verify a crate against the others, cargo puts them in a temporary registry, unpacks each
/// into `$CARGO_HOME/registry/src/<that registry>/<name>-<version>` and builds it into the
/// shared target dir. Cargo takes a registry crate of a given version to be immutable: it skips
/// the unpacking when that directory exists and the build when one of that version exists. Our
/// version does not change between commits, so without this a dependent crate is verified
/// against the sources of the last packaging (CI failed this way when burn-dist-zero called a
/// method burn-dist had just gained).
fn forget_earlier_packages() -> Result<(), String> {
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| std::path::Path::new(&home).join(".cargo")))
        .ok_or("neither CARGO_HOME nor HOME is set")?;
    // An unpacked crates.io crate of the same name would be unpacked again from cargo's
    // download cache, so removing every match is safe.
    for registry in entries(&cargo_home.join("registry/src")) {
        for unpacked in entries(&registry) {
            if is_unpacked_published_crate(&unpacked) {
                remove_dir(&unpacked)?;
            }
        }
    }
    // Builds are found through rustc's dep-info (`deps/<crate>-<hash>.d`, which names the
    // sources): the ones built from a registry lose their fingerprint
    // (`.fingerprint/<name>-<hash>`), so cargo builds them again.
    let debug = target_dir().join("debug");
    for dep_info in entries(&debug.join("deps")) {
        let Some(stem) = dep_info
            .extension()
            .filter(|ext| *ext == "d")
            .and(dep_info.file_stem())
            .map(|stem| stem.to_string_lossy().into_owned())
        else {
            continue;
        };
        let Some((crate_name, hash)) = stem.rsplit_once('-') else {
            continue;
        };
        let Some(name) = PUBLISHED
            .iter()
            .find(|name| name.replace('-', "_") == crate_name)
        else {
            continue;
        };
        let from_a_registry = std::fs::read_to_string(&dep_info)
            .is_ok_and(|sources| sources.contains("/registry/src/"));
        let fingerprint = debug.join(".fingerprint").join(format!("{name}-{hash}"));
        if from_a_registry && fingerprint.exists() {
            remove_dir(&fingerprint)?;
        }
    }
    Ok(())
}

/// The entries of a directory; none when it cannot be read (it was never made).
fn entries(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .map(|entries| entries.flatten().map(|entry| entry.path()).collect())
        .unwrap_or_default()
}

/// Whether `path` is named `<one of PUBLISHED>-<version>`.
fn is_unpacked_published_crate(path: &std::path::Path) -> bool {
    let Some(name) = path.file_name() else {
        return false;
    };
    let name = name.to_string_lossy();
    PUBLISHED.iter().any(|crate_name| {
        name.strip_prefix(crate_name)
            .and_then(|rest| rest.strip_prefix('-'))
            .is_some_and(|version| version.starts_with(|c: char| c.is_ascii_digit()))
    })
}

fn remove_dir(dir: &std::path::Path) -> Result<(), String> {
    std::fs::remove_dir_all(dir).map_err(|e| format!("removing {}: {e}", dir.display()))
}

fn demo() -> Result<(), String> {
    cargo(&[
        "build",
        "--release",
        "-p",
        "burn-dist-run",
        "-p",
        "synthetic-ddp",
        "--bins",
    ])?;
    let bin = target_dir().join("release");
    run(Command::new(bin.join("burn-dist-run"))
        .args(["--nproc-per-node", "2", "--master-port", "0", "--"])
        .arg(bin.join("synthetic-ddp"))
        .args([
            "--model",
            "transformer",
            "--steps",
            "100",
            "--global-batch",
            "16",
        ]))
}

/// The tests that start real processes: the launcher's own, host collectives between ranks,
/// and training through the launcher (the examples, burn-train's Learner, crash and resume).
fn integration() -> Result<(), String> {
    cargo(&["build", "-p", "burn-dist-run", "--bins"])?;
    cargo(&[
        "test",
        "-p",
        "burn-dist-run",
        "--test",
        "multiprocess",
        "--test",
        "launcher",
        "--test",
        "restarts",
        "--test",
        "torchrun",
    ])?;
    cargo(&[
        "test",
        "-p",
        "synthetic-ddp",
        "--test",
        "launched",
        "--test",
        "checkpoint_crash",
        "--test",
        "chaos",
        "--test",
        "checkpoint_disk",
        "--test",
        "restarts",
        "--test",
        "elastic",
    ])?;
    cargo(&[
        "test",
        "-p",
        "gpt-pretrain",
        "--test",
        "equivalence",
        "--test",
        "resume",
        "--test",
        "elastic",
    ])?;
    cargo(&["test", "-p", "learner-ddp", "--test", "learner_launched"])
}

/// The long chaos test: random SIGKILLs of a rank of a 3-process job for `seconds`.
fn chaos(seconds: &str) -> Result<(), String> {
    cargo(&["build", "-p", "burn-dist-run", "--bins"])?;
    run(Command::new(env!("CARGO"))
        .args(["test", "-p", "synthetic-ddp", "--test", "chaos", "--"])
        .args(["--ignored", "--exact", "chaos_long", "--nocapture"])
        .env("BURN_DIST_CHAOS_SECS", seconds))
}

/// cargo-fuzz needs nightly flags; RUSTC_BOOTSTRAP lets the stable toolchain accept them.
fn fuzz(seconds: &str) -> Result<(), String> {
    let has_cargo_fuzz = Command::new(env!("CARGO"))
        .args(["fuzz", "--version"])
        .output();
    if !has_cargo_fuzz.is_ok_and(|o| o.status.success()) {
        cargo(&["install", "cargo-fuzz", "--locked"])?;
    }
    let crate_dir = workspace_root().join("crates/burn-dist-comm");
    run(Command::new(env!("CARGO"))
        .current_dir(crate_dir)
        .env("RUSTC_BOOTSTRAP", "1")
        .env("CARGO_TARGET_DIR", target_dir().join("fuzz"))
        .args(["fuzz", "run", "store_frame", "--", "-max_len=4096"])
        .arg(format!("-max_total_time={seconds}")))
}

/// Builds a criterion bench without running it and returns its executable. `plain` builds the
/// reference workspace benches/plain in its own target dir: it must never share a build (and so
/// features) with this workspace, which turns on Burn's `distributed`.
fn build_bench(plain: bool, bench: &str) -> Result<std::path::PathBuf, String> {
    let mut command = Command::new(env!("CARGO"));
    command.args(["bench", "--locked", "--no-run", "--bench", bench]);
    command.args(["--message-format", "json-render-diagnostics"]);
    if plain {
        command.arg("--manifest-path").arg(plain_manifest());
        command.env("CARGO_TARGET_DIR", target_dir().join("plain"));
    } else {
        command.args(["-p", "burn-dist-benches"]);
    }
    let shown = format!("{command:?}");
    let output = command
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run {shown}: {e}"))?;
    if !output.status.success() {
        return Err(format!("{shown} failed: {}", output.status));
    }
    // One JSON object per line; the bench's artifact line carries its "executable" path.
    let stdout = String::from_utf8_lossy(&output.stdout);
    stdout
        .lines()
        .filter(|l| l.contains(r#""reason":"compiler-artifact""#))
        .filter(|l| l.contains(&format!(r#""name":"{bench}""#)))
        .find_map(|l| json_string(l, "executable"))
        .map(Into::into)
        .ok_or_else(|| format!("{shown} reported no executable for bench {bench}"))
}

fn plain_manifest() -> std::path::PathBuf {
    workspace_root().join("benches/plain/Cargo.toml")
}

/// The string value of the first `"key":"…"` in a line of JSON (no escapes expected in paths).
fn json_string(line: &str, key: &str) -> Option<String> {
    let start = line.find(&format!(r#""{key}":""#))? + key.len() + 4;
    let len = line[start..].find('"')?;
    Some(line[start..start + len].to_string())
}

/// The number after the first `"point_estimate":` following `"section":` in criterion's
/// estimates.json.
fn json_estimate(text: &str, section: &str) -> Option<f64> {
    let at = text.find(&format!(r#""{section}":"#))?;
    let rest = &text[at..];
    let start = rest.find(r#""point_estimate":"#)? + r#""point_estimate":"#.len();
    let end = rest[start..].find([',', '}'])?;
    rest[start..start + end].trim().parse().ok()
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

/// Builds both benches, then runs them alternately `rounds` times (swapping which goes first
/// every round) so that machine drift affects both, and reports the median step times and the
/// DDP/plain ratio. The DDP bench also measures the decorator without a `Ddp` (no hooks), which
/// splits the overhead into decorator and reducer. Each run writes criterion's output under its
/// own CRITERION_HOME, so every round's `new/estimates.json` is that run's alone.
fn bench_overhead(rounds: usize) -> Result<(), String> {
    let benches = [
        (
            "plain",
            build_bench(true, "plain_step")?,
            &["plain_flex"][..],
        ),
        (
            "ddp",
            build_bench(false, "ddp_overhead")?,
            &["decorated_no_ddp", "ddp_world_1"][..],
        ),
    ];
    let home = target_dir().join("bench-overhead");
    // Milliseconds per round of: plain, decorated without DDP, DDP.
    let mut times: Vec<[f64; 3]> = Vec::new();
    for round in 0..rounds {
        let mut order = [0, 1];
        if round % 2 == 1 {
            order.reverse();
        }
        let mut row = Vec::new();
        for i in order {
            let (name, exe, functions) = &benches[i];
            let dir = home.join(format!("round-{round}")).join(name);
            let _ = std::fs::remove_dir_all(&dir);
            eprintln!("xtask: round {}/{rounds}: {name}", round + 1);
            run(Command::new(exe)
                .env("CRITERION_HOME", &dir)
                .args(["--bench", "--noplot", "--warm-up-time", "2"])
                .args(["--measurement-time", "6", "transformer_step"]))?;
            for function in *functions {
                let file = dir.join(format!("transformer_step/{function}/new/estimates.json"));
                let text = std::fs::read_to_string(&file)
                    .map_err(|e| format!("cannot read {}: {e}", file.display()))?;
                let ns = json_estimate(&text, "median")
                    .ok_or_else(|| format!("no median in {}", file.display()))?;
                row.push((*function, ns / 1e6));
            }
        }
        let get = |f: &str| row.iter().find(|(n, _)| *n == f).expect("measured").1;
        times.push([
            get("plain_flex"),
            get("decorated_no_ddp"),
            get("ddp_world_1"),
        ]);
    }
    println!("\nmedian step time per criterion run, ms (odd rounds ran plain first)");
    println!("round   plain  decorated     ddp  ddp/plain");
    for (round, [plain, decorated, ddp]) in times.iter().enumerate() {
        let ratio = ddp / plain;
        println!(
            "{:>5}  {plain:>6.2}  {decorated:>9.2}  {ddp:>6.2}  {ratio:>9.4}",
            round + 1
        );
    }
    let column = |c: usize| median(&mut times.iter().map(|t| t[c]).collect::<Vec<_>>());
    let ratio = |c: usize| median(&mut times.iter().map(|t| t[c] / t[0]).collect::<Vec<_>>());
    let (plain, decorated, ddp) = (column(0), column(1), column(2));
    let (decorator_ratio, ddp_ratio) = (ratio(1), ratio(2));
    println!(
        "\nmedians over {rounds} rounds: plain Autodiff<Flex> {plain:.2} ms, decorated without \
         DDP {decorated:.2} ms, DDP world size 1 {ddp:.2} ms\n\
         decorator alone: {:+.2} %; DDP overhead: {:+.2} % (median of per-round ratios), \
         {:+.2} % (ratio of medians); goal <= 5 %: {}",
        (decorator_ratio - 1.0) * 100.0,
        (ddp_ratio - 1.0) * 100.0,
        (ddp / plain - 1.0) * 100.0,
        if ddp_ratio <= 1.05 { "met" } else { "MISSED" }
    );
    Ok(())
}
