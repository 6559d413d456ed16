//! 1, 2 and 4 real processes (through `burn-dist-run`) training the tiny GPT on the same global
//! batch follow the same loss curve, step by step, training and validation, with the same
//! gradient norms, and end with the same parameters; so does 2 ranks with 2 accumulation
//! micro-batches each. Burn's AdamW with this example's global clipping and ZeRO stages 2 and 3
//! follow ZeroAdam stage 1 alike (stage 3 bit for bit stage 2); f16 and bf16 train.
//!
//! The tokens/s printed every step and recorded for the plot add up to the end-to-end figure.
//!
//! Losses alone would hide a gradient summed instead of averaged: clipping and Adam's scale
//! invariance make its updates nearly the same. The gradient norm shows it at once.

use burn_dist_models::processes::scratch_dir;

mod common;

use common::{Run, assert_same_run, launched};

/// The number just before `unit` in `line`.
fn number_before(line: &str, unit: &str) -> f64 {
    let head = &line[..line
        .find(unit)
        .unwrap_or_else(|| panic!("no {unit:?} in {line:?}"))];
    let number = head.trim_end().rsplit(' ').next().unwrap();
    number
        .parse()
        .unwrap_or_else(|e| panic!("{number:?} in {line:?}: {e}"))
}

/// The throughput printed every step (`--log-every 1`) is the one in the metrics file (and so
/// the plot), and both agree within 2 % with the end-to-end figure, the global batch's tokens
/// times the steps over the training loop's wall time, which rank 0 prints at the end and which
/// the last record's `elapsed_s` gives too.
fn assert_throughput_is_end_to_end(run: &Run, tokens_per_step: f64, what: &str) {
    let rank0 = run
        .stdout
        .lines()
        .filter_map(|l| l.strip_prefix("[rank 0] "));
    let printed: Vec<f64> = rank0
        .clone()
        .filter(|l| l.starts_with("step "))
        .map(|l| number_before(l, " tok/s"))
        .collect();
    let recorded: Vec<f64> = run.steps.iter().map(|r| r.tokens_per_s).collect();
    assert_eq!(
        printed.len(),
        recorded.len(),
        "{what}: a line per step\n{}",
        run.stdout
    );
    for (step, (p, r)) in printed.iter().zip(&recorded).enumerate() {
        assert!(
            (p - r).abs() <= 0.5,
            "{what}: step {}: printed {p}, recorded {r}",
            step + 1
        );
    }
    let end_line = rank0
        .clone()
        .find(|l| l.starts_with("throughput: "))
        .unwrap_or_else(|| panic!("{what}: no end-to-end line\n{}", run.stdout));
    let end_to_end = number_before(end_line, " tokens/s end to end");
    let steps = run.steps.len() as f64;
    // What the plot shows over the run: every step's tokens over the sum of the steps' times.
    let step_seconds: f64 = recorded.iter().map(|r| tokens_per_step / r).sum();
    let plotted = steps * tokens_per_step / step_seconds;
    let elapsed = run.steps.last().unwrap().elapsed_s;
    let timed = steps * tokens_per_step / elapsed;
    for (name, value) in [("plotted", plotted), ("from elapsed_s", timed)] {
        let off = (value / end_to_end - 1.0).abs();
        assert!(
            off <= 0.02,
            "{what}: {name} {value:.0} tokens/s vs {end_to_end:.0} end to end ({:.1} % off)",
            100.0 * off
        );
    }
}

#[test]
fn one_two_and_four_ranks_follow_the_same_loss_curve() {
    let dir = scratch_dir("gpt-equivalence");
    let reference = launched(&dir, 1, &[]);
    assert_eq!(reference.steps.len(), 5);
    assert!(
        reference
            .steps
            .iter()
            .filter(|r| r.val_loss.is_some())
            .count()
            == 3,
        "steps 2, 4, 5"
    );
    assert!(
        reference.steps[4].loss < reference.steps[0].loss,
        "it learns"
    );
    assert_throughput_is_end_to_end(&reference, 4.0 * 16.0, "1 rank");
    let two = launched(&dir, 2, &[]);
    assert_same_run(&two, &reference, "2 ranks");
    assert_throughput_is_end_to_end(&two, 4.0 * 16.0, "2 ranks");
    assert_same_run(&launched(&dir, 4, &[]), &reference, "4 ranks");
    assert_same_run(
        &launched(&dir, 2, &["--accumulation", "2"]),
        &reference,
        "2 ranks × 2 micro-batches",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn adamw_and_zero_stages_2_and_3_follow_zero_stage_1_and_mixed_precision_trains() {
    let dir = scratch_dir("gpt-optimizers");
    // A clip norm the gradients exceed, so that both clipping implementations are exercised.
    let clip = ["--max-grad-norm", "0.5"];
    let reference = launched(&dir, 2, &clip);
    assert!(
        reference
            .steps
            .iter()
            .any(|r| r.grad_norm.is_some_and(|g| g > 0.5)),
        "clipping is active"
    );
    let adamw = launched(&dir, 2, &[&clip[..], &["--optimizer", "adamw"]].concat());
    assert_same_run(&adamw, &reference, "Burn's AdamW");
    let stage2 = launched(&dir, 2, &[&clip[..], &["--zero-stage", "2"]].concat());
    assert_same_run(&stage2, &reference, "ZeRO stage 2");
    let stage3 = launched(&dir, 2, &[&clip[..], &["--zero-stage", "3"]].concat());
    assert_same_run(&stage3, &reference, "ZeRO stage 3");
    assert_eq!(
        stage3.params, stage2.params,
        "stage 3 is bit for bit stage 2"
    );
    for record in &stage3.steps {
        let shards = record.shards.expect("stage 3 records its shards");
        assert!(shards.gathered_mib > 0.0 && shards.reads == 0, "{shards:?}");
        // Launched on one host, the ranks share /dev/shm (Linux, unless BURN_DIST_SHM=0 turns
        // it off): the step's gathers read the peers' pieces where they lie (the bitwise check
        // above covers their results).
        let shared_memory = std::env::var("BURN_DIST_SHM").map_or(true, |v| v != "0");
        if cfg!(target_os = "linux") && shared_memory {
            assert!(shards.gathered_in_place > 0, "{shards:?}");
        }
    }
    assert!(stage2.steps.iter().all(|r| r.shards.is_none()));
    for precision in ["f16", "bf16"] {
        let run = launched(&dir, 2, &["--precision", precision]).steps;
        let (first, last) = (run[0].loss, run[run.len() - 1].loss);
        assert!(
            last < first && last.is_finite(),
            "{precision}: loss {first} -> {last}"
        );
        assert_eq!(
            run[0].loss_scale.is_some(),
            precision == "f16",
            "{precision}: loss scaling is for f16 only"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
