//! burn-train's single-device `Learner`, trained data-parallel: one process per rank.
//!
//! ```text
//! cargo build --release -p burn-dist-run -p learner-ddp
//! target/release/burn-dist-run --nproc-per-node 2 -- \
//!     target/release/learner-ddp --artifact-dir /tmp/learner-ddp
//! ```
//!
//! Rank 0 writes metrics, `experiment.log` and checkpoints into `--artifact-dir`; the other
//! ranks are given `<artifact-dir>/rank-<r>` as their Learner directory and write nothing at
//! all, so a stray write would show up there instead of clobbering rank 0's files.

use std::path::PathBuf;
use std::process::ExitCode;

use burn::backend::Autodiff;
use burn_dist::{Ddp, DdpConfig, DistributedBackend};
use burn_dist_models::step::{float_params, write_params};
use burn_flex::{Flex, FlexDevice};
use clap::Parser;
use learner_ddp::model::Regressor;
use learner_ddp::{MODEL_SEED, Run, learner};

type B = Autodiff<DistributedBackend<Flex>>;

#[derive(Parser)]
#[command(about = "Train an MLP with burn-train's Learner, data-parallel across processes")]
struct Args {
    /// Where rank 0 writes metrics, experiment.log and checkpoints.
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
    /// Constant learning rate of Burn's Adam.
    #[arg(long, default_value_t = 1e-2)]
    lr: f64,
    /// Rank 0 writes the final parameters here (burn_dist_models::step::write_params format).
    #[arg(long)]
    out: Option<PathBuf>,
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
    let mut ddp = Ddp::init(DdpConfig::new()).map_err(|e| format!("joining the job: {e}"))?;
    let (rank, world) = (ddp.rank(), ddp.world_size());
    if rank != 0 {
        // Rank 0's logs go to `experiment.log` through burn-train's own logger; the other
        // ranks switch that off, so their warnings go to stderr.
        tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_env_filter("warn")
            .init();
    }
    let run = Run {
        samples: args.samples,
        valid_samples: args.valid_samples,
        epochs: args.epochs,
        batch: args.batch_size,
        lr: args.lr,
    };
    run.check(world)?;
    let artifact_dir = if rank == 0 {
        // burn-train would only find out at its first write, in a panic from another thread.
        std::fs::create_dir_all(&args.artifact_dir).map_err(|e| {
            format!(
                "creating --artifact-dir {}: {e}",
                args.artifact_dir.display()
            )
        })?;
        args.artifact_dir.clone()
    } else {
        args.artifact_dir.join(format!("rank-{rank}"))
    };
    // Each rank says where its Learner may write, so a test can check every rank's directory.
    println!("learner directory: {}", artifact_dir.display());

    let model = ddp
        .prepare(Regressor::<B>::new(MODEL_SEED, &FlexDevice))
        .map_err(|e| format!("rank {rank}: preparing the model: {e}"))?;
    let trained = learner::fit(model, &run, rank, world, &artifact_dir);

    // Every step must have gone through the reducer; a missing mark would instead train each
    // rank on its own gradients without any error.
    let steps = (run.epochs * run.steps_per_epoch(world)) as u64;
    let synced = ddp.stats().backwards;
    if synced != steps {
        return Err(format!(
            "rank {rank}: the Learner ran {steps} steps but {synced} backward passes synchronized \
             gradients: the parameters were not marked for sync in every step"
        ));
    }
    if let (0, Some(path)) = (rank, &args.out) {
        write_params(path, &float_params(&trained))
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    Ok(())
}
