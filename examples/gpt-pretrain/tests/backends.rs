//! The same program on every backend: `--backend wgpu` (Burn's `Wgpu`, fusion on, over Mesa's
//! lavapipe here) keeps gradients, ZeroAdam's state and the parameters in device memory, and
//! follows the `--backend flex` run step by step, at 1 and 2 ranks, at ZeRO stages 1, 2 and 3,
//! and in f16 with loss scaling. A checkpoint written on the device path resumes resharded.
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
/// The key third of the attention bias is rounding noise (`assert_same_model`).
const KEY_NOISE: Option<f64> = Some(1e-3);
/// f16 parameters and activations round at 1e-3, and the two backends' f16 kernels round
/// differently: the losses and gradient norms agree within 2e-3 (seen 2026-12-01: 1e-4).
const F16_STEPS: f64 = 2e-3;

#[test]
fn wgpu_follows_flex_at_one_and_two_ranks_every_zero_stage_and_f16() {
    burn_dist_kernels::testing::wgpu_client();
    let dir = scratch_dir("gpt-backends");
    // f16 with loss scaling: its first steps overflow and are skipped on both backends alike.
    for (world, flags, tolerance) in [
        (
            1,
            &["--zero-stage", "1"][..],
            (STEP_TOLERANCE, Some((PARAM_TOLERANCE, KEY_NOISE))),
        ),
        (
            2,
            &["--zero-stage", "1"],
            (STEP_TOLERANCE, Some((PARAM_TOLERANCE, KEY_NOISE))),
        ),
        (
            2,
            &["--zero-stage", "2"],
            (STEP_TOLERANCE, Some((PARAM_TOLERANCE, KEY_NOISE))),
        ),
        // Stage 3: the pieces in device memory, every gather into fresh device buffers.
        (
            2,
            &["--zero-stage", "3"],
            (STEP_TOLERANCE, Some((PARAM_TOLERANCE, KEY_NOISE))),
        ),
        // In f16 the tensors that start at zero (biases) differ by 10 % of their small norms
        // after 3 updates: the curves are compared, not the tensors.
        (2, &["--precision", "f16"], (F16_STEPS, None)),
    ] {
        let run = |backend| {
            let args: Vec<&str> = ["--backend", backend]
                .iter()
                .chain(flags)
                .copied()
                .collect();
            launched(&dir, world, &args)
        };
        assert_same_run_within(
            &run("wgpu"),
            &run("flex"),
            tolerance.0,
            tolerance.1,
            &format!("wgpu vs flex, {world} ranks, {flags:?}"),
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

/// A checkpoint written on the device path (ZeroAdam's state read back from device memory)
/// resumes on the device path at other world sizes (resharded), and on the host path, to the
/// model the uninterrupted device run reaches.
#[test]
fn a_wgpu_checkpoint_resumes_resharded_on_wgpu_and_on_flex() {
    burn_dist_kernels::testing::wgpu_client();
    let dir = scratch_dir("gpt-backends-resume");
    let saved = &["--backend", "wgpu", "--checkpoint-every", "2"];
    let straight = launched(&dir, 2, saved);
    let checkpoint = dir.join(format!("world2{}", saved.join("")));
    let step4 = checkpoint.join("checkpoints/step-0000000004");
    let step4 = step4.to_str().expect("a UTF-8 path");
    for (world, backend) in [(1, "wgpu"), (4, "wgpu"), (2, "flex")] {
        let resumed = launched(&dir, world, &["--backend", backend, "--resume", step4]);
        assert_eq!(
            resumed.steps.iter().map(|r| r.step).collect::<Vec<_>>(),
            [5],
            "resumed after step 4"
        );
        let what = format!("step-4 checkpoint of 2 wgpu ranks, resumed on {world} {backend} ranks");
        let (got, reference) = (&resumed.steps[0], &straight.steps[4]);
        assert!(
            (got.loss - reference.loss).abs() <= STEP_TOLERANCE * reference.loss,
            "{what}: loss {} vs {}",
            got.loss,
            reference.loss
        );
        common::assert_same_model(&resumed.params, &straight.params, PARAM_TOLERANCE, &what);
    }
}

/// The metrics file records the bytes each step moved between host and device. On the host path
/// (Flex) the reducer reads every f32 gradient and writes its mean back: the model's gradient
/// bytes each way. On the device path (wgpu, staged collectives, ZeroAdam stage 1) the same
/// gradients are staged through the host, plus ZeroAdam's scalars (8 bytes down, 48 up) and the
/// parameter all-gather's chunks (this rank's shard down, the other ranks' up): nothing else.
#[test]
fn the_metrics_count_the_bytes_between_host_and_device_per_step() {
    burn_dist_kernels::testing::wgpu_client();
    let dir = scratch_dir("gpt-backends-bytes");
    let numels = common::tiny_numels();
    let gradient = 4 * numels.iter().sum::<usize>() as u64;
    let world = 2;
    let shard = 4 * burn_dist::FlatLayout::new(&numels, world, 4).shard_len as u64;
    let flex = launched(&dir, world, &["--backend", "flex"]);
    let wgpu = launched(&dir, world, &["--backend", "wgpu"]);
    for (f, w) in flex.steps.iter().zip(&wgpu.steps) {
        assert_eq!(
            (f.bytes_to_host, f.bytes_to_device),
            (gradient, gradient),
            "flex, step {}",
            f.step
        );
        assert_eq!(
            (w.bytes_to_host, w.bytes_to_device),
            (
                gradient + 8 + shard,
                gradient + 48 + (world as u64 - 1) * shard
            ),
            "wgpu, step {}",
            w.step
        );
    }
}

/// `--offload` (ZeroAdam's state on the host, the model and the reduction on wgpu) follows the
/// run with the state in device memory step by step, at 2 ranks and ZeRO stages 1 to 3 (the
/// host step and the fused kernels round a few operations differently), and its metrics count
/// per step what the state in device memory moves, less ZeroAdam's scalars (its agreement is
/// the host's), plus the gradient shard down and the new shard up, once each (at stage 3 the
/// new shard goes into the model's pieces; the gathers are the same either way).
#[test]
fn offload_follows_the_state_in_device_memory_and_counts_its_bytes() {
    burn_dist_kernels::testing::wgpu_client();
    let dir = scratch_dir("gpt-backends-offload");
    let numels = common::tiny_numels();
    let world = 2;
    for stage in ["1", "2", "3"] {
        // Stage 3's shards are the sharded model's, aligned as it aligns them.
        let align = match stage {
            "3" => burn_dist::SHARD_ALIGN,
            _ => 4,
        };
        let shard = 4 * burn_dist::FlatLayout::new(&numels, world, align).shard_len as u64;
        let on_device = launched(&dir, world, &["--backend", "wgpu", "--zero-stage", stage]);
        let offloaded = launched(
            &dir,
            world,
            &["--backend", "wgpu", "--zero-stage", stage, "--offload"],
        );
        assert_same_run_within(
            &offloaded,
            &on_device,
            1e-5,
            Some((1e-5, None)),
            &format!("--offload vs the state in device memory, stage {stage}"),
        );
        for (d, o) in on_device.steps.iter().zip(&offloaded.steps) {
            assert_eq!(
                (o.bytes_to_host, o.bytes_to_device),
                (d.bytes_to_host - 8 + shard, d.bytes_to_device - 48 + shard),
                "--offload, stage {stage}, step {}",
                o.step
            );
        }
    }
}
