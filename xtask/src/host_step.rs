//! `cargo xtask bench-host-step`: ZeroAdam's host step (`burn_dist_kernels::host`) beside
//! PyTorch's CPU AdamW, at the same sizes and thread counts, in one run; prints the ratio
//! table of docs/perf/host-step.md.
//!
//! - Ours: the `host-step-bench` binary of burn-dist-kernels, release.
//! - PyTorch: `benches/torch/adamw_cpu.py` in a venv with torch: `BURN_DIST_TORCH_VENV` when
//!   set, else `<target dir>/torch-venv`, created with `python3 -m venv` and
//!   `pip install torch` (PyPI) when torch does not import there. Never part of CI.
//! - The two run alternately, ROUNDS times (who goes first swaps every round), so that the load
//!   of a shared machine falls on both; each figure is the median over the rounds of each run's
//!   median step time, each ratio the median of the per-round ratios.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

const USAGE: &str = "usage: cargo xtask bench-host-step [--rounds N] [--sizes N,N,...] [--threads T,T,...] [--reps R]
  (threads 0 = all cores; defaults: 3 rounds, sizes 1048576,16777216, threads 1,0, 20 reps)";

/// The tables: a title, then the columns (label, implementation, variant), ours first, the
/// torch ones each followed by torch/ours.
type Table = (
    &'static str,
    [(&'static str, &'static str, &'static str); 3],
);
const TABLES: [Table; 4] = [
    (
        "AdamW update, steps 1-150",
        [
            ("ours: update", "ours", "update"),
            ("torch foreach", "torch", "foreach"),
            ("torch fused", "torch", "fused"),
        ],
    ),
    (
        "AdamW update, steps from 1000 (1 - beta1^t = 1 in f32: one division less for us)",
        [
            ("ours: update", "ours", "update_late"),
            ("torch foreach", "torch", "foreach"),
            ("torch fused", "torch", "fused"),
        ],
    ),
    (
        "whole step (unscale + inf/NaN check + norm + update), steps 1-150",
        [
            ("ours: unscale+check+norm+update", "ours", "full"),
            ("torch clip_grad_norm_ + foreach", "torch", "foreach_clip"),
            ("torch clip_grad_norm_ + fused", "torch", "fused_clip"),
        ],
    ),
    (
        "whole step, steps from 1000",
        [
            ("ours: unscale+check+norm+update", "ours", "full_late"),
            ("torch clip_grad_norm_ + foreach", "torch", "foreach_clip"),
            ("torch clip_grad_norm_ + fused", "torch", "fused_clip"),
        ],
    ),
];

/// One measurement line of either bench: (implementation, variant, elements, threads) → ms.
type Key = (String, String, usize, usize);

pub fn bench_host_step(args: &[String]) -> Result<(), String> {
    let mut rounds = 3usize;
    let mut forwarded: Vec<String> = Vec::new();
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        let value = rest
            .next()
            .ok_or_else(|| format!("bench-host-step: {arg} needs a value\n{USAGE}"))?;
        match arg.as_str() {
            "--rounds" => {
                rounds =
                    value.parse().ok().filter(|&r| r > 0).ok_or_else(|| {
                        format!("--rounds {value}: not a positive count\n{USAGE}")
                    })?;
            }
            "--sizes" | "--threads" | "--reps" => forwarded.extend([arg.clone(), value.clone()]),
            other => {
                return Err(format!(
                    "bench-host-step: unknown argument {other:?}\n{USAGE}"
                ));
            }
        }
    }
    super::cargo(&[
        "build",
        "--release",
        "-p",
        "burn-dist-kernels",
        "--bin",
        "host-step-bench",
    ])?;
    let ours = super::target_dir().join("release/host-step-bench");
    let python = torch_python()?;
    let script = super::workspace_root().join("benches/torch/adamw_cpu.py");

    let mut per_round: Vec<BTreeMap<Key, Timing>> = Vec::new();
    for round in 0..rounds {
        let mut commands = [Command::new(&ours), Command::new(&python)];
        commands[1].arg(&script);
        if round % 2 == 1 {
            commands.reverse();
        }
        let mut times = BTreeMap::new();
        for command in &mut commands {
            command.args(&forwarded);
            eprintln!("xtask: round {}/{rounds}: {command:?}", round + 1);
            times.extend(measurements(command)?);
        }
        per_round.push(times);
    }
    print_table(&per_round);
    Ok(())
}

/// A python with torch: the venv's, made (torch from PyPI) when torch does not import there.
pub(crate) fn torch_python() -> Result<PathBuf, String> {
    let venv = std::env::var_os("BURN_DIST_TORCH_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| super::target_dir().join("torch-venv"));
    let python = venv.join("bin/python");
    let imports_torch = |python: &Path| {
        Command::new(python)
            .args(["-c", "import torch"])
            .status()
            .is_ok_and(|s| s.success())
    };
    if imports_torch(&python) {
        return Ok(python);
    }
    eprintln!(
        "xtask: no torch in {}: creating the venv and installing torch from PyPI",
        venv.display()
    );
    if !python.exists() {
        super::run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    }
    super::run(Command::new(&python).args(["-m", "pip", "install", "--upgrade", "pip", "torch"]))?;
    if imports_torch(&python) {
        Ok(python)
    } else {
        Err(format!(
            "torch does not import in {} after pip install",
            venv.display()
        ))
    }
}

/// One run's figures for one key, ms: the median step and the fastest step.
#[derive(Debug, Clone, Copy)]
struct Timing {
    median: f64,
    best: f64,
}

/// Runs one bench and parses its lines `<impl> <variant> <elements> <threads> <median> <min>`.
fn measurements(command: &mut Command) -> Result<Vec<(Key, Timing)>, String> {
    let shown = format!("{command:?}");
    let output = command
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run {shown}: {e}"))?;
    if !output.status.success() {
        return Err(format!("{shown} failed: {}", output.status));
    }
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let parsed = match fields.as_slice() {
                [imp, variant, n, threads, median, best] => {
                    match (n.parse(), threads.parse(), median.parse(), best.parse()) {
                        (Ok(n), Ok(threads), Ok(median), Ok(best)) => Some((
                            (imp.to_string(), variant.to_string(), n, threads),
                            Timing { median, best },
                        )),
                        _ => None,
                    }
                }
                _ => None,
            };
            parsed.ok_or_else(|| format!("{shown}: cannot read the line {line:?}"))
        })
        .collect()
}

fn median(mut values: Vec<f64>) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    Some((values[(n - 1) / 2] + values[n / 2]) / 2.0)
}

fn min(values: &[f64]) -> Option<f64> {
    values.iter().copied().reduce(f64::min)
}

fn max(values: &[f64]) -> Option<f64> {
    values.iter().copied().reduce(f64::max)
}

/// Markdown tables (update only; the whole step with the norm; each at early and late steps),
/// one row per (size, threads). Each time is the median over the rounds of each run's median
/// step, then, in brackets, the fastest step of all rounds. Each torch/ours (above 1: ours is
/// faster) is the median of the per-round ratios of run medians with their range, then the
/// ratio of the fastest steps, which a busy machine disturbs least. Then ours and torch's
/// foreach per round, to show the noise.
fn print_table(per_round: &[BTreeMap<Key, Timing>]) {
    let mut cases: Vec<(usize, usize)> = per_round
        .iter()
        .flat_map(|t| t.keys().map(|(_, _, n, threads)| (*n, *threads)))
        .collect();
    cases.sort();
    cases.dedup();
    let key = |imp: &str, variant: &str, n: usize, threads: usize| {
        (imp.to_string(), variant.to_string(), n, threads)
    };
    let timings = |imp: &str, variant: &str, n: usize, threads: usize| -> Vec<Timing> {
        let key = key(imp, variant, n, threads);
        per_round
            .iter()
            .filter_map(|t| t.get(&key).copied())
            .collect()
    };
    let medians = |imp, variant, n, threads| -> Vec<f64> {
        timings(imp, variant, n, threads)
            .iter()
            .map(|t| t.median)
            .collect()
    };
    let best = |imp, variant, n, threads| -> Option<f64> {
        min(&timings(imp, variant, n, threads)
            .iter()
            .map(|t| t.best)
            .collect::<Vec<_>>())
    };
    for (title, columns) in TABLES {
        println!(
            "\n### {title}\n\nms: median of {} runs' median steps (fastest step); torch/ours: \
             median of the runs' ratios (range); ratio of the fastest steps\n",
            per_round.len()
        );
        let [(ours_label, _, ours), rest @ ..] = columns;
        let mut header = format!("| elements | threads | {ours_label} |");
        for (label, _, _) in rest {
            header += &format!(" {label} | torch/ours |");
        }
        println!("{header}");
        println!("|{}", "---|".repeat(3 + 2 * rest.len()));
        for &(n, threads) in &cases {
            let cell = |imp, variant| match (
                median(medians(imp, variant, n, threads)),
                best(imp, variant, n, threads),
            ) {
                (Some(m), Some(b)) => format!("{m:.2} ({b:.2})"),
                _ => "–".into(),
            };
            let mut row = format!("| {n} | {threads} | {} |", cell("ours", ours));
            for (_, _, variant) in rest {
                // torch/ours per round, where both ran.
                let ratios: Vec<f64> = per_round
                    .iter()
                    .filter_map(|t| {
                        let torch = t.get(&key("torch", variant, n, threads))?;
                        Some(torch.median / t.get(&key("ours", ours, n, threads))?.median)
                    })
                    .collect();
                let best_ratio = best("torch", variant, n, threads)
                    .zip(best("ours", ours, n, threads))
                    .map(|(t, o)| t / o);
                let ratio = match (
                    median(ratios.clone()),
                    min(&ratios),
                    max(&ratios),
                    best_ratio,
                ) {
                    (Some(m), Some(lo), Some(hi), Some(b)) => {
                        format!("**{m:.2}×** ({lo:.2}–{hi:.2}); {b:.2}×")
                    }
                    _ => "–".into(),
                };
                row += &format!(" {} | {ratio} |", cell("torch", variant));
            }
            println!("{row}");
        }
    }
    println!(
        "\n### per round, run medians, ms: ours update / torch foreach; ours full / torch clip+foreach\n"
    );
    for &(n, threads) in &cases {
        let show = |v: Vec<f64>| {
            v.iter()
                .map(|x| format!("{x:.2}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        println!(
            "{n} elements, {threads} threads: [{}] / [{}]; [{}] / [{}]",
            show(medians("ours", "update", n, threads)),
            show(medians("torch", "foreach", n, threads)),
            show(medians("ours", "full", n, threads)),
            show(medians("torch", "foreach_clip", n, threads)),
        );
    }
}
