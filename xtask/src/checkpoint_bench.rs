//! `cargo xtask bench-checkpoint`: the step time a checkpoint costs, saved synchronously
//! (`checkpoint::save`) and in the background (`checkpoint::AsyncSaver`,
//! `--checkpoint-async`), for the GPT-2 124M shape on 4 ranks of this machine (gpt-pretrain
//! through burn-dist-run, ZeroAdam), beside the same run without checkpoints, the three in
//! rotated order each round. Never part of CI. The figures go to docs/perf/checkpoint.md.
//!
//! Per run, from rank 0's metrics (`metrics.jsonl`): the seconds its training thread spent on
//! checkpoints (`checkpoint_s`), and the loop's wall time up to the last step's record. The
//! save after the last step is outside both (the record comes first), so a run of S steps
//! saving every K counts the saves after steps K, 2K, … below S.

use crate::gpt::{build_release, number_after};
use crate::zero3_bench::{BATCH, CONTEXT, WORLD, gpt2_124m_on_4_ranks};
use crate::{run, target_dir};

const USAGE: &str =
    "usage: cargo xtask bench-checkpoint [--steps N] [--every K] [--rounds R] [--zero-stage S]
  (defaults: 8 steps, a checkpoint every 3, 2 rounds, stage 2; at least one save before the
  last step)";

/// One configuration: its name in the table and its flags.
type Config = (&'static str, &'static [&'static str]);
const CONFIGS: [Config; 3] = [
    ("no checkpoint", &[]),
    ("synchronous (checkpoint::save)", &[]),
    ("in the background (AsyncSaver)", &["--checkpoint-async"]),
];

/// One run's figures.
struct Figures {
    /// Wall time of the loop up to the last step's record, s.
    wall_s: f64,
    /// Seconds rank 0's training thread spent on checkpoints in that time.
    checkpoint_s: f64,
}

pub fn bench_checkpoint(args: &[String]) -> Result<(), String> {
    let (mut steps, mut every, mut rounds, mut stage) = (8usize, 3usize, 2usize, 2usize);
    for pair in args.chunks(2) {
        let value = || {
            pair.get(1)
                .and_then(|n| n.parse::<usize>().ok())
                .filter(|&n| n >= 1)
                .ok_or_else(|| {
                    format!(
                        "bench-checkpoint: {} takes a positive number\n{USAGE}",
                        pair[0]
                    )
                })
        };
        match pair[0].as_str() {
            "--steps" => steps = value()?,
            "--every" => every = value()?,
            "--rounds" => rounds = value()?,
            "--zero-stage" => stage = value()?,
            other => {
                return Err(format!(
                    "bench-checkpoint: unknown argument {other:?}\n{USAGE}"
                ));
            }
        }
    }
    let saves = (steps - 1) / every;
    if saves == 0 {
        return Err(format!(
            "bench-checkpoint: no save before the last step with --steps {steps} --every {every}\n{USAGE}"
        ));
    }
    let bin = build_release()?;
    let mut results: Vec<[Option<Figures>; 3]> = Vec::new();
    for round in 0..rounds {
        let mut figures: [Option<Figures>; 3] = Default::default();
        for i in 0..3 {
            let c = (round + i) % 3;
            let (name, _) = CONFIGS[c];
            eprintln!("xtask: round {}/{rounds}: {name}", round + 1);
            figures[c] = Some(gpt(&bin, c, (steps, every, stage))?);
        }
        results.push(figures);
    }
    print_table(&results, (steps, every, stage, saves));
    Ok(())
}

/// Runs configuration `c` and reads its figures.
fn gpt(
    bin: &std::path::Path,
    c: usize,
    (steps, every, stage): (usize, usize, usize),
) -> Result<Figures, String> {
    let dir = target_dir()
        .join("bench-checkpoint")
        .join(format!("config-{c}"));
    let _ = std::fs::remove_dir_all(&dir);
    let mut command = gpt2_124m_on_4_ranks(bin, steps, &dir);
    command
        .args(["--zero-stage", &stage.to_string()])
        .args(CONFIGS[c].1);
    if c > 0 {
        command.args(["--checkpoint-every", &every.to_string()]);
    }
    run(&mut command)?;
    let metrics = dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&metrics)
        .map_err(|e| format!("reading {}: {e}", metrics.display()))?;
    let (mut wall_s, mut checkpoint_s) = (0.0, 0.0);
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        wall_s = number_after(line, "\"elapsed_s\":").ok_or("a record without elapsed_s")?;
        checkpoint_s += number_after(line, "\"checkpoint_s\":").unwrap_or(0.0);
    }
    let _ = std::fs::remove_dir_all(dir.join("checkpoints"));
    Ok(Figures {
        wall_s,
        checkpoint_s,
    })
}

fn print_table(
    results: &[[Option<Figures>; 3]],
    (steps, every, stage, saves): (usize, usize, usize, usize),
) {
    println!(
        "GPT-2 124M shape (vocabulary 50304, context {CONTEXT}), {WORLD} ranks, global batch \
         {BATCH}, ZeroAdam stage {stage}, {steps} steps, a checkpoint every {every}: {saves} \
         save(s) before the last step; {} round(s) in rotated order\n",
        results.len()
    );
    println!(
        "| configuration | loop wall time, s (per round) | training thread in checkpoints per save, s | wall time lost per save vs no checkpoint, s |"
    );
    println!("|---|---|---|---|");
    for (c, (name, _)) in CONFIGS.iter().enumerate() {
        let runs: Vec<&Figures> = results
            .iter()
            .map(|r| r[c].as_ref().expect("run"))
            .collect();
        let walls: Vec<String> = runs.iter().map(|f| format!("{:.1}", f.wall_s)).collect();
        let in_thread: Vec<f64> = runs.iter().map(|f| f.checkpoint_s / saves as f64).collect();
        let lost: Vec<f64> = results
            .iter()
            .map(|r| {
                let (this, none) = (r[c].as_ref().expect("run"), r[0].as_ref().expect("run"));
                (this.wall_s - none.wall_s) / saves as f64
            })
            .collect();
        let (in_thread, lost) = match c {
            0 => ("-".to_string(), "-".to_string()),
            _ => (spread(&in_thread), spread(&lost)),
        };
        println!("| {name} | {} | {in_thread} | {lost} |", walls.join(" / "));
    }
}

/// The median of `values` and their range.
fn spread(values: &[f64]) -> String {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    format!(
        "{median:.2} ({:.2} to {:.2})",
        sorted[0],
        sorted[sorted.len() - 1]
    )
}
