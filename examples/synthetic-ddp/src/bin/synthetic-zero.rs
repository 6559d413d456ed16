//! The MLP of `synthetic-ddp` trained with ZeroAdam and periodic sharded checkpoints, resuming
//! from the newest complete checkpoint in `--checkpoint-dir` if there is one (at any world
//! size). Used by the crash tests; also the shortest complete example of the ZeRO stack.
//!
//! Under `burn-dist-run --max-restarts N` it needs nothing more to survive a crash: every start
//! resumes from the newest complete checkpoint.
//!
//! At the end rank 0 prints `validation loss BITS (LOSS)`, the mean squared error on a
//! held-out global batch.
//!
//! Rank 0 prints one line per step, `step S samples N loss BITS (LOSS)`: the step, the data
//! position it trains at (samples consumed by all ranks before it) and its local loss, with the
//! loss's f32 bits, so that a test can see exactly where a resumed run starts.
//!
//! ```text
//! burn-dist-run --nproc-per-node 2 -- target/release/synthetic-zero --checkpoint-dir ckpt
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use burn::tensor::ElementConversion;
use burn_dist::{Ddp, DdpConfig, DistributedAutodiff, DistributedBackend, Sharded};
use burn_dist_testing::{MLP_SIZES, Mlp, parameters, shard_rows, synthetic_rows};
use burn_dist_zero::ZeroAdamConfig;
use burn_dist_zero::checkpoint::{self, TrainingState};
use burn_flex::{Flex, FlexDevice};
use clap::Parser;

type B = Autodiff<DistributedBackend<Flex>>;
/// ZeRO stage 3: the model's parameters sharded too.
type Stage3 = Autodiff<DistributedBackend<Flex, Sharded>>;

/// The data index of the held-out batch that the validation loss is measured on.
const HELD_OUT: usize = 1_000_000;

#[derive(Parser)]
#[command(about = "Train an MLP with ZeroAdam and sharded checkpoints")]
struct Args {
    #[arg(long, default_value_t = 6)]
    steps: u64,
    #[arg(long, default_value_t = 12)]
    global_batch: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 1e-2)]
    lr: f64,
    /// The first this many steps use `--early-lr` instead of `--lr` (a run that differs from
    /// another only before a checkpoint, for the resume tests).
    #[arg(long, default_value_t = 0)]
    early_steps: u64,
    /// Learning rate of the first `--early-steps` steps.
    #[arg(long, default_value_t = 1e-2)]
    early_lr: f64,
    #[arg(long)]
    checkpoint_dir: PathBuf,
    /// Save after every this many steps.
    #[arg(long, default_value_t = 2)]
    checkpoint_every: u64,
    /// Save in the background (`checkpoint::AsyncSaver`): each checkpoint completes at a
    /// later step, or at the end.
    #[arg(long)]
    checkpoint_async: bool,
    /// ZeRO stage: 1 shards the optimizer state, 2 the gradients too, 3 the parameters too
    /// (every rank then runs the validation and reads the final parameters, which gather).
    #[arg(long, default_value_t = 1)]
    zero_stage: u8,
    /// Rank 0 writes the final parameters here (little-endian f32, tensors in visit order).
    #[arg(long)]
    out: Option<PathBuf>,
    /// For the restart tests: in start RESTART of the job (0: the first), rank RANK announces
    /// `paused after step STEP on rank RANK (pid P)` once step STEP is done and waits to be
    /// killed. Repeatable.
    #[arg(long, value_name = "RESTART:RANK:STEP", value_parser = pause_point)]
    pause_after: Vec<Pause>,
}

/// A point `--pause-after` names.
#[derive(Clone, Copy, PartialEq)]
struct Pause {
    restart: usize,
    rank: usize,
    step: u64,
}

fn pause_point(text: &str) -> Result<Pause, String> {
    let bad = || format!("{text:?} is not RESTART:RANK:STEP (three non-negative integers)");
    let parts: Vec<&str> = text.split(':').collect();
    let [restart, rank, step] = parts[..] else {
        return Err(bad());
    };
    Ok(Pause {
        restart: restart.parse().map_err(|_| bad())?,
        rank: rank.parse().map_err(|_| bad())?,
        step: step.parse().map_err(|_| bad())?,
    })
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<(), String> {
    // Announcements with the pid, so that the crash and chaos tests can kill a rank at a known
    // point (set-up, or after a step) and check that it and its peers are gone afterwards.
    let pid = std::process::id();
    let announced_rank = std::env::var("RANK").unwrap_or_default();
    eprintln!("rank {announced_rank}: starting (pid {pid})");
    // Which start of the job this is (burn-dist-run --max-restarts, or torchrun): a restarted
    // job needs no other hint, as it resumes from the newest checkpoint below.
    let restart = burn_dist_comm::env::restart_count().map_err(|e| e.to_string())?;
    eprintln!("rank {announced_rank}: restart {restart} (pid {pid})");
    let ddp = Ddp::init(DdpConfig::new()).map_err(|e| format!("joining the job: {e}"))?;
    match args.zero_stage {
        3 => train::<Stage3>(args, ddp, restart, pid),
        _ => train::<B>(args, ddp, restart, pid),
    }
}

/// The training loop on the backend `B` (its mode: replicated, or sharded at stage 3).
fn train<B: DistributedAutodiff<Device = FlexDevice>>(
    args: Args,
    mut ddp: Ddp,
    restart: usize,
    pid: u32,
) -> Result<(), String> {
    let (rank, world) = (ddp.rank(), ddp.world_size());
    let fail = |e: &dyn std::fmt::Display| format!("rank {rank}: {e}");
    let model = B::prepare_model(&mut ddp, Mlp::<B>::new(&MLP_SIZES, 7, &FlexDevice))
        .map_err(|e| fail(&e))?;
    let mut zero = ZeroAdamConfig::new()
        .with_stage(args.zero_stage)
        .init::<B, _>(&ddp, &model)
        .map_err(|e| fail(&e))?;
    let (mut model, start, mut samples) =
        match checkpoint::latest(&args.checkpoint_dir).map_err(|e| fail(&e))? {
            Some(dir) => {
                let (model, state) =
                    checkpoint::load(&dir, &ddp, model, &mut zero).map_err(|e| fail(&e))?;
                if rank == 0 {
                    println!("resumed from {} at step {}", dir.display(), state.step);
                }
                (model, state.step, state.samples_consumed)
            }
            None => (model, 0, 0),
        };
    let [input, .., output] = MLP_SIZES;
    let rows = shard_rows(args.global_batch, rank, world);
    let batch_samples = args.global_batch as u64;
    let mut saver = args
        .checkpoint_async
        .then(|| checkpoint::AsyncSaver::new(&args.checkpoint_dir));
    for step in start..args.steps {
        // The data position comes from the samples consumed so far (a resumed run: the
        // checkpoint's), one global batch per step.
        let b = (samples / batch_samples) as usize;
        let x = synthetic_rows::<B, 2>(0, b, [args.global_batch, input], rows.clone(), &FlexDevice);
        let y =
            synthetic_rows::<B, 2>(1, b, [args.global_batch, output], rows.clone(), &FlexDevice);
        let loss = (model.forward(x) - y).powi_scalar(2).mean();
        if rank == 0 {
            let value = loss.clone().into_scalar().elem::<f32>();
            println!(
                "step {step} samples {samples} loss {:08x} ({value})",
                value.to_bits()
            );
        }
        let grads = ddp
            .backward(loss, &model)
            .map_err(|e| fail(&e))?
            .expect("no accumulation");
        let lr = if step < args.early_steps {
            args.early_lr
        } else {
            args.lr
        };
        model = zero.step(lr, model, grads, &ddp).map_err(|e| fail(&e))?.0;
        samples += batch_samples;
        let done = step + 1;
        eprintln!("rank {rank}: step {done} done (pid {pid})");
        let here = Pause {
            restart,
            rank,
            step: done,
        };
        if args.pause_after.contains(&here) {
            eprintln!("paused after step {done} on rank {rank} (pid {pid})");
            loop {
                std::thread::park();
            }
        }
        let mut saved = match &mut saver {
            Some(saver) => saver.poll(&ddp).map_err(|e| fail(&e))?,
            None => None,
        };
        if done % args.checkpoint_every == 0 {
            let state = TrainingState::new(done, samples);
            saved = match &mut saver {
                Some(saver) => {
                    let committed = saver.wait(&ddp).map_err(|e| fail(&e))?;
                    saver
                        .save(&ddp, &model, &zero, &state)
                        .map_err(|e| fail(&e))?;
                    committed.or(saved)
                }
                None => Some(
                    checkpoint::save(&args.checkpoint_dir, &ddp, &model, &zero, &state)
                        .map_err(|e| fail(&e))?,
                ),
            };
        }
        if let (0, Some(dir)) = (rank, saved) {
            println!("saved {}", dir.display());
        }
    }
    if let Some(saver) = &mut saver
        && let Some(dir) = saver.wait(&ddp).map_err(|e| fail(&e))?
        && rank == 0
    {
        println!("saved {}", dir.display());
    }
    // At stage 3 an evaluation and a read of the parameters gather them: every rank takes part.
    let takes_part = rank == 0 || B::SHARDED;
    if takes_part {
        // A held-out batch no step trains on (step index 1_000_000), on the whole batch.
        let rows = 0..args.global_batch;
        let x = synthetic_rows::<B, 2>(
            0,
            HELD_OUT,
            [args.global_batch, input],
            rows.clone(),
            &FlexDevice,
        );
        let y = synthetic_rows::<B, 2>(1, HELD_OUT, [args.global_batch, output], rows, &FlexDevice);
        let loss = (model.valid().forward(x.inner()) - y.inner())
            .powi_scalar(2)
            .mean();
        let value = loss.into_scalar().elem::<f32>();
        if rank == 0 {
            println!("validation loss {:08x} ({value})", value.to_bits());
        }
    }
    if let (true, Some(path)) = (takes_part, &args.out) {
        let bytes: Vec<u8> = parameters::<B, _>(&model)
            .iter()
            .flatten()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        if rank == 0 {
            std::fs::write(path, bytes).map_err(|e| format!("writing {}: {e}", path.display()))?;
        }
    }
    Ok(())
}
