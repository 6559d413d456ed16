//! `fused-step`: the fused ZeroAdam step (both passes, bf16 model copy, clipping on) at
//! `--elements` f32 parameters, timed with a synchronised wall clock (median of single
//! steps after warm-up), next to a device copy of the same kind (the bandwidth yardstick),
//! and Burn's stock AdamW on burn-cuda tensors (fusion and autotune on, as users get it).
//!
//! Effective bandwidth counts each byte the step must read or write once:
//! - fused step: pass 1 reads and writes g (8 B); pass 2 reads master, m, v, g (16 B) and
//!   writes master, m, v (12 B) and the bf16 model copy (2 B): 38 B per element;
//! - AdamW (Burn's, and PyTorch's in `fused_adamw_torch.py`): reads p, g, m, v and writes
//!   p, m, v: 28 B per element;
//! - copy: 4 B read + 4 B written per element.
//!
//! The JSON lines carry the same fields as `fused_adamw_torch.py`'s: `elements`, `ms_median`,
//! `ms_min`, `iters`, `bytes_per_element`, `effective_gbps`, `copy_gbps`, `fraction_of_copy`.

use std::time::Instant;

use burn::optim::{AdamWConfig, SimpleOptimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_cuda::Cuda;
use burn_dist_kernels::testing::{Rng, random_state};
use burn_dist_kernels::{FusedAdam, Hyper, ModelDtype, StepScalars};
use cubecl::Runtime;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use serde_json::{Value, json};

use crate::Options;
use crate::libraries::check_cuda_runtime;
use crate::report::{Report, guarded, median};

const FUSED_BYTES: usize = 38;
const ADAMW_BYTES: usize = 28;
const COPY_BYTES: usize = 8;
const WARMUP: usize = 3;
const ITERS: usize = 20;
const BURN_ITERS: usize = 10;
/// Random values are generated for a block this long and tiled (1 B random values would
/// take most of the time budget on one core).
const BLOCK: usize = 1 << 20;

pub fn run(report: &mut Report, options: &Options) {
    if let Err(e) = check_cuda_runtime() {
        return report.fail("fused-step/fused", e, json!({}));
    }
    let n = options.elements.next_multiple_of(4);
    let free = match free_memory(options.device) {
        Ok(free) => free,
        Err(e) => return report.fail("fused-step/fused", e, json!({})),
    };
    let copy_gbps = match guarded(|| fused_and_copy(report, options.device, n)) {
        Ok(Ok(copy_gbps)) => copy_gbps,
        Ok(Err(e)) => return report.fail("fused-step/fused", e, json!({ "elements": n })),
        Err(panic) => return report.fail("fused-step/fused", panic, json!({ "elements": n })),
    };
    // Burn's AdamW at the same size if it fits next to what the fused step still holds in
    // cubecl's pool (~22 B per element), else at a smaller size (the line says which).
    let mut m = n;
    while m > BLOCK && (22 * n + 40 * m) as f64 > 0.9 * free as f64 {
        m /= 2;
    }
    match guarded(|| burn_adamw(options.device, m)) {
        Ok(Ok(times)) => {
            let mut fields = timing_fields(m, ADAMW_BYTES, &times, copy_gbps);
            fields["same_size_as_fused"] = json!(m == n);
            report.pass("fused-step/burn-adamw", fields);
        }
        Ok(Err(e)) => report.fail("fused-step/burn-adamw", e, json!({ "elements": m })),
        Err(panic) => report.fail("fused-step/burn-adamw", panic, json!({ "elements": m })),
    }
}

fn free_memory(device: usize) -> Result<usize, String> {
    let ctx = cudarc::driver::CudaContext::new(device)
        .map_err(|e| format!("opening GPU {device}: {e:?}"))?;
    let (free, _total) = ctx
        .mem_get_info()
        .map_err(|e| format!("reading GPU {device}'s free memory: {e:?}"))?;
    Ok(free)
}

/// `len` values: a random block of `BLOCK`, repeated.
fn tiled(block: &[f32], len: usize) -> Vec<f32> {
    block.iter().copied().cycle().take(len).collect()
}

/// Times `f` (one step, then a device sync) `iters` times after `warmup` runs; milliseconds.
fn time(warmup: usize, iters: usize, mut f: impl FnMut()) -> Vec<f64> {
    for _ in 0..warmup {
        f();
    }
    (0..iters)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect()
}

fn gbps(elements: usize, bytes_per_element: usize, ms: f64) -> f64 {
    (elements * bytes_per_element) as f64 / (ms * 1e-3) / 1e9
}

fn timing_fields(elements: usize, bytes: usize, times: &[f64], copy_gbps: f64) -> Value {
    let ms = median(times);
    let effective = gbps(elements, bytes, ms);
    json!({
        "elements": elements,
        "ms_median": ms,
        "ms_min": times.iter().copied().fold(f64::INFINITY, f64::min),
        "iters": times.len(),
        "bytes_per_element": bytes,
        "effective_gbps": effective,
        "copy_gbps": copy_gbps,
        "fraction_of_copy": effective / copy_gbps,
    })
}

/// Times the device copy and the fused step; writes their lines; returns the copy bandwidth.
fn fused_and_copy(report: &mut Report, device: usize, n: usize) -> Result<f64, String> {
    let start = Instant::now();
    let fused = FusedAdam::new(CudaRuntime::client(&CudaDevice::new(device)));
    let mut rng = Rng::new(Rng::fresh_seed());
    let (master, m, v) = random_state(&mut rng, BLOCK);
    let grads = rng.nonzero_vec(BLOCK, 1e-3, 1.0);
    let b = fused.upload(
        &tiled(&master, n),
        &tiled(&m, n),
        &tiled(&v, n),
        0,
        &tiled(&grads, n),
        // 1: the gradient stays the same from step to step (no drift to denormals or zeros).
        1.0,
        ModelDtype::Bf16,
    );
    fused.sync();
    let setup_s = start.elapsed().as_secs_f64();

    let dst = fused.client().empty(n * 4);
    let copy_times = time(2, ITERS, || {
        fused.copy(&b.grads, &dst, n);
        fused.sync();
    });
    let copy_gbps = gbps(n, COPY_BYTES, median(&copy_times));
    report.pass(
        "fused-step/copy",
        timing_fields(n, COPY_BYTES, &copy_times, copy_gbps),
    );
    drop(dst);

    let hyper = Hyper {
        scalars: StepScalars {
            lr: 1e-4,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            decoupled: true,
            step: 0,
        },
        max_norm: Some(1.0),
    };
    let times = time(WARMUP, ITERS, || {
        fused.step(&b, hyper);
        fused.sync();
    });
    // A step skipped for found-inf would be fast and wrong: every step must have counted.
    let steps = fused.read_u32(&b.step)[0] as usize;
    let stats = fused.read_f32(&b.stats);
    if steps != WARMUP + ITERS || stats[1] != 0.0 {
        return Err(format!(
            "the timed steps did not all run: step counter {steps} (want {}), found_inf {}",
            WARMUP + ITERS,
            stats[1]
        ));
    }
    let mut fields = timing_fields(n, FUSED_BYTES, &times, copy_gbps);
    fields["model_dtype"] = json!("bf16");
    fields["setup_seconds"] = json!(setup_s);
    fields["goal_fraction_of_copy"] = json!(0.85);
    report.pass("fused-step/fused", fields);
    drop(b);
    fused.client().memory_cleanup();
    Ok(copy_gbps)
}

/// Burn's AdamW (`burn-optim`) on one tensor of `len` f32 on burn-cuda; milliseconds per step.
fn burn_adamw(device: usize, len: usize) -> Result<Vec<f64>, String> {
    let device = CudaDevice::new(device);
    let mut rng = Rng::new(Rng::fresh_seed());
    let block = rng.nonzero_vec(BLOCK, 1e-2, 2.0);
    let grads = rng.nonzero_vec(BLOCK, 1e-3, 1.0);
    let tensor =
        |values: Vec<f32>| Tensor::<Cuda, 1>::from_data(TensorData::new(values, [len]), &device);
    let optim = AdamWConfig::new().with_weight_decay(0.01).build();
    let grad = tensor(tiled(&grads, len));
    let (mut param, mut state) = optim.step(1e-4, tensor(tiled(&block, len)), grad.clone(), None);
    let sync = || <Cuda as Backend>::sync(&device).map_err(|e| format!("{e:?}"));
    sync()?;
    let mut failed = None;
    let times = time(WARMUP, BURN_ITERS, || {
        let (p, s) = optim.step(1e-4, param.clone(), grad.clone(), state.take());
        (param, state) = (p, s);
        if let Err(e) = sync() {
            failed.get_or_insert(e);
        }
    });
    match failed {
        Some(e) => Err(format!("burn-cuda sync failed: {e}")),
        None if times.iter().any(|&t| t <= 0.0) => Err("a step took no time".into()),
        None => Ok(times),
    }
}
