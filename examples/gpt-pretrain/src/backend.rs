//! `--backend`: the one place where the backend is chosen. The training code (`train`) is the
//! same for every backend; only how the `Ddp` joins the job and where ZeroAdam's state goes
//! differ: the host path on Flex, the device path (gradients, optimizer state and parameters in
//! device memory) on Burn's `Wgpu` and `Cuda`.

use burn::backend::Autodiff;
use burn_dist::{Ddp, DdpConfig, DistributedBackend};
use burn_dist_comm::{CommConfig, HostCommunicator};
use burn_flex::{Flex, FlexDevice};

use crate::cli::{Args, BackendKind};
use crate::train::{self, Outcome};

/// Runs the job described by `args` on the backend it names.
pub fn run(args: &Args) -> Result<Outcome, String> {
    let config = DdpConfig::new().with_accumulation_steps(args.accumulation);
    match args.backend {
        BackendKind::Flex => {
            let mut ddp = if launched() {
                Ddp::init(config).map_err(|e| format!("joining the job: {e}"))?
            } else {
                Ddp::for_thread(one_rank(), config)
            };
            let keep = |zero, _: &Ddp| Ok(zero);
            train::run_with::<Autodiff<DistributedBackend<Flex>>>(
                args,
                &mut ddp,
                &FlexDevice,
                &keep,
            )
        }
        BackendKind::Wgpu => wgpu(args, config),
        BackendKind::Cuda => cuda(args, config),
    }
}

/// Whether a launcher (burn-dist-run, torchrun, Slurm) started this process.
fn launched() -> bool {
    ["RANK", "SLURM_PROCID"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}

/// Started by hand, not by a launcher: a job of one rank, in this process.
fn one_rank() -> HostCommunicator {
    HostCommunicator::local_group(1, &CommConfig::default()).remove(0)
}

#[cfg(feature = "wgpu")]
fn wgpu(args: &Args, config: DdpConfig) -> Result<Outcome, String> {
    use burn_wgpu::{Wgpu, WgpuDevice};
    let device = WgpuDevice::default();
    let mut ddp = if launched() {
        Ddp::init_staged::<Wgpu>(config, &device).map_err(|e| format!("joining the job: {e}"))?
    } else {
        Ddp::for_thread_staged::<Wgpu>(one_rank(), config, &device)
    };
    let on_device =
        |zero: burn_dist_zero::ZeroAdam, ddp: &Ddp| zero.on_device::<Wgpu>(ddp, &device);
    train::run_with::<Autodiff<DistributedBackend<Wgpu>>>(args, &mut ddp, &device, &on_device)
}

#[cfg(not(feature = "wgpu"))]
fn wgpu(_: &Args, _: DdpConfig) -> Result<Outcome, String> {
    Err(not_built("wgpu"))
}

#[cfg(feature = "cuda")]
fn cuda(args: &Args, config: DdpConfig) -> Result<Outcome, String> {
    use burn_cuda::{Cuda, CudaDevice};
    if !launched() {
        return Err(
            "--backend cuda: start it with `burn-dist-run --nproc-per-node N -- \
                    gpt-pretrain ...` (even for one GPU: NCCL joins through the job's store)"
                .into(),
        );
    }
    let local_rank = std::env::var("LOCAL_RANK")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let device = CudaDevice::new(local_rank);
    let mut ddp =
        Ddp::init_nccl::<Cuda>(config, &device).map_err(|e| format!("joining the job: {e}"))?;
    let on_device =
        |zero: burn_dist_zero::ZeroAdam, ddp: &Ddp| zero.on_device::<Cuda>(ddp, &device);
    train::run_with::<Autodiff<DistributedBackend<Cuda>>>(args, &mut ddp, &device, &on_device)
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
