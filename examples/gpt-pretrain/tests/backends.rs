//! The same program on every backend: `--backend wgpu` (Burn's `Wgpu`, fusion on, over Mesa's
//! lavapipe here) keeps gradients, ZeroAdam's state and the parameters in device memory, and
//! follows the `--backend flex` run step by step, at 1 and 2 ranks and at ZeRO stages 1 and 2.
//! A backend the binary was built without is refused by name.

use std::process::Command;

use burn_dist_models::processes::scratch_dir;

mod common;

use common::{RUN, assert_same_run_within, launched};

/// lavapipe's f32 kernels sum in another order than Flex's: the curves agree to rounding, not
/// bit for bit (seen 2026-12-01: the parameters within 3.5e-5 after 5 steps; the losses and
/// gradient norms within 1e-4).
const STEP_TOLERANCE: f64 = 1e-4;
const PARAM_TOLERANCE: f64 = 2e-4;

#[test]
fn wgpu_follows_flex_at_one_and_two_ranks_and_both_zero_stages() {
    burn_dist_kernels::testing::wgpu_client();
    let dir = scratch_dir("gpt-backends");
    for (world, stage) in [(1, "1"), (2, "1"), (2, "2")] {
        let flex = launched(&dir, world, &["--backend", "flex", "--zero-stage", stage]);
        let wgpu = launched(&dir, world, &["--backend", "wgpu", "--zero-stage", stage]);
        assert_same_run_within(
            &wgpu,
            &flex,
            STEP_TOLERANCE,
            PARAM_TOLERANCE,
            &format!("wgpu vs flex, {world} ranks, ZeRO stage {stage}"),
        );
    }
}

#[test]
fn a_backend_the_binary_lacks_is_refused_with_the_build_command() {
    let output = Command::new(env!("CARGO_BIN_EXE_gpt-pretrain"))
        .args(RUN)
        .args(["--backend", "cuda", "--run-dir"])
        .arg(scratch_dir("gpt-backend-missing"))
        .output()
        .expect("running gpt-pretrain");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("built without its `cuda` feature") && stderr.contains("--features cuda"),
        "{stderr}"
    );
}
