//! The fused kernels compute the CPU reference's function, on cubecl's wgpu runtime (WGSL). In
//! CI this runs over Mesa's software Vulkan driver (lavapipe), installed by `.ci/run`.
//!
//! The checks themselves live in `burn_dist_kernels::testing`, generic over the runtime, so
//! that the GPU check (`cargo xtask gpu-check`) runs the same ones on CUDA. Inputs are random
//! with a fresh seed per run (printed; replay with `BURN_DIST_SEED`) and never zero.
//!
//! bf16: WGSL has no bf16 type, so the bf16 model copy is checked against the reference only
//! on a runtime that supports it (CUDA: `cargo xtask gpu-check`); here the test says it skips.

use burn_dist_kernels::FusedAdam;
use burn_dist_kernels::testing::{
    Rng, check_consecutive_steps, check_fused_step_equals_f64_reference,
    check_half_precision_copies, check_inf_and_nan_skip_the_step,
};
use cubecl::wgpu::WgpuRuntime;

fn fused() -> FusedAdam<WgpuRuntime> {
    let client = burn_dist_kernels::testing::wgpu_client();
    println!("wgpu adapter: {:?}", client.properties().hardware);
    FusedAdam::new(client)
}

fn seeded() -> Rng {
    let seed = Rng::fresh_seed();
    println!("seed {seed} (replay with BURN_DIST_SEED={seed})");
    Rng::new(seed)
}

#[test]
fn fused_step_equals_f64_reference_on_wgpu() {
    check_fused_step_equals_f64_reference(&fused(), &mut seeded());
}

#[test]
fn half_precision_copy_is_round_to_nearest_even_of_master() {
    let skipped = check_half_precision_copies(&fused(), &mut seeded());
    for dtype in skipped {
        println!(
            "SKIP {dtype:?}: not supported by this runtime (WGSL has no bf16; f16 needs shader-f16)"
        );
    }
}

#[test]
fn injected_inf_and_nan_are_detected_and_the_step_is_skipped() {
    check_inf_and_nan_skip_the_step(&fused(), &mut seeded());
}

#[test]
fn consecutive_steps_count_on_the_device_and_follow_the_reference() {
    check_consecutive_steps(&fused(), &mut seeded());
}
