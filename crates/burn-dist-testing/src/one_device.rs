//! Several ranks on one device: threads as ranks, each with its own `Ddp` on the staged device
//! collectives of an in-process group (`Ddp::for_thread_staged`), against one rank with the
//! whole batch on the same device. NCCL refuses two ranks on one GPU; the staged collectives do
//! not, so this is how more than one rank reaches a real GPU (the device check's `ranks` line
//! on CUDA) and, the same code with the same comparisons and tolerances, the wgpu twin in CI.
//!
//! What a world of two or three shows that a world of one cannot:
//! - gradients that differ between ranks averaged (a wrong slot, offset or bucket order shows);
//! - uneven shards ([`MODEL`]'s element count divides by neither 2 nor 3), and where the
//!   all-gather puts them;
//! - stage 3's gathers carrying a peer's pieces;
//! - a parameter whose rows cubecl-cuda pads ([`MODEL`]'s `[16, 96]` weight: 384-byte rows in
//!   f32, 192 in bf16) through the staging copies;
//! - the memory formulas with shards smaller than the model, each rank's own: cubecl counts the
//!   memory of each stream (`ComputeClient::memory_usage`), and each rank's thread has its own.
//!
//! Each [`Case`] trains [`STEPS`] Adam steps (Burn's Adam for DDP in f32, ZeroAdam in device
//! memory at stages 1 to 3) and reports an [`Outcome`]; [`Outcome::failures`] says what is
//! wrong.

use burn::backend::Autodiff;
use burn::module::Module;
use burn::tensor::FloatDType;
use burn_cubecl::cubecl::Runtime;
use burn_dist::{CubeResident, Ddp, DistributedAutodiff, DistributedBackend, FlatLayout, Sharded};
use burn_dist_comm::{CommConfig, HostCommunicator};
use burn_dist_zero::ZeroAdamConfig;

use crate::{
    BurnAdam, Cast, Mlp, OptimizerKind, Stepper, parameters, relative_error, shard_rows,
    synthetic_rows,
};

/// The model: an MLP whose first weight, `[16, 96]`, has rows cubecl-cuda pads, and whose
/// 317 543 elements divide by neither 2 nor 3. The 512-wide layers make the parameters (1.2 MiB
/// in f32) dwarf what the memory formula leaves out.
pub const MODEL: [usize; 5] = [16, 96, 512, 512, 7];
pub const STEPS: usize = 4;
/// Divisible by 1, 2 and 3.
pub const GLOBAL_BATCH: usize = 12;
pub const LR: f64 = 1e-2;
/// Bytes in use between steps that the formulas leave out (the optimizer's scalars and
/// per-cube partials, one-element stand-ins, a loss), per rank.
pub const SMALL_BYTES: u64 = 64 << 10;

/// How the ranks train.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Gradients all-reduced in buckets, Burn's Adam on every rank (f32 only: Burn's Adam on
    /// f16 parameters turns to NaN, its epsilon and squared gradients below f16's range).
    Ddp,
    /// Gradients all-reduced as DDP's, ZeroAdam's f32 master weights and moments sharded in
    /// device memory: DDP for half-precision models.
    Zero1,
    /// ZeRO stage 2: gradients reduce-scattered, ZeroAdam's state in device memory.
    Zero2,
    /// ZeRO stage 3: the parameters sharded too (`DistributedBackend<X, Sharded>`).
    Zero3,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Ddp => "ddp",
            Mode::Zero1 => "zero1",
            Mode::Zero2 => "zero2",
            Mode::Zero3 => "zero3",
        }
    }
}

/// One comparison: `world` ranks in `mode` with the model in `dtype`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Case {
    pub mode: Mode,
    pub world: usize,
    pub dtype: FloatDType,
}

impl Case {
    pub fn name(&self) -> String {
        format!("{}/w{}/{:?}", self.mode.name(), self.world, self.dtype).to_lowercase()
    }
}

/// DDP, ZeRO-2 and ZeRO-3 at 2 and 3 ranks in f32, and in `half` (bf16 on CUDA; f16 on wgpu,
/// whose WGSL has no bf16) DDP's reduction with ZeroAdam's f32 master weights (stage 1), ZeRO-2
/// and ZeRO-3.
pub fn cases(half: FloatDType) -> Vec<Case> {
    let mut cases = Vec::new();
    for (dtype, modes) in [
        (FloatDType::F32, [Mode::Ddp, Mode::Zero2, Mode::Zero3]),
        (half, [Mode::Zero1, Mode::Zero2, Mode::Zero3]),
    ] {
        for mode in modes {
            for world in [2, 3] {
                cases.push(Case { mode, world, dtype });
            }
        }
    }
    cases
}

/// How far `world` ranks may end from one rank with the whole batch (relative, all parameters):
/// in f32 the rounding of a gradient summed over part of the batch, then averaged (seen on
/// lavapipe: 2e-7); in f16 and bf16 a part-batch gradient rounds to the model's dtype before
/// the average and a whole-batch one once, and the parameters are the f32 master weights
/// rounded to that dtype: 4 of its machine epsilons (seen on lavapipe in f16: 1.8 of them).
pub fn tolerance(dtype: FloatDType) -> f64 {
    match dtype {
        FloatDType::F32 => 1e-5,
        // 2^-10 and 2^-7.
        FloatDType::F16 => 4.0 * 9.765_625e-4,
        _ => 4.0 * 7.812_5e-3,
    }
}

/// What one case showed.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub case: Case,
    /// Rank 0's parameters against the one-rank reference's.
    pub relative_error: f64,
    pub tolerance: f64,
    /// Every rank ends with the same parameters, bit for bit (every mode keeps them replicated
    /// between steps, stage 3 through its gathers).
    pub ranks_agree: bool,
    /// The flat layout's last shard holds fewer real elements than the others.
    pub uneven_shards: bool,
    /// Stage 3: bytes gathered by rank 0's ops, which carry every peer's pieces.
    pub gathered_bytes: u64,
    /// Per rank: (bytes of device memory in use between steps, the formula). F32 and DDP,
    /// stages 2 and 3 only: the formulas count 4-byte elements.
    pub memory: Vec<(u64, u64)>,
}

impl Outcome {
    /// What is wrong, one line each (empty: the case passed).
    pub fn failures(&self) -> Vec<String> {
        let name = self.case.name();
        let mut failures = Vec::new();
        // A NaN error fails too.
        if self.relative_error.is_nan() || self.relative_error > self.tolerance {
            failures.push(format!(
                "{name}: the parameters end {:.3e} (relative) from one rank with the whole batch, \
                 more than {:e}",
                self.relative_error, self.tolerance
            ));
        }
        if !self.ranks_agree {
            failures.push(format!("{name}: the ranks end with different parameters"));
        }
        if !self.uneven_shards {
            failures.push(format!(
                "{name}: the shards are even; the case does not test uneven ones"
            ));
        }
        if self.case.mode == Mode::Zero3 && self.gathered_bytes == 0 {
            failures.push(format!("{name}: stage 3 gathered nothing"));
        }
        for (rank, (measured, formula)) in self.memory.iter().enumerate() {
            if !(*formula..=formula + SMALL_BYTES).contains(measured) {
                failures.push(format!(
                    "{name}: rank {rank} holds {measured} bytes of device memory between steps; \
                     the formula says {formula} (+ at most {SMALL_BYTES})"
                ));
            }
        }
        failures
    }
}

/// Ψ, this world's shard S and whether the shards are uneven, for [`MODEL`].
fn layout(world: usize) -> (u64, u64, bool) {
    let numels: Vec<usize> = MODEL.windows(2).flat_map(|w| [w[0] * w[1], w[1]]).collect();
    let flat = FlatLayout::new(&numels, world, burn_dist::SHARD_ALIGN);
    let uneven = flat.shard_len * world > flat.total;
    (flat.total as u64, flat.shard_len as u64, uneven)
}

/// Bytes one rank holds between steps, in f32: the parameters and Burn's two Adam moments
/// (DDP: 12Ψ); the parameters and ZeroAdam's master weights, moments and model copy (stage 2:
/// 4Ψ + 16S); the pieces, which are the master weights, and the moments (stage 3: 12S).
fn formula(mode: Mode, world: usize) -> Option<u64> {
    let (total, shard, _) = layout(world);
    match mode {
        Mode::Ddp => Some(12 * total),
        Mode::Zero1 => None,
        Mode::Zero2 => Some(4 * total + 16 * shard),
        Mode::Zero3 => Some(12 * shard),
    }
}

/// Runs `case` with every rank on `device` (backend `X`), then the one-rank reference there.
pub fn run_case<X>(case: Case, device: &X::Device) -> Outcome
where
    X: CubeResident,
{
    let train = |world| match case.mode {
        Mode::Zero3 => train::<X, Autodiff<DistributedBackend<X, Sharded>>>(case, world, device),
        _ => train::<X, Autodiff<DistributedBackend<X>>>(case, world, device),
    };
    let reference = train(1).remove(0);
    let ranks = train(case.world);
    let flat = |params: &[Vec<f32>]| params.concat();
    let relative_error = relative_error(&flat(&ranks[0].params), &flat(&reference.params));
    let ranks_agree = ranks.iter().all(|r| {
        r.params.len() == ranks[0].params.len()
            && r.params.iter().zip(&ranks[0].params).all(|(a, b)| {
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
            })
    });
    let memory = match formula(case.mode, case.world) {
        Some(formula) if case.dtype == FloatDType::F32 => {
            ranks.iter().map(|r| (r.in_use, formula)).collect()
        }
        _ => Vec::new(),
    };
    Outcome {
        case,
        relative_error,
        tolerance: tolerance(case.dtype),
        ranks_agree,
        uneven_shards: layout(case.world).2,
        gathered_bytes: ranks[0].gathered_bytes,
        memory,
    }
}

/// Buckets of 16 KiB, then 64 KiB: the model spans about twenty, and ZeRO's gradient segments
/// cross shard boundaries.
fn config() -> burn_dist::DdpConfig {
    burn_dist::DdpConfig::new().with_buckets(
        burn_dist::BucketConfig::new()
            .with_first_bucket_bytes(16 << 10)
            .with_bucket_bytes(64 << 10),
    )
}

/// One rank's end.
struct Trained {
    params: Vec<Vec<f32>>,
    /// Bytes of device memory this rank's stream holds between steps.
    in_use: u64,
    gathered_bytes: u64,
}

/// `world` ranks of `case` on backend `B` over `X`'s device memory.
fn train<X, B>(case: Case, world: usize, device: &X::Device) -> Vec<Trained>
where
    X: CubeResident,
    B: DistributedAutodiff<Device = X::Device>,
{
    let comms = HostCommunicator::local_group(world, &CommConfig::default());
    burn_dist_comm::testing::run_ranks(comms, |rank, comm| {
        let device = device.clone();
        let mut ddp = Ddp::for_thread_staged::<X>(comm, config(), &device);
        let model = Mlp::<B>::new(&MODEL, 7, &device).map(&mut Cast(case.dtype));
        let mut model = B::prepare_model(&mut ddp, model).expect("prepared");
        let mut optim: Box<dyn Stepper<B, Mlp<B>>> = match case.mode {
            Mode::Ddp => BurnAdam.build::<B, Mlp<B>>(&ddp, &model),
            stage => Box::new(
                ZeroAdamConfig::new()
                    .with_stage(match stage {
                        Mode::Zero1 => 1,
                        Mode::Zero2 => 2,
                        _ => 3,
                    })
                    .init::<B, _>(&ddp, &model)
                    .and_then(|zero| zero.on_device::<X>(&ddp, &device))
                    .expect("ZeroAdam in device memory"),
            ),
        };
        let [input, .., output] = MODEL;
        for step in 0..STEPS {
            let rows = shard_rows(GLOBAL_BATCH, rank, world);
            let x = synthetic_rows::<B, 2>(0, step, [GLOBAL_BATCH, input], rows.clone(), &device)
                .cast(case.dtype);
            let y = synthetic_rows::<B, 2>(1, step, [GLOBAL_BATCH, output], rows, &device)
                .cast(case.dtype);
            let loss = (model.forward(x) - y).powi_scalar(2).mean();
            let grads = ddp
                .backward(loss, &model)
                .expect("backward")
                .expect("gradients");
            model = optim.step(&ddp, LR, model, grads).expect("optimizer step");
        }
        // This rank's stream's count (each thread has its own stream).
        B::sync(&device).expect("sync");
        let in_use = X::Runtime::client(&X::cube_device(&device))
            .memory_usage()
            .map_or(0, |m| m.bytes_in_use);
        let params = parameters::<B, _>(&model);
        Trained {
            params,
            in_use,
            gathered_bytes: ddp.shard_stats().map_or(0, |s| s.gathered_bytes),
        }
    })
}
