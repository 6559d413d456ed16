//! The training program: join the job, build the corpus and the model, then train, evaluate,
//! log, checkpoint. Generic over the autodiff backend (`Autodiff<DistributedBackend<Flex>>` on
//! CPU today; CUDA plugs in the same way).

use std::io::Write;
use std::num::NonZeroUsize;
use std::path::PathBuf;

use burn::module::{AutodiffModule, Module};
use burn::optim::AdamWConfig;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, FloatDType};
use burn_dist::{Ddp, DistributedAutodiff, GradScaler, GradScalerConfig};
use burn_dist_comm::{Communicator, HostBuffer, ReduceOp};
use burn_dist_zero::checkpoint::{self, TrainingState};
use burn_dist_zero::{RuledAdamW, ZeroAdam, ZeroAdamConfig};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use burn_dist_models::Cast;

use crate::cli::{Args, DecayKind, OptimizerKind, Precision};
use crate::data::{self, Corpus, EvalPlan, Loader};
use crate::memory::PssSampler;
use crate::metrics::{self, LoopClock, MetricsWriter, ShardRecord, StepRecord};
use crate::model::{Gpt, GptConfig};
use crate::phases::{Observer, Phase, Phases, Split};
use crate::schedule::CosineSchedule;

/// What a finished run reached (rank 0's view; every rank computes the same numbers).
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub steps: u64,
    pub final_loss: f64,
    pub final_val_loss: Option<f64>,
    pub floor: Option<f64>,
}

/// Where ZeroAdam's state goes once built: `|zero, _| Ok(zero)` keeps it on the host; the
/// device path passes `|zero, ddp| zero.on_device::<B>(ddp, &device)` (see `backend`).
pub type PlaceOptimizer<'a> = &'a dyn Fn(ZeroAdam, &Ddp) -> burn_dist_zero::Result<ZeroAdam>;

/// Runs the job described by `args` with a `Ddp` the caller built (e.g. the GPU check's, whose
/// reducer runs on NCCL); its accumulation must be `args.accumulation`. `place` moves
/// ZeroAdam's state (see [`PlaceOptimizer`]).
pub fn run_with<B: DistributedAutodiff>(
    args: &Args,
    ddp: &mut Ddp,
    device: &B::Device,
    place: PlaceOptimizer,
) -> Result<Outcome, String> {
    run_observed::<B>(args, ddp, device, place, None)
}

/// [`run_with`], with the run's phases handed to `observer` as they end (see
/// [`crate::phases`]): the device check writes its first-step line from them, and ends the
/// run early when its time is short.
pub fn run_observed<'a, B: DistributedAutodiff>(
    args: &'a Args,
    ddp: &'a mut Ddp,
    device: &B::Device,
    place: PlaceOptimizer,
    observer: Option<&'a mut dyn Observer>,
) -> Result<Outcome, String> {
    let rank = ddp.rank();
    if ddp.accumulation_steps() != args.accumulation {
        return Err(format!(
            "rank {rank}: the Ddp accumulates {} micro-batches but --accumulation is {}",
            ddp.accumulation_steps(),
            args.accumulation
        ));
    }
    let phases = Phases::start(args.phase_log && rank == 0, observer);
    Trainer::<B>::new(args, ddp, device, place, phases)
        .and_then(|trainer| trainer.train())
        .map_err(|e| format!("rank {rank}: {e}"))
}

enum Optim<B: AutodiffBackend> {
    Zero(Box<ZeroAdam>),
    /// Burn's AdamW, one for the parameters that decay and one for the others.
    AdamW(Box<RuledAdamW<Gpt<B>, B>>),
}

struct Trainer<'a, B: DistributedAutodiff> {
    args: &'a Args,
    ddp: &'a mut Ddp,
    device: B::Device,
    corpus: Corpus,
    config: GptConfig,
    model: Option<Gpt<B>>,
    optim: Optim<B>,
    scaler: Option<GradScaler>,
    schedule: CosineSchedule,
    loader: Loader,
    /// The validation windows every evaluation reads.
    eval: EvalPlan,
    start: u64,
    /// Which start of the job this is (`burn-dist-run --max-restarts` or torchrun; 0: the first).
    restart: usize,
    bar: ProgressBar,
    metrics: Option<MetricsWriter>,
    phases: Phases<'a>,
    /// `--checkpoint-async`: the background saver.
    saver: Option<checkpoint::AsyncSaver>,
    /// Seconds spent on checkpoints since the last record (`StepRecord::checkpoint_s`).
    checkpoint_s: f64,
}

impl<'a, B: DistributedAutodiff> Trainer<'a, B> {
    fn new(
        args: &'a Args,
        ddp: &'a mut Ddp,
        device: &B::Device,
        place: PlaceOptimizer,
        phases: Phases<'a>,
    ) -> Result<Self, String> {
        let (rank, world) = (ddp.rank(), ddp.world_size());
        args.check(world)?;
        let corpus = Corpus::load(&args.source(), args.val_fraction)?;
        let config = args.model_config(corpus.vocab_size)?;
        let seq = config.context;
        let windows = data::window_count(corpus.train.len(), seq);

        // Every rank builds the same model from the seed; `prepare` checks that they agree and
        // copies rank 0's values anyway (at ZeRO stage 3, `prepare_sharded` keeps each rank's
        // piece of them).
        ddp.seed(args.seed);
        let model = config.init::<B>(args.seed, device);
        let model = match args.precision {
            Precision::F32 => model,
            Precision::F16 => model.map(&mut Cast(FloatDType::F16)),
            Precision::Bf16 => model.map(&mut Cast(FloatDType::BF16)),
        };
        let model = B::prepare_model(ddp, model).map_err(|e| e.to_string())?;
        let max_grad_norm = (args.max_grad_norm > 0.0).then_some(args.max_grad_norm);
        let mut optim = match args.optimizer {
            OptimizerKind::Zero => Optim::Zero(Box::new(
                ZeroAdamConfig::new()
                    .with_beta_1(args.beta1)
                    .with_beta_2(args.beta2)
                    .with_epsilon(1e-8)
                    .with_weight_decay(args.weight_decay)
                    .with_decay(args.decay.rule())
                    .with_max_grad_norm(max_grad_norm)
                    .with_stage(args.zero_stage)
                    .init::<B, _>(ddp, &model)
                    .and_then(|zero| place(zero, ddp))
                    .map_err(|e| format!("--optimizer zero: {e}"))?,
            )),
            OptimizerKind::Adamw => Optim::AdamW(Box::new(
                RuledAdamW::new(
                    &AdamWConfig::new()
                        .with_beta_1(args.beta1)
                        .with_beta_2(args.beta2)
                        .with_epsilon(1e-8)
                        .with_weight_decay(args.weight_decay),
                    ddp.params(),
                    &args.decay.rule(),
                )
                .map_err(|e| format!("--optimizer adamw: {e}"))?,
            )),
        };
        let mut scaler = (args.precision == Precision::F16).then(|| GradScalerConfig::new().init());

        // Resume: weights, optimizer shards (resharded to this world size), random stream,
        // loss scale and data position.
        let (model, start, consumed) = match (args.resume_path()?, &mut optim) {
            (Some(path), Optim::Zero(zero)) => {
                let (model, state) = checkpoint::load(&path, ddp, model, zero)
                    .map_err(|e| format!("--resume {}: {e}", path.display()))?;
                scaler = scaler.map(|s| state.restore_scaler(s));
                (model, state.step, state.samples_consumed)
            }
            _ => (model, 0, 0),
        };
        let loader = Loader::new(rank, world, args.seed, windows, args.global_batch, consumed)?;
        // Checked here, identically on every rank, so that no rank fails alone inside an
        // evaluation while the others wait in its all-reduce.
        let val_windows = data::window_count(corpus.val.len(), seq);
        if val_windows == 0 {
            return Err(format!(
                "the validation split has {} tokens, not one window of {} (more data or a larger --val-fraction, or a smaller --context)",
                corpus.val.len(),
                seq + 1
            ));
        }
        let eval = EvalPlan::new(val_windows, args.eval_sequences, args.seed);

        let bar = if rank == 0 {
            let bar = ProgressBar::with_draw_target(
                Some(args.steps as u64),
                ProgressDrawTarget::stderr(),
            );
            bar.set_style(
                ProgressStyle::with_template(
                    "{bar:30} {pos}/{len} steps {msg} [{elapsed_precise}, eta {eta}]",
                )
                .expect("a valid template"),
            );
            bar.set_position(start);
            bar
        } else {
            ProgressBar::hidden()
        };
        let metrics = if rank == 0 {
            Some(MetricsWriter::open(&args.metrics_path(), start > 0)?)
        } else {
            None
        };
        let mut trainer = Trainer {
            schedule: CosineSchedule {
                max_lr: args.lr,
                min_lr: args.min_lr.unwrap_or(args.lr / 10.0),
                warmup: args.warmup,
                total: args.steps,
            },
            args,
            device: device.clone(),
            corpus,
            config,
            model: Some(model),
            optim,
            scaler,
            loader,
            eval,
            start,
            // A malformed value was already refused when the rank joined the job.
            restart: burn_dist_comm::env::restart_count().unwrap_or(0),
            bar,
            metrics,
            phases,
            saver: args
                .checkpoint_async
                .then(|| checkpoint::AsyncSaver::new(args.checkpoint_dir())),
            checkpoint_s: 0.0,
            ddp,
        };
        trainer.announce(windows);
        // Nothing to stop yet: only a step's phase can end the run.
        let _ = trainer.phases.reach(Phase::ModelBuilt);
        Ok(trainer)
    }

    fn rank(&self) -> usize {
        self.ddp.rank()
    }

    /// Waits for the device's queued work, so that the phase just ended is timed whole.
    fn sync(&self, step: u64) -> Result<(), String> {
        B::sync(&self.device).map_err(|e| format!("step {step}: waiting for the device: {e:?}"))
    }

    /// Rank 0 prints a line (above the progress bar when there is one).
    fn say(&self, line: String) {
        if self.ddp.is_main() {
            self.bar.suspend(|| {
                println!("{line}");
                let _ = std::io::stdout().flush();
            });
        }
    }

    fn announce(&self, train_windows: usize) {
        let (args, config) = (self.args, &self.config);
        self.say(format!("corpus: {}", self.corpus.description));
        if let (Some(floor), Some(chain)) = (self.corpus.floor(), &self.corpus.chain) {
            self.say(format!(
                "entropy floor: {floor:.4} nats/token (the chain's entropy rate: the best expected loss at every target position)"
            ));
            // The evaluated windows are a finite sample: the ideal model's loss on exactly
            // their targets is the floor the validation loss is compared with in practice.
            let seq = config.context;
            let oracle: f64 = self
                .eval
                .windows
                .iter()
                .map(|&i| chain.oracle_loss(&self.corpus.val[i * seq..i * seq + seq + 1]))
                .sum::<f64>()
                / self.eval.windows.len() as f64;
            self.say(format!(
                "the ideal model scores {oracle:.4} nats/token on the {} validation windows evaluated",
                self.eval.windows.len()
            ));
        }
        self.say(self.eval.describe(config.context));
        self.say(format!(
            "model: {} layers, width {}, {} heads, context {}, vocabulary {}, {:.3} M parameters, {:?}",
            config.n_layer,
            config.d_model,
            config.n_head,
            config.context,
            config.vocab_size,
            config.num_params() as f64 / 1e6,
            args.precision
        ));
        self.say(format!(
            "training: {} ranks, global batch {} sequences ({} tokens) in {} micro-batch(es), {} steps, {} windows per epoch, {:?}{}",
            self.ddp.world_size(),
            args.global_batch,
            args.global_batch * config.context,
            args.accumulation,
            args.steps,
            train_windows,
            args.optimizer,
            match args.optimizer {
                OptimizerKind::Zero => format!(" (ZeRO stage {})", args.zero_stage),
                OptimizerKind::Adamw => String::new(),
            }
        ));
        let params = self.ddp.params();
        let decayed = args
            .decay
            .rule()
            .resolve(params)
            .map_or(0, |decays| decays.iter().filter(|&&d| d).count());
        self.say(match args.decay {
            DecayKind::Matrices => format!(
                "weight decay {} on the {decayed} of {} parameter tensors with two or more dimensions (--decay matrices; --decay all: every one)",
                args.weight_decay,
                params.len()
            ),
            DecayKind::All => format!(
                "weight decay {} on all {} parameter tensors (--decay all)",
                args.weight_decay,
                params.len()
            ),
        });
        match (self.start, self.restart) {
            (0, 0) => {}
            (0, n) => self.say(format!("restart {n}: no checkpoint yet, starting afresh")),
            (step, 0) => self.say(format!("resumed at step {step}")),
            (step, n) => self.say(format!("restart {n}: resumed at step {step}")),
        }
    }

    fn train(mut self) -> Result<Outcome, String> {
        let args = self.args;
        let steps = args.steps as u64;
        let floor = self.corpus.floor();
        let tokens = (args.global_batch * self.config.context) as u64;
        let flops_per_token = self.config.flops_per_token(self.config.context);
        let mfu = |tokens_per_s: f64| {
            args.peak_flops
                .map(|peak| flops_per_token * tokens_per_s / peak)
        };
        let mut outcome = Outcome {
            steps: self.start,
            final_loss: f64::NAN,
            final_val_loss: None,
            floor,
        };
        if self.start >= steps {
            return Err(format!(
                "the checkpoint is at step {}: nothing to do for --steps {steps}",
                self.start
            ));
        }
        let mut clock = LoopClock::start();
        let mut moved = self.ddp.stats();
        let mut shards_before = self.ddp.shard_stats().unwrap_or_default();
        // Each rank's peak memory as the host pays for it (PSS), read at the steps' high points.
        let pss = PssSampler::start();
        for done in self.start + 1..=steps {
            if let Some(pss) = &pss {
                pss.next_step();
            }
            let (loss, lr, grad_norm, skipped, loss_scale, split) = self.step(done - 1)?;
            let stops = self
                .phases
                .reach(Phase::Step {
                    step: done,
                    loss,
                    split,
                })
                .is_break();
            let before = std::mem::replace(&mut moved, self.ddp.stats());
            let last = done == steps || stops;
            let evaluates =
                last || (args.eval_every > 0 && done.is_multiple_of(args.eval_every as u64));
            let val_loss = if evaluates {
                let val_loss = self.evaluate()?;
                let _ = self.phases.reach(Phase::Evaluated {
                    step: done,
                    val_loss,
                });
                Some(val_loss)
            } else {
                None
            };
            // The same decision on every rank: the resident-memory gather is a collective.
            let prints = last
                || evaluates
                || (args.log_every > 0 && done.is_multiple_of(args.log_every as u64));
            let (rss_mib, peak_rss_mib, peak_pss_mib) = if prints {
                self.gather_memory(pss.as_ref())?
            } else {
                (Vec::new(), Vec::new(), Vec::new())
            };
            let shared = self.ddp.communicator().shared_memory();
            let shards = self.ddp.shard_stats().map(|now| {
                let before = std::mem::replace(&mut shards_before, now);
                ShardRecord {
                    shard_mib: mib(now.shard_bytes as u64),
                    gathered_peak_mib: mib(now.last_step_peak_bytes as u64),
                    gathered_mib: mib(now.gathered_bytes - before.gathered_bytes),
                    reads: now.reads,
                    gather_wait_s: (now.wait_nanos - before.wait_nanos) as f64 * 1e-9,
                    prefetched: now.prefetched - before.prefetched,
                    reused_buffers: now.reused_buffers - before.reused_buffers,
                    pooled_mib: mib(now.pooled_bytes as u64),
                    gathered_in_place: now.gathered_in_place - before.gathered_in_place,
                    shared_mib: mib(shared.held as u64),
                    shared_peak_mib: mib(shared.peak as u64),
                }
            });
            let rate = clock.lap(tokens);
            let record = StepRecord {
                step: done,
                loss,
                val_loss,
                floor,
                lr,
                loss_scale,
                grad_norm: grad_norm.is_finite().then_some(grad_norm),
                skipped,
                tokens_per_s: rate.tokens_per_s,
                flops_per_s: flops_per_token * rate.tokens_per_s,
                mfu: mfu(rate.tokens_per_s),
                rss_mib,
                peak_rss_mib,
                peak_pss_mib,
                shards,
                elapsed_s: rate.elapsed_s,
                checkpoint_s: args
                    .checkpoint_every
                    .map(|_| std::mem::take(&mut self.checkpoint_s)),
                bytes_to_host: moved.bytes_to_host - before.bytes_to_host,
                bytes_to_device: moved.bytes_to_device - before.bytes_to_device,
            };
            if let Some(metrics) = &mut self.metrics {
                metrics.write(&record)?;
            }
            self.bar.set_position(done);
            self.bar.set_message(format!("loss {loss:.4}"));
            if prints {
                let interval = clock.interval();
                self.say(log_line(&record, steps, interval, mfu(interval)));
            }
            outcome = Outcome {
                steps: done,
                final_loss: loss,
                final_val_loss: val_loss.or(outcome.final_val_loss),
                floor,
            };
            let began = std::time::Instant::now();
            // A collective on every rank alike: the saver is pending on all or on none.
            self.poll_saver()?;
            if let Some(every) = args.checkpoint_every
                && (done.is_multiple_of(every) || last)
            {
                self.save(done)?;
            }
            self.checkpoint_s += began.elapsed().as_secs_f64();
            let pauses_here = args.pause_after_step == Some(done)
                && args.pause_rank.is_none_or(|rank| rank == self.rank());
            if pauses_here && self.restart == 0 {
                pause(self.rank(), done);
            }
            if last {
                break;
            }
        }
        self.bar.finish_and_clear();
        // The last asynchronous checkpoint completes before the run counts as done.
        let committed = match &mut self.saver {
            Some(saver) => saver.wait(self.ddp).map_err(|e| e.to_string())?,
            None => None,
        };
        if let Some(dir) = committed {
            self.saved(&dir);
        }
        self.finish(&outcome, &clock)?;
        Ok(outcome)
    }

    /// One optimizer step (`step` counts from 0): every micro-batch's forward and backward,
    /// then the update. Returns the mean loss over ranks and micro-batches, the learning rate,
    /// the gradient norm, whether the step was skipped, the loss scale used, and, when its
    /// phases are timed (the first step, or one the observer splits), its parts' seconds.
    #[allow(clippy::type_complexity)] // one step's figures, each named above
    fn step(
        &mut self,
        step: u64,
    ) -> Result<(f64, f64, f64, bool, Option<f32>, Option<Split>), String> {
        // The first step of this run (a resumed run's too) and the steps the observer splits.
        let first = step == self.start;
        let timed = self.phases.listened() && (first || self.phases.splits(step + 1));
        let mut split = Split {
            forward_s: 0.0,
            backward_s: 0.0,
            optimizer_s: 0.0,
        };
        let mut clock = std::time::Instant::now();
        let lap = |clock: &mut std::time::Instant| {
            let seconds = clock.elapsed().as_secs_f64();
            *clock = std::time::Instant::now();
            seconds
        };
        let (args, seq) = (self.args, self.config.context);
        let lr = self.schedule.lr(step as usize);
        self.ddp.set_step(step);
        let windows = self.loader.next_step();
        let micro = windows.len() / args.accumulation;
        let loss_scale = self.scaler.as_ref().map(GradScaler::scale);
        let mut model = self
            .model
            .take()
            .expect("the model is in place between steps");
        let mut loss_sum = 0.0;
        let mut grads = None;
        for chunk in windows.chunks(micro) {
            if args.accumulation > 1 {
                // Each backward consumes the sync marks (see burn-dist's guide).
                model = self.ddp.mark(model);
            }
            let (inputs, targets) = data::batch::<B>(&self.corpus.train, seq, chunk, &self.device);
            let loss = model.loss(inputs, targets);
            loss_sum += loss.clone().into_scalar().elem::<f64>();
            if timed {
                split.forward_s += lap(&mut clock);
                if first {
                    let _ = self.phases.reach(Phase::FirstForward);
                }
            }
            let loss = match &self.scaler {
                Some(scaler) => scaler.scale_loss(loss),
                None => loss,
            };
            grads = self
                .ddp
                .backward(loss, &model)
                .map_err(|e| format!("step {}: {e}", step + 1))?;
            if timed {
                self.sync(step + 1)?;
                split.backward_s += lap(&mut clock);
                if first {
                    let _ = self.phases.reach(Phase::FirstBackward);
                }
            }
        }
        let grads = grads.expect("the last micro-batch of a window returns the gradients");
        let max_grad_norm = (args.max_grad_norm > 0.0).then_some(args.max_grad_norm);
        let (model, grad_norm, skipped) = match &mut self.optim {
            Optim::Zero(zero) => {
                let stepped = match &mut self.scaler {
                    Some(scaler) => zero.step_scaled(lr, model, grads, self.ddp, scaler),
                    None => zero.step(lr, model, grads, self.ddp),
                };
                let (model, report) = stepped.map_err(|e| format!("step {}: {e}", step + 1))?;
                (model, report.grad_norm, report.skipped)
            }
            Optim::AdamW(adamw) => {
                let (grads, norm) = burn_dist::clip_grad_norm(&model, grads, max_grad_norm);
                (adamw.step(lr, model, grads), norm, false)
            }
        };
        self.model = Some(model);
        if timed {
            self.sync(step + 1)?;
            split.optimizer_s += lap(&mut clock);
            if first {
                let _ = self.phases.reach(Phase::FirstOptimizerStep);
            }
        }
        let loss = self.mean_over_ranks(loss_sum / args.accumulation as f64)?;
        Ok((
            loss,
            lr,
            grad_norm,
            skipped,
            loss_scale,
            timed.then_some(split),
        ))
    }

    fn mean_over_ranks(&self, value: f64) -> Result<f64, String> {
        let reduced = self
            .ddp
            .communicator()
            .all_reduce(HostBuffer::F32(vec![value as f32]), ReduceOp::Avg)
            .wait()
            .map_err(|e| format!("averaging the loss: {e}"))?;
        let HostBuffer::F32(v) = reduced else {
            unreachable!("an f32 all-reduce returns f32")
        };
        Ok(f64::from(v[0]))
    }

    /// Mean validation loss over the plan's windows, the same at every world size: each rank
    /// sums the loss of its share, weighted by windows, and the sums are added.
    fn evaluate(&self) -> Result<f64, String> {
        let (args, seq) = (self.args, self.config.context);
        let model = self.model.as_ref().expect("the model is in place").valid();
        let (rank, world) = (self.rank(), self.ddp.world_size());
        let micro = args.global_batch / world / args.accumulation;
        let mut sum = 0.0f64;
        for (windows, weight) in self.eval.share(rank, world, micro) {
            let (inputs, targets) =
                data::batch::<B::InnerBackend>(&self.corpus.val, seq, &windows, &self.device);
            let loss = model.loss(inputs, targets).into_scalar().elem::<f64>();
            sum += loss * weight as f64;
        }
        // Gathered and added in rank order in f64: the same total on every rank, and no f32
        // rounding of a sum over thousands of windows.
        let all = self
            .ddp
            .communicator()
            .all_gather(HostBuffer::U8(sum.to_le_bytes().to_vec()), 8 * world)
            .wait()
            .map_err(|e| format!("summing the validation loss: {e}"))?;
        let total: f64 = all
            .as_bytes()
            .chunks_exact(8)
            .map(|rank| f64::from_le_bytes(rank.try_into().expect("8 bytes")))
            .sum();
        Ok(total / self.eval.windows.len() as f64)
    }

    /// Every rank's resident memory, its peak so far and its peak PSS so far (empty where a
    /// rank cannot read it) in MiB, gathered (in rank order) on every rank.
    #[allow(clippy::type_complexity)]
    fn gather_memory(
        &self,
        pss: Option<&PssSampler>,
    ) -> Result<(Vec<f64>, Vec<f64>, Vec<f64>), String> {
        let world = self.ddp.world_size();
        let mine = [
            metrics::resident_kib().unwrap_or(0),
            metrics::peak_resident_kib().unwrap_or(0),
            pss.map_or(0, |pss| pss.peak() >> 10),
        ];
        let mine = mine.iter().flat_map(|kib| kib.to_le_bytes()).collect();
        let all = self
            .ddp
            .communicator()
            .all_gather(HostBuffer::U8(mine), 24 * world)
            .wait()
            .map_err(|e| format!("gathering resident memory: {e}"))?;
        let mib = |c: &[u8]| u64::from_le_bytes(c.try_into().expect("8 bytes")) as f64 / 1024.0;
        let ranks = all.as_bytes().chunks_exact(24);
        let column = |i: usize| -> Vec<f64> {
            ranks
                .clone()
                .map(|rank| mib(&rank[8 * i..8 * i + 8]))
                .collect()
        };
        let mut peak_pss = column(2);
        if peak_pss.contains(&0.0) {
            peak_pss.clear();
        }
        Ok((column(0), column(1), peak_pss))
    }

    fn save(&mut self, done: u64) -> Result<(), String> {
        let Optim::Zero(zero) = &self.optim else {
            unreachable!("Args::check refuses checkpoints without ZeroAdam")
        };
        let mut state = TrainingState::new(done, done * self.args.global_batch as u64)
            .with_random(self.args.seed, done);
        if let Some(scaler) = &self.scaler {
            state = state.with_scaler(scaler);
        }
        let root = self.args.checkpoint_dir();
        let model = self.model.as_ref().expect("the model is in place");
        let failed = |e| format!("saving step {done} under {}: {e}", root.display());
        let Some(saver) = &mut self.saver else {
            let dir = checkpoint::save(&root, self.ddp, model, zero, &state).map_err(failed)?;
            self.saved(&dir);
            return Ok(());
        };
        // The save before it completes first (one snapshot at a time).
        let committed = saver.wait(self.ddp).map_err(|e| e.to_string())?;
        saver.save(self.ddp, model, zero, &state).map_err(failed)?;
        let held = saver.snapshot_bytes();
        if let Some(dir) = committed {
            self.saved(&dir);
        }
        self.say(format!(
            "saving step {done} in the background ({:.1} MiB held on rank {})",
            held as f64 / (1 << 20) as f64,
            self.rank()
        ));
        Ok(())
    }

    /// `--checkpoint-async`: completes the pending checkpoint once every rank has written its
    /// files (a collective while one is pending).
    fn poll_saver(&mut self) -> Result<(), String> {
        let committed = match &mut self.saver {
            Some(saver) => saver.poll(self.ddp).map_err(|e| e.to_string())?,
            None => None,
        };
        if let Some(dir) = committed {
            self.saved(&dir);
        }
        Ok(())
    }

    /// A checkpoint is complete in `dir`: said, and `--keep-last` applied.
    fn saved(&self, dir: &std::path::Path) {
        self.say(format!("saved {}", dir.display()));
        let root = self.args.checkpoint_dir();
        if let (0, Some(keep)) = (self.rank(), self.args.keep_last.and_then(NonZeroUsize::new)) {
            // Not fatal: the new checkpoint is complete; an old one left behind costs only disk.
            match checkpoint::keep_last(&root, keep) {
                Ok(removed) => {
                    for old in removed {
                        self.say(format!("removed {} (--keep-last {keep})", old.display()));
                    }
                }
                Err(e) => self.say(format!(
                    "warning: --keep-last {keep}: removing old checkpoints under {}: {e}",
                    root.display()
                )),
            }
        }
    }

    /// Rank 0: the parameter dump, the plot and the summary lines. The end-to-end rate is read
    /// first: the loop, its last checkpoint included, and nothing after it.
    fn finish(&self, outcome: &Outcome, clock: &LoopClock) -> Result<(), String> {
        // Read on every rank: at ZeRO stage 3 reading a parameter gathers it from every rank.
        let model = self.model.as_ref().expect("the model is in place");
        let params = self
            .args
            .out
            .as_ref()
            .map(|_| burn_dist_models::step::float_params::<B, _>(model));
        if !self.ddp.is_main() {
            return Ok(());
        }
        let (tokens_per_s, tokens, seconds) = clock.end_to_end();
        if let (Some(out), Some(params)) = (&self.args.out, params) {
            burn_dist_models::step::write_params(out, &params)
                .map_err(|e| format!("--out {}: {e}", out.display()))?;
        }
        if !self.args.no_plot {
            let path = self.metrics_plot_path();
            let records = metrics::read(&self.args.metrics_path())?;
            crate::plot::plot(&records, outcome.floor, &path)?;
            self.say(format!("plot: {}", path.display()));
        }
        let val = outcome.final_val_loss.map_or("-".into(), |v| {
            format!(
                "{v:.4} ({} of {} windows)",
                self.eval.windows.len(),
                self.eval.total
            )
        });
        let gap = match (outcome.final_val_loss, outcome.floor) {
            (Some(v), Some(f)) => format!(", floor {f:.4}, gap {:+.4} nats/token", v - f),
            _ => String::new(),
        };
        self.say(format!(
            "done: {} steps, train loss {:.4}, validation loss {val}{gap}",
            outcome.steps, outcome.final_loss
        ));
        self.say(format!(
            "throughput: {tokens_per_s:.0} tokens/s end to end ({tokens} tokens in {seconds:.2} s \
             of training loop, evaluations and checkpoints included)"
        ));
        Ok(())
    }

    fn metrics_plot_path(&self) -> PathBuf {
        self.args.run_dir.join("loss.svg")
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

/// The line printed every `--log-every` steps: the step's numbers, with the throughput (and
/// MFU) of the whole interval since the previous line.
fn log_line(r: &StepRecord, steps: u64, tokens_per_s: f64, mfu: Option<f64>) -> String {
    let mut line = format!("step {:>5}/{steps} | loss {:.4}", r.step, r.loss);
    if let Some(v) = r.val_loss {
        line += &format!(" | val {v:.4}");
    }
    if let Some(f) = r.floor {
        line += &format!(" | floor {f:.4}");
    }
    line += &format!(" | lr {:.2e} | {tokens_per_s:.0} tok/s", r.lr);
    if let Some(mfu) = mfu {
        line += &format!(" | MFU {:.2} %", 100.0 * mfu);
    }
    if let Some(s) = r.loss_scale {
        line += &format!(" | scale {s}");
    }
    if r.skipped {
        line += " | skipped (inf/NaN)";
    }
    match r.peak_pss_mib.iter().copied().reduce(f64::max) {
        Some(peak) => {
            line += &format!(" | peak pss {peak:.0} MiB/rank (private + share of shared)")
        }
        None => {
            if let Some(peak) = r.peak_rss_mib.iter().copied().reduce(f64::max) {
                line += &format!(" | peak rss {peak:.0} MiB/rank");
            }
        }
    }
    if let Some(shards) = &r.shards {
        line += &format!(
            " | shard {:.1} MiB, gathered {:.1} MiB at most, {:.2} s waiting for gathers, \
             {} into pooled buffers, {} read in place, shared buffers {:.1} MiB ({:.1} at most)",
            shards.shard_mib,
            shards.gathered_peak_mib,
            shards.gather_wait_s,
            shards.reused_buffers,
            shards.gathered_in_place,
            shards.shared_mib,
            shards.shared_peak_mib
        );
    }
    line
}

/// The crash tests' hook: announce the pid on stdout and wait to be killed.
fn pause(rank: usize, step: u64) -> ! {
    println!(
        "paused after step {step} on rank {rank} (pid {})",
        std::process::id()
    );
    let _ = std::io::stdout().flush();
    loop {
        std::thread::park();
    }
}
