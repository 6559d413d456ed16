//! `gpt`: the end-to-end comparison of issue 7. GPT-2 124M (`gpt-pretrain --model gpt2-124m`,
//! vocabulary 50257 padded to 50304) trains for a few steps on the synthetic corpus with our
//! stack, `Autodiff<DistributedBackend<CudaBackend>>` with the in-place NCCL reducer at world
//! size 1, in two variants:
//! - `gpt/burn-dist`: f32 parameters and compute, Burn's AdamW with gpt-pretrain's global-norm
//!   clipping (Burn has no autocast, and gpt-pretrain's AdamW refuses f16/bf16 parameters,
//!   which would lose small updates without f32 master weights);
//! - `gpt/burn-dist-bf16`: bf16 parameters and compute, ZeroAdam with its f32 master weights and
//!   moments on the GPU (`ZeroAdam::on_device`: the fused kernels, the gradient shard and the
//!   parameter all-gather in device memory), same clipping.
//!
//! `gpt2_torch.py` runs the same shape, batch and sequence length in PyTorch (bf16 autocast,
//! fused AdamW, SDPA, TF32), and the report puts the lines side by side: tokens/s and MFU by the
//! same formula.
//!
//! Tokens/s is the median over the steps after `WARMUP` (the first steps compile kernels
//! through NVRTC and autotune).

use burn_dist::{CudaBackend, CudaDevice, DdpConfig, DistributedBackend};
use burn_dist_zero::ZeroAdam;
use clap::Parser;
use gpt_pretrain::cli::Args;
use gpt_pretrain::train::PlaceOptimizer;
use serde_json::json;

use crate::Options;
use crate::libraries::check_cuda_runtime;
use crate::report::{Report, guarded, median};

type B = burn::backend::Autodiff<DistributedBackend<CudaBackend>>;

/// Sequences per step: 16 × 1024 tokens, as in gpt2_torch.py's default.
const BATCH: usize = 16;
const STEPS: usize = 13;
const WARMUP: usize = 3;
/// H200 SXM dense bf16 tensor-core peak (gpt2_torch.py uses the same figure).
const PEAK_FLOPS: f64 = 989e12;

/// One configuration of our stack.
pub struct Variant {
    check: &'static str,
    /// gpt-pretrain flags that differ between the variants.
    flags: &'static [&'static str],
    /// Whether ZeroAdam's state goes to the GPU.
    zero_on_device: bool,
    precision: &'static str,
    optimizer: &'static str,
}

pub const VARIANTS: [Variant; 2] = [
    Variant {
        check: "gpt/burn-dist",
        flags: &["--optimizer", "adamw"],
        zero_on_device: false,
        precision: "f32 parameters and compute (no autocast in Burn)",
        optimizer: "Burn AdamW, global-norm clipping 1.0",
    },
    Variant {
        check: "gpt/burn-dist-bf16",
        flags: &["--optimizer", "zero", "--precision", "bf16"],
        zero_on_device: true,
        precision: "bf16 parameters and compute, f32 master weights",
        optimizer: "ZeroAdam on the GPU (fused kernels), global-norm clipping 1.0",
    },
];

/// Runs `variants` one after the other (run.sh runs each under its own limit: `gpt-f32`,
/// `gpt-bf16`).
pub fn run(report: &mut Report, options: &Options, variants: &[Variant]) {
    if let Err(e) = check_cuda_runtime() {
        for variant in variants {
            report.fail(variant.check, &e, json!({}));
        }
        return;
    }
    for variant in variants {
        match guarded(|| measure(variant, options.device)) {
            Ok(Ok(fields)) => report.pass(variant.check, fields),
            Ok(Err(e)) | Err(e) => report.fail(variant.check, e, json!({})),
        }
    }
}

/// Trains `variant` for STEPS steps and returns its line's fields.
fn measure(variant: &Variant, device_index: usize) -> Result<serde_json::Value, String> {
    let scratch = std::env::temp_dir().join(format!(
        "gpu-check-{}-{}",
        variant.check.replace('/', "-"),
        std::process::id()
    ));
    let metrics = scratch.join("metrics.jsonl");
    let fixed = [
        "gpt-pretrain",
        "--model",
        "gpt2-124m",
        "--synthetic-vocab",
        "50257",
        "--synthetic-tokens",
        "2000000",
        "--max-grad-norm",
        "1.0",
        "--eval-every",
        "0",
        "--log-every",
        "1",
        "--no-plot",
    ];
    let args = fixed
        .iter()
        .chain(variant.flags)
        .map(|s| s.to_string())
        .chain([
            "--steps".into(),
            STEPS.to_string(),
            "--global-batch".into(),
            BATCH.to_string(),
            "--warmup".into(),
            "2".into(),
            "--peak-flops".into(),
            PEAK_FLOPS.to_string(),
            "--run-dir".into(),
            scratch.display().to_string(),
            "--metrics".into(),
            metrics.display().to_string(),
        ]);
    let args = Args::try_parse_from(args).map_err(|e| e.to_string())?;
    let device = CudaDevice::new(device_index);
    let on_device =
        |zero: ZeroAdam, ddp: &burn_dist::Ddp| zero.on_device::<CudaBackend>(ddp, &device);
    let place: PlaceOptimizer = if variant.zero_on_device {
        &on_device
    } else {
        &|zero, _| Ok(zero)
    };
    // Each variant joins (and, dropping its Ddp, leaves) its own world-size-1 group.
    let mut ddp = crate::ddp_step::join(&device, DdpConfig::new())?;
    let outcome = gpt_pretrain::train::run_with::<B>(&args, &mut ddp, &device, place);
    drop(ddp);
    let records = gpt_pretrain::metrics::read(&metrics);
    let _ = std::fs::remove_dir_all(&scratch);
    let (outcome, records) = (outcome?, records?);
    let timed: Vec<_> = records.iter().skip(WARMUP).collect();
    if timed.is_empty() {
        return Err(format!(
            "no step after the {WARMUP} warm-up steps was recorded"
        ));
    }
    let tokens: Vec<f64> = timed.iter().map(|r| r.tokens_per_s).collect();
    let tokens_per_s = median(&tokens);
    let flops_per_token = timed[0].flops_per_s / timed[0].tokens_per_s;
    Ok(json!({
        "tokens_per_s": tokens_per_s,
        "mfu": flops_per_token * tokens_per_s / PEAK_FLOPS,
        "step_ms": (BATCH * 1024) as f64 / tokens_per_s * 1e3,
        "batch": BATCH,
        "context": 1024,
        "steps_timed": timed.len(),
        "final_loss": outcome.final_loss,
        "peak_flops": PEAK_FLOPS,
        "precision": variant.precision,
        "optimizer": variant.optimizer,
    }))
}
