//! `burn-dist-check`: joins a job, all-reduces a known buffer many times, checks every result
//! against the reference and reports the bus bandwidth. The `nccl-tests` of burn-dist, and the
//! worker of the multi-process tests. Run it under the launcher:
//!
//! ```text
//! burn-dist-run --nproc-per-node 4 -- burn-dist-check --mib 8 --iters 20
//! ```

use std::process::ExitCode;
use std::time::Instant;

use burn_dist_comm::testing::{rank_data, reference_reduce};
use burn_dist_comm::{CommConfig, Communicator, DType, ReduceOp, human_bytes, init};
use clap::{Parser, ValueEnum};

#[derive(Parser)]
#[command(
    version,
    about = "Verify and time host all-reduce across the ranks of a job"
)]
struct Args {
    /// Size of the all-reduced buffer in MiB.
    #[arg(long, default_value_t = 4.0)]
    mib: f64,
    /// How many all-reduces to run; every result is checked.
    #[arg(long, default_value_t = 10)]
    iters: usize,
    #[arg(long, value_enum, default_value_t = Dtype::F32)]
    dtype: Dtype,
    /// Seed of the per-rank input data.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

#[derive(Clone, Copy, ValueEnum)]
enum Dtype {
    F32,
    F16,
    Bf16,
}

fn main() -> ExitCode {
    burn_dist_comm::logging::init_stderr("warn");
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("{message}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<(), String> {
    let group = init(CommConfig::default()).map_err(|e| format!("error: joining the job: {e}"))?;
    let (rank, world) = (group.info.rank, group.info.world_size);
    let fail = |e| format!("rank {rank}: error: {e}");
    let links: Vec<String> = (group.comm.links().iter().enumerate())
        .filter_map(|(peer, link)| link.map(|link| format!("{peer} {link}")))
        .collect();
    println!(
        "rank {rank}: pid {} joined a group of {world}; data links: {}",
        std::process::id(),
        links.join(", ")
    );

    let dtype = match args.dtype {
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::Bf16 => DType::BF16,
    };
    let len = (args.mib * (1 << 20) as f64) as usize / dtype.size();
    let inputs: Vec<_> = (0..world)
        .map(|r| rank_data(dtype, len, args.seed, r))
        .collect();
    let expected = reference_reduce(&inputs, ReduceOp::Sum);
    let comm = &group.comm;

    let mut seconds = 0.0;
    for iter in 0..args.iters {
        let input = inputs[rank].clone();
        let started = Instant::now();
        let got = comm.all_reduce(input, ReduceOp::Sum).wait().map_err(fail)?;
        seconds += started.elapsed().as_secs_f64();
        if got.as_bytes() != expected.as_bytes() {
            return Err(format!(
                "rank {rank}: all_reduce #{iter} differs from the reference"
            ));
        }
        if iter == 0 {
            println!("rank {rank}: first all_reduce verified");
        }
    }
    comm.barrier().wait().map_err(fail)?;
    let bytes = len * dtype.size();
    // Bus bandwidth as nccl-tests defines it: what each rank's links carry per second.
    let bus = 2.0 * (world - 1) as f64 / world as f64 * (bytes * args.iters) as f64 / seconds;
    println!(
        "rank {rank}: {} all_reduces of {} verified; bus bandwidth {:.2} GB/s",
        args.iters,
        human_bytes(bytes),
        bus / 1e9
    );
    Ok(())
}
