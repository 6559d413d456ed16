//! The command line, and its translation into checked settings (every bad combination is an
//! error that names the flag).

use std::path::PathBuf;

use burn_dist_zero::{DecayRule, checkpoint};
use clap::{Parser, ValueEnum};

use crate::data::text::Tokenizer;
use crate::data::{EvalWindows, Source};
use crate::model::GptConfig;

#[derive(Parser, Debug, Clone)]
#[command(
    name = "gpt-pretrain",
    // A flag given twice takes its last value, so wrappers (`cargo xtask pretrain ARGS`) can
    // override their defaults.
    args_override_self = true,
    about = "Pretrain a GPT-2-style model data-parallel (launch N ranks with burn-dist-run)"
)]
pub struct Args {
    /// Model size; --n-layer, --n-head, --d-model and --context override its parts.
    #[arg(long, value_enum, default_value_t = ModelSize::Tiny)]
    pub model: ModelSize,
    #[arg(long)]
    pub n_layer: Option<usize>,
    #[arg(long)]
    pub n_head: Option<usize>,
    #[arg(long)]
    pub d_model: Option<usize>,
    /// Tokens per training sequence (and learned positions).
    #[arg(long)]
    pub context: Option<usize>,
    #[arg(long, default_value_t = 0.0)]
    pub dropout: f64,
    /// Give the LM head its own matrix instead of reusing the token embedding.
    #[arg(long)]
    pub untie_weights: bool,

    /// Train on this UTF-8 text file (default: the built-in synthetic corpus).
    #[arg(long, conflicts_with = "shards")]
    pub text: Option<PathBuf>,
    /// Tokenizer of --text.
    #[arg(long, value_enum, default_value_t = Tokenizer::Gpt2)]
    pub tokenizer: Tokenizer,
    /// llm.c/nanoGPT .bin token shards: a directory or a file pattern (`dir/train_*.bin`).
    #[arg(long)]
    pub shards: Option<String>,
    /// Synthetic corpus: vocabulary size.
    #[arg(long, default_value_t = 64)]
    pub synthetic_vocab: usize,
    /// Synthetic corpus: allowed successors of each token.
    #[arg(long, default_value_t = 6)]
    pub synthetic_successors: usize,
    /// Synthetic corpus: tokens generated (both splits).
    #[arg(long, default_value_t = 2_000_000)]
    pub synthetic_tokens: usize,
    /// Seed of the synthetic corpus.
    #[arg(long, default_value_t = 1)]
    pub data_seed: u64,
    /// Share of the tokens held out for validation (shards named `*val*` replace it).
    #[arg(long, default_value_t = 0.05)]
    pub val_fraction: f64,

    /// Optimizer steps in all (a resumed run continues up to this step).
    #[arg(long, default_value_t = 600)]
    pub steps: usize,
    /// Sequences per optimizer step over all ranks and micro-batches; divisible by
    /// world size × --accumulation. The same value trains the same model at any world size.
    #[arg(long, default_value_t = 32)]
    pub global_batch: usize,
    /// Micro-batches per optimizer step on each rank (gradient accumulation).
    #[arg(long, default_value_t = 1)]
    pub accumulation: usize,
    #[arg(long, value_enum, default_value_t = OptimizerKind::Zero)]
    pub optimizer: OptimizerKind,
    /// Where the model trains. `wgpu` and `cuda` keep gradients, ZeroAdam's state and the
    /// parameters in device memory (the binary needs the feature of the same name).
    #[arg(long, value_enum, default_value_t = BackendKind::Flex)]
    pub backend: BackendKind,
    /// ZeRO stage of --optimizer zero: 1 shards the optimizer state, 2 also the gradients, 3
    /// also the parameters (each rank keeps its piece of every weight; an op gathers the
    /// weights it uses; `--backend flex` only for now).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=3))]
    pub zero_stage: u8,
    /// With `--backend wgpu|cuda`, ZeRO stages 1 to 3: ZeroAdam's state (f32 master weights,
    /// moments) in host memory, stepped on the host's cores, while the model and the gradient
    /// reduction stay on the device (`ZeroAdam::offloaded`): the device holds the parameters
    /// alone between steps (at stage 3 its shard of them), and each step moves the gradient
    /// shard down and the new shard up.
    #[arg(long)]
    pub offload: bool,
    /// ZeRO stage 3: gathers in flight ahead of their use once the first step has recorded
    /// the order of the weights' uses (burn-dist's `PrefetchConfig::gathers`); 0 gathers
    /// each weight when its op needs it.
    #[arg(long, default_value_t = 2)]
    pub prefetch_gathers: usize,
    /// Peak learning rate (after warmup).
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f64,
    /// Final learning rate of the cosine decay (default: --lr / 10).
    #[arg(long)]
    pub min_lr: Option<f64>,
    #[arg(long, default_value_t = 20)]
    pub warmup: usize,
    #[arg(long, default_value_t = 0.1)]
    pub weight_decay: f32,
    /// Which parameters --weight-decay applies to: `matrices`, the tensors of two or more
    /// dimensions (the weights of the matmuls and the embeddings; not the biases or the
    /// LayerNorm gains: GPT-2's rule, as nanoGPT and llm.c apply it), or `all`.
    #[arg(long, value_enum, default_value_t = DecayKind::Matrices)]
    pub decay: DecayKind,
    #[arg(long, default_value_t = 0.9)]
    pub beta1: f32,
    #[arg(long, default_value_t = 0.95)]
    pub beta2: f32,
    /// Clip the global gradient norm to this (0: no clipping).
    #[arg(long, default_value_t = 1.0)]
    pub max_grad_norm: f32,
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    pub precision: Precision,
    /// Seed of the model's initialization and of the data order.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,

    /// Evaluate every this many steps (and after the last; 0: only after the last).
    #[arg(long, default_value_t = 50)]
    pub eval_every: usize,
    /// Validation windows per evaluation: the whole split when it has at most this many, else
    /// this many spread evenly over it (one seeded draw from each of as many equal stretches);
    /// `all`: every window. The ranks share them; the loss is the mean over the windows.
    #[arg(long, value_name = "N|all", default_value = "512", value_parser = EvalWindows::parse)]
    pub eval_sequences: EvalWindows,
    /// Print a line every this many steps.
    #[arg(long, default_value_t = 10)]
    pub log_every: usize,

    /// Save a checkpoint every K steps (and after the last step), ZeroAdam only.
    #[arg(long)]
    pub checkpoint_every: Option<u64>,
    /// Where checkpoints go (default: RUN_DIR/checkpoints).
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Keep only the K newest complete checkpoints: after each save, rank 0 removes older ones.
    #[arg(long, value_name = "K")]
    pub keep_last: Option<usize>,
    /// Write checkpoints in the background (`checkpoint::AsyncSaver`): each save copies the
    /// state into memory and returns; the checkpoint completes at a later step, or at the end.
    #[arg(long)]
    pub checkpoint_async: bool,
    /// Resume from a checkpoint directory, or the newest complete one under a root; `auto`:
    /// from the newest complete one under the checkpoint directory if there is one, else start
    /// afresh (for jobs a launcher restarts: `burn-dist-run --max-restarts`).
    #[arg(long, value_name = "PATH|auto", value_parser = resume_from)]
    pub resume: Option<Resume>,

    /// Directory of the run's metrics, plot and (by default) checkpoints.
    #[arg(long, default_value = "runs/gpt-pretrain")]
    pub run_dir: PathBuf,
    /// Metrics file, JSON Lines (default: RUN_DIR/metrics.jsonl).
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// Skip the SVG plot (RUN_DIR/loss.svg).
    #[arg(long)]
    pub no_plot: bool,
    /// Print each phase as it ends, with its time (rank 0): the model built, the first
    /// forward, backward and optimizer step (each ended by a device sync: a cold GPU compiles
    /// and tunes its kernels there), then every step and evaluation.
    #[arg(long)]
    pub phase_log: bool,
    /// Peak FLOP/s of the hardware of ALL ranks together, for the MFU column
    /// (e.g. 989e12 for one H100 SXM in bf16).
    #[arg(long)]
    pub peak_flops: Option<f64>,
    /// Rank 0 writes the final parameters here (burn-dist-models' parameter-file format).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Test hook: after this step every rank (or `--pause-rank`) announces its pid on stdout
    /// and waits to be killed; in the job's first start only, so that a restarted job runs on.
    #[arg(long, hide = true)]
    pub pause_after_step: Option<u64>,
    /// Test hook: with `--pause-after-step`, only this rank pauses; the others go on and wait
    /// for it in the next collective, as for a rank that hangs or is lost.
    #[arg(long, hide = true)]
    pub pause_rank: Option<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ModelSize {
    Tiny,
    #[value(name = "gpt2-124m")]
    Gpt2_124m,
    #[value(name = "gpt2-350m")]
    Gpt2_350m,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// Burn's Flex on the CPU; gradients reduced through host buffers.
    Flex,
    /// Burn's `Wgpu` (fusion on): Vulkan, Metal, DX12, or Mesa's lavapipe on a CPU; the device
    /// path with collectives staged through the host.
    Wgpu,
    /// Burn's `Cuda` (fusion on), one GPU per rank (`LOCAL_RANK`); the device path with NCCL.
    Cuda,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OptimizerKind {
    /// burn-dist-zero's ZeroAdam: AdamW with the state sharded across ranks.
    Zero,
    /// Burn's AdamW, replicated on every rank (f32 only, no checkpoints).
    Adamw,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DecayKind {
    /// Tensors of two or more dimensions only (GPT-2's rule).
    Matrices,
    /// Every parameter (Burn's AdamW).
    All,
}

impl DecayKind {
    pub fn rule(self) -> DecayRule {
        match self {
            DecayKind::Matrices => DecayRule::Matrices,
            DecayKind::All => DecayRule::All,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Precision {
    F32,
    /// f16 parameters and activations, f32 master weights and loss scaling (ZeroAdam only).
    F16,
    /// bf16 parameters and activations, f32 master weights, no scaling (ZeroAdam only).
    Bf16,
}

/// Where `--resume` takes its checkpoint from.
#[derive(Debug, Clone, PartialEq)]
pub enum Resume {
    /// `auto`: the newest complete checkpoint under the checkpoint directory, if any.
    Auto,
    /// A checkpoint directory, or a root whose newest complete checkpoint is taken (`./auto`
    /// for a directory named `auto`).
    Path(PathBuf),
}

fn resume_from(text: &str) -> Result<Resume, String> {
    match text {
        "" => Err("give a checkpoint path, or `auto`".into()),
        "auto" => Ok(Resume::Auto),
        path => Ok(Resume::Path(PathBuf::from(path))),
    }
}

impl Args {
    /// The corpus the flags select.
    pub fn source(&self) -> Source {
        match (&self.text, &self.shards) {
            (Some(path), _) => Source::Text {
                path: path.clone(),
                tokenizer: self.tokenizer,
            },
            (None, Some(pattern)) => Source::Shards {
                pattern: pattern.clone(),
            },
            (None, None) => Source::Synthetic {
                vocab: self.synthetic_vocab,
                successors: self.synthetic_successors,
                tokens: self.synthetic_tokens,
                seed: self.data_seed,
            },
        }
    }

    /// The model for a corpus of `vocab` tokens. GPT-2 sizes pad the vocabulary to a multiple
    /// of 64 (50257 → 50304, as nanoGPT does: faster matmuls, the extra rows are never targets).
    pub fn model_config(&self, vocab: usize) -> Result<GptConfig, String> {
        let base = match self.model {
            ModelSize::Tiny => GptConfig::tiny(vocab),
            ModelSize::Gpt2_124m => GptConfig::gpt2_124m(vocab.next_multiple_of(64)),
            ModelSize::Gpt2_350m => GptConfig::gpt2_350m(vocab.next_multiple_of(64)),
        };
        let config = GptConfig {
            n_layer: self.n_layer.unwrap_or(base.n_layer),
            n_head: self.n_head.unwrap_or(base.n_head),
            d_model: self.d_model.unwrap_or(base.d_model),
            context: self.context.unwrap_or(base.context),
            dropout: self.dropout,
            tie_weights: !self.untie_weights,
            ..base
        };
        config.validate().map_err(|e| format!("--model: {e}"))?;
        Ok(config)
    }

    /// Combinations that cannot work, named by their flags. `world` is the number of ranks.
    pub fn check(&self, world: usize) -> Result<(), String> {
        let per_step = world * self.accumulation;
        if self.accumulation == 0
            || self.global_batch == 0
            || !self.global_batch.is_multiple_of(per_step)
        {
            return Err(format!(
                "--global-batch {} is not a positive multiple of world size {world} × --accumulation {}",
                self.global_batch, self.accumulation
            ));
        }
        if self.steps == 0 {
            return Err("--steps must be positive".into());
        }
        if self.lr <= 0.0 || self.min_lr.is_some_and(|m| m < 0.0 || m > self.lr) {
            return Err("--lr must be positive and --min-lr between 0 and --lr".into());
        }
        if self.optimizer == OptimizerKind::Adamw {
            if self.precision != Precision::F32 {
                return Err(format!(
                    "--precision {:?} needs --optimizer zero: Burn's AdamW keeps no f32 master weights, so f16/bf16 parameters would lose small updates",
                    self.precision
                ));
            }
            if self.checkpoint_every.is_some() || self.resume.is_some() {
                return Err(
                    "--checkpoint-every and --resume need --optimizer zero: the sharded checkpoints hold ZeroAdam's state, and Burn's AdamW state has no place in them"
                        .into(),
                );
            }
            if self.zero_stage != 1 {
                return Err("--zero-stage applies to --optimizer zero only".into());
            }
        }
        if self.offload {
            if self.backend == BackendKind::Flex {
                return Err("--offload needs --backend wgpu or cuda: on flex ZeroAdam's state is in host memory already".into());
            }
            if self.optimizer != OptimizerKind::Zero {
                return Err(
                    "--offload needs --optimizer zero: it moves ZeroAdam's state to the host"
                        .into(),
                );
            }
        }
        if self.checkpoint_every == Some(0) {
            return Err("--checkpoint-every must be positive".into());
        }
        match self.keep_last {
            Some(0) => {
                return Err(
                    "--keep-last must be at least 1 (omit it to keep every checkpoint)".into(),
                );
            }
            Some(_) if self.checkpoint_every.is_none() => {
                return Err("--keep-last needs --checkpoint-every: it removes old checkpoints after each save".into());
            }
            _ => {}
        }
        if self.checkpoint_async && self.checkpoint_every.is_none() {
            return Err(
                "--checkpoint-async needs --checkpoint-every: it says how checkpoints are written"
                    .into(),
            );
        }
        Ok(())
    }

    /// The checkpoint `--resume` names, if any: `auto` looks for the newest complete one under
    /// the checkpoint directory (none there: a fresh start).
    pub fn resume_path(&self) -> Result<Option<PathBuf>, String> {
        match &self.resume {
            None => Ok(None),
            Some(Resume::Path(path)) => Ok(Some(path.clone())),
            Some(Resume::Auto) => {
                let root = self.checkpoint_dir();
                checkpoint::latest(&root)
                    .map_err(|e| format!("--resume auto: {}: {e}", root.display()))
            }
        }
    }

    pub fn checkpoint_dir(&self) -> PathBuf {
        self.checkpoint_dir
            .clone()
            .unwrap_or_else(|| self.run_dir.join("checkpoints"))
    }

    pub fn metrics_path(&self) -> PathBuf {
        self.metrics
            .clone()
            .unwrap_or_else(|| self.run_dir.join("metrics.jsonl"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> Args {
        Args::parse_from(["gpt-pretrain"].iter().chain(extra))
    }

    /// `auto` takes the newest complete checkpoint under the checkpoint directory, and starts
    /// afresh when there is none; any other value is a path.
    #[test]
    fn resume_auto_finds_the_newest_checkpoint_or_none() {
        let root = std::env::temp_dir().join(format!("gpt-resume-auto-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let dir = root.to_str().unwrap();
        let auto = args(&["--resume", "auto", "--checkpoint-dir", dir]);
        assert_eq!(auto.resume, Some(Resume::Auto));
        assert_eq!(auto.resume_path().unwrap(), None, "no checkpoint yet");
        for step in [2, 4] {
            let step_dir = checkpoint::step_dir(&root, step);
            std::fs::create_dir_all(&step_dir).unwrap();
            std::fs::write(step_dir.join(checkpoint::MANIFEST), "{}").unwrap();
        }
        // A newer directory without a manifest is an interrupted save: not taken.
        std::fs::create_dir_all(checkpoint::step_dir(&root, 6)).unwrap();
        let newest = checkpoint::step_dir(&root, 4);
        assert_eq!(auto.resume_path().unwrap(), Some(newest));
        let path = args(&["--resume", "./auto"]);
        assert_eq!(path.resume_path().unwrap(), Some(PathBuf::from("./auto")));
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn defaults_are_the_tiny_model_on_the_synthetic_corpus() {
        let a = args(&[]);
        assert!(matches!(a.source(), Source::Synthetic { vocab: 64, .. }));
        let config = a.model_config(64).unwrap();
        assert_eq!(
            (
                config.n_layer,
                config.d_model,
                config.n_head,
                config.context
            ),
            (2, 64, 4, 64)
        );
        a.check(2).unwrap();
        assert_eq!(a.eval_sequences, EvalWindows::AtMost(512));
        assert_eq!(a.decay, DecayKind::Matrices, "GPT-2's decay rule");
        assert_eq!(
            args(&["--eval-sequences", "all", "--decay", "all"]).eval_sequences,
            EvalWindows::All
        );
        assert!(Args::try_parse_from(["gpt-pretrain", "--eval-sequences", "0"]).is_err());
        assert_eq!(
            args(&["--model", "gpt2-124m"])
                .model_config(50257)
                .unwrap()
                .vocab_size,
            50304
        );
    }

    #[test]
    fn offload_needs_a_device_backend_and_zeroadam() {
        args(&["--offload", "--backend", "wgpu"]).check(1).unwrap();
        for stage in ["2", "3"] {
            args(&["--offload", "--backend", "cuda", "--zero-stage", stage])
                .check(1)
                .unwrap();
        }
        let e = args(&["--offload"]).check(1).unwrap_err();
        assert!(e.contains("--offload needs --backend"), "{e}");
        let e = args(&["--offload", "--backend", "wgpu", "--optimizer", "adamw"])
            .check(1)
            .unwrap_err();
        assert!(e.contains("--offload needs --optimizer zero"), "{e}");
    }

    #[test]
    fn bad_combinations_name_their_flags() {
        let e = args(&["--global-batch", "6"]).check(4).unwrap_err();
        assert!(
            e.contains("--global-batch 6") && e.contains("world size 4"),
            "{e}"
        );
        let e = args(&["--optimizer", "adamw", "--precision", "f16"])
            .check(1)
            .unwrap_err();
        assert!(
            e.contains("--precision") && e.contains("--optimizer zero"),
            "{e}"
        );
        let e = args(&["--optimizer", "adamw", "--checkpoint-every", "5"])
            .check(1)
            .unwrap_err();
        assert!(e.contains("--checkpoint-every"), "{e}");
        let e = args(&["--checkpoint-every", "5", "--keep-last", "0"])
            .check(1)
            .unwrap_err();
        assert!(e.contains("--keep-last must be at least 1"), "{e}");
        let e = args(&["--keep-last", "2"]).check(1).unwrap_err();
        assert!(e.contains("--keep-last needs --checkpoint-every"), "{e}");
        let e = args(&["--checkpoint-async"]).check(1).unwrap_err();
        assert!(
            e.contains("--checkpoint-async needs --checkpoint-every"),
            "{e}"
        );
        args(&["--checkpoint-every", "5", "--checkpoint-async"])
            .check(1)
            .unwrap();
        args(&["--checkpoint-every", "5", "--keep-last", "2"])
            .check(1)
            .unwrap();
        let e = args(&["--d-model", "66"]).model_config(64).unwrap_err();
        assert!(e.contains("not divisible by the 4 heads"), "{e}");
        assert!(Args::try_parse_from(["gpt-pretrain", "--zero-stage", "4"]).is_err());
        args(&["--zero-stage", "3"]).check(1).unwrap();
        args(&["--zero-stage", "3", "--backend", "wgpu"])
            .check(1)
            .unwrap();
    }
}
