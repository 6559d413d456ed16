//! `gpt`: the end-to-end comparison of issues 7 and 44. GPT-2 124M (`gpt-pretrain --model
//! gpt2-124m`, vocabulary 50257 padded to 50304) trains on the synthetic corpus with our stack,
//! `Autodiff<DistributedBackend<X>>` with the in-place NCCL reducer at world size 1, where
//! `--stack` picks `X`:
//! - `fusion`: Burn's default `Cuda` (burn-fusion on burn-cuda), what users train with;
//! - `cube`: burn-cuda without fusion (`CubeBackend`), one kernel per op;
//!
//! and `--precision` the rest:
//! - `f32`: f32 parameters and compute, Burn's AdamW with gpt-pretrain's global-norm clipping
//!   (Burn has no autocast, and gpt-pretrain's AdamW refuses f16/bf16 parameters, which would
//!   lose small updates without f32 master weights);
//! - `bf16`: bf16 parameters and compute, ZeroAdam with its f32 master weights and moments on
//!   the GPU (`ZeroAdam::on_device`: the fused kernels, the gradient shard and the parameter
//!   all-gather in device memory), same clipping.
//!
//! The run's phases come through gpt-pretrain's observer ([`gpt_pretrain::phases`]):
//! - `gpt/<stack>-<precision>/first-step`, written as soon as the first step ends: the model's
//!   build, the first forward, backward and optimizer step, each ended by a device sync (on a
//!   cold GPU they compile and tune every kernel);
//! - then `WARMUP` steps more, one step split into forward, backward and optimizer (each ended
//!   by a sync), and up to `TIMED` timed steps; the check stops early, as after a last step,
//!   when what `--seconds` leaves would not hold two more steps and the evaluation;
//! - the final evaluation reads one batch of the training shape (`Variant::batch` windows), so
//!   that it compiles nothing new (an evaluation over every window ends with a smaller batch,
//!   whose shapes tune again);
//! - `gpt/<stack>-<precision>`: the median tokens/s of the timed steps, MFU, the split step,
//!   the device memory cubecl holds.
//!
//! `gpt-profile` runs the same with cubecl's kernel profiling on (every kernel timed, a table
//! at each device sync, written to [`profile_log`]) for `PROFILED` split steps after the
//! warm-up, and reports the kernels that took the most time and how much of the steps' wall
//! time the kernels fill: a GPU that waits for the host shows up as a small fraction.
//!
//! `gpt2_torch.py` runs the same shape, batch and sequence length in PyTorch (bf16 autocast,
//! fused AdamW, SDPA, TF32), and the report puts the lines side by side: tokens/s and MFU by the
//! same formula.

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::time::Instant;

use burn_dist::{
    CubeResident, CudaBackend, CudaDevice, DdpConfig, DistributedAutodiff, DistributedBackend,
    Sharded,
};
use burn_dist_zero::ZeroAdam;
use clap::Parser;
use cubecl::Runtime;
use gpt_pretrain::cli::Args;
use gpt_pretrain::phases::{Observer, Phase, PhaseEvent, Split};
use gpt_pretrain::train::PlaceOptimizer;
use serde_json::json;

use crate::Options;
use crate::libraries::check_cuda_runtime;
use crate::report::{Report, guarded, median};

/// Sequences per step: 16 × 1024 tokens, as in gpt2_torch.py's default.
const BATCH: usize = 16;
const CONTEXT: usize = 1024;
/// Steps after the first that are not timed (kernels still compile and tune on them).
const WARMUP: u64 = 2;
/// Timed steps at most, after the warm-up and the split step.
const TIMED: u64 = 8;
/// gpt-profile: split steps profiled after the warm-up.
const PROFILED: u64 = 2;
/// Kept at the end of `--seconds`: the evaluation's metrics, dropping the model, the line.
const MARGIN_S: f64 = 15.0;
/// H100/H200 SXM dense bf16 tensor-core peak (gpt2_torch.py uses the same figure).
const PEAK_FLOPS: f64 = 989e12;
/// How many of the slowest kernels the profile line names.
const TOP_KERNELS: usize = 12;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Stack {
    Fusion,
    Cube,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Precision {
    F32,
    Bf16,
}

/// One configuration of our stack.
struct Variant {
    stack: Stack,
    precision: Precision,
    /// bf16: ZeroAdam's stage.
    stage: usize,
    /// bf16: ZeroAdam's state in host memory (`ZeroAdam::offloaded`) rather than the GPU's.
    offload: bool,
    /// `--model gpt-6b`: [`SIX_B`]'s shape, one sequence per step, instead of GPT-2 124M.
    six_b: bool,
}

/// `--model gpt-6b`: 30 layers of width 4096 (32 heads) on GPT-2's vocabulary, 6.25 B
/// parameters. At stage 3 with the state on the GPU, 14 bytes each (bf16 pieces, f32 master
/// weights and moments) are 87.5 GB, more than an 80 GB H100 holds; offloaded, the GPU holds
/// its 12.5 GB of bf16 pieces (and the 25 GB f32 gradient shard during a step) and the host
/// its 75 GB of state (issue 46's goal).
const SIX_B: [&str; 6] = ["--n-layer", "30", "--n-head", "32", "--d-model", "4096"];

impl Variant {
    fn of(options: &Options) -> Result<Variant, String> {
        let stack = match options.stack.as_str() {
            "fusion" => Stack::Fusion,
            "cube" => Stack::Cube,
            other => return Err(format!("--stack {other:?}: fusion or cube")),
        };
        let precision = match options.precision.as_str() {
            "f32" => Precision::F32,
            "bf16" => Precision::Bf16,
            other => return Err(format!("--precision {other:?}: f32 or bf16")),
        };
        let offload = match options.place.as_str() {
            "device" => false,
            "offload" => true,
            other => return Err(format!("--place {other:?}: device or offload")),
        };
        let stage = options.zero_stage;
        if !(1..=3).contains(&stage) {
            return Err(format!("--zero-stage {stage}: 1, 2 or 3"));
        }
        let six_b = match options.model.as_str() {
            "gpt2-124m" => false,
            "gpt-6b" => true,
            other => return Err(format!("--model {other:?}: gpt2-124m or gpt-6b")),
        };
        if precision == Precision::F32 && (offload || stage != 1 || six_b) {
            return Err(
                "--zero-stage, --place offload and --model gpt-6b need --precision \
                        bf16: the f32 run trains with Burn's AdamW, not ZeroAdam"
                    .into(),
            );
        }
        Ok(Variant {
            stack,
            precision,
            stage,
            offload,
            six_b,
        })
    }

    fn name(&self) -> String {
        let stack = match self.stack {
            Stack::Fusion => "fusion",
            Stack::Cube => "cube",
        };
        let precision = match self.precision {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        };
        let stage = match self.stage {
            1 => String::new(),
            stage => format!("-zero{stage}"),
        };
        let place = if self.offload { "-offload" } else { "" };
        let model = if self.six_b { "-6b" } else { "" };
        format!("{stack}-{precision}{stage}{place}{model}")
    }

    /// gpt-pretrain flags that differ between the variants.
    fn flags(&self) -> Vec<String> {
        let flags: &[&str] = match self.precision {
            Precision::F32 => &["--optimizer", "adamw"],
            Precision::Bf16 => &["--optimizer", "zero", "--precision", "bf16"],
        };
        let mut flags: Vec<String> = flags.iter().map(|s| s.to_string()).collect();
        if self.precision == Precision::Bf16 {
            flags.extend(["--zero-stage".to_string(), self.stage.to_string()]);
        }
        if self.six_b {
            flags.extend(SIX_B.iter().map(|s| s.to_string()));
        }
        flags
    }

    /// Sequences per step: [`BATCH`], or one for the 6 B shape (its activations at 16 would
    /// not fit beside it).
    fn batch(&self) -> usize {
        if self.six_b { 1 } else { BATCH }
    }

    /// Bytes per parameter the device holds between steps at world size 1, by the formula
    /// (docs/guide.md's memory table; S = Ψ): the bf16 parameters (2), and in device memory
    /// the f32 master weights and moments (12) and at stages 1 and 2 the model copy the
    /// kernels write (2); `None` for the f32 run (Burn's AdamW).
    fn device_bytes_per_parameter(&self) -> Option<u64> {
        match (self.precision, self.offload, self.stage) {
            (Precision::F32, ..) => None,
            (Precision::Bf16, true, _) => Some(2),
            (Precision::Bf16, false, 3) => Some(14),
            (Precision::Bf16, false, _) => Some(16),
        }
    }

    fn describe(&self) -> serde_json::Value {
        let bf16_optimizer = match (self.offload, self.stage) {
            (false, 1) => "ZeroAdam on the GPU (fused kernels), global-norm clipping 1.0".into(),
            (false, stage) => format!(
                "ZeroAdam stage {stage} on the GPU (fused kernels), global-norm clipping 1.0"
            ),
            (true, stage) => format!(
                "ZeroAdam stage {stage} offloaded (its state and step on the host), \
                 global-norm clipping 1.0"
            ),
        };
        let (precision, optimizer) = match self.precision {
            Precision::F32 => (
                "f32 parameters and compute (no autocast in Burn)",
                "Burn AdamW, global-norm clipping 1.0".to_string(),
            ),
            Precision::Bf16 => (
                "bf16 parameters and compute, f32 master weights",
                bf16_optimizer,
            ),
        };
        let stack = match self.stack {
            Stack::Fusion => "Burn's Cuda (burn-fusion on burn-cuda)",
            Stack::Cube => "burn-cuda without fusion (CubeBackend)",
        };
        json!({ "stack": stack, "precision": precision, "optimizer": optimizer })
    }
}

/// Where cubecl's profiling tables go for gpt-profile (set before any client exists).
pub fn profile_log() -> PathBuf {
    std::env::temp_dir().join(format!(
        "burn-dist-gpu-check-profile-{}.log",
        std::process::id()
    ))
}

pub fn run(report: &mut Report, options: &Options, profile: bool) {
    let kind = if profile { "gpt-profile" } else { "gpt" };
    let variant = match Variant::of(options) {
        Ok(variant) => variant,
        Err(e) => return report.fail(kind, e, json!({})),
    };
    let check = format!("{kind}/{}", variant.name());
    if let Err(e) = check_cuda_runtime() {
        return report.fail(&check, e, json!({}));
    }
    let started = Instant::now();
    type Sharded3<X> = burn::backend::Autodiff<DistributedBackend<X, Sharded>>;
    type Replicated<X> = burn::backend::Autodiff<DistributedBackend<X>>;
    let measured = guarded(|| match (variant.stack, variant.stage) {
        (Stack::Fusion, 3) => measure::<burn_cuda::Cuda, Sharded3<burn_cuda::Cuda>>(
            report, &check, &variant, options, profile,
        ),
        (Stack::Fusion, _) => measure::<burn_cuda::Cuda, Replicated<burn_cuda::Cuda>>(
            report, &check, &variant, options, profile,
        ),
        (Stack::Cube, 3) => measure::<CudaBackend, Sharded3<CudaBackend>>(
            report, &check, &variant, options, profile,
        ),
        (Stack::Cube, _) => measure::<CudaBackend, Replicated<CudaBackend>>(
            report, &check, &variant, options, profile,
        ),
    });
    let seconds = json!({ "seconds": started.elapsed().as_secs_f64() });
    match (measured, options.expect.as_str()) {
        (Ok(Ok(fields)), "train") => report.pass(&check, fields),
        (Ok(Err(e)) | Err(e), "train") => report.fail(&check, e, seconds),
        // A shape that fits only offloaded: `on_device` must refuse it by name.
        (Ok(Err(e)) | Err(e), "device-memory-error") if e.contains(DEVICE_MEMORY_ERROR) => report
            .pass(
                &check,
                json!({ "refused": e, "seconds": seconds["seconds"] }),
            ),
        (Ok(Err(e)) | Err(e), "device-memory-error") => report.fail(
            &check,
            format!("expected ZeroAdam's device-memory refusal, got: {e}"),
            seconds,
        ),
        (Ok(Ok(fields)), "device-memory-error") => report.fail(
            &check,
            "trained with the state in device memory: expected ZeroAdam's device-memory refusal",
            fields,
        ),
        (_, other) => report.fail(
            &check,
            format!("--expect {other:?}: train or device-memory-error"),
            seconds,
        ),
    }
}

/// What `ZeroError::DeviceMemory`'s message starts with, after the rank.
const DEVICE_MEMORY_ERROR: &str = "ZeroAdam's state in device memory needs";

/// Watches the run's phases: writes the first-step line, keeps every step's time, asks for the
/// split steps and stops the run when `--seconds` runs short.
struct Watch<'r> {
    report: &'r mut Report,
    check: String,
    started: Instant,
    seconds: Option<f64>,
    /// Steps split into their parts: the one after the warm-up, or the profiled ones.
    split: std::ops::RangeInclusive<u64>,
    /// The last step to run.
    last: u64,
    /// (step, seconds, split) of every step.
    steps: Vec<(u64, f64, Option<Split>)>,
    /// The first step's phases: (name, seconds at its end since the check started).
    first: Vec<(&'static str, f64)>,
    stopped: Option<String>,
    /// gpt-profile: the profile log's length when the warm-up ended and when the profiled
    /// steps did.
    profile_marks: Option<(u64, u64)>,
    profile: bool,
    /// Reads the device memory cubecl holds: (in use, reserved) bytes.
    memory: &'r dyn Fn() -> Option<(u64, u64)>,
    /// After each step from the second on (between steps): (in use, reserved) bytes.
    between_steps: Vec<(u64, u64)>,
}

impl Watch<'_> {
    fn since_start(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    fn first_step_line(&mut self, took_s: f64) {
        let mut fields = serde_json::Map::new();
        for (name, at) in &self.first {
            fields.insert(format!("{name}_at_s"), json!(at));
        }
        fields.insert("first_step_s".into(), json!(took_s));
        let check = format!("{}/first-step", self.check);
        self.report.pass(&check, serde_json::Value::Object(fields));
    }

    /// Whether two more steps and the evaluation (as long as the slowest step after the
    /// first) still fit in `--seconds`.
    fn time_is_short(&self) -> Option<String> {
        let limit = self.seconds?;
        let later: Vec<f64> = self.steps.iter().skip(1).map(|s| s.1).collect();
        let step = later.iter().copied().fold(f64::NAN, f64::max);
        let step = if step.is_nan() { self.steps[0].1 } else { step };
        let needed = 3.0 * step + MARGIN_S;
        let left = limit - self.since_start();
        (left < needed).then(|| {
            format!(
                "stopped after step {}: {left:.0} s of its {limit:.0} s were left, and two more \
                 steps and the evaluation need about {needed:.0} s",
                self.steps.len()
            )
        })
    }
}

impl Observer for Watch<'_> {
    fn observe(&mut self, event: &PhaseEvent) -> ControlFlow<()> {
        let at = self.since_start();
        match &event.phase {
            Phase::ModelBuilt => self.first.push(("model_built", at)),
            Phase::FirstForward => self.first.push(("first_forward", at)),
            Phase::FirstBackward => self.first.push(("first_backward", at)),
            Phase::FirstOptimizerStep => self.first.push(("first_optimizer_step", at)),
            Phase::Evaluated { .. } => {}
            Phase::Step { step, split, .. } => {
                let step = *step;
                self.steps.push((step, event.took_s, *split));
                if step > 1
                    && let Some(memory) = (self.memory)()
                {
                    self.between_steps.push(memory);
                }
                if step == 1 {
                    self.first_step_line(event.took_s);
                }
                if self.profile {
                    // cubecl writes a table at each device sync. The step before the profiled
                    // ones is split too, so its last table is written when it ends; the step
                    // after them is not, so nothing of it is written before it ends.
                    let length = std::fs::metadata(profile_log()).map_or(0, |m| m.len());
                    let (first, last) = (*self.split.start() + 1, *self.split.end());
                    if step == first - 1 {
                        self.profile_marks = Some((length, length));
                    } else if step == last + 1
                        && let Some(marks) = &mut self.profile_marks
                    {
                        marks.1 = length;
                    }
                }
                if step >= self.last {
                    return ControlFlow::Break(());
                }
                if let Some(reason) = self.time_is_short() {
                    self.stopped = Some(reason);
                    return ControlFlow::Break(());
                }
            }
        }
        ControlFlow::Continue(())
    }

    fn split(&self, step: u64) -> bool {
        self.split.contains(&step)
    }
}

/// Trains the variant as `T` (replicated or sharded) on backend `X` and returns its line's
/// fields.
fn measure<X, T>(
    report: &mut Report,
    check: &str,
    variant: &Variant,
    options: &Options,
    profile: bool,
) -> Result<serde_json::Value, String>
where
    X: CubeResident<Runtime = cubecl::cuda::CudaRuntime, Device = CudaDevice>,
    T: DistributedAutodiff<Device = CudaDevice>,
{
    let scratch = std::env::temp_dir().join(format!(
        "gpu-check-{}-{}",
        check.replace('/', "-"),
        std::process::id()
    ));
    let metrics = scratch.join("metrics.jsonl");
    // Steps: the first, the warm-up, then the split step, then the timed ones. gpt-profile: the
    // first and the warm-up, the last of which is split too (its kernels' tables are then
    // written when it ends), the profiled split steps, and one step more, unsplit (its end
    // marks the end of the profiled tables).
    let (split, last) = if profile {
        (WARMUP + 1..=WARMUP + 1 + PROFILED, WARMUP + 2 + PROFILED)
    } else {
        (WARMUP + 2..=WARMUP + 2, WARMUP + 2 + TIMED)
    };
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
        "--phase-log",
        "--no-plot",
    ];
    let args = fixed
        .iter()
        .map(|s| s.to_string())
        .chain(variant.flags())
        .chain([
            "--steps".into(),
            last.to_string(),
            "--global-batch".into(),
            variant.batch().to_string(),
            "--eval-sequences".into(),
            variant.batch().to_string(),
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
    let device = CudaDevice::new(options.device);
    let on_device = |zero: ZeroAdam, ddp: &burn_dist::Ddp| zero.on_device::<X>(ddp, &device);
    let offloaded = |zero: ZeroAdam, ddp: &burn_dist::Ddp| zero.offloaded::<X>(ddp, &device);
    let place: PlaceOptimizer = match (variant.precision, variant.offload) {
        (Precision::Bf16, false) => &on_device,
        (Precision::Bf16, true) => &offloaded,
        (Precision::F32, _) => &|zero, _| Ok(zero),
    };
    let client = X::Runtime::client(&device);
    let memory = || {
        let usage = client.memory_usage().ok()?;
        Some((usage.bytes_in_use, usage.bytes_reserved))
    };
    let mut watch = Watch {
        report,
        check: check.to_string(),
        started: Instant::now(),
        seconds: options.seconds.map(|s| s as f64),
        split: split.clone(),
        last,
        steps: Vec::new(),
        first: Vec::new(),
        stopped: None,
        profile_marks: None,
        profile,
        memory: &memory,
        between_steps: Vec::new(),
    };
    // Each run joins (and, dropping its Ddp, leaves) its own world-size-1 group.
    let mut ddp = crate::ddp_step::join_for::<X>(&device, DdpConfig::new())?;
    let outcome =
        gpt_pretrain::train::run_observed::<T>(&args, &mut ddp, &device, place, Some(&mut watch));
    // What the formula of the device's memory between steps counts, and what the offloaded
    // steps waited for the gradient shard.
    let parameters: u64 = ddp.params().iter().map(|p| p.numel() as u64).sum();
    let shard_wait_s = ddp.stats().shard_wait_nanos as f64 * 1e-9;
    drop(ddp);
    let memory = X::Runtime::client(&device).memory_usage().ok();
    let records = gpt_pretrain::metrics::read(&metrics);
    let _ = std::fs::remove_dir_all(&scratch);
    let (outcome, records) = (outcome?, records?);
    let timed: Vec<f64> = watch
        .steps
        .iter()
        .filter(|(step, _, split)| *step > WARMUP + 1 && split.is_none())
        .map(|s| s.1)
        .collect();
    let split_step = watch.steps.iter().find_map(|s| s.2.filter(|_| s.0 > 1));
    let mut fields = json!({
        "batch": variant.batch(),
        "context": CONTEXT,
        "steps": watch.steps.len(),
        "steps_timed": timed.len(),
        "first_step_s": watch.steps.first().map(|s| s.1),
        "final_loss": outcome.final_loss,
        "val_loss": outcome.final_val_loss,
        "eval_sequences": variant.batch(),
        "peak_flops": PEAK_FLOPS,
        "stopped_early": watch.stopped,
        "device_bytes_reserved": memory.as_ref().map(|m| m.bytes_reserved),
        "seconds": watch.since_start(),
    });
    merge(&mut fields, variant.describe());
    if let Some(per_parameter) = variant.device_bytes_per_parameter() {
        let in_use: Vec<f64> = watch.between_steps.iter().map(|m| m.0 as f64).collect();
        let reserved = watch.between_steps.iter().map(|m| m.1).max();
        let formula = per_parameter * parameters;
        let between = (!in_use.is_empty()).then(|| median(&in_use));
        merge(
            &mut fields,
            json!({
                "zero_stage": variant.stage,
                "offload": variant.offload,
                "parameters": parameters,
                "device_bytes_between_steps": between,
                "device_bytes_reserved_max": reserved,
                "formula_bytes_between_steps": formula,
                "formula_bytes_per_parameter": per_parameter,
                "between_steps_over_formula": between.map(|b| b / formula as f64),
                "shard_wait_s_per_step": shard_wait_s / watch.steps.len().max(1) as f64,
            }),
        );
    }
    // A profiled run's times are the profiler's: its line gives kernels, not a rate.
    if let Some(split) = split_step.filter(|_| !profile) {
        merge(
            &mut fields,
            json!({
                "split_forward_s": split.forward_s,
                "split_backward_s": split.backward_s,
                "split_optimizer_s": split.optimizer_s,
            }),
        );
    }
    if !timed.is_empty() && !profile {
        let step_s = median(&timed);
        let tokens_per_s = (variant.batch() * CONTEXT) as f64 / step_s;
        let flops_per_token = records
            .first()
            .map_or(f64::NAN, |r| r.flops_per_s / r.tokens_per_s);
        merge(
            &mut fields,
            json!({
                "tokens_per_s": tokens_per_s,
                "step_ms": step_s * 1e3,
                "mfu": flops_per_token * tokens_per_s / PEAK_FLOPS,
            }),
        );
    }
    if profile {
        let (from, to) = watch.profile_marks.unwrap_or((0, 0));
        let profiled: Vec<f64> = watch
            .steps
            .iter()
            .filter(|s| s.0 > *split.start() && s.0 <= *split.end())
            .map(|s| s.1)
            .collect();
        merge(&mut fields, kernels_profiled(from, to, &profiled)?);
        let _ = std::fs::remove_file(profile_log());
    } else if timed.is_empty() {
        return Err(format!(
            "no timed step: {} steps in {:.0} s (the first took {:.1} s){}",
            watch.steps.len(),
            watch.since_start(),
            watch.steps.first().map_or(f64::NAN, |s| s.1),
            watch
                .stopped
                .as_ref()
                .map_or(String::new(), |s| format!("; {s}"))
        ));
    }
    Ok(fields)
}

fn merge(into: &mut serde_json::Value, from: serde_json::Value) {
    if let (Some(into), serde_json::Value::Object(from)) = (into.as_object_mut(), from) {
        into.extend(from);
    }
}

/// The kernels of the profile log between byte offsets `from` and `to` (the profiled steps,
/// whose wall times are `wall_s`): the slowest, their share, and how much of the steps' wall
/// time all kernels together fill.
fn kernels_profiled(from: u64, to: u64, wall_s: &[f64]) -> Result<serde_json::Value, String> {
    let path = profile_log();
    let text = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let (from, to) = (from as usize, (to as usize).min(text.len()));
    let text = String::from_utf8_lossy(&text[from.min(to)..to]);
    let kernels = crate::profile::Kernels::parse(&text);
    if kernels.tables == 0 {
        return Err(format!(
            "cubecl wrote no profiling table into {} during the profiled steps ({from}..{to})",
            path.display()
        ));
    }
    let wall: f64 = wall_s.iter().sum();
    let total = kernels.total_s();
    let top: Vec<serde_json::Value> = kernels
        .slowest(TOP_KERNELS)
        .iter()
        .map(|k| {
            json!({
                "kernel": k.name.chars().take(120).collect::<String>(),
                "seconds_per_step": k.seconds / wall_s.len().max(1) as f64,
                "launches_per_step": k.launches as f64 / wall_s.len().max(1) as f64,
                "share_of_kernel_time": k.seconds / total,
            })
        })
        .collect();
    Ok(json!({
        "profiled_steps": wall_s.len(),
        "profile_tables": kernels.tables,
        "kernel_s_per_step": total / wall_s.len().max(1) as f64,
        "wall_s_per_step": wall / wall_s.len().max(1) as f64,
        "kernel_fraction_of_wall": total / wall,
        "kernel_launches_per_step": kernels.launches() as f64 / wall_s.len().max(1) as f64,
        "slowest_kernels": top,
    }))
}
