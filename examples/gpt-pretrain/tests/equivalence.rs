//! 1, 2 and 4 real processes (through `burn-dist-run`) training the tiny GPT on the same global
//! batch follow the same loss curve, step by step, training and validation, with the same
//! gradient norms, and end with the same parameters; so does 2 ranks with 2 accumulation
//! micro-batches each. Burn's AdamW with this example's global clipping and ZeRO stage 2 follow
//! ZeroAdam stage 1 alike; f16 and bf16 train.
//!
//! Losses alone would hide a gradient summed instead of averaged: clipping and Adam's scale
//! invariance make its updates nearly the same. The gradient norm shows it at once.

use burn_dist_models::processes::scratch_dir;

mod common;

use common::{assert_same_run, launched};

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
    assert_same_run(&launched(&dir, 2, &[]), &reference, "2 ranks");
    assert_same_run(&launched(&dir, 4, &[]), &reference, "4 ranks");
    assert_same_run(
        &launched(&dir, 2, &["--accumulation", "2"]),
        &reference,
        "2 ranks × 2 micro-batches",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn adamw_and_zero_stage_2_follow_zero_stage_1_and_mixed_precision_trains() {
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
