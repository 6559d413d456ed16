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
const CHECKS: [&str; 3] = [
    "device-path/fusion-ddp",
    "device-path/zero-step/stage-1",
    "device-path/zero-step/stage-2",
];
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
    let runs: [Check; 3] = [
        fusion_ddp,
        |ddp, d| zero_step(ddp, d, 1),
        |ddp, d| zero_step(ddp, d, 2),
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
    mut model: burn_dist_models::TransformerBlock<B>,
    optim: &mut burn_dist_zero::ZeroAdam,
    device: &CudaDevice,
) -> Result<(Vec<Vec<f32>>, Vec<f64>), String> {
    let mut ms = Vec::new();
    for step in 0..STEPS {
        let (x, y) = CONFIG.batch::<B>(step, device);
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
        let _ = float_params::<B, _>(&model);
        ms.push(start.elapsed().as_secs_f64() * 1e3);
    }
    Ok((float_params::<B, _>(&model), ms))
}
