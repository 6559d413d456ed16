//! `cargo xtask bench-zero3`: the GPT-2 124M shape on 4 ranks of this machine, one after the
//! other in one run, each rank's peak memory (PSS: private memory plus its share of each shared
//! page, read at the steps' high points by one rule for every configuration, FSDP2's included;
//! VmHWM beside it) and the step time, for Burn's AdamW
//! (replicated), ZeroAdam at stages 1, 2 and 3, stage 3 with its gathers on demand and with
//! its gathers on the main lane (`BURN_DIST_GATHER_LANE=0`) too, and the time stage 3's steps
//! wait for their gathers (gpt-pretrain through burn-dist-run), and
//! PyTorch FSDP2 (`benches/torch/fsdp2_gpt.py` under torchrun, gloo, torch from PyPI in a venv:
//! see `host_step::torch_python`). With `--rounds R`, only stage 2, stage 3 and FSDP2,
//! alternately R times, each ratio taken within its round. Never part of CI. The figures go to
//! docs/perf/zero3.md.

use std::process::Command;

use crate::gpt::{build_release, list_after, number_after};
use crate::host_step::torch_python;
use crate::{run, target_dir, workspace_root};

pub(crate) const WORLD: usize = 4;
/// Sequences of the global batch (one per rank) and tokens per sequence.
pub(crate) const BATCH: usize = 4;
pub(crate) const CONTEXT: usize = 64;

/// One configuration's figures.
struct Figures {
    name: String,
    /// Median wall time of the timed steps, s.
    step_s: f64,
    /// Every rank's peak proportional set size (private memory plus its share of each shared
    /// page, read at the steps' high points by one rule for both: gpt-pretrain's
    /// `peak_pss_mib`, `fsdp2_gpt.py`'s), MiB: what a rank costs the host.
    peak_mib: Vec<f64>,
    /// Every rank's peak resident memory (VmHWM), MiB: shared pages counted in full in every
    /// rank that maps them (the peers' gather buffers at stage 3, torch's libraries).
    hwm_mib: Vec<f64>,
    /// What the runtime alone holds (PyTorch: torch imported, process group up), PSS, MiB.
    baseline_mib: Option<f64>,
    /// Stage 3: median seconds per timed step that rank 0's ops waited for gathers.
    gather_wait_s: Option<f64>,
}

impl Figures {
    /// The largest rank's peak, MiB: what the table's "max" column and the chart show.
    fn max_peak_mib(&self) -> f64 {
        self.peak_mib.iter().copied().fold(0.0, f64::max)
    }

    /// The largest rank's VmHWM, MiB.
    fn max_hwm_mib(&self) -> f64 {
        self.hwm_mib.iter().copied().fold(0.0, f64::max)
    }
}

const USAGE: &str = "usage: cargo xtask bench-zero3 [--steps N] [--rounds R]
  (steps at least 3, default 6; rounds at least 2 runs only stage 2, stage 3 and FSDP2,
  alternately R times, and prints each round's ratios)";

/// A configuration of gpt-pretrain: its name in the table, its flags and its environment.
type Config = (
    &'static str,
    &'static [&'static str],
    &'static [(&'static str, &'static str)],
);

const STAGE_2: Config = ("ZeroAdam stage 2", &["--zero-stage", "2"], &[]);
const STAGE_3: Config = ("ZeroAdam stage 3", &["--zero-stage", "3"], &[]);

pub fn bench_zero3(args: &[String]) -> Result<(), String> {
    let (mut steps, mut rounds) = (6usize, 1usize);
    for pair in args.chunks(2) {
        let count = |least: usize| {
            pair.get(1)
                .and_then(|n| n.parse::<usize>().ok())
                .filter(|&n| n >= least)
                .ok_or_else(|| {
                    format!(
                        "bench-zero3: {} takes a number of at least {least}\n{USAGE}",
                        pair[0]
                    )
                })
        };
        match pair[0].as_str() {
            "--steps" => steps = count(3)?,
            "--rounds" => rounds = count(2)?,
            other => return Err(format!("bench-zero3: unknown argument {other:?}\n{USAGE}")),
        }
    }
    let bin = build_release()?;
    let python = torch_python()?;
    if rounds > 1 {
        return alternate(&bin, &python, steps, rounds);
    }
    let mut all = Vec::new();
    for config in [
        (
            "Burn AdamW, replicated",
            &["--optimizer", "adamw"][..],
            &[][..],
        ),
        ("ZeroAdam stage 1", &["--zero-stage", "1"][..], &[]),
        STAGE_2,
        (
            "ZeroAdam stage 3, gathers on demand",
            &["--zero-stage", "3", "--prefetch-gathers", "0"][..],
            &[],
        ),
        (
            "ZeroAdam stage 3, gathers behind reductions",
            &["--zero-stage", "3"][..],
            &[("BURN_DIST_GATHER_LANE", "0")][..],
        ),
        STAGE_3,
    ] {
        all.push(ours(&bin, config, steps)?);
    }
    all.push(fsdp2(&python, steps)?);
    print_table(&all, steps);
    let svg = workspace_root().join("docs/perf/zero3.svg");
    std::fs::write(&svg, bar_chart(&all)).map_err(|e| format!("writing {}: {e}", svg.display()))?;
    println!("figure: {}", svg.display());
    Ok(())
}

/// Stage 2, stage 3 and FSDP2, `rounds` times, each round starting one configuration later than
/// the one before: a machine whose speed drifts during the run (a shared VM's does, by a third
/// between runs minutes apart) weighs on all three alike, and each round's ratios compare runs
/// a few minutes apart. Prints every round and the medians of its ratios.
fn alternate(
    bin: &std::path::Path,
    python: &std::path::Path,
    steps: usize,
    rounds: usize,
) -> Result<(), String> {
    let mut results = Vec::new();
    for round in 0..rounds {
        let mut figures: [Option<Figures>; 3] = [None, None, None];
        for which in rotated(round) {
            eprintln!("xtask: round {}/{rounds}, configuration {which}", round + 1);
            figures[which] = Some(match which {
                0 => ours(bin, STAGE_2, steps)?,
                1 => ours(bin, STAGE_3, steps)?,
                _ => fsdp2(python, steps)?,
            });
        }
        results.push(figures.map(|f| f.expect("every configuration ran this round")));
    }
    print_rounds(&results, steps);
    Ok(())
}

/// The order of the three configurations in round `round`: 0 1 2, then 1 2 0, then 2 0 1.
fn rotated(round: usize) -> [usize; 3] {
    [0, 1, 2].map(|i| (i + round) % 3)
}

/// Each round's step times of stage 2, stage 3 and FSDP2, stage 3's over the other two, then the
/// medians over the rounds.
fn print_rounds(results: &[[Figures; 3]], steps: usize) {
    println!(
        "GPT-2 124M shape, {WORLD} ranks, steps 2-{} timed (median), {} rounds in rotated order",
        steps - 1,
        results.len()
    );
    println!(
        "| round | stage 2 (s) | stage 3 (s) | FSDP2 (s) | stage 3 / stage 2 | stage 3 / FSDP2 | stage 3 waits (s/step) | peak PSS: stage 2 / stage 3 / FSDP2 (MiB) | VmHWM: stage 2 / stage 3 / FSDP2 (MiB) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for (round, [two, three, fsdp]) in results.iter().enumerate() {
        println!(
            "| {} | {:.2} | {:.2} | {:.2} | {:.3} | {:.3} | {} | {:.0} / {:.0} / {:.0} | {:.0} / {:.0} / {:.0} |",
            round + 1,
            two.step_s,
            three.step_s,
            fsdp.step_s,
            three.step_s / two.step_s,
            three.step_s / fsdp.step_s,
            three
                .gather_wait_s
                .map_or("-".into(), |w| format!("{w:.2}")),
            two.max_peak_mib(),
            three.max_peak_mib(),
            fsdp.max_peak_mib(),
            two.max_hwm_mib(),
            three.max_hwm_mib(),
            fsdp.max_hwm_mib()
        );
    }
    let (over_two, over_fsdp) = median_ratios(results);
    println!("median stage 3 / stage 2: {over_two:.3}; median stage 3 / FSDP2: {over_fsdp:.3}");
}

/// The medians over the rounds of stage 3's step time over stage 2's and over FSDP2's, each
/// ratio taken within its round.
fn median_ratios(results: &[[Figures; 3]]) -> (f64, f64) {
    let ratio = |of: usize| median(results.iter().map(|r| r[1].step_s / r[of].step_s).collect());
    (ratio(0), ratio(2))
}

/// Timed steps: not the first (kernel warm-up, first allocations) nor the last (gpt-pretrain
/// evaluates after it).
fn timed(step: usize, steps: usize) -> bool {
    step > 1 && step < steps
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Runs gpt-pretrain on `WORLD` ranks in configuration `config`, and reads its figures.
fn ours(
    bin: &std::path::Path,
    (name, flags, env): Config,
    steps: usize,
) -> Result<Figures, String> {
    let dir = target_dir()
        .join("bench-zero3")
        .join(name.replace([' ', ','], "-"));
    let _ = std::fs::remove_dir_all(&dir);
    run(gpt2_124m_on_4_ranks(bin, steps, &dir)
        .envs(env.iter().copied())
        .args(flags))?;
    read_metrics(name, &dir.join("metrics.jsonl"), steps)
}

/// `burn-dist-run` starting gpt-pretrain on `WORLD` ranks at the GPT-2 124M shape (context
/// `CONTEXT`, global batch `BATCH`) for `steps` steps, one line of metrics per step, no
/// evaluation before the end, no plot, its run directory `dir`; the caller adds its flags. The
/// benchmarks of this shape (this one, `checkpoint_bench`) share it.
pub(crate) fn gpt2_124m_on_4_ranks(
    bin: &std::path::Path,
    steps: usize,
    dir: &std::path::Path,
) -> Command {
    let mut command = Command::new(bin.join("burn-dist-run"));
    command
        .args([
            "--nproc-per-node",
            &WORLD.to_string(),
            "--master-port",
            "0",
            "--",
        ])
        .arg(bin.join("gpt-pretrain"))
        .args(["--model", "gpt2-124m", "--synthetic-vocab", "50304"])
        .args(["--context", &CONTEXT.to_string()])
        .args(["--global-batch", &BATCH.to_string()])
        .args(["--steps", &steps.to_string(), "--warmup", "1"])
        .args(["--eval-every", "0", "--eval-sequences", &BATCH.to_string()])
        .args(["--log-every", "1", "--no-plot"])
        .arg("--run-dir")
        .arg(dir);
    command
}

/// A gpt-pretrain run's figures from its metrics.
fn read_metrics(name: &str, metrics: &std::path::Path, steps: usize) -> Result<Figures, String> {
    let text = std::fs::read_to_string(metrics)
        .map_err(|e| format!("reading {}: {e}", metrics.display()))?;
    let tokens = (BATCH * CONTEXT) as f64;
    let (mut times, mut waits) = (Vec::new(), Vec::new());
    let (mut peak_mib, mut hwm_mib) = (Vec::new(), Vec::new());
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let step = number_after(line, "\"step\":").ok_or("a record without a step")? as usize;
        if timed(step, steps) {
            times.push(tokens / number_after(line, "\"tokens_per_s\":").ok_or("no tokens_per_s")?);
            waits.extend(number_after(line, "\"gather_wait_s\":"));
        }
        if let Some(peaks) = list_after(line, "\"peak_pss_mib\":[") {
            peak_mib = peaks;
        }
        if let Some(peaks) = list_after(line, "\"peak_rss_mib\":[") {
            hwm_mib = peaks;
        }
    }
    Ok(Figures {
        name: name.into(),
        step_s: median(times),
        peak_mib,
        hwm_mib,
        baseline_mib: None,
        gather_wait_s: (!waits.is_empty()).then(|| median(waits)),
    })
}

/// FSDP2's figures, from the lines its ranks print.
fn fsdp2(python: &std::path::Path, steps: usize) -> Result<Figures, String> {
    let script = workspace_root().join("benches/torch/fsdp2_gpt.py");
    let out = Command::new(python)
        .args([
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            &WORLD.to_string(),
        ])
        .arg(script)
        .args([
            "--context",
            &CONTEXT.to_string(),
            "--batch",
            &(BATCH / WORLD).to_string(),
        ])
        .args(["--steps", &steps.to_string()])
        .env("OMP_NUM_THREADS", "1")
        .output()
        .map_err(|e| format!("running torchrun: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "FSDP2 run failed ({}):\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    // (rank, baseline PSS, peak PSS, VmHWM, step times)
    let mut ranks: Vec<(usize, f64, f64, f64, Vec<f64>)> = Vec::new();
    // The ranks share one pipe, and a rank's line can land right after another's last number
    // with no newline between them: every report starts a line of its own here.
    let stdout = stdout.replace("fsdp2 rank ", "\nfsdp2 rank ");
    for line in stdout.lines().filter(|l| l.starts_with("fsdp2 rank ")) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let field = |key: &str| {
            words
                .iter()
                .position(|w| *w == key)
                .and_then(|i| words.get(i + 1))
                .ok_or_else(|| format!("no {key} in {line:?}"))
        };
        let number = |key: &str| -> Result<f64, String> {
            field(key)?
                .parse()
                .map_err(|e| format!("{key} in {line:?}: {e}"))
        };
        let times = field("step_s")?
            .split(',')
            .map(|t| t.parse::<f64>().map_err(|e| format!("{t}: {e}")))
            .collect::<Result<Vec<_>, _>>()?;
        ranks.push((
            number("rank")? as usize,
            number("baseline_pss_mib")?,
            number("peak_pss_mib")?,
            number("peak_mib")?,
            times,
        ));
    }
    ranks.sort_by_key(|r| r.0);
    if ranks.len() != WORLD {
        return Err(format!(
            "FSDP2 printed {} rank lines:\n{stdout}",
            ranks.len()
        ));
    }
    // The ranks synchronize every step (a barrier ends it): rank 0's times are the job's.
    let times = ranks[0]
        .4
        .iter()
        .enumerate()
        .filter(|(i, _)| timed(i + 1, steps))
        .map(|(_, t)| *t)
        .collect();
    Ok(Figures {
        name: "PyTorch FSDP2 (gloo)".into(),
        step_s: median(times),
        peak_mib: ranks.iter().map(|r| r.2).collect(),
        hwm_mib: ranks.iter().map(|r| r.3).collect(),
        baseline_mib: Some(ranks.iter().map(|r| r.1).fold(0.0, f64::max)),
        gather_wait_s: None,
    })
}

fn print_table(all: &[Figures], steps: usize) {
    println!(
        "GPT-2 124M shape (vocabulary 50304, context {CONTEXT}), {WORLD} ranks, global batch \
         {BATCH}, steps 2-{} timed (median)",
        steps - 1
    );
    println!(
        "| configuration | step (s) | waiting for gathers (s/step) | peak PSS per rank (MiB) | \
         max | max VmHWM (MiB) | runtime baseline, PSS (MiB) |"
    );
    println!("|---|---|---|---|---|---|---|");
    for f in all {
        let peaks: Vec<String> = f.peak_mib.iter().map(|p| format!("{p:.0}")).collect();
        let max = f.max_peak_mib();
        let baseline = f.baseline_mib.map_or("-".into(), |b| format!("{b:.0}"));
        let wait = f.gather_wait_s.map_or("-".into(), |w| format!("{w:.2}"));
        println!(
            "| {} | {:.2} | {wait} | {} | {max:.0} | {:.0} | {baseline} |",
            f.name,
            f.step_s,
            peaks.join(" / "),
            f.max_hwm_mib()
        );
    }
}

/// The table as an SVG of two bar charts, peak per rank (the largest rank's) and step time, one
/// bar per configuration: written by hand, so that xtask stays without dependencies.
fn bar_chart(all: &[Figures]) -> String {
    const LABEL_W: f64 = 190.0;
    const BAR_W: f64 = 260.0;
    const ROW_H: f64 = 26.0;
    const TOP: f64 = 40.0;
    // Title, the value of a configuration, decimals shown.
    type Value = fn(&Figures) -> f64;
    let panels: [(&str, Value, usize); 2] = [
        ("peak memory per rank, PSS (MiB)", Figures::max_peak_mib, 0),
        ("step time (s)", |f| f.step_s, 2),
    ];
    let width = LABEL_W + 2.0 * (BAR_W + 70.0);
    let height = TOP + ROW_H * all.len() as f64 + 30.0;
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" \
         font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    for (row, f) in all.iter().enumerate() {
        let y = TOP + ROW_H * row as f64;
        svg += &format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>\n",
            LABEL_W - 8.0,
            y + 15.0,
            f.name
        );
    }
    for (panel, (title, value, decimals)) in panels.iter().enumerate() {
        let x0 = LABEL_W + panel as f64 * (BAR_W + 70.0);
        let max = all
            .iter()
            .map(value)
            .fold(0.0, f64::max)
            .max(f64::MIN_POSITIVE);
        svg += &format!("<text x=\"{x0}\" y=\"24\" font-weight=\"bold\">{title}</text>\n");
        for (row, f) in all.iter().enumerate() {
            let (y, v) = (TOP + ROW_H * row as f64, value(f));
            let w = BAR_W * v / max;
            let fill = if f.name.contains("stage 3") {
                "#c0392b"
            } else {
                "#5d7fa3"
            };
            let shown = format!("{v:.*}", decimals);
            svg += &format!(
                "<rect x=\"{x0}\" y=\"{}\" width=\"{w:.1}\" height=\"{}\" fill=\"{fill}\"/>\n\
                 <text x=\"{:.1}\" y=\"{}\">{shown}</text>\n",
                y + 3.0,
                ROW_H - 6.0,
                x0 + w + 4.0,
                y + 15.0
            );
        }
    }
    svg += &format!(
        "<text x=\"8\" y=\"{}\" fill=\"#555\">GPT-2 124M shape, {WORLD} ranks on one machine \
         (cargo xtask bench-zero3; docs/perf/zero3.md)</text>\n</svg>\n",
        height - 10.0
    );
    svg
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures(name: &str, step_s: f64, peak: f64) -> Figures {
        Figures {
            name: name.into(),
            step_s,
            peak_mib: vec![peak / 2.0, peak],
            hwm_mib: vec![peak],
            baseline_mib: None,
            gather_wait_s: None,
        }
    }

    #[test]
    fn each_round_starts_one_configuration_later_and_runs_all_three() {
        assert_eq!(rotated(0), [0, 1, 2]);
        assert_eq!(rotated(1), [1, 2, 0]);
        assert_eq!(rotated(2), [2, 0, 1]);
        assert_eq!(rotated(3), [0, 1, 2]);
    }

    #[test]
    fn the_ratios_are_taken_within_each_round_then_their_median() {
        // Round 2 ran on a machine twice as slow: its ratios are those of round 1, although its
        // stage 3 is slower than every other round's stage 2.
        let round = |two, three, fsdp| {
            [
                figures("2", two, 1.0),
                figures("3", three, 1.0),
                figures("f", fsdp, 1.0),
            ]
        };
        let results = [
            round(4.0, 4.4, 5.0),
            round(8.0, 8.8, 10.0),
            round(4.0, 6.0, 4.0),
        ];
        let (over_two, over_fsdp) = median_ratios(&results);
        assert!((over_two - 1.1).abs() < 1e-12, "{over_two}");
        assert!((over_fsdp - 0.88).abs() < 1e-12, "{over_fsdp}");
    }

    #[test]
    fn the_chart_scales_each_panel_to_its_largest_bar_and_names_every_configuration() {
        let svg = bar_chart(&[
            figures("a", 2.0, 1000.0),
            figures("ZeroAdam stage 3", 4.0, 250.0),
        ]);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains(">a</text>") && svg.contains(">ZeroAdam stage 3</text>"));
        // Peaks: 1000 is the full bar, 250 a quarter; steps: 4.0 full, 2.0 half.
        for width in ["260.0", "65.0", "130.0"] {
            assert!(
                svg.contains(&format!("width=\"{width}\"")),
                "{width}: {svg}"
            );
        }
        assert!(svg.contains(">1000</text>") && svg.contains(">4.00</text>"));
    }
}
