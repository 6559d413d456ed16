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
//! `cuMemcpyDtoH` and compared with the tensor's values, for whole tensors and for views that
//! start inside their memory page (row slices). At world size 1 the reduction cannot show a
//! wrong address (the average of one rank is its input), this does.
//!
//! Then `ddp-step/views`: gradients the reducer must not reduce where they are, a parameter used
//! only transposed (its gradient is a strided view) and two parameters added together (their
//! gradients share memory with each other and with the rest of backward): the gradients after
//! `Ddp::backward` against the unsynchronized copy's, and how many private copies the hook made
//! (`private_copies`, 2 expected: the transposed one and one of the pair).
//!
//! Then `ddp-step/zero2`: the same `Ddp` switched to ZeRO stage 2 (`shard_gradients` over the
//! flat layout at world size 1, so the one shard is every gradient): one more backward of each
//! model on the same batch, and the reduced shard (grouped in-place `ncclReduce` of each
//! parameter piece to its owner, read back by the owner) against the plain model's gradients,
//! flattened in visit order.
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
use burn_dist_models::{TransformerBlock, relative_error};
use serde_json::json;

use crate::Options;
use crate::libraries::check_cuda_runtime;
use crate::report::{Report, guarded, median};

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

pub fn run(report: &mut Report, options: &Options) {
    if let Err(e) = check_cuda_runtime() {
        return report.fail("ddp-step/runtime", e, json!({}));
    }
    let device = CudaDevice {
        index: options.device,
    };
    match guarded(|| addresses(&device)) {
        Ok(Ok(fields)) => report.pass("ddp-step/address", fields),
        Ok(Err(e)) => return report.fail("ddp-step/address", e, json!({})),
        Err(panic) => {
            return report.fail("ddp-step/address", format!("panicked: {panic}"), json!({}));
        }
    }
    let buckets = burn_dist::BucketConfig::new()
        .with_first_bucket_bytes(FIRST_BUCKET_BYTES)
        .with_bucket_bytes(BUCKET_BYTES);
    let mut ddp = match join(&device, DdpConfig::new().with_buckets(buckets)) {
        Ok(ddp) => ddp,
        Err(e) => return report.fail("ddp-step/init", e, json!({ "device": options.device })),
    };
    match guarded(|| views(&mut ddp, &device)) {
        Ok(Ok((status, fields))) => report.line("ddp-step/views", status, fields),
        Ok(Err(e)) => report.fail("ddp-step/views", e, json!({})),
        Err(panic) => report.fail("ddp-step/views", format!("panicked: {panic}"), json!({})),
    }
    let models = match guarded(|| measure(ddp, &device)) {
        Ok(Ok((status, fields, models))) => {
            report.line("ddp-step", status, fields);
            models
        }
        Ok(Err(e)) => return report.fail("ddp-step", e, json!({})),
        Err(panic) => return report.fail("ddp-step", format!("panicked: {panic}"), json!({})),
    };
    match guarded(|| zero2(models, &device)) {
        Ok(Ok((status, fields))) => report.line("ddp-step/zero2", status, fields),
        Ok(Err(e)) => report.fail("ddp-step/zero2", e, json!({})),
        Err(panic) => report.fail("ddp-step/zero2", format!("panicked: {panic}"), json!({})),
    }
}

/// What the overhead measurement leaves for the ZeRO-2 check: the `Ddp`, then its model and
/// the plain one (equal parameters).
type Models = (Ddp, TransformerBlock<B>, TransformerBlock<B>);

/// Reads tensors back through the address the reducer would give NCCL.
fn addresses(device: &CudaDevice) -> Result<Fields, String> {
    let ctx = cudarc::driver::CudaContext::new(device.index).map_err(|e| format!("{e:?}"))?;
    ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
    let (rows, cols) = (64usize, 96usize);
    let values: Vec<f32> = (0..rows * cols).map(|i| i as f32 * 0.5 - 7.0).collect();
    let whole = Tensor::<CudaBackend, 2>::from_data(
        burn::tensor::TensorData::new(values.clone(), [rows, cols]),
        device,
    );
    let mut cases = Vec::new();
    for range in [0..rows, 5..21, 63..64] {
        let view = whole.clone().slice([range.clone()]);
        let primitive = view.into_primitive().tensor();
        if !primitive.is_contiguous() {
            return Err(format!("rows {range:?}: the view is not contiguous"));
        }
        let (address, _keep) = burn_dist::device_address(&primitive)?;
        <CudaBackend as Backend>::sync(device).map_err(|e| format!("{e:?}"))?;
        let mut read = vec![0f32; range.len() * cols];
        // SAFETY: the address is the start of `range.len() * cols` live f32 (kept by `_keep`);
        // the context of the device is current on this thread.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut read, address) }
            .map_err(|e| format!("rows {range:?}: cuMemcpyDtoH from {address:#x}: {e:?}"))?;
        let expected = &values[range.start * cols..range.end * cols];
        if read != expected {
            let first = read
                .iter()
                .zip(expected)
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            return Err(format!(
                "rows {range:?}: the memory at {address:#x} holds {} at element {first}, the \
                 tensor {}",
                read[first], expected[first]
            ));
        }
        cases.push(format!("rows {}..{}", range.start, range.end));
    }
    Ok(json!({ "cases": cases }))
}

/// Parameters whose gradients are not plain private tensors.
#[derive(Module, Debug)]
struct Views<B: Backend> {
    /// Used only as `a.transpose()`.
    a: Param<Tensor<B, 2>>,
    /// Added together: one gradient for both.
    p1: Param<Tensor<B, 2>>,
    p2: Param<Tensor<B, 2>>,
}

impl Views<B> {
    const ROWS: usize = 16;
    const IN: usize = 32;
    const OUT: usize = 48;

    fn new(device: &CudaDevice) -> Self {
        let param = |shape: [usize; 2], seed: u64| {
            let values = burn_dist_models::uniform(shape[0] * shape[1], seed, 0, 0.5);
            Param::from_tensor(Tensor::from_data(
                burn::tensor::TensorData::new(values, shape),
                device,
            ))
        };
        Views {
            a: param([Self::OUT, Self::IN], 1),
            p1: param([Self::ROWS, Self::OUT], 2),
            p2: param([Self::ROWS, Self::OUT], 3),
        }
    }

    fn loss(&self, x: Tensor<B, 2>) -> Tensor<B, 1> {
        let y = x.matmul(self.a.val().transpose()) + self.p1.val() + self.p2.val();
        y.powi_scalar(2).mean()
    }
}

fn views(ddp: &mut Ddp, device: &CudaDevice) -> Result<(crate::report::Status, Fields), String> {
    let model = ddp.prepare(Views::new(device)).map_err(|e| e.to_string())?;
    let plain = Views::new(device);
    let x = Tensor::<B, 2>::from_data(
        burn::tensor::TensorData::new(
            burn_dist_models::uniform(Views::ROWS * Views::IN, 4, 0, 1.0),
            [Views::ROWS, Views::IN],
        ),
        device,
    );
    let copies_before = burn_dist::private_copies();
    let grads = ddp
        .backward(model.loss(x.clone()), &model)
        .map_err(|e| e.to_string())?
        .ok_or("no gradients after a backward without accumulation")?;
    let copies = burn_dist::private_copies() - copies_before;
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
    let fields = json!({
        "private_copies": copies,
        "private_copies_expected": 2,
        "grads_bitwise_equal": bitwise,
        "grads_relative_error": error,
    });
    if error <= TOLERANCE {
        Ok((crate::report::Status::Pass, fields))
    } else {
        let mut fields = fields;
        fields["error"] = json!(format!(
            "the gradients after Ddp::backward differ from the plain ones by {error:.3e} \
             (relative; at most {TOLERANCE:e})"
        ));
        Ok((crate::report::Status::Fail, fields))
    }
}

/// A world-size-1 group on loopback (as a real job joins, through a TCP store) and its NCCL
/// reducer on `device`.
pub(crate) fn join(device: &CudaDevice, config: DdpConfig) -> Result<Ddp, String> {
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
    Ddp::with_nccl(group, config, device).map_err(|e| e.to_string())
}

type Fields = serde_json::Value;

fn measure(
    mut ddp: Ddp,
    device: &CudaDevice,
) -> Result<(crate::report::Status, Fields, Models), String> {
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
    let syncs_before = ddp.device_syncs();
    let backwards_before = ddp.stats().backwards;

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
    let syncs_per_step = (ddp.device_syncs() - syncs_before) as f64 / timed_steps as f64;
    let backwards = ddp.stats().backwards - backwards_before;

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
        "compute_syncs_per_step": syncs_per_step,
        "hooked_backwards": backwards,
        "params_bitwise_equal": bitwise,
        "params_relative_error": error,
    });
    let ok = backwards == timed_steps && error <= TOLERANCE && error.is_finite();
    let models = (ddp, ddp_model, plain_model);
    if ok {
        Ok((crate::report::Status::Pass, fields, models))
    } else {
        let mut fields = fields;
        fields["error"] = json!(format!(
            "the ddp model's parameters differ from the plain model's by {error:.3e} (relative; \
             at most {TOLERANCE:e} expected) or the reducer saw {backwards} of {timed_steps} \
             backwards"
        ));
        Ok((crate::report::Status::Fail, fields, models))
    }
}

/// ZeRO-2 on the device path at world size 1: the shard is every reduced gradient.
fn zero2(
    (mut ddp, ddp_model, plain_model): Models,
    device: &CudaDevice,
) -> Result<(crate::report::Status, Fields), String> {
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
    ddp.backward(loss(&ddp_model), &ddp_model)
        .map_err(|e| e.to_string())?;
    let shard = ddp.take_gradient_shard().map_err(|e| e.to_string())?;
    let seconds = start.elapsed().as_secs_f64();
    let grads = GradientsParams::from_grads(loss(&plain_model).backward(), &plain_model);
    let plain = flat_gradients(&plain_model, &grads);

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
        Ok((crate::report::Status::Pass, fields))
    } else {
        let mut fields = fields;
        fields["error"] = json!(format!(
            "the ZeRO-2 shard differs from the plain gradients by {error:.3e} (relative; at most \
             {TOLERANCE:e}), or {used} of {} parameters were seen as used",
            numels.len()
        ));
        Ok((crate::report::Status::Fail, fields))
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
