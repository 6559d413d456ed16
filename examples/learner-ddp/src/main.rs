//! burn-train's single-device `Learner`, trained data-parallel: one process per rank.
//!
//! ```text
//! cargo build --release -p burn-dist-run -p learner-ddp
//! target/release/burn-dist-run --nproc-per-node 2 -- \
//!     target/release/learner-ddp --artifact-dir /tmp/learner-ddp
//! ```
//!
//! `--backend wgpu --optimizer zero2 --offload` (built with `--features wgpu`) trains the same
//! on Burn's `Wgpu`, ZeroAdam's state in host memory.
//!
//! Rank 0 writes metrics, `experiment.log` and checkpoints into `--artifact-dir`; the other
//! ranks are given `<artifact-dir>/rank-<r>` as their Learner directory and write nothing at
//! all, so a stray write would show up there instead of clobbering rank 0's files.

use std::path::PathBuf;
use std::process::ExitCode;

use burn::backend::Autodiff;
use burn::optim::AdamConfig;
use burn::tensor::backend::Backend;
use burn_dist::{Ddp, DdpConfig, DistributedAutodiff, DistributedBackend, Sharded};
use burn_dist_models::step::{float_params, write_params};
use burn_dist_zero::{ZeroAdam, ZeroAdamConfig};
use burn_flex::{Flex, FlexDevice};
use clap::Parser;
use learner_ddp::model::Regressor;
use learner_ddp::{BackendChoice, MODEL_SEED, OptimizerChoice, Run, learner};

/// Where ZeroAdam's state goes once built: kept as it is on Flex (the host path); on the device
/// path into device memory or, with `--offload`, host memory beside the device model.
type PlaceZero<'a> = &'a dyn Fn(ZeroAdam, &Ddp) -> burn_dist_zero::Result<ZeroAdam>;

#[derive(Parser)]
#[command(about = "Train an MLP with burn-train's Learner, data-parallel across processes")]
struct Args {
    /// Where rank 0 writes metrics, experiment.log and checkpoints (one per epoch).
    #[arg(long)]
    artifact_dir: PathBuf,
    #[arg(long, default_value_t = 2)]
    epochs: usize,
    /// Samples per step on each rank; the global batch is this times the world size.
    #[arg(long, default_value_t = 4)]
    batch_size: usize,
    /// Training samples; a multiple of the global batch.
    #[arg(long, default_value_t = 64)]
    samples: usize,
    #[arg(long, default_value_t = 16)]
    valid_samples: usize,
    /// Constant learning rate.
    #[arg(long, default_value_t = 1e-2)]
    lr: f64,
    #[arg(long, value_enum, default_value_t = OptimizerChoice::Adam)]
    optimizer: OptimizerChoice,
    /// Continue after this epoch's checkpoint in --artifact-dir (written at any world size).
    #[arg(long)]
    resume: Option<usize>,
    /// Shows the error of a forgotten `mark_for_sync` in `TrainStep::step`: the steps do not
    /// mark the model.
    #[arg(long, hide = true)]
    skip_mark: bool,
    /// Rank 0 writes the final parameters here (burn_dist_models::step::write_params format).
    #[arg(long)]
    out: Option<PathBuf>,
    /// `wgpu`: Burn's `Wgpu` (fusion on) with gradients reduced in device memory
    /// (`Ddp::init_staged`); ZeroAdam's state then lives in device memory (`on_device`).
    #[arg(long, value_enum, default_value_t = BackendChoice::Flex)]
    backend: BackendChoice,
    /// With `--backend wgpu` and ZeroAdam: its state in host memory beside the device model
    /// (`ZeroAdam::offloaded`).
    #[arg(long)]
    offload: bool,
}

fn main() -> ExitCode {
    match train(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

fn train(args: Args) -> Result<(), String> {
    if args.offload
        && (args.backend != BackendChoice::Wgpu || args.optimizer.zero_stage().is_none())
    {
        return Err(
            "--offload needs --backend wgpu and a ZeroAdam --optimizer (zero1, zero2 \
                    or zero3): it moves ZeroAdam's state from device to host memory"
                .into(),
        );
    }
    match args.backend {
        BackendChoice::Flex => {
            let mut ddp =
                Ddp::init(DdpConfig::new()).map_err(|e| format!("joining the job: {e}"))?;
            train_on::<Flex>(&args, &mut ddp, &FlexDevice, &|zero, _| Ok(zero))
        }
        BackendChoice::Wgpu => wgpu(&args),
    }
}

#[cfg(feature = "wgpu")]
fn wgpu(args: &Args) -> Result<(), String> {
    use burn_wgpu::{Wgpu, WgpuDevice};
    let device = WgpuDevice::default();
    let mut ddp = Ddp::init_staged::<Wgpu>(DdpConfig::new(), &device)
        .map_err(|e| format!("joining the job: {e}"))?;
    let place = |zero: ZeroAdam, ddp: &Ddp| match args.offload {
        true => zero.offloaded::<Wgpu>(ddp, &device),
        false => zero.on_device::<Wgpu>(ddp, &device),
    };
    train_on::<Wgpu>(args, &mut ddp, &device, &place)
}

#[cfg(not(feature = "wgpu"))]
fn wgpu(_: &Args) -> Result<(), String> {
    Err(
        "--backend wgpu: this binary was built without it (cargo build -p learner-ddp \
         --features wgpu)"
            .into(),
    )
}

/// The run on backend `X` (its device `device`), once `ddp` has joined the job.
fn train_on<X: Backend>(
    args: &Args,
    ddp: &mut Ddp,
    device: &X::Device,
    place: PlaceZero,
) -> Result<(), String> {
    let (rank, world) = (ddp.rank(), ddp.world_size());
    if rank != 0 {
        // Rank 0's logs go to `experiment.log` through burn-train's own logger; the other
        // ranks switch that off, so their warnings go to stderr.
        burn_dist_comm::logging::init_stderr("warn");
    }
    let run = Run {
        samples: args.samples,
        valid_samples: args.valid_samples,
        epochs: args.epochs,
        batch: args.batch_size,
        lr: args.lr,
    };
    run.check(world)?;
    if rank == 0 {
        // burn-train would only find out at its first write, in a panic from another thread.
        std::fs::create_dir_all(&args.artifact_dir).map_err(|e| {
            format!(
                "creating --artifact-dir {}: {e}",
                args.artifact_dir.display()
            )
        })?;
    }
    // Each rank says where its Learner may write, so a test can check every rank's directory.
    let own = burn_dist::train::rank_directory(ddp, &args.artifact_dir);
    println!("learner directory: {}", own.display());

    learner_ddp::model::MARK_FOR_SYNC.store(!args.skip_mark, std::sync::atomic::Ordering::Relaxed);
    // ZeRO stage 3 shards the parameters too, which takes the backend's `Sharded` mode; the
    // program is otherwise the same.
    let trained = match args.optimizer {
        OptimizerChoice::Zero3 => {
            fit::<Autodiff<DistributedBackend<X, Sharded>>>(ddp, args, &run, device, place)?
        }
        _ => fit::<Autodiff<DistributedBackend<X>>>(ddp, args, &run, device, place)?,
    };
    if let (0, Some(path)) = (rank, &args.out) {
        write_params(path, &trained).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    Ok(())
}

/// Prepares the model in `D`'s mode, trains it with the chosen optimizer, and returns the
/// trained parameters (read on every rank: at stage 3 a read is a collective).
fn fit<D: DistributedAutodiff>(
    ddp: &mut Ddp,
    args: &Args,
    run: &Run,
    device: &D::Device,
    place: PlaceZero,
) -> Result<Vec<Vec<f32>>, String> {
    let rank = ddp.rank();
    let model = D::prepare_model(ddp, Regressor::<D>::new(MODEL_SEED, device))
        .map_err(|e| format!("rank {rank}: preparing the model: {e}"))?;
    // The one line that differs between Burn's Adam and ZeroAdam.
    let trained = match args.optimizer.zero_stage() {
        None => {
            let adam = ddp.optimizer(AdamConfig::new().init());
            learner::fit(ddp, model, adam, run, &args.artifact_dir, args.resume)
        }
        Some(stage) => {
            // Burn's Adam: no weight decay.
            let zero = ZeroAdamConfig::new()
                .with_weight_decay(0.0)
                .with_stage(stage)
                .init::<D, _>(ddp, &model)
                .and_then(|zero| place(zero, ddp))
                .map_err(|e| format!("rank {rank}: building ZeroAdam: {e}"))?;
            if rank == 0 {
                println!("ZeroAdam stage {stage}: its state in {}", zero.placement());
            }
            learner::fit(ddp, model, zero, run, &args.artifact_dir, args.resume)
        }
    };
    Ok(float_params(&trained))
}
