//! `gpt`: the end-to-end comparison of issue 7. GPT-2 124M (`gpt-pretrain --model gpt2-124m`,
//! vocabulary 50257 padded to 50304) trains for a few steps on the synthetic corpus with our
//! stack: `Autodiff<DistributedBackend<CudaBackend>>`, the in-place NCCL reducer at world size
//! 1, Burn's AdamW with gpt-pretrain's global-norm clipping, f32 parameters (Burn has no
//! autocast; gpt-pretrain's AdamW refuses f16/bf16 parameters, which would lose small updates
//! without f32 master weights). `gpt2_torch.py` runs the same shape, batch and sequence length
//! in PyTorch (bf16 autocast, fused AdamW, SDPA, TF32), and the report puts the two lines side
//! by side: tokens/s and MFU by the same formula.
//!
//! Tokens/s is the median over the steps after `WARMUP` (the first steps compile kernels
//! through NVRTC and autotune).

use burn_dist::{CudaBackend, CudaDevice, DdpConfig, DistributedBackend};
use clap::Parser;
use gpt_pretrain::cli::Args;
use serde_json::json;

use crate::Options;
use crate::libraries::check_cuda_runtime;
use crate::report::{Report, guarded};

type B = burn::backend::Autodiff<DistributedBackend<CudaBackend>>;

const CHECK: &str = "gpt/burn-dist";
/// Sequences per step: 16 × 1024 tokens, as in gpt2_torch.py's default.
const BATCH: usize = 16;
const STEPS: usize = 13;
const WARMUP: usize = 3;
/// H200 SXM dense bf16 tensor-core peak (gpt2_torch.py uses the same figure).
const PEAK_FLOPS: f64 = 989e12;

pub fn run(report: &mut Report, options: &Options) {
    if let Err(e) = check_cuda_runtime() {
        report.fail(CHECK, e, json!({}));
        return;
    }
    let scratch = std::env::temp_dir().join(format!("gpu-check-gpt-{}", std::process::id()));
    let metrics = scratch.join("metrics.jsonl");
    let args = [
        "gpt-pretrain",
        "--model",
        "gpt2-124m",
        "--synthetic-vocab",
        "50257",
        "--synthetic-tokens",
        "2000000",
        "--optimizer",
        "adamw",
        "--max-grad-norm",
        "1.0",
        "--eval-every",
        "0",
        "--log-every",
        "1",
        "--no-plot",
    ]
    .map(String::from)
    .into_iter()
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
    let outcome = guarded(|| -> Result<serde_json::Value, String> {
        let args = Args::try_parse_from(args).map_err(|e| e.to_string())?;
        let device = CudaDevice::new(options.device);
        let mut ddp = crate::ddp_step::join(&device, DdpConfig::new())?;
        let outcome = gpt_pretrain::train::run_with::<B>(&args, &mut ddp, &device)?;
        let records = gpt_pretrain::metrics::read(&metrics)?;
        let timed: Vec<_> = records.iter().skip(WARMUP).collect();
        if timed.is_empty() {
            return Err(format!(
                "no step after the {WARMUP} warm-up steps was recorded"
            ));
        }
        let mut tokens: Vec<f64> = timed.iter().map(|r| r.tokens_per_s).collect();
        tokens.sort_by(f64::total_cmp);
        let tokens_per_s = tokens[tokens.len() / 2];
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
            "precision": "f32 parameters and compute (no autocast in Burn)",
            "optimizer": "Burn AdamW, global-norm clipping 1.0",
        }))
    });
    let _ = std::fs::remove_dir_all(&scratch);
    match outcome {
        Ok(Ok(fields)) => report.pass(CHECK, fields),
        Ok(Err(e)) | Err(e) => report.fail(CHECK, e, json!({})),
    }
}
