//! `device-path`: the device path on Burn's default `Cuda` (fusion on), NCCL at world size 1
//! (issue 14, item 7).
//!
//! - `device-path/fusion-ddp`: a transformer block trained with Adam on
//!   `Autodiff<DistributedBackend<Cuda>>`, prepared by a `Ddp` built with `Ddp::with_nccl::<Cuda>`,
//!   against the same model never prepared (plain `Cuda`: no hook runs). At world size 1 the
//!   average is the identity: the parameters must agree (1e-6) after every step, and the reducer
//!   must have moved no byte between host and device (`bytes_to_host`, `bytes_to_device` 0:
//!   fusion's gradients are resolved and reduced in device memory).
//! - `device-path/zero-step/stage-1` and `/stage-2` (one line each, written as each is done):
//!   ZeroAdam at stages 1 and 2 with its state in device memory
//!   (`ZeroAdam::on_device::<Cuda>`) over that `Ddp`, against ZeroAdam on the host path on the
//!   same backend (a thread of its own with a host group of one): parameters within 1e-5, and
//!   per step exactly the scalars cross (8 bytes down: the shard's sum of squares and found-inf;
//!   48 up: `1 / scale`, the agreed totals, nine hyper-parameters). The step times are reported.
//! - `device-path/stage-3`: ZeRO stage 3 on the device path (`DistributedBackend<Cuda,
//!   Sharded>`, `Ddp::prepare_sharded` on the NCCL `Ddp`, ZeroAdam at stage 3 on the device):
//!   each gather writes into fresh cubecl buffers through NCCL, the fused step updates the
//!   pieces in place. Against ZeroAdam at stage 2 on the device, on the same model and batches:
//!   the parameters (within 1e-5, f32 rounding: fusion sees the gathered weights as new
//!   tensors), exactly the scalars crossing per step (the gathers move no byte through the
//!   host), the step times, the gathers per step and the time spent waiting for them (medians
//!   over the steps after the first, which compiles), and each stage's device memory from cubecl's own count (`memory_usage()`)
//!   between steps, against the formula (stage 2: 4Ψ + 16S bytes; stage 3: 12S, the pieces
//!   being the master weights; Ψ the parameters, S the rank's shard, the whole model at world
//!   size 1), and the most in use at any gradient's arrival in one more step (activations
//!   included, so reported, not held to the formula).

use std::time::Instant;

use burn::optim::AdamConfig;
use burn_cuda::Cuda;
use burn_dist::{CudaDevice, Ddp, DdpConfig, DistributedBackend};
use burn_dist_comm::{CommConfig, HostCommunicator};
use burn_dist_models::relative_error;
use burn_dist_models::step::{LR, StepConfig, float_params, transformer_step};
use burn_dist_zero::ZeroAdamConfig;
use serde_json::json;

use crate::Options;
use crate::libraries::check_cuda_runtime;
use crate::report::{Report, Status, guarded, median};

type B = burn::backend::Autodiff<DistributedBackend<Cuda>>;

/// About 9.5 M parameters, as `ddp-step`.
const CONFIG: StepConfig = StepConfig {
    d_model: 1024,
    heads: 16,
    batch: 16,
    seq: 128,
    seed: 29,
};
const STEPS: usize = 6;
/// The lines of this check, in the order they are written.
/// In this order, each line written as soon as its part is done. `fusion-ddp` pays the cold
/// compilation and autotuning of the block's fused kernels (166 s on an H200, 2026-12-04),
/// which the later lines reuse: after it the stage-3 line took 15 s, while first it did not
/// finish within the check's limit.
const CHECKS: [&str; 4] = [
    "device-path/fusion-ddp",
    "device-path/zero-step/stage-1",
    "device-path/zero-step/stage-2",
    "device-path/stage-3",
];
/// Stage 3 against stage 2, both on the device: f32 rounding. The gathered weights reach
/// fusion as new tensors of fresh buffers, so fusion may fuse and tune their ops otherwise
/// than stage 2's resident weights (the first H200 run: 3.45e-6 after 7 steps); as the
/// zero-step lines against the host path.
const STAGE3_TOLERANCE: f64 = 1e-5;
/// Bytes in use between steps that the formula leaves out (the optimizer's scalars and
/// per-cube partials, a loss, stand-ins): at most this much, plus 1 %.
const SMALL_BYTES: u64 = 1 << 20;
/// Bytes per step of ZeroAdam's scalars on the NCCL path: down, up.
const SCALARS: (u64, u64) = (8, 4 + 8 + 36);

pub fn run(report: &mut Report, options: &Options) {
    if let Err(e) = check_cuda_runtime() {
        return report.fail("device-path/runtime", e, json!({}));
    }
    let device = CudaDevice {
        index: options.device,
    };
    let mut ddp = match crate::ddp_step::join_for::<Cuda>(&device, DdpConfig::new()) {
        Ok(ddp) => ddp,
        Err(e) => {
            for check in CHECKS {
                report.fail(check, format!("joining a group of one: {e}"), json!({}));
            }
            return;
        }
    };
    // Each line is written as soon as its part is done, so that a timeout late in the suite
    // (fusion's autotune and 24 more transformer steps come after fusion-ddp) keeps the parts
    // before it.
    let runs: [Check; 4] = [
        fusion_ddp,
        |ddp, d| zero_step(ddp, d, 1),
        |ddp, d| zero_step(ddp, d, 2),
        stage_three,
    ];
    for (check, run) in CHECKS.into_iter().zip(runs) {
        match guarded(|| run(&mut ddp, &device)) {
            Ok(Ok((status, fields))) => report.line(check, status, fields),
            Ok(Err(e)) => report.fail(check, e, json!({})),
            Err(panic) => report.fail(check, format!("panicked: {panic}"), json!({})),
        }
    }
}

type Check = fn(&mut Ddp, &CudaDevice) -> Result<(Status, serde_json::Value), String>;

fn fusion_ddp(ddp: &mut Ddp, device: &CudaDevice) -> Result<(Status, serde_json::Value), String> {
    let mut plain = CONFIG.model::<B>(device);
    let mut synced = ddp
        .prepare(CONFIG.model::<B>(device))
        .map_err(|e| e.to_string())?;
    let (mut plain_optim, mut synced_optim) = (AdamConfig::new().init(), AdamConfig::new().init());
    let (mut plain_ms, mut synced_ms, mut worst) = (Vec::new(), Vec::new(), 0.0f64);
    for step in 0..STEPS {
        let (x, y) = CONFIG.batch::<B>(step, device);
        let start = Instant::now();
        plain = transformer_step(plain, &mut plain_optim, x.clone(), y.clone(), LR).0;
        let _ = float_params::<B, _>(&plain);
        plain_ms.push(start.elapsed().as_secs_f64() * 1e3);
        let start = Instant::now();
        synced = transformer_step(synced, &mut synced_optim, x, y, LR).0;
        let after = float_params::<B, _>(&synced);
        synced_ms.push(start.elapsed().as_secs_f64() * 1e3);
        for (a, b) in after.iter().zip(float_params::<B, _>(&plain).iter()) {
            worst = worst.max(relative_error(a, b));
        }
    }
    let stats = ddp.stats();
    let fields = json!({
        "steps": STEPS,
        "max_relative_error": worst,
        "bytes_to_host": stats.bytes_to_host,
        "bytes_to_device": stats.bytes_to_device,
        "device_launches": stats.device_launches,
        "private_copies": stats.private_copies,
        "plain_ms_median": median(&plain_ms),
        "ddp_ms_median": median(&synced_ms),
    });
    let passed = worst <= 1e-6
        && stats.bytes_to_host == 0
        && stats.bytes_to_device == 0
        && stats.device_launches > 0;
    Ok((if passed { Status::Pass } else { Status::Fail }, fields))
}

fn zero_step(
    ddp: &mut Ddp,
    device: &CudaDevice,
    stage: u8,
) -> Result<(Status, serde_json::Value), String> {
    let (passed, fields) = zero_stage(ddp, device, stage)?;
    Ok((if passed { Status::Pass } else { Status::Fail }, fields))
}

/// ZeroAdam at ZeRO `stage` on the device path against its host path.
fn zero_stage(
    ddp: &mut Ddp,
    device: &CudaDevice,
    stage: u8,
) -> Result<(bool, serde_json::Value), String> {
    let zero = ZeroAdamConfig::new().with_stage(stage);
    // The host path on the same backend, on a thread of its own (its `Ddp` serves that thread).
    let reference = {
        let (zero, device) = (zero.clone(), device.clone());
        std::thread::spawn(move || -> Result<Vec<Vec<f32>>, String> {
            let comm = HostCommunicator::local_group(1, &CommConfig::default()).remove(0);
            let mut host = Ddp::for_thread(comm, DdpConfig::new());
            let model = host
                .prepare(CONFIG.model::<B>(&device))
                .map_err(|e| e.to_string())?;
            let mut optim = zero
                .init::<B, _>(&host, &model)
                .map_err(|e| e.to_string())?;
            train(&mut host, model, &mut optim, &device).map(|(params, _)| params)
        })
        .join()
        .map_err(|_| "the host-path reference panicked".to_string())??
    };
    let model = ddp
        .prepare(CONFIG.model::<B>(device))
        .map_err(|e| e.to_string())?;
    let mut optim = zero
        .init::<B, _>(ddp, &model)
        .and_then(|z| z.on_device::<Cuda>(ddp, device))
        .map_err(|e| e.to_string())?;
    let before = optim.traffic().unwrap_or_default();
    let (params, ms) = train(ddp, model, &mut optim, device)?;
    let moved = optim.traffic().unwrap_or_default().since(before);
    let worst = params
        .iter()
        .zip(&reference)
        .map(|(a, b)| relative_error(a, b))
        .fold(0.0f64, f64::max);
    let expected = (STEPS as u64 * SCALARS.0, STEPS as u64 * SCALARS.1);
    let fields = json!({
        "stage": stage,
        "steps": STEPS,
        "max_relative_error_vs_host": worst,
        "bytes_to_host": moved.to_host,
        "bytes_to_device": moved.to_device,
        "expected_bytes": [expected.0, expected.1],
        "step_ms_median": median(&ms),
    });
    Ok((
        worst <= 1e-5 && (moved.to_host, moved.to_device) == expected,
        fields,
    ))
}

/// `STEPS` ZeroAdam steps on `CONFIG`'s batches; the final parameters and each step's time.
fn train(
    ddp: &mut Ddp,
    model: burn_dist_models::TransformerBlock<B>,
    optim: &mut burn_dist_zero::ZeroAdam,
    device: &CudaDevice,
) -> Result<(Vec<Vec<f32>>, Vec<f64>), String> {
    let (model, ms) = steps(ddp, model, optim, device, 0..STEPS)?;
    Ok((float_params::<B, _>(&model), ms))
}

/// ZeroAdam steps `range` (batch indices) of `model` on any autodiff backend over `Cuda`, each
/// timed to the end of its kernels.
fn steps<A: burn::tensor::backend::AutodiffBackend<Device = CudaDevice>>(
    ddp: &mut Ddp,
    model: burn_dist_models::TransformerBlock<A>,
    optim: &mut burn_dist_zero::ZeroAdam,
    device: &CudaDevice,
    range: std::ops::Range<usize>,
) -> Result<(burn_dist_models::TransformerBlock<A>, Vec<f64>), String> {
    steps_then(ddp, model, optim, device, range, |_| {})
}

/// [`steps`], calling `after(ddp)` at the end of each step.
fn steps_then<A: burn::tensor::backend::AutodiffBackend<Device = CudaDevice>>(
    ddp: &mut Ddp,
    mut model: burn_dist_models::TransformerBlock<A>,
    optim: &mut burn_dist_zero::ZeroAdam,
    device: &CudaDevice,
    range: std::ops::Range<usize>,
    mut after: impl FnMut(&Ddp),
) -> Result<(burn_dist_models::TransformerBlock<A>, Vec<f64>), String> {
    let mut ms = Vec::new();
    for step in range {
        let (x, y) = CONFIG.batch::<A>(step, device);
        let start = Instant::now();
        let loss = (model.forward(x) - y).powi_scalar(2).mean();
        let grads = ddp
            .backward(loss, &model)
            .map_err(|e| e.to_string())?
            .ok_or("no gradients at the end of a window of one")?;
        model = optim
            .step(LR, model, grads, ddp)
            .map_err(|e| e.to_string())?
            .0;
        <Cuda as burn::tensor::backend::Backend>::sync(device).map_err(|e| format!("{e:?}"))?;
        ms.push(start.elapsed().as_secs_f64() * 1e3);
        after(ddp);
    }
    Ok((model, ms))
}

/// Bytes cubecl holds in use on `device` once its queued work has run.
fn in_use(device: &CudaDevice) -> Result<u64, String> {
    use cubecl::Runtime;
    <Cuda as burn::tensor::backend::Backend>::sync(device).map_err(|e| format!("{e:?}"))?;
    cubecl::cuda::CudaRuntime::client(device)
        .memory_usage()
        .map(|usage| usage.bytes_in_use)
        .map_err(|e| format!("cubecl's memory usage: {e:?}"))
}

/// What one stage's run on the device path leaves: parameters, step times, device memory
/// between steps and at most during one more step.
struct StageRun {
    params: Vec<Vec<f32>>,
    ms: Vec<f64>,
    between_steps: u64,
    peak: u64,
    moved: burn_dist::Traffic,
    /// Stage 3: what each timed step gathered (its own counts, not cumulative).
    per_step: Vec<burn_dist::ShardStats>,
}

/// ZeroAdam at `stage` (2 or 3) on the device path of `ddp`, model prepared for that stage.
fn stage_run<A>(ddp: &mut Ddp, device: &CudaDevice, stage: u8) -> Result<StageRun, String>
where
    A: burn_dist::DistributedAutodiff<Device = CudaDevice>,
{
    let model = A::prepare_model(ddp, CONFIG.model::<A>(device)).map_err(|e| e.to_string())?;
    let mut optim = ZeroAdamConfig::new()
        .with_stage(stage)
        .init::<A, _>(ddp, &model)
        .and_then(|z| z.on_device::<Cuda>(ddp, device))
        .map_err(|e| e.to_string())?;
    let before = optim.traffic().unwrap_or_default();
    let mut last = ddp.shard_stats().unwrap_or_default();
    let mut per_step = Vec::new();
    let (model, ms) = steps_then(ddp, model, &mut optim, device, 0..STEPS, |ddp| {
        if let Some(now) = ddp.shard_stats() {
            per_step.push(burn_dist::ShardStats {
                gathers: now.gathers - last.gathers,
                gathered_bytes: now.gathered_bytes - last.gathered_bytes,
                wait_nanos: now.wait_nanos - last.wait_nanos,
                prefetched: now.prefetched - last.prefetched,
                ..now
            });
            last = now;
        }
    })?;
    let moved = optim.traffic().unwrap_or_default().since(before);
    let between_steps = in_use(device)?;
    // One more step with the memory read at every gradient's arrival.
    let peak = std::sync::Arc::new(std::sync::Mutex::new(between_steps));
    let (watched, watched_device) = (peak.clone(), device.clone());
    ddp.set_observer(move |_, _| {
        if let Ok(now) = in_use(&watched_device) {
            let mut peak = watched.lock().unwrap_or_else(|e| e.into_inner());
            *peak = (*peak).max(now);
        }
    });
    let (model, _) = steps(ddp, model, &mut optim, device, STEPS..STEPS + 1)?;
    ddp.set_observer(|_, _| {});
    let peak = *peak.lock().unwrap_or_else(|e| e.into_inner());
    // Read once at the end (a read of a sharded model gathers every parameter).
    let params = float_params::<A, _>(&model);
    Ok(StageRun {
        params,
        ms,
        between_steps,
        peak,
        moved,
        per_step,
    })
}

/// `device-path/stage-3`: see the module docs.
fn stage_three(ddp: &mut Ddp, device: &CudaDevice) -> Result<(Status, serde_json::Value), String> {
    type Stage3 = burn::backend::Autodiff<DistributedBackend<Cuda, burn_dist::Sharded>>;
    let two = stage_run::<B>(ddp, device, 2)?;
    let three = stage_run::<Stage3>(ddp, device, 3)?;
    let numels: Vec<usize> = two.params.iter().map(Vec::len).collect();
    let layout = burn_dist::FlatLayout::new(&numels, 1, burn_dist::SHARD_ALIGN);
    let (total, shard) = (layout.total as u64, layout.shard_len as u64);
    let formula = [4 * total + 16 * shard, 12 * shard];
    let fits = |measured: u64, formula: u64| {
        (formula..=formula + formula / 100 + SMALL_BYTES).contains(&measured)
    };
    let worst = three
        .params
        .iter()
        .zip(&two.params)
        .map(|(a, b)| relative_error(a, b))
        .fold(0.0f64, f64::max);
    let expected = (STEPS as u64 * SCALARS.0, STEPS as u64 * SCALARS.1);
    // Medians over the steps after the first (which compiles and records the schedule).
    let after_first = three.per_step.get(1..).unwrap_or_default();
    let per_step = |count: fn(&burn_dist::ShardStats) -> u64| {
        median(
            &after_first
                .iter()
                .map(|s| count(s) as f64)
                .collect::<Vec<_>>(),
        )
    };
    let fields = json!({
        "steps": STEPS,
        "parameters": total,
        "max_relative_error_vs_stage_2": worst,
        "bytes_to_host": three.moved.to_host,
        "bytes_to_device": three.moved.to_device,
        "expected_bytes": [expected.0, expected.1],
        "stage2_ms_median": median(&two.ms),
        "stage3_ms_median": median(&three.ms),
        "stage2_first_step_ms": two.ms.first(),
        "stage3_first_step_ms": three.ms.first(),
        "gathers_per_step": per_step(|s| s.gathers),
        "gathered_mib_per_step": per_step(|s| s.gathered_bytes) / (1u64 << 20) as f64,
        "prefetched_per_step": per_step(|s| s.prefetched),
        "gather_wait_ms_per_step": per_step(|s| s.wait_nanos) / 1e6,
        "first_step_gather_wait_ms": three.per_step.first().map(|s| s.wait_nanos as f64 / 1e6),
        "stage2_bytes_between_steps": two.between_steps,
        "stage2_formula_bytes": formula[0],
        "stage3_bytes_between_steps": three.between_steps,
        "stage3_formula_bytes": formula[1],
        "stage2_peak_bytes": two.peak,
        "stage3_peak_bytes": three.peak,
    });
    let passed = worst <= STAGE3_TOLERANCE
        && (three.moved.to_host, three.moved.to_device) == expected
        && fits(two.between_steps, formula[0])
        && fits(three.between_steps, formula[1]);
    Ok((if passed { Status::Pass } else { Status::Fail }, fields))
}
