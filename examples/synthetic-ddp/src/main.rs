//! An MLP or a transformer block on synthetic regression data, trained data-parallel: one
//! process per rank, each on its shard of every global batch, gradients averaged during backward.
//!
//! ```text
//! cargo build --release -p burn-dist-run -p synthetic-ddp
//! target/release/burn-dist-run --nproc-per-node 4 -- target/release/synthetic-ddp --steps 50
//! ```
//!
//! The result does not depend on the number of ranks (up to rounding): 1, 2, 3 or 4 ranks
//! train to the same parameters, which `--out` writes for comparison.

use std::io::Write;
use std::process::ExitCode;

use burn::backend::Autodiff;
use burn_dist::{Ddp, DdpConfig, DistributedBackend};
use burn_dist_testing::{BurnAdam, Synthetic, train_synthetic};
use burn_flex::{Flex, FlexDevice};
use clap::{Parser, ValueEnum};

type B = Autodiff<DistributedBackend<Flex>>;

#[derive(Parser)]
#[command(about = "Train an MLP or a transformer block data-parallel on synthetic data")]
struct Args {
    #[arg(long, value_enum, default_value_t = Model::Mlp)]
    model: Model,
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Samples per step over all ranks; must be divisible by the world size (times the
    /// accumulation steps).
    #[arg(long, default_value_t = 12)]
    global_batch: usize,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1)]
    accumulation: usize,
    #[arg(long, default_value_t = 1e-2)]
    lr: f64,
    /// Rank 0 writes the final parameters here (little-endian f32, tensors in visit order).
    #[arg(long)]
    out: Option<std::path::PathBuf>,
}

#[derive(Clone, Copy, ValueEnum)]
enum Model {
    Mlp,
    Transformer,
}

fn main() -> ExitCode {
    burn_dist_comm::logging::init_stderr("warn");
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<(), String> {
    let config = DdpConfig::new().with_accumulation_steps(args.accumulation);
    let mut ddp = Ddp::init(config).map_err(|e| format!("joining the job: {e}"))?;
    let (rank, world) = (ddp.rank(), ddp.world_size());
    if !args.global_batch.is_multiple_of(world * args.accumulation) {
        return Err(format!(
            "--global-batch {} is not divisible by world size {world} × accumulation {}",
            args.global_batch, args.accumulation
        ));
    }
    let params = train_synthetic::<B>(
        &mut ddp,
        match args.model {
            Model::Mlp => Synthetic::Mlp,
            Model::Transformer => Synthetic::Transformer,
        },
        &BurnAdam,
        args.steps,
        args.global_batch,
        args.lr,
        &FlexDevice,
        |step, loss| {
            if rank == 0 {
                println!("step {step:>4}  loss {loss:.6}");
            }
        },
    )
    .map_err(|e| format!("rank {rank}: {e}"))?;
    if let (0, Some(path)) = (rank, &args.out) {
        let bytes: Vec<u8> = params
            .iter()
            .flatten()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        std::fs::File::create(path)
            .and_then(|mut f| f.write_all(&bytes))
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    Ok(())
}
