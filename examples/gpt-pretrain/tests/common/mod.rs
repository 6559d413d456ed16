//! Scaffolding shared by the gpt-pretrain integration tests.

// Each test crate uses a part of it.
#![allow(dead_code)]

use std::path::Path;
use std::process::Command;

use burn_dist_models::processes::launcher;
use burn_dist_models::relative_error;
use burn_dist_models::step::read_params;
use burn_flex::{Flex, FlexDevice};
use gpt_pretrain::metrics::{self, StepRecord};

/// The tests' model: `--model tiny` at `--context 16` on the synthetic corpus's vocabulary.
const D_MODEL: usize = 64;

/// `got` and `reference` (a run's parameters as `--out` writes them, in visit order) agree
/// tensor by tensor within `tolerance` (‖got − reference‖ / ‖reference‖), with one exception:
/// the key third of each attention's `c_attn.bias` (query, key and value biases in one vector).
/// Its gradient is zero in exact arithmetic (softmax ignores a constant added to a row of
/// scores), so its values are rounding noise that Adam turns into updates, and that noise
/// depends on the reduction order (a fresh 1-rank run differs from a 2-rank one there). That
/// third is only held to stay noise: its difference within 1e-3 of the whole bias's norm. The
/// query and value thirds get `tolerance` of their own norms, like every other tensor.
/// The element counts of the tests' model's parameters, in visit order.
pub fn tiny_numels() -> Vec<usize> {
    let mut config = gpt_pretrain::model::GptConfig::tiny(64);
    config.context = 16;
    let model = config.init::<Flex>(0, &FlexDevice);
    burn_dist::Survey::of::<Flex, _>(&model)
        .floats
        .iter()
        .map(|p| p.numel())
        .collect()
}

pub fn assert_same_model(got: &[Vec<f32>], reference: &[Vec<f32>], tolerance: f64, what: &str) {
    assert_same_model_with_noise(got, reference, tolerance, Some(1e-3), what);
}

/// [`assert_same_model`] with the bound on the key third's noise; `None` leaves it unchecked
/// (in f16 the noise is as large as the bias itself).
pub fn assert_same_model_with_noise(
    got: &[Vec<f32>],
    reference: &[Vec<f32>],
    tolerance: f64,
    key_noise: Option<f64>,
    what: &str,
) {
    let mut config = gpt_pretrain::model::GptConfig::tiny(64);
    config.context = 16;
    let model = config.init::<Flex>(0, &FlexDevice);
    let params = burn_dist::Survey::of::<Flex, _>(&model).floats;
    assert_eq!(
        params.iter().map(|p| p.numel()).collect::<Vec<_>>(),
        reference.iter().map(Vec::len).collect::<Vec<_>>(),
        "{what}: the tensors are the tiny model's"
    );
    assert_eq!(got.len(), reference.len(), "{what}: tensors");
    let norm = |x: &[f32]| x.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt();
    for ((param, got), reference) in params.iter().zip(got).zip(reference) {
        let name = &param.name;
        let check = |part: &str, error: f64, tolerance: f64| {
            assert!(
                error <= tolerance,
                "{what}: {name}{part} differs by {error:e} (tolerance {tolerance:e})"
            );
        };
        if !name.ends_with("attn.c_attn.bias") {
            check("", relative_error(got, reference), tolerance);
            continue;
        }
        let (q, k, v) = (0..D_MODEL, D_MODEL..2 * D_MODEL, 2 * D_MODEL..3 * D_MODEL);
        check(
            " (query)",
            relative_error(&got[q.clone()], &reference[q]),
            tolerance,
        );
        check(
            " (value)",
            relative_error(&got[v.clone()], &reference[v]),
            tolerance,
        );
        let key_difference: Vec<f32> = got[k.clone()]
            .iter()
            .zip(&reference[k])
            .map(|(a, b)| a - b)
            .collect();
        if let Some(key_noise) = key_noise {
            check(" (key)", norm(&key_difference) / norm(reference), key_noise);
        }
    }
}

/// Small enough for a debug build on 2 cores: 4 sequences of 16 tokens per step.
pub const RUN: &[&str] = &[
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
pub struct Run {
    pub steps: Vec<StepRecord>,
    pub params: Vec<Vec<f32>>,
    pub stdout: String,
}

pub fn launched(dir: &Path, world: usize, extra: &[&str]) -> Run {
    let name = format!("world{world}{}", extra.join(""));
    launched_as(dir, &name, world, extra)
}

/// [`launched`], its files named `name` under `dir` (for arguments that are paths).
pub fn launched_as(dir: &Path, name: &str, world: usize, extra: &[&str]) -> Run {
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
        .arg(dir.join(name))
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

/// The same training, step by step (loss, validation loss, gradient norm to 1e-4), and the
/// same parameters at the end (1e-5 per tensor; they agree to 1e-6; see `assert_same_model`).
pub fn assert_same_run(got: &Run, reference: &Run, what: &str) {
    assert_same_run_within(got, reference, 1e-4, Some((1e-5, Some(1e-3))), what);
}

/// [`assert_same_run`] with its tolerances: `steps` for the per-step figures (relative),
/// `params` for the final tensors (`None`: `(tolerance, key_noise)` as in
/// [`assert_same_model_with_noise`]; `None`: the curves only).
pub fn assert_same_run_within(
    got: &Run,
    reference: &Run,
    steps: f64,
    params: Option<(f64, Option<f64>)>,
    what: &str,
) {
    assert_eq!(got.steps.len(), reference.steps.len(), "{what}: steps");
    let close = |a: f64, b: f64| (a - b).abs() <= steps * b.abs();
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
        // A step skipped for an overflow (f16 loss scaling) has no norm; then on both runs.
        match (g.grad_norm, r.grad_norm) {
            (Some(a), Some(b)) => assert!(
                close(a, b),
                "{what}: step {} gradient norm {a} vs {b}",
                r.step
            ),
            (None, None) if g.skipped && r.skipped => {}
            (a, b) => panic!("{what}: step {} gradient norms {a:?} vs {b:?}", r.step),
        }
    }
    if let Some((tolerance, key_noise)) = params {
        assert_same_model_with_noise(&got.params, &reference.params, tolerance, key_noise, what);
    }
}
