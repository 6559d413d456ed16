//! Times the host step (`burn_dist_kernels::host`) on one flat f32 shard, for
//! `cargo xtask bench-host-step`, which runs it beside PyTorch's CPU AdamW
//! (`benches/torch/adamw_cpu.py`) and prints the ratios (docs/perf/host-step.md).
//!
//! usage: host-step-bench [--sizes N,N,...] [--threads T,T,...] [--reps R]
//!
//! Prints one line per (variant, size, threads): `ours <variant> <elements> <threads>
//! <median ms> <min ms>`, where the variant is
//! - `update`: `host::adam_update` alone (AdamW, weight decay 0.1, no model copy), the work of
//!   `torch.optim.AdamW.step`;
//! - `full`: `host::unscale_and_check` + `clip_factor` + `host::adam_update`, ZeroAdam's whole
//!   host step (less its collectives), the work of `clip_grad_norm_` + `step`;
//! - `update_late`, `full_late`: the same from step 1000 on, where `1 - beta1^t` is exactly 1
//!   in f32 (from step 165) and AdamW's first division folds away; `update` and `full` run
//!   steps 1 to 150.
//!
//! Threads 0 means rayon's default: one per core.
//!
//! Before timing, it checks the vectorized build it times against the reference (the unit
//! tests run unoptimized, where nothing is vectorized): for 1 and all threads, AdamW at the
//! three kinds of step (the bias corrections below 1, the first exactly 1, both) and Adam + L2,
//! the update is bitwise the reference's and the unscaled gradient too; a mismatch panics.

use std::time::Instant;

use burn_dist_kernels::testing::Rng;
use burn_dist_kernels::{ModelCopy, StepScalars, clip_factor, host, reference};

/// Untimed steps before the timed ones: page faults and the thread pool's start are not the
/// step.
const WARMUP: usize = 3;

/// `update` and `full` run steps 1 to this, over and over: `1 - beta1^t` < 1 in f32 (t ≤ 164).
const EARLY_STEPS: usize = 150;

/// `update_late` and `full_late` run from this step on: `1 - beta1^t` is exactly 1 in f32 and
/// AdamW's first division folds away (see `host`), as in most of a training run.
const LATE_STEP: u32 = 1000;

struct Args {
    sizes: Vec<usize>,
    threads: Vec<usize>,
    reps: usize,
}

fn parse_list(flag: &str, value: Option<String>) -> Result<Vec<usize>, String> {
    let value = value.ok_or_else(|| format!("{flag} needs a value"))?;
    value
        .split(',')
        .map(|x| {
            x.trim()
                .parse()
                .map_err(|e| format!("{flag} {value}: {x:?} is not a count ({e})"))
        })
        .collect()
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        sizes: vec![1 << 20, 16 << 20],
        threads: vec![1, 0],
        reps: 20,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--sizes" => args.sizes = parse_list("--sizes", it.next())?,
            "--threads" => args.threads = parse_list("--threads", it.next())?,
            "--reps" => match parse_list("--reps", it.next())?.as_slice() {
                [reps] if *reps > 0 => args.reps = *reps,
                _ => return Err("--reps needs one positive count".into()),
            },
            other => {
                return Err(format!(
                    "unknown argument {other:?}; usage: host-step-bench [--sizes N,N,...] \
                     [--threads T,T,...] [--reps R]"
                ));
            }
        }
    }
    Ok(args)
}

/// Median (the mean of the middle two for an even count, as Python's `statistics.median`) and
/// minimum of `times` (ms).
fn summary(mut times: Vec<f64>) -> (f64, f64) {
    times.sort_by(f64::total_cmp);
    let n = times.len();
    let median = (times[(n - 1) / 2] + times[n / 2]) / 2.0;
    (median, times[0])
}

/// The bench's AdamW scalars (PyTorch's `AdamW(lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
/// weight_decay=0.1)`).
fn adamw(step: u32) -> StepScalars {
    StepScalars {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
        decoupled: true,
        step,
    }
}

/// The release build's host step against the reference, bitwise (see the module doc).
fn check_against_reference(threads: &[usize]) {
    let n = 3 * host::CHUNK + 21;
    let mut rng = Rng::new(7);
    let l2 = StepScalars {
        decoupled: false,
        ..adamw(5)
    };
    for &threads in threads {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a thread pool");
        for s in [adamw(5), adamw(250), adamw(25_000), l2] {
            let master = rng.nonzero_vec(n, 1e-3, 0.2);
            let m = rng.nonzero_vec(n, 1e-6, 1e-2);
            let v = rng.positive_vec(n, 1e-10, 1e-4);
            let grads = rng.nonzero_vec(n, 1e-6, 1e2);
            // The clip factor from the reference's sum, for both: the fast sum is summed in
            // another order (its own test bounds it).
            let clip = clip_factor(
                reference::unscale_and_check(&mut grads.clone(), 1.0 / 1024.0).1,
                Some(1.0),
            );
            // The two implementations share their signatures; the reference is sequential, so
            // running it in the pool changes nothing.
            type Check = fn(&mut [f32], f32) -> (bool, f64);
            type Update = fn(
                &mut [f32],
                &mut [f32],
                &mut [f32],
                &[f32],
                f32,
                bool,
                &StepScalars,
                ModelCopy<'_>,
            );
            let run = |(check, update): (Check, Update)| {
                let (mut p, mut m, mut v, mut g) =
                    (master.clone(), m.clone(), v.clone(), grads.clone());
                pool.install(|| {
                    check(&mut g, 1.0 / 1024.0);
                    update(&mut p, &mut m, &mut v, &g, clip, false, &s, ModelCopy::None);
                });
                [p, m, v, g].map(|x| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
            };
            let fast = run((host::unscale_and_check, host::adam_update));
            let slow = run((reference::unscale_and_check, reference::adam_update));
            for (i, name) in ["master", "m", "v", "unscaled gradient"].iter().enumerate() {
                assert!(
                    fast[i] == slow[i],
                    "host step != reference: {name}, {threads} threads, {s:?}"
                );
            }
        }
    }
    eprintln!("host-step-bench: the host step is bitwise the reference (release build)");
}

/// One flat shard of `n` elements with gradients and moments shaped like training's.
struct Shard {
    master: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    grads: Vec<f32>,
}

impl Shard {
    fn new(n: usize) -> Self {
        let mut rng = Rng::new(42);
        Shard {
            master: rng.nonzero_vec(n, 1e-3, 0.2),
            m: vec![0.0; n],
            v: vec![0.0; n],
            grads: rng.nonzero_vec(n, 1e-6, 1e-2),
        }
    }

    fn update(&mut self, step: u32, clip: f32) {
        let s = adamw(step);
        host::adam_update(
            &mut self.master,
            &mut self.m,
            &mut self.v,
            &self.grads,
            clip,
            false,
            &s,
            ModelCopy::None,
        );
    }

    /// ZeroAdam's host step: unscale (by 1, so that repeated steps keep the gradient; the
    /// multiply runs all the same), check, norm, clip factor, update.
    fn full(&mut self, step: u32) {
        let (found_inf, sum_sq) = host::unscale_and_check(&mut self.grads, 1.0);
        let clip = clip_factor(sum_sq, Some(1.0));
        assert!(!found_inf, "the bench's gradient is finite");
        self.update(step, clip);
    }
}

fn main() -> std::process::ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("host-step-bench: {message}");
            return std::process::ExitCode::from(2);
        }
    };
    check_against_reference(&args.threads);
    for &n in &args.sizes {
        let mut shard = Shard::new(n);
        for &threads in &args.threads {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("a thread pool");
            let threads = pool.current_num_threads();
            for variant in ["update", "update_late", "full", "full_late"] {
                let mut times = Vec::with_capacity(args.reps);
                for i in 0..WARMUP + args.reps {
                    let step = match variant.ends_with("_late") {
                        false => 1 + (i % EARLY_STEPS) as u32,
                        true => LATE_STEP + i as u32,
                    };
                    let start = Instant::now();
                    pool.install(|| match variant {
                        "update" | "update_late" => shard.update(step, 1.0),
                        _ => shard.full(step),
                    });
                    if i >= WARMUP {
                        times.push(start.elapsed().as_secs_f64() * 1e3);
                    }
                }
                let (median, min) = summary(times);
                println!("ours {variant} {n} {threads} {median:.4} {min:.4}");
            }
        }
    }
    std::process::ExitCode::SUCCESS
}
