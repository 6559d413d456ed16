//! `cargo xtask mutants [--shard K/N] [GROUP…]`: mutation testing with cargo-mutants on the
//! files that carry the project's claims, one group at a time, so that each run is bounded on 2
//! cores; `--shard K/N` runs the K-th of N consecutive slices of each group's mutants (an hour
//! or so each for the large groups), so that a group can be finished over several sittings.
//!
//! Each group names the files to mutate and the test targets that must catch their mutants
//! (the package's unit tests plus the integration tests that prove the claim). A run works on a
//! fresh clone of the committed HEAD (cargo-mutants edits sources in place there, never in the
//! working tree) and builds in a target dir of its own, `<target>/mutants/target`: cargo names
//! a path crate's artifacts without its absolute path, so a clone sharing the usual target dir
//! would overwrite the working tree's test binaries with mutated ones (seen 2026-12-01). The
//! first run builds the dependencies once; later ones reuse them. Results go to
//! `<target>/mutants/<group>/mutants.out/` (caught.txt,
//! missed.txt, timeout.txt, unviable.txt); the counts are printed at the end and recorded by
//! hand, dated, in docs/testing.md with the survivors triaged.

use std::path::Path;
use std::process::Command;

/// A set of files mutated together, and the tests that must catch their mutants.
struct Group {
    name: &'static str,
    package: &'static str,
    files: &'static [&'static str],
    /// Arguments to `cargo test` (which test targets run for each mutant).
    tests: &'static [&'static str],
    /// Packages whose tests run besides `package`'s: where a claim's test lives elsewhere
    /// (ZeRO-2's gradient shard is kept by burn-dist's reducer and checked by burn-dist-zero's
    /// tests). A test target named in `tests` runs in whichever of them has it.
    other_test_packages: &'static [&'static str],
    /// Whether the tests run the kernels on wgpu (Mesa's lavapipe).
    needs_vulkan: bool,
    /// Seconds one mutant's tests may take before cargo-mutants counts it as a timeout (a
    /// mutant that makes a wait or a loop endless): several times the group's unmutated tests.
    test_timeout_secs: u32,
}

const GROUPS: &[Group] = &[
    Group {
        name: "scaler",
        package: "burn-dist",
        files: &[
            "crates/burn-dist/src/scaler.rs",
            "crates/burn-dist/src/sync.rs",
        ],
        tests: DDP_TESTS,
        needs_vulkan: true,
        other_test_packages: &["burn-dist-zero"],
        test_timeout_secs: LONG_TESTS_TIMEOUT_SECS,
    },
    Group {
        name: "checkpoint-reader",
        package: "burn-dist-zero",
        files: &[
            "crates/burn-dist-zero/src/checkpoint/manifest.rs",
            "crates/burn-dist-zero/src/checkpoint/files.rs",
            "crates/burn-dist-zero/src/checkpoint/shard_file.rs",
        ],
        tests: &["--lib", "--test", "checkpoint"],
        needs_vulkan: false,
        other_test_packages: &[],
        test_timeout_secs: LONG_TESTS_TIMEOUT_SECS,
    },
    Group {
        name: "zero-adam",
        package: "burn-dist-zero",
        files: &["crates/burn-dist-zero/src/shard.rs"],
        // checkpoint: `import`; on_device: the device path's state and traffic (the first
        // run's survivors).
        tests: &[
            "--lib",
            "--test",
            "zero_adam",
            "--test",
            "loss_scaling",
            "--test",
            "checkpoint",
            "--test",
            "on_device",
        ],
        needs_vulkan: true,
        other_test_packages: &[],
        test_timeout_secs: LONG_TESTS_TIMEOUT_SECS,
    },
    Group {
        name: "reducer",
        package: "burn-dist",
        files: &["crates/burn-dist/src/reducer.rs"],
        tests: DDP_TESTS,
        needs_vulkan: true,
        other_test_packages: &["burn-dist-zero"],
        test_timeout_secs: LONG_TESTS_TIMEOUT_SECS,
    },
    Group {
        name: "kernels-reference",
        package: "burn-dist-kernels",
        files: &["crates/burn-dist-kernels/src/reference.rs"],
        tests: KERNEL_TESTS,
        needs_vulkan: true,
        other_test_packages: &[],
        test_timeout_secs: KERNEL_TESTS_TIMEOUT_SECS,
    },
    Group {
        name: "kernels-gpu",
        package: "burn-dist-kernels",
        files: &["crates/burn-dist-kernels/src/kernels.rs"],
        tests: KERNEL_TESTS,
        needs_vulkan: true,
        other_test_packages: &[],
        test_timeout_secs: KERNEL_TESTS_TIMEOUT_SECS,
    },
];

/// What checks burn-dist's reducer and its hooks: DDP against one rank (`ddp`), the device path
/// (`device_twin`, and burn-dist-zero's `on_device`), ZeRO-2's gradient shard (`zero_adam`),
/// the overflow injected into it (`loss_scaling`), and misuse refused by type (`typed_errors`).
/// Each was the only catcher of some survivor of an earlier run (docs/testing.md).
const DDP_TESTS: &[&str] = &[
    "--lib",
    "--test",
    "ddp",
    "--test",
    "device_twin",
    "--test",
    "typed_errors",
    "--test",
    "zero_adam",
    "--test",
    "on_device",
    "--test",
    "loss_scaling",
];

/// The f64 reference (`reference.rs`) and the CubeCL kernels (`kernels.rs`) are checked by the
/// same tests: each against the other and against Burn's Adam.
const KERNEL_TESTS: &[&str] = &[
    "--lib",
    "--test",
    "reference_matches_burn",
    "--test",
    "kernels_on_wgpu",
];

/// The kernel groups' timeout: their unmutated tests take about 5 s.
const KERNEL_TESTS_TIMEOUT_SECS: u32 = 60;

/// The timeout of the groups whose unmutated tests take up to 100 s (the reducer's, with
/// lavapipe).
const LONG_TESTS_TIMEOUT_SECS: u32 = 300;

pub fn mutants(args: &[String]) -> Result<(), String> {
    let (shard, names) = shard_and_groups(args)?;
    let chosen: Vec<&Group> = if names.is_empty() {
        GROUPS.iter().collect()
    } else {
        names
            .iter()
            .map(|name| {
                GROUPS
                    .iter()
                    .find(|g| g.name == name.as_str())
                    .ok_or_else(|| {
                        let names: Vec<_> = GROUPS.iter().map(|g| g.name).collect();
                        format!(
                            "mutants: no group {name:?}; the groups: {}",
                            names.join(", ")
                        )
                    })
            })
            .collect::<Result<_, _>>()?
    };
    ensure_cargo_mutants()?;
    if chosen.iter().any(|g| g.needs_vulkan) {
        crate::prerequisites::ensure_vulkan_driver()?;
    }
    let root = crate::workspace_root();
    let work = crate::target_dir().join("mutants");
    let source = work.join("src");
    let _ = std::fs::remove_dir_all(&source);
    std::fs::create_dir_all(&work).map_err(|e| format!("cannot create {}: {e}", work.display()))?;
    crate::run(
        Command::new("git")
            .args(["clone", "--quiet", "--no-local"])
            .arg(&root)
            .arg(&source),
    )?;
    let mut summary = Vec::new();
    for group in chosen {
        // A shard's outcomes are kept beside the others' (`<group>-shard-K-of-N`).
        let name = match shard {
            Some(Shard { k, n }) => format!("{}-shard-{k}-of-{n}", group.name),
            None => group.name.to_string(),
        };
        let out = work.join(&name);
        let _ = std::fs::remove_dir_all(&out);
        let mut command = Command::new(env!("CARGO"));
        command
            .current_dir(&source)
            .env("CARGO_TARGET_DIR", work.join("target"))
            .args([
                "mutants",
                "--in-place",
                "--no-shuffle",
                "--profile",
                "mutants",
                "--package",
                group.package,
            ])
            .args([
                "--timeout",
                &group.test_timeout_secs.to_string(),
                "--output",
            ])
            .arg(&out);
        for file in group.files {
            command.args(["--file", file]);
        }
        if !group.other_test_packages.is_empty() {
            // Naming any test package replaces the default (the mutated one): name it too.
            let packages: Vec<&str> = [group.package]
                .into_iter()
                .chain(group.other_test_packages.iter().copied())
                .collect();
            for package in &packages {
                command.args(["--test-package", package]);
            }
            // cargo-mutants 27 runs its unmutated baseline on the mutated package alone, where
            // the other packages' test targets do not exist; run it here instead.
            baseline(&source, &work.join("target"), &packages, group.tests)?;
            command.args(["--baseline", "skip"]);
        }
        if let Some(Shard { k, n }) = shard {
            // cargo-mutants counts shards from 0.
            command.args(["--shard", &format!("{}/{n}", k - 1)]);
        }
        command.arg("--").args(group.tests);
        eprintln!(
            "xtask: mutants: group {} ({})",
            group.name,
            group.files.join(", ")
        );
        // cargo-mutants exits non-zero when a mutant survives: that is a result, not an error.
        let status = command
            .status()
            .map_err(|e| format!("cannot run cargo mutants: {e}"))?;
        let counts = count(&out.join("mutants.out"));
        summary.push(format!("{name:<18} {counts} (exit {status})"));
    }
    println!(
        "\ncargo-mutants, per group (outcomes under {}):",
        work.display()
    );
    for line in summary {
        println!("  {line}");
    }
    Ok(())
}

/// The group's tests on the unmutated tree, as cargo-mutants would run them, so that a
/// mutant's failure means the mutant (the build it leaves also makes the first mutant quicker).
fn baseline(source: &Path, target: &Path, packages: &[&str], tests: &[&str]) -> Result<(), String> {
    let mut command = Command::new(env!("CARGO"));
    command
        .current_dir(source)
        .env("CARGO_TARGET_DIR", target)
        .args(["test", "--profile", "mutants"]);
    for package in packages {
        command.args(["--package", package]);
    }
    crate::run(command.args(tests))
        .map_err(|e| format!("mutants: the unmutated tree fails the group's tests: {e}"))
}

/// The K-th of N consecutive slices of a group's mutants, counted from 1.
#[derive(Clone, Copy)]
struct Shard {
    k: u32,
    n: u32,
}

/// `--shard K/N` (checked: 1 ≤ K ≤ N) and the group names, from the command line.
fn shard_and_groups(args: &[String]) -> Result<(Option<Shard>, Vec<&String>), String> {
    let mut shard = None;
    let mut names = Vec::new();
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        if arg != "--shard" {
            names.push(arg);
            continue;
        }
        let value = args
            .next()
            .ok_or("mutants: --shard needs a value, K/N (for example 1/3)")?;
        let parsed = value
            .split_once('/')
            .and_then(|(k, n)| Some((k.parse::<u32>().ok()?, n.parse::<u32>().ok()?)))
            .filter(|&(k, n)| 1 <= k && k <= n)
            .map(|(k, n)| Shard { k, n });
        if parsed.is_none() {
            return Err(format!(
                "mutants: --shard {value:?} is not K/N with 1 <= K <= N (for example 1/3)"
            ));
        }
        shard = parsed;
    }
    Ok((shard, names))
}

/// "N caught, N missed, N timeout, N unviable" from cargo-mutants' output files.
fn count(dir: &Path) -> String {
    ["caught", "missed", "timeout", "unviable"]
        .iter()
        .map(|kind| {
            let lines = std::fs::read_to_string(dir.join(format!("{kind}.txt")))
                .map_or(0, |t| t.lines().filter(|l| !l.trim().is_empty()).count());
            format!("{lines} {kind}")
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn ensure_cargo_mutants() -> Result<(), String> {
    let present = Command::new(env!("CARGO"))
        .args(["mutants", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if present {
        Ok(())
    } else {
        crate::cargo(&["install", "cargo-mutants", "--locked"])
    }
}
