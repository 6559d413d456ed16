//! `ddp-step`: the in-place NCCL reducer (`Ddp::with_nccl`) on a transformer training step at
//! world size 1, against the same backend without synchronization.
//!
//! Two copies of `burn_dist_models::TransformerBlock` start from the same deterministic
//! weights on `Autodiff<DistributedBackend<CudaBackend>>` (burn-cuda without fusion):
//! - **ddp**: prepared by a `Ddp` built with NCCL on this GPU; every backward hands its
//!   gradients to the reducer, which reduces them in place, bucket by bucket (several buckets:
//!   the caps are scaled down to the model as in the CPU bench);
//! - **plain**: never prepared, so its parameters are not marked and Burn calls no hook: every
//!   op is burn-cuda's (the decorator only forwards), which is what training without a `Ddp`
//!   installed runs.
//!
//! Both take the same Adam steps on the same batches, in interleaved rounds (plain then ddp,
//! then ddp then plain, …) so that clock and thermal drift hit both alike. The line reports the
//! median step time of each and the overhead (target: at most 3 %, DESIGN.md), the compute
//! stream synchronizations per step (docs/gpu.md, "Ordering"), and whether the parameters agree
//! after every step taken: at world size 1 an average over ranks is the identity, so they must
//! (bitwise is expected; the check passes within a relative error of 1e-6).
//!
//! First `ddp-step/address`: what the reducer hands NCCL as a gradient's memory
//! (`burn_dist::device_address`, cubecl's resource pointer) is read back with a plain
//! `cuMemcpyDtoH` and compared with the tensor's values, for a whole tensor, for row views that
//! start inside their memory page (an offset into the allocation), and for a tensor whose rows
//! cubecl-cuda pads (its `[128, 1]` strides for `[64, 96]` f32) through the reducer's own
//! private contiguous copy. The other shapes have rows of 512 bytes, which cubecl-cuda does not
//! pad, so the views are contiguous. At world size 1 the reduction cannot show a wrong address
//! (the average of one rank is its input), this does. Each case is checked and reported; one
//! failure does not hide the others, nor stop the sub-checks after it.
//!
//! Then `ddp-step/zero2`: ZeRO stage 2 (`shard_gradients` over the flat layout at world size 1,
//! so the one shard is every gradient) on a fresh pair of models: one backward of each on the
//! same batch, and the reduced shard (grouped in-place `ncclReduce` of each parameter piece to
//! its owner, read back by the owner) against the plain model's gradients, flattened in visit
//! order. It runs on a thread of its own with a `Ddp` of its own and a 70 s deadline, logging
//! each phase it reaches, before the `Ddp` of the other lines is built: on the first H200 run it
//! wrote nothing within the check's limit, and a stuck zero2 must not eat the whole limit: past
//! the deadline its line fails naming the last phase, and the lines after it are not run (its
//! thread would still share the process's hooks).
//!
//! Then, on a new `Ddp`, `ddp-step/views`: gradients the reducer must not reduce where they are, a parameter used
//! only transposed (its gradient is a strided view), two parameters added together (their
//! gradients share memory with each other and with the rest of backward) and one whose rows
//! cubecl-cuda pads: the gradients after `Ddp::backward` against the unsynchronized copy's,
//! and how many private copies the hook made (`private_copies`, 4 expected: the transposed one,
//! both of the pair, since burn-autodiff hands both parents of an add one `dy` and each hook
//! fires while the other branch still holds it, and the padded one; `pitched_copies` 1; the
//! same model on wgpu copies the first 3, `burn-dist/tests/device_twin.rs`).
//!
//! Then `ddp-step/warmup` (written as soon as the cold compilation and autotuning of the
//! transformer's kernels is done, so a timeout after it still leaves that figure) and
//! `ddp-step`, the timed comparison, with the private copies per step (0 expected: every
//! parameter of the block has rows of a multiple of 512 bytes or rank 1).
//!
//! What world size 1 cannot show: that NCCL changes anything (the average of one rank is its
//! input), and the cost of a real reduction.

use std::net::TcpListener;
use std::time::Instant;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_dist::{CudaBackend, CudaDevice, Ddp, DdpConfig, DistributedBackend, FlatLayout};
use burn_dist_comm::{CommConfig, Group, RankInfo};
use burn_dist_models::step::{LR, StepConfig, float_params, transformer_step};
use burn_dist_models::{SharedGradients, TransformerBlock, relative_error};
use serde_json::json;

use crate::Options;
use crate::libraries::check_cuda_runtime;
use crate::report::{Report, Status, guarded, median};

type Inner = DistributedBackend<CudaBackend>;
type B = burn::backend::Autodiff<Inner>;

/// About 9.5 M parameters (38 MB of f32 gradients): big enough that a step is not only launch
/// latency, small enough to compile and run in seconds.
const CONFIG: StepConfig = StepConfig {
    d_model: 1024,
    heads: 16,
    batch: 16,
    seq: 128,
    seed: 23,
};
/// Bucket caps scaled to the model (38 MB): about six buckets, as DDP's defaults give a model
/// of a few hundred MB.
const FIRST_BUCKET_BYTES: usize = 1 << 20;
const BUCKET_BYTES: usize = 8 << 20;
const WARMUP: usize = 3;
const ROUNDS: usize = 8;
const STEPS_PER_ROUND: usize = 4;
const TOLERANCE: f64 = 1e-6;
/// How long `ddp-step/zero2` may take (one cold forward and backward of the block, which
/// compiles and autotunes its kernels) before the timed steps go on without it.
const ZERO2_DEADLINE: std::time::Duration = std::time::Duration::from_secs(70);

/// The last phase a sub-check reached, logged with the time since it started, so that a check
/// that never finishes still says where it was.
#[derive(Clone)]
struct Progress(std::sync::Arc<std::sync::Mutex<(Instant, &'static str)>>);

impl Default for Progress {
    fn default() -> Self {
        Progress(std::sync::Arc::new(std::sync::Mutex::new((
            Instant::now(),
            "not started",
        ))))
    }
}

impl Progress {
    fn reached(&self, phase: &'static str) {
        let mut last = self.0.lock().unwrap_or_else(|e| e.into_inner());
        last.1 = phase;
        eprintln!(
            "ddp-step/zero2: {phase} after {:.1} s",
            last.0.elapsed().as_secs_f64()
        );
    }

    fn last(&self) -> String {
        let last = self.0.lock().unwrap_or_else(|e| e.into_inner());
        format!("{} (at {:.1} s)", last.1, last.0.elapsed().as_secs_f64())
    }
}

/// The sub-checks after `ddp-step/init`, each reported whether or not another one failed.
const AFTER_INIT: [&str; 3] = ["ddp-step/views", "ddp-step/warmup", "ddp-step"];

pub fn run(report: &mut Report, options: &Options) {
    if let Err(e) = check_cuda_runtime() {
        return report.fail("ddp-step/runtime", e, json!({}));
    }
    let device = CudaDevice {
        index: options.device,
    };
    match guarded(|| addresses(&device)) {
        Ok((status, fields)) => report.line("ddp-step/address", status, fields),
        Err(panic) => report.fail("ddp-step/address", format!("panicked: {panic}"), json!({})),
    }
    let buckets = buckets();
    // ZeRO-2 first, on a thread of its own with its own `Ddp` and a deadline: the first H200
    // run (2026-12-04) wrote no zero2 line within the check's limit, and a stuck zero2 must
    // not eat it all. Its phases go to the log. The `Ddp` of the lines after it is built once
    // it is over: the newest `Ddp` of a process serves the hooks, and dropping an older one
    // leaves it in place.
    let progress = Progress::default();
    let watched = progress.clone();
    let (done, result) = std::sync::mpsc::channel();
    let (zero2_device, zero2_buckets) = (device.clone(), buckets.clone());
    std::thread::spawn(move || {
        let outcome = guarded(|| {
            let mut ddp = join(&zero2_device, DdpConfig::new().with_buckets(zero2_buckets))?;
            zero2(&mut ddp, &zero2_device, &watched)
        });
        // The receiver may have stopped waiting (the deadline passed): nothing to tell then.
        let _ = done.send(outcome);
    });
    match result.recv_timeout(ZERO2_DEADLINE) {
        Ok(Ok(Ok((status, fields)))) => report.line("ddp-step/zero2", status, fields),
        Ok(Ok(Err(e))) => report.fail("ddp-step/zero2", e, json!({})),
        Ok(Err(panic)) => report.fail("ddp-step/zero2", format!("panicked: {panic}"), json!({})),
        Err(_) => {
            report.fail(
                "ddp-step/zero2",
                format!(
                    "no result within {} s; the last phase it reached: {}",
                    ZERO2_DEADLINE.as_secs(),
                    progress.last()
                ),
                json!({ "phase": progress.last() }),
            );
            // Its thread goes on, and its backward would report to whichever `Ddp` of this
            // process is newest: the lines after it would measure nothing they could trust.
            for check in AFTER_INIT {
                report.fail(
                    check,
                    "not run: ddp-step/zero2 did not finish, and its thread shares the \
                     process's hooks",
                    json!({}),
                );
            }
            return;
        }
    }
    let mut ddp = match join(&device, DdpConfig::new().with_buckets(buckets)) {
        Ok(ddp) => ddp,
        Err(e) => {
            report.fail("ddp-step/init", e, json!({ "device": options.device }));
            for check in AFTER_INIT {
                report.fail(check, "not run: ddp-step/init failed", json!({}));
            }
            return;
        }
    };
    match guarded(|| views(&mut ddp, &device)) {
        Ok(Ok((status, fields))) => report.line("ddp-step/views", status, fields),
        Ok(Err(e)) => report.fail("ddp-step/views", e, json!({})),
        Err(panic) => report.fail("ddp-step/views", format!("panicked: {panic}"), json!({})),
    }
    timed(report, &mut ddp, &device);
}

/// `ddp-timed`: only the warm-up and the timed comparison, on a `Ddp` of its own. The other
/// lines of `ddp-step` passed on the GPU (2026-12-04), this one never produced its figure:
/// run first, it is not held up by them.
pub fn run_timed(report: &mut Report, options: &Options) {
    if let Err(e) = check_cuda_runtime() {
        return report.fail("ddp-step/runtime", e, json!({}));
    }
    let device = CudaDevice {
        index: options.device,
    };
    match join(&device, DdpConfig::new().with_buckets(buckets())) {
        Ok(mut ddp) => timed(report, &mut ddp, &device),
        Err(e) => report.fail(
            "ddp-step",
            format!("joining a group of one: {e}"),
            json!({}),
        ),
    }
}

/// Bucket caps scaled to the model (see [`FIRST_BUCKET_BYTES`]).
fn buckets() -> burn_dist::BucketConfig {
    burn_dist::BucketConfig::new()
        .with_first_bucket_bytes(FIRST_BUCKET_BYTES)
        .with_bucket_bytes(BUCKET_BYTES)
}

/// The `ddp-step/warmup` and `ddp-step` lines.
fn timed(report: &mut Report, ddp: &mut Ddp, device: &CudaDevice) {
    match guarded(|| measure(report, ddp, device)) {
        Ok(Ok((status, fields))) => report.line("ddp-step", status, fields),
        Ok(Err(e)) => report.fail("ddp-step", e, json!({})),
        Err(panic) => report.fail("ddp-step", format!("panicked: {panic}"), json!({})),
    }
}

/// Reads tensors back through the address the reducer would give NCCL: every case, then one
/// line with the cases that passed and the failures.
fn addresses(device: &CudaDevice) -> (Status, Fields) {
    let mut passed = Vec::new();
    let mut failures = Vec::new();
    let ctx = match cudarc::driver::CudaContext::new(device.index)
        .and_then(|ctx| ctx.bind_to_thread().map(|()| ctx))
    {
        Ok(ctx) => ctx,
        Err(e) => return (Status::Fail, json!({ "error": format!("{e:?}") })),
    };
    // 128 f32 columns: 512-byte rows, which cubecl-cuda does not pad, so row views are
    // contiguous, and rows 5.. start 2560 bytes into the allocation.
    let cols = 128;
    for (name, rows) in [("whole", 0..64), ("rows 5..21", 5..21), ("row 63", 63..64)] {
        match read_back(device, [64, cols], rows, false) {
            Ok(()) => passed.push(name.to_string()),
            Err(e) => failures.push(format!("{name}: {e}")),
        }
    }
    // 96 f32 columns: 384-byte rows, padded to 512 (strides [128, 1]): not contiguous, so the
    // reducer reduces its private contiguous copy, whose address is read back.
    let padded = burn_dist::cuda_pads_rows(&[64, 96], 4);
    match read_back(device, [64, 96], 0..64, true) {
        Ok(()) => passed.push("padded [64, 96] via the reducer's copy".into()),
        Err(e) => failures.push(format!("padded [64, 96]: {e}")),
    }
    drop(ctx);
    let fields = json!({
        "cases": passed,
        "padded_64x96_predicted": padded,
    });
    if failures.is_empty() {
        (Status::Pass, fields)
    } else {
        let mut fields = fields;
        fields["error"] = json!(failures.join("; "));
        (Status::Fail, fields)
    }
}

/// Uploads a `shape` f32 tensor of known values, slices `rows`, and compares the memory at the
/// address the reducer would hand NCCL with the values. `copy`: through the reducer's private
/// contiguous copy (a padded tensor is not contiguous); else the view must be contiguous.
fn read_back(
    device: &CudaDevice,
    shape: [usize; 2],
    rows: std::ops::Range<usize>,
    copy: bool,
) -> Result<(), String> {
    let [height, cols] = shape;
    let values: Vec<f32> = (0..height * cols).map(|i| i as f32 * 0.5 - 7.0).collect();
    let whole = Tensor::<CudaBackend, 2>::from_data(
        burn::tensor::TensorData::new(values.clone(), shape),
        device,
    );
    let view = whole.slice([rows.clone()]).into_primitive().tensor();
    let strides = view.meta.strides().to_vec();
    let primitive = if copy {
        if view.is_contiguous() {
            return Err(format!(
                "expected padded rows, but strides {strides:?} are contiguous"
            ));
        }
        burn_dist::contiguous_copy(view)
    } else {
        view
    };
    if !primitive.is_contiguous() {
        return Err(format!("not contiguous: strides {strides:?}"));
    }
    let (address, _keep) = burn_dist::device_address(&primitive.client, &primitive.handle)?;
    <CudaBackend as Backend>::sync(device).map_err(|e| format!("{e:?}"))?;
    let mut read = vec![0f32; rows.len() * cols];
    // SAFETY: the address is the start of `rows.len() * cols` live f32 (kept by `_keep`); the
    // context of the device is current on this thread.
    unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut read, address) }
        .map_err(|e| format!("cuMemcpyDtoH from {address:#x}: {e:?}"))?;
    let expected = &values[rows.start * cols..rows.end * cols];
    match read.iter().zip(expected).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(first) => Err(format!(
            "the memory at {address:#x} holds {} at element {first}, the tensor {}",
            read[first], expected[first]
        )),
    }
}

/// The model of `ddp-step/views` (see its documentation for the copies it calls for).
type Views = SharedGradients<B>;
/// On CUDA: the transposed one, both of the pair (burn-autodiff hands both parents of an add
/// the same `dy`), and the padded one.
const COPIES: u64 = Views::UNPITCHED_COPIES + PITCHED_COPIES;
const PITCHED_COPIES: u64 = 1;

fn views(ddp: &mut Ddp, device: &CudaDevice) -> Result<(Status, Fields), String> {
    let model = ddp.prepare(Views::new(device)).map_err(|e| e.to_string())?;
    let plain = Views::new(device);
    let x = Views::input(device);
    let before = ddp.stats();
    let grads = ddp
        .backward(model.loss(x.clone()), &model)
        .map_err(|e| e.to_string())?
        .ok_or("no gradients after a backward without accumulation")?;
    let after = ddp.stats();
    let copies = after.private_copies - before.private_copies;
    let pitched = after.pitched_copies - before.pitched_copies;
    let synced = flat_gradients(&model, &grads);
    let reference = flat_gradients(
        &plain,
        &GradientsParams::from_grads(plain.loss(x).backward(), &plain),
    );
    let bitwise = synced.len() == reference.len()
        && synced
            .iter()
            .zip(&reference)
            .all(|(a, b)| a.to_bits() == b.to_bits());
    let error = if synced.len() == reference.len() {
        relative_error(&synced, &reference)
    } else {
        f64::INFINITY
    };
    // The counts say whether each copy path ran; the gradients say whether it is right. A
    // count off the expected one is reported, not failed: it is Burn's gradient layout, not
    // the reducer, that differs from the prediction.
    let fields = json!({
        "private_copies": copies,
        "private_copies_expected": COPIES,
        "pitched_copies": pitched,
        "pitched_copies_expected": PITCHED_COPIES,
        "copies_as_expected": copies == COPIES && pitched == PITCHED_COPIES,
        "grads_bitwise_equal": bitwise,
        "grads_relative_error": error,
    });
    if error <= TOLERANCE {
        Ok((Status::Pass, fields))
    } else {
        let mut fields = fields;
        fields["error"] = json!(format!(
            "the gradients after Ddp::backward differ from the plain ones by {error:.3e} \
             (relative; at most {TOLERANCE:e})"
        ));
        Ok((Status::Fail, fields))
    }
}

/// A world-size-1 group on loopback (as a real job joins, through a TCP store) and its NCCL
/// reducer on `device`, for burn-cuda without fusion.
pub(crate) fn join(device: &CudaDevice, config: DdpConfig) -> Result<Ddp, String> {
    join_for::<CudaBackend>(device, config)
}

/// [`join`] for the device path of backend `X` (burn-cuda with or without fusion).
pub(crate) fn join_for<X>(device: &CudaDevice, config: DdpConfig) -> Result<Ddp, String>
where
    X: burn_dist::CubeResident<Runtime = cubecl::cuda::CudaRuntime>,
{
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("finding a free loopback port: {e}"))?
        .port();
    let local_rank = device.index.to_string();
    let port = port.to_string();
    let info = RankInfo::from_vars(|name| match name {
        "RANK" => Some("0".into()),
        "WORLD_SIZE" => Some("1".into()),
        "LOCAL_RANK" => Some(local_rank.clone()),
        "MASTER_ADDR" => Some("127.0.0.1".into()),
        "MASTER_PORT" => Some(port.clone()),
        "BURN_DIST_TOKEN" => Some("gpu-check".into()),
        _ => None,
    })
    .map_err(|e| e.to_string())?;
    let group = Group::join(info, &CommConfig::default()).map_err(|e| e.to_string())?;
    Ddp::with_nccl::<X>(group, config, device).map_err(|e| e.to_string())
}

type Fields = serde_json::Value;

/// The timed comparison; writes `ddp-step/warmup` as soon as the warm-up steps are done.
fn measure(
    report: &mut Report,
    ddp: &mut Ddp,
    device: &CudaDevice,
) -> Result<(Status, Fields), String> {
    if !ddp.reduces_on_device() {
        return Err("the Ddp built with NCCL does not reduce on the device".into());
    }
    let mut ddp_model = ddp
        .prepare(CONFIG.model::<B>(device))
        .map_err(|e| e.to_string())?;
    let mut plain_model: TransformerBlock<B> = CONFIG.model::<B>(device);
    let buckets = ddp.layout().buckets.len();
    let mut ddp_optim = AdamConfig::new().init();
    let mut plain_optim = AdamConfig::new().init();
    let sync = || <Inner as Backend>::sync(device).map_err(|e| format!("{e:?}"));

    // The same batch for both at every step index.
    let mut step = 0;
    let started = Instant::now();
    for _ in 0..WARMUP {
        let (x, y) = CONFIG.batch::<B>(step, device);
        plain_model = transformer_step(plain_model, &mut plain_optim, x.clone(), y.clone(), LR).0;
        ddp_model = transformer_step(ddp_model, &mut ddp_optim, x, y, LR).0;
        step += 1;
    }
    sync()?;
    let warmup_s = started.elapsed().as_secs_f64();
    // Every parameter of the block has rank 1 or rows of a multiple of 512 bytes: none padded.
    let padded_params = ddp
        .params()
        .iter()
        .filter(|p| burn_dist::cuda_pads_rows(&p.shape, p.dtype.size()))
        .count();
    report.pass(
        "ddp-step/warmup",
        json!({
            "warmup_steps": WARMUP,
            "warmup_s": warmup_s,
            "parameters": ddp.params().iter().map(|p| p.numel()).sum::<usize>(),
            "buckets": buckets,
            "padded_params_predicted": padded_params,
        }),
    );
    let stats_before = ddp.stats();
    let backwards_before = stats_before.backwards;

    let mut plain_ms = Vec::with_capacity(ROUNDS);
    let mut ddp_ms = Vec::with_capacity(ROUNDS);
    for round in 0..ROUNDS {
        let batches: Vec<_> = (step..step + STEPS_PER_ROUND)
            .map(|s| CONFIG.batch::<B>(s, device))
            .collect();
        sync()?;
        for first_plain in [round % 2 == 0, round % 2 != 0] {
            let start = Instant::now();
            for (x, y) in batches.iter().cloned() {
                if first_plain {
                    plain_model = transformer_step(plain_model, &mut plain_optim, x, y, LR).0;
                } else {
                    ddp_model = transformer_step(ddp_model, &mut ddp_optim, x, y, LR).0;
                }
            }
            sync()?;
            let ms = start.elapsed().as_secs_f64() * 1e3 / STEPS_PER_ROUND as f64;
            if first_plain {
                plain_ms.push(ms);
            } else {
                ddp_ms.push(ms);
            }
        }
        step += STEPS_PER_ROUND;
    }
    let timed_steps = (ROUNDS * STEPS_PER_ROUND) as u64;
    let stats = ddp.stats();
    let backwards = stats.backwards - backwards_before;
    let per_step = |count: u64| count as f64 / timed_steps as f64;

    let plain = float_params::<B, _>(&plain_model);
    let synced = float_params::<B, _>(&ddp_model);
    let bitwise = plain.len() == synced.len()
        && plain.iter().zip(&synced).all(|(a, b)| {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
        });
    let flat = |t: &[Vec<f32>]| t.concat();
    let error = relative_error(&flat(&synced), &flat(&plain));
    let (plain_median, ddp_median) = (median(&plain_ms), median(&ddp_ms));
    let overhead = ddp_median / plain_median - 1.0;
    let fields = json!({
        "d_model": CONFIG.d_model,
        "batch": CONFIG.batch,
        "seq": CONFIG.seq,
        "parameters": plain.iter().map(Vec::len).sum::<usize>(),
        "buckets": buckets,
        "steps": step,
        "warmup_s": warmup_s,
        "plain_ms_median": plain_median,
        "ddp_ms_median": ddp_median,
        "plain_ms_min": min(&plain_ms),
        "ddp_ms_min": min(&ddp_ms),
        "overhead": overhead,
        "overhead_target": 0.03,
        "overhead_met": overhead <= 0.03,
        // Each launch of ready buckets waits for the compute stream once.
        "compute_syncs_per_step": per_step(stats.device_launches - stats_before.device_launches),
        "private_copies_per_step": per_step(stats.private_copies - stats_before.private_copies),
        "pitched_copies_per_step": per_step(stats.pitched_copies - stats_before.pitched_copies),
        "padded_params_predicted": padded_params,
        "hooked_backwards": backwards,
        "params_bitwise_equal": bitwise,
        "params_relative_error": error,
    });
    let ok = backwards == timed_steps && error <= TOLERANCE && error.is_finite();
    if ok {
        Ok((Status::Pass, fields))
    } else {
        let mut fields = fields;
        fields["error"] = json!(format!(
            "the ddp model's parameters differ from the plain model's by {error:.3e} (relative; \
             at most {TOLERANCE:e} expected) or the reducer saw {backwards} of {timed_steps} \
             backwards"
        ));
        Ok((Status::Fail, fields))
    }
}

/// ZeRO-2 on the device path at world size 1, on a fresh pair of models: the shard is every
/// reduced gradient.
fn zero2(
    ddp: &mut Ddp,
    device: &CudaDevice,
    progress: &Progress,
) -> Result<(Status, Fields), String> {
    progress.reached("joined");
    let ddp_model = ddp
        .prepare(CONFIG.model::<B>(device))
        .map_err(|e| e.to_string())?;
    progress.reached("prepared");
    let plain_model: TransformerBlock<B> = CONFIG.model::<B>(device);
    let numels: Vec<usize> = ddp.params().iter().map(|p| p.numel()).collect();
    let flat = FlatLayout::new(&numels, 1, 4);
    ddp.shard_gradients(flat.clone())
        .map_err(|e| e.to_string())?;
    if !ddp.reduces_on_device() {
        return Err("under ZeRO-2 the NCCL Ddp no longer reduces on the device".into());
    }
    let (x, y) = CONFIG.batch::<B>(1_000_000, device);
    let loss =
        |model: &TransformerBlock<B>| (model.forward(x.clone()) - y.clone()).powi_scalar(2).mean();

    let start = Instant::now();
    let ddp_loss = loss(&ddp_model);
    <Inner as Backend>::sync(device).map_err(|e| format!("{e:?}"))?;
    progress.reached("forward done");
    ddp.backward(ddp_loss, &ddp_model)
        .map_err(|e| e.to_string())?;
    progress.reached("backward done (gradients reduce-scattered)");
    let shard = ddp.take_gradient_shard().map_err(|e| e.to_string())?;
    progress.reached("shard read to the host");
    let seconds = start.elapsed().as_secs_f64();
    let grads = GradientsParams::from_grads(loss(&plain_model).backward(), &plain_model);
    let plain = flat_gradients(&plain_model, &grads);
    progress.reached("plain gradients read");

    let reduced = &shard.values[..flat.total.min(shard.values.len())];
    let bitwise = reduced.len() == plain.len()
        && reduced
            .iter()
            .zip(&plain)
            .all(|(a, b)| a.to_bits() == b.to_bits());
    let error = if reduced.len() == plain.len() {
        relative_error(reduced, &plain)
    } else {
        f64::INFINITY
    };
    let used = shard.used.iter().filter(|&&u| u).count();
    let fields = json!({
        "elements": flat.total,
        "shard_len": shard.values.len(),
        "params_used": used,
        "params": numels.len(),
        "seconds": seconds,
        "shard_bitwise_equal": bitwise,
        "shard_relative_error": error,
        "gradient_elements_held": ddp.gradient_elements_held(),
    });
    if error <= TOLERANCE && used == numels.len() {
        Ok((Status::Pass, fields))
    } else {
        let mut fields = fields;
        fields["error"] = json!(format!(
            "the ZeRO-2 shard differs from the plain gradients by {error:.3e} (relative; at most \
             {TOLERANCE:e}), or {used} of {} parameters were seen as used",
            numels.len()
        ));
        Ok((Status::Fail, fields))
    }
}

/// The gradients of `model`'s float parameters, flattened in visit order (zeros for a
/// parameter without one).
fn flat_gradients<M: Module<B>>(model: &M, grads: &GradientsParams) -> Vec<f32> {
    struct Collect<'a> {
        grads: &'a GradientsParams,
        out: Vec<f32>,
    }
    impl ModuleVisitor<B> for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let n = param.val().shape().num_elements();
            match self.grads.get::<Inner, D>(param.id) {
                Some(grad) => self.out.extend(
                    grad.into_data()
                        .convert::<f32>()
                        .into_vec::<f32>()
                        .expect("f32 values"),
                ),
                None => self.out.extend(std::iter::repeat_n(0.0, n)),
            }
        }
    }
    let mut collect = Collect {
        grads,
        out: Vec::new(),
    };
    model.visit(&mut collect);
    collect.out
}

fn min(values: &[f64]) -> f64 {
    values.iter().copied().fold(f64::INFINITY, f64::min)
}
