//! 1, 2 and 4 real processes (through `burn-dist-run`) training the tiny GPT on the same global
//! batch follow the same loss curve, step by step, training and validation, with the same
//! gradient norms, and end with the same parameters; so does 2 ranks with 2 accumulation
//! micro-batches each. Burn's AdamW with this example's global clipping and ZeRO stage 2 follow
//! ZeroAdam stage 1 alike; f16 and bf16 train.
//!
//! The tokens/s printed every step and recorded for the plot add up to the end-to-end figure.
//!
//! Losses alone would hide a gradient summed instead of averaged: clipping and Adam's scale
//! invariance make its updates nearly the same. The gradient norm shows it at once.

use std::path::Path;
use std::process::Command;

use burn_dist_models::processes::{launcher, scratch_dir};
use burn_dist_models::step::read_params;
use gpt_pretrain::metrics::{self, StepRecord};

mod common;

use common::assert_same_model;

/// Small enough for a debug build on 2 cores: 4 sequences of 16 tokens per step.
const RUN: &[&str] = &[
    "--steps",
    "5",
    "--global-batch",
    "4",
    "--context",
    "16",
    "--synthetic-tokens",
    "20000",
    "--warmup",
    "2",
    "--eval-every",
    "2",
    "--eval-sequences",
    "8",
    "--log-every",
    "1",
    "--no-plot",
];

/// A run's metrics, step by step, its final parameters, and what rank 0 printed.
struct Run {
    steps: Vec<StepRecord>,
    params: Vec<Vec<f32>>,
    stdout: String,
}

fn launched(dir: &Path, world: usize, extra: &[&str]) -> Run {
    let name = format!("world{world}{}", extra.join(""));
    let metrics = dir.join(format!("{name}.jsonl"));
    let params = dir.join(format!("{name}.bin"));
    let output = Command::new(launcher())
        .args([
            "--nproc-per-node",
            &world.to_string(),
            "--master-port",
            "0",
            "--",
        ])
        .arg(env!("CARGO_BIN_EXE_gpt-pretrain"))
        .args(RUN)
        .args(extra)
        .arg("--run-dir")
        .arg(dir.join(&name))
        .arg("--metrics")
        .arg(&metrics)
        .arg("--out")
        .arg(&params)
        .env("BURN_DIST_TIMEOUT_SECS", "60")
        .output()
        .expect("running burn-dist-run");
    assert!(
        output.status.success(),
        "{world} ranks {extra:?}: {}\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    Run {
        steps: metrics::read(&metrics).unwrap(),
        params: read_params(&params).unwrap(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
    }
}

/// The number just before `unit` in `line`.
fn number_before(line: &str, unit: &str) -> f64 {
    let head = &line[..line
        .find(unit)
        .unwrap_or_else(|| panic!("no {unit:?} in {line:?}"))];
    let number = head.trim_end().rsplit(' ').next().unwrap();
    number
        .parse()
        .unwrap_or_else(|e| panic!("{number:?} in {line:?}: {e}"))
}

/// The throughput printed every step (`--log-every 1`) is the one in the metrics file (and so
/// the plot), and both agree within 2 % with the end-to-end figure, the global batch's tokens
/// times the steps over the training loop's wall time, which rank 0 prints at the end and which
/// the last record's `elapsed_s` gives too.
fn assert_throughput_is_end_to_end(run: &Run, tokens_per_step: f64, what: &str) {
    let rank0 = run
        .stdout
        .lines()
        .filter_map(|l| l.strip_prefix("[rank 0] "));
    let printed: Vec<f64> = rank0
        .clone()
        .filter(|l| l.starts_with("step "))
        .map(|l| number_before(l, " tok/s"))
        .collect();
    let recorded: Vec<f64> = run.steps.iter().map(|r| r.tokens_per_s).collect();
    assert_eq!(
        printed.len(),
        recorded.len(),
        "{what}: a line per step\n{}",
        run.stdout
    );
    for (step, (p, r)) in printed.iter().zip(&recorded).enumerate() {
        assert!(
            (p - r).abs() <= 0.5,
            "{what}: step {}: printed {p}, recorded {r}",
            step + 1
        );
    }
    let end_line = rank0
        .clone()
        .find(|l| l.starts_with("throughput: "))
        .unwrap_or_else(|| panic!("{what}: no end-to-end line\n{}", run.stdout));
    let end_to_end = number_before(end_line, " tokens/s end to end");
    let steps = run.steps.len() as f64;
    // What the plot shows over the run: every step's tokens over the sum of the steps' times.
    let step_seconds: f64 = recorded.iter().map(|r| tokens_per_step / r).sum();
    let plotted = steps * tokens_per_step / step_seconds;
    let elapsed = run.steps.last().unwrap().elapsed_s;
    let timed = steps * tokens_per_step / elapsed;
    for (name, value) in [("plotted", plotted), ("from elapsed_s", timed)] {
        let off = (value / end_to_end - 1.0).abs();
        assert!(
            off <= 0.02,
            "{what}: {name} {value:.0} tokens/s vs {end_to_end:.0} end to end ({:.1} % off)",
            100.0 * off
        );
    }
}

/// The same training, step by step (loss, validation loss, gradient norm to 1e-4), and the
/// same parameters at the end (1e-5 per tensor; they agree to 1e-6; see `assert_same_model`).
fn assert_same_run(got: &Run, reference: &Run, what: &str) {
    assert_eq!(got.steps.len(), reference.steps.len(), "{what}: steps");
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-4 * b.abs();
    for (g, r) in got.steps.iter().zip(&reference.steps) {
        assert!(
            close(g.loss, r.loss),
            "{what}: step {} loss {} vs {} on 1 rank",
            r.step,
            g.loss,
            r.loss
        );
        match (g.val_loss, r.val_loss) {
            (Some(a), Some(b)) => assert!(
                close(a, b),
                "{what}: step {} validation loss {a} vs {b}",
                r.step
            ),
            (a, b) => assert_eq!(
                a.is_some(),
                b.is_some(),
                "{what}: step {} evaluates",
                r.step
            ),
        }
        let (Some(a), Some(b)) = (g.grad_norm, r.grad_norm) else {
            panic!("{what}: step {} has no gradient norm", r.step);
        };
        assert!(
            close(a, b),
            "{what}: step {} gradient norm {a} vs {b}",
            r.step
        );
    }
    assert_same_model(&got.params, &reference.params, 1e-5, what);
}

#[test]
fn one_two_and_four_ranks_follow_the_same_loss_curve() {
    let dir = scratch_dir("gpt-equivalence");
    let reference = launched(&dir, 1, &[]);
    assert_eq!(reference.steps.len(), 5);
    assert!(
        reference
            .steps
            .iter()
            .filter(|r| r.val_loss.is_some())
            .count()
            == 3,
        "steps 2, 4, 5"
    );
    assert!(
        reference.steps[4].loss < reference.steps[0].loss,
        "it learns"
    );
    assert_throughput_is_end_to_end(&reference, 4.0 * 16.0, "1 rank");
    let two = launched(&dir, 2, &[]);
    assert_same_run(&two, &reference, "2 ranks");
    assert_throughput_is_end_to_end(&two, 4.0 * 16.0, "2 ranks");
    assert_same_run(&launched(&dir, 4, &[]), &reference, "4 ranks");
    assert_same_run(
        &launched(&dir, 2, &["--accumulation", "2"]),
        &reference,
        "2 ranks × 2 micro-batches",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn adamw_and_zero_stage_2_follow_zero_stage_1_and_mixed_precision_trains() {
    let dir = scratch_dir("gpt-optimizers");
    // A clip norm the gradients exceed, so that both clipping implementations are exercised.
    let clip = ["--max-grad-norm", "0.5"];
    let reference = launched(&dir, 2, &clip);
    assert!(
        reference
            .steps
            .iter()
            .any(|r| r.grad_norm.is_some_and(|g| g > 0.5)),
        "clipping is active"
    );
    let adamw = launched(&dir, 2, &[&clip[..], &["--optimizer", "adamw"]].concat());
    assert_same_run(&adamw, &reference, "Burn's AdamW");
    let stage2 = launched(&dir, 2, &[&clip[..], &["--zero-stage", "2"]].concat());
    assert_same_run(&stage2, &reference, "ZeRO stage 2");
    for precision in ["f16", "bf16"] {
        let run = launched(&dir, 2, &["--precision", precision]).steps;
        let (first, last) = (run[0].loss, run[run.len() - 1].loss);
        assert!(
            last < first && last.is_finite(),
            "{precision}: loss {first} -> {last}"
        );
        assert_eq!(
            run[0].loss_scale.is_some(),
            precision == "f16",
            "{precision}: loss scaling is for f16 only"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
