//! The GPT example's long-running tasks: `cargo xtask pretrain` (the README's main command) and
//! `cargo xtask soak` (8 ranks × 1000 small steps: no hang, and every rank's resident memory
//! flat after warm-up).

use std::path::Path;
use std::process::Command;

use crate::{cargo, run, target_dir};

/// Steps before memory is expected to be flat (allocator pools, the bucket layout rebuilt after
/// step 1, first checkpoint-free evaluation all happen before).
const WARMUP_STEPS: u64 = 100;
/// Largest allowed growth of any rank's resident memory after warm-up.
const RSS_TOLERANCE: f64 = 0.05;

pub(crate) fn build_release() -> Result<std::path::PathBuf, String> {
    cargo(&[
        "build",
        "--release",
        "--locked",
        "-p",
        "burn-dist-run",
        "-p",
        "gpt-pretrain",
        "--bins",
    ])?;
    Ok(target_dir().join("release"))
}

/// 2 ranks pretrain the tiny GPT on the built-in synthetic corpus and report the validation
/// loss against the corpus's entropy floor (metrics, plot and checkpoints in runs/gpt-pretrain).
pub fn pretrain(extra: &[String]) -> Result<(), String> {
    let bin = build_release()?;
    run(Command::new(bin.join("burn-dist-run"))
        .args(["--nproc-per-node", "2", "--master-port", "0", "--"])
        .arg(bin.join("gpt-pretrain"))
        .args(["--checkpoint-every", "200"])
        .args(extra))
}

/// 8 ranks × 1000 steps of a very small GPT through the launcher. Fails on a hang (every
/// collective times out after 120 s), a failed rank, or a rank whose resident memory after
/// step WARMUP_STEPS varies by more than RSS_TOLERANCE.
pub fn soak() -> Result<(), String> {
    let bin = build_release()?;
    let dir = target_dir().join("soak");
    let _ = std::fs::remove_dir_all(&dir);
    let metrics = dir.join("metrics.jsonl");
    run(Command::new(bin.join("burn-dist-run"))
        .args(["--nproc-per-node", "8", "--master-port", "0", "--"])
        .arg(bin.join("gpt-pretrain"))
        .args([
            "--steps",
            "1000",
            "--global-batch",
            "8",
            "--context",
            "16",
            "--n-layer",
            "1",
            "--d-model",
            "32",
            "--n-head",
            "2",
            "--synthetic-tokens",
            "200000",
            "--eval-every",
            "250",
            "--eval-sequences",
            "64",
            "--log-every",
            "100",
            "--no-plot",
        ])
        .arg("--run-dir")
        .arg(&dir)
        .arg("--metrics")
        .arg(&metrics)
        .env("BURN_DIST_TIMEOUT_SECS", "120"))?;
    check_flat_memory(&metrics)
}

/// Every rank's VmRSS over the steps after warm-up that record it (those that print a line)
/// stays within RSS_TOLERANCE of its minimum.
fn check_flat_memory(metrics: &Path) -> Result<(), String> {
    let text = std::fs::read_to_string(metrics)
        .map_err(|e| format!("reading {}: {e}", metrics.display()))?;
    let mut per_rank: Vec<Vec<f64>> = Vec::new();
    let mut steps = 0;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let step = number_after(line, "\"step\":")
            .ok_or_else(|| format!("{}: a line without a step: {line}", metrics.display()))?;
        steps = steps.max(step as u64);
        if (step as u64) < WARMUP_STEPS {
            continue;
        }
        // Resident memory is gathered on the steps that print a line (every 100th here).
        let Some(rss) = list_after(line, "\"rss_mib\":[") else {
            continue;
        };
        per_rank.resize(rss.len(), Vec::new());
        for (rank, mib) in rss.into_iter().enumerate() {
            per_rank[rank].push(mib);
        }
    }
    if steps != 1000 || per_rank.len() != 8 {
        return Err(format!(
            "soak: expected 1000 steps of 8 ranks, the metrics hold {steps} steps of {} ranks",
            per_rank.len()
        ));
    }
    // --log-every 100: steps 100, 200, ..., 1000.
    if let Some((rank, series)) = per_rank.iter().enumerate().find(|(_, s)| s.len() < 10) {
        return Err(format!(
            "soak: rank {rank} has resident memory for {} steps after warm-up, expected 10",
            series.len()
        ));
    }
    let mut worst = (0, 0.0);
    for (rank, series) in per_rank.iter().enumerate() {
        let min = series.iter().copied().fold(f64::MAX, f64::min);
        let max = series.iter().copied().fold(0.0, f64::max);
        let growth = max / min - 1.0;
        println!(
            "soak: rank {rank}: resident {min:.1} to {max:.1} MiB after step {WARMUP_STEPS} ({:+.2} %)",
            100.0 * growth
        );
        if growth > worst.1 {
            worst = (rank, growth);
        }
    }
    if worst.1 > RSS_TOLERANCE {
        return Err(format!(
            "soak: rank {}'s resident memory grew {:.1} % after warm-up (allowed {:.0} %)",
            worst.0,
            100.0 * worst.1,
            100.0 * RSS_TOLERANCE
        ));
    }
    println!(
        "soak: 8 ranks × 1000 steps, no hang, resident memory flat within {:.0} %",
        100.0 * RSS_TOLERANCE
    );
    Ok(())
}

/// The number right after `key` in a JSON line.
pub(crate) fn number_after(line: &str, key: &str) -> Option<f64> {
    let rest = &line[line.find(key)? + key.len()..];
    let end = rest
        .find(|c: char| !(c.is_ascii_digit() || matches!(c, '.' | '-' | 'e' | 'E' | '+')))
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// The numbers of the JSON array that starts right after `key`.
pub(crate) fn list_after(line: &str, key: &str) -> Option<Vec<f64>> {
    let rest = &line[line.find(key)? + key.len()..];
    let inner = &rest[..rest.find(']')?];
    inner.split(',').map(|v| v.trim().parse().ok()).collect()
}
