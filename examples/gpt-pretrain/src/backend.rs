//! `--backend`: the one place where the backend is chosen. The training code (`train`) is the
//! same for every backend; only how the `Ddp` joins the job and where ZeroAdam's state goes
//! differ: the host path on Flex, the device path (gradients, optimizer state and parameters in
//! device memory, or with `--offload` the optimizer state in host memory) on Burn's `Wgpu` and
//! `Cuda`.

use burn::backend::Autodiff;
use burn_dist::{Ddp, DdpConfig, DistributedBackend, PrefetchConfig, Sharded};
use burn_flex::{Flex, FlexDevice};

use crate::cli::{Args, BackendKind};
use crate::train::{self, Outcome};

/// Runs the job described by `args` on the backend it names.
pub fn run(args: &Args) -> Result<Outcome, String> {
    let prefetch = PrefetchConfig::new().with_gathers(args.prefetch_gathers);
    let config = DdpConfig::new()
        .with_accumulation_steps(args.accumulation)
        .with_prefetch(prefetch);
    match args.backend {
        BackendKind::Flex => {
            // Started by hand (no launcher variable), `Ddp::init` is a job of one rank.
            let mut ddp = Ddp::init(config).map_err(|e| format!("joining the job: {e}"))?;
            let keep = |zero, _: &Ddp| Ok(zero);
            in_mode::<Flex>(args, &mut ddp, &FlexDevice, &keep)
        }
        BackendKind::Wgpu => wgpu(args, config),
        BackendKind::Cuda => cuda(args, config),
    }
}

/// The training loop on backend `X`, its parameters replicated or, at ZeRO stage 3, sharded
/// too (burn-dist's `Sharded` mode: on the device path the pieces live in device memory).
fn in_mode<X: burn::tensor::backend::Backend>(
    args: &Args,
    ddp: &mut Ddp,
    device: &X::Device,
    place: train::PlaceOptimizer,
) -> Result<Outcome, String> {
    match args.zero_stage {
        3 => train::run_with::<Autodiff<DistributedBackend<X, Sharded>>>(args, ddp, device, place),
        _ => train::run_with::<Autodiff<DistributedBackend<X>>>(args, ddp, device, place),
    }
}

#[cfg(feature = "wgpu")]
fn wgpu(args: &Args, config: DdpConfig) -> Result<Outcome, String> {
    use burn_wgpu::{Wgpu, WgpuDevice};
    let device = WgpuDevice::default();
    let mut ddp =
        Ddp::init_staged::<Wgpu>(config, &device).map_err(|e| format!("joining the job: {e}"))?;
    // `--offload`: the state on the host beside the model on the device.
    let place = |zero: burn_dist_zero::ZeroAdam, ddp: &Ddp| match args.offload {
        true => zero.offloaded::<Wgpu>(ddp, &device),
        false => zero.on_device::<Wgpu>(ddp, &device),
    };
    in_mode::<Wgpu>(args, &mut ddp, &device, &place)
}

#[cfg(not(feature = "wgpu"))]
fn wgpu(_: &Args, _: DdpConfig) -> Result<Outcome, String> {
    Err(not_built("wgpu"))
}

#[cfg(feature = "cuda")]
fn cuda(args: &Args, config: DdpConfig) -> Result<Outcome, String> {
    use burn_cuda::{Cuda, CudaDevice};
    let local_rank = std::env::var("LOCAL_RANK")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let device = CudaDevice::new(local_rank);
    // Without a launcher this fails naming `burn-dist-run` (NCCL meets through the job's store).
    let mut ddp = Ddp::init_nccl::<Cuda>(config, &device)
        .map_err(|e| format!("--backend cuda: joining the job: {e}"))?;
    // `--offload`: the state on the host beside the model on the device.
    let place = |zero: burn_dist_zero::ZeroAdam, ddp: &Ddp| match args.offload {
        true => zero.offloaded::<Cuda>(ddp, &device),
        false => zero.on_device::<Cuda>(ddp, &device),
    };
    in_mode::<Cuda>(args, &mut ddp, &device, &place)
}

#[cfg(not(feature = "cuda"))]
fn cuda(_: &Args, _: DdpConfig) -> Result<Outcome, String> {
    Err(not_built("cuda"))
}

#[cfg(not(all(feature = "wgpu", feature = "cuda")))]
fn not_built(feature: &str) -> String {
    format!(
        "--backend {feature}: this gpt-pretrain was built without its `{feature}` feature; build \
         it with `cargo build --release -p gpt-pretrain --features {feature}`"
    )
}
