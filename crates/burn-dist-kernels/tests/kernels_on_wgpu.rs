//! The fused kernels compute the CPU reference's function, on cubecl's wgpu runtime (WGSL). In
//! CI this runs over Mesa's software Vulkan driver (lavapipe), installed by `.ci/run`.
//!
//! Inputs are random with a fresh seed per run (printed; replay with `BURN_DIST_SEED`) and
//! never zero; outputs that are pure outputs (the model copy, the partial sums, `stats`,
//! `factors`) start poisoned with NaN bits, so an unwritten element fails the comparison.
//!
//! bf16: WGSL has no bf16 type, so the bf16 model copy is checked against the reference only
//! on a runtime that supports it (CUDA: `cargo xtask gpu-check`); here the test says it skips.

use burn_dist_kernels::testing::Rng;
use burn_dist_kernels::{
    FusedAdam, Hyper, ModelCopy, ModelDtype, StepScalars, adam_update, adam_update_f64,
    clip_factor, relative_error, unscale_and_check,
};
use cubecl::Runtime;
use cubecl::wgpu::{WgpuDevice, WgpuRuntime};
use half::{bf16, f16};

fn fused() -> FusedAdam<WgpuRuntime> {
    let client = WgpuRuntime::client(&WgpuDevice::DefaultDevice);
    println!("wgpu adapter: {:?}", client.properties().hardware);
    FusedAdam::new(client)
}

fn scalars(decoupled: bool, rng: &mut Rng) -> StepScalars {
    StepScalars {
        lr: 1e-3 * (1.0 + rng.unit() as f32),
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01 + 0.1 * rng.unit() as f32,
        decoupled,
        step: 0,
    }
}

/// Random nonzero state shaped like real moments: `|m| < sqrt(v)` (Cauchy–Schwarz on the
/// moving averages), so that the update stays around `lr` as in training.
fn random_state(rng: &mut Rng, len: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let master = rng.nonzero_vec(len, 1e-2, 2.0);
    let v = rng.positive_vec(len, 1e-8, 1e-2);
    let m = v
        .iter()
        .map(|v| v.sqrt() * rng.nonzero(1e-2, 1.0))
        .collect();
    (master, m, v)
}

fn to64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&x| x as f64).collect()
}

/// One case: random state at step `steps_taken`, one fused step on the device, compared with
/// the f32 reference and the f64 evaluation.
fn check_step(
    fused: &FusedAdam<WgpuRuntime>,
    rng: &mut Rng,
    len: usize,
    decoupled: bool,
    clip: bool,
    dtype: ModelDtype,
) {
    let (master, m, v) = random_state(rng, len);
    let scaled = rng.nonzero_vec(len, 1e-2, 1e3);
    let inv_scale = 1.0 / 1024.0;
    let steps_taken = rng.below(50) as u32;
    let s = StepScalars {
        step: steps_taken + 1,
        ..scalars(decoupled, rng)
    };

    // Pass 1 on the host first, to pick a max norm that clips.
    let mut grads = scaled.clone();
    let (found_inf, sum_sq) = unscale_and_check(&mut grads, inv_scale);
    let max_norm = clip.then(|| (0.5 * sum_sq.sqrt()) as f32);

    let b = fused.upload(&master, &m, &v, steps_taken, &scaled, inv_scale, dtype);
    fused.step(
        &b,
        Hyper {
            scalars: s,
            max_norm,
        },
    );

    // Pass 1: the unscale is one multiply, bitwise; the sum of squares within 1e-6 of f64.
    assert!(!found_inf);
    assert_eq!(fused.read_f32(&b.grads), grads, "unscaled gradient");
    let stats = fused.read_f32(&b.stats);
    assert_eq!(stats[1], 0.0, "found_inf");
    let sum_err = (stats[0] as f64 - sum_sq).abs() / sum_sq;
    assert!(
        sum_err <= 1e-6,
        "sum of squares: relative error {sum_err:e}"
    );
    assert_eq!(fused.read_u32(&b.step), [steps_taken + 1], "step counter");

    // Pass 2 against the f64 evaluation of the same update.
    let clip = clip_factor(sum_sq, max_norm);
    if max_norm.is_some() {
        assert!(clip < 1.0, "the case is meant to clip");
    }
    let (mut p64, mut m64, mut v64) = (to64(&master), to64(&m), to64(&v));
    let clip64 = max_norm.map_or(1.0, |n| (n as f64 / (sum_sq.sqrt() + 1e-6)).min(1.0));
    adam_update_f64(
        &mut p64,
        &mut m64,
        &mut v64,
        &to64(&grads),
        clip64,
        false,
        &s,
    );
    let (kp, km, kv) = (
        fused.read_f32(&b.master),
        fused.read_f32(&b.m),
        fused.read_f32(&b.v),
    );
    for (name, k, r) in [("master", &kp, &p64), ("m", &km, &m64), ("v", &kv, &v64)] {
        let err = relative_error(k, r);
        assert!(
            err <= 1e-6,
            "{name}: ‖kernel−ref64‖/‖ref64‖ = {err:e} (len {len})"
        );
    }
    // And against the f32 reference (same formulas and order; the clip factor is computed in
    // f32 on the device and in f64 on the host, so not bitwise).
    let (mut rp, mut rm, mut rv) = (master.clone(), m.clone(), v.clone());
    adam_update(
        &mut rp,
        &mut rm,
        &mut rv,
        &grads,
        clip,
        false,
        &s,
        ModelCopy::None,
    );
    let err32 = relative_error(&kp, &to64(&rp));
    assert!(err32 <= 1e-6, "master vs f32 reference: {err32:e}");

    // The model copy: every element written, and equal to the master rounded to nearest even.
    let bytes = fused.read_bytes(&b.model);
    match dtype {
        ModelDtype::None => {}
        ModelDtype::F32 => assert_eq!(bytemuck_f32(&bytes), kp, "f32 model copy"),
        ModelDtype::F16 => {
            let got: Vec<f16> = bytes
                .chunks_exact(2)
                .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                .collect();
            let want: Vec<f16> = kp.iter().map(|&x| f16::from_f32(x)).collect();
            let bad = got
                .iter()
                .zip(&want)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            assert_eq!(
                bad, 0,
                "f16 copy: {bad} of {len} elements differ from RNE(master)"
            );
        }
        ModelDtype::Bf16 => {
            let got: Vec<bf16> = bytes
                .chunks_exact(2)
                .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                .collect();
            let want: Vec<bf16> = kp.iter().map(|&x| bf16::from_f32(x)).collect();
            assert_eq!(got, want, "bf16 copy");
        }
    }
}

fn bytemuck_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn fused_step_equals_f64_reference_on_wgpu() {
    let seed = Rng::fresh_seed();
    println!("seed {seed} (replay with BURN_DIST_SEED={seed})");
    let mut rng = Rng::new(seed);
    let fused = fused();
    // Lengths: vectorized (multiple of 4), odd (scalar path), one partial cube, many cubes.
    let lens = [4 * 256 * 37, 12_345, 3, 1 << 18];
    for (i, &len) in lens.iter().enumerate() {
        for decoupled in [true, false] {
            check_step(
                &fused,
                &mut rng,
                len,
                decoupled,
                i % 2 == 0,
                ModelDtype::F32,
            );
        }
    }
    check_step(&fused, &mut rng, 4096, true, false, ModelDtype::None);
}

#[test]
fn half_precision_copy_is_round_to_nearest_even_of_master() {
    let seed = Rng::fresh_seed();
    println!("seed {seed} (replay with BURN_DIST_SEED={seed})");
    let mut rng = Rng::new(seed);
    let fused = fused();
    if fused.supports(ModelDtype::F16) {
        for decoupled in [true, false] {
            check_step(&fused, &mut rng, 4 * 1000, decoupled, true, ModelDtype::F16);
        }
    } else {
        println!("SKIP f16: this wgpu adapter has no shader-f16");
    }
    // WGSL has no bf16: checked only where a runtime supports it (CUDA, in the GPU check).
    if fused.supports(ModelDtype::Bf16) {
        check_step(&fused, &mut rng, 4 * 1000, true, false, ModelDtype::Bf16);
    } else {
        println!("SKIP bf16: not supported by this runtime (WGSL has no bf16)");
    }
}

#[test]
fn injected_inf_and_nan_are_detected_and_the_step_is_skipped() {
    let seed = Rng::fresh_seed();
    println!("seed {seed} (replay with BURN_DIST_SEED={seed})");
    let mut rng = Rng::new(seed);
    let fused = fused();
    for (case, bad) in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::MAX]
        .into_iter()
        .enumerate()
    {
        let len = [4 * 300, 777, 1 << 16, 8][case];
        let (master, m, v) = random_state(&mut rng, len);
        let mut scaled = rng.nonzero_vec(len, 1e-2, 1e3);
        let pos = rng.below(len);
        scaled[pos] = bad;
        // f32::MAX is finite but overflows when unscaled by 2 (inv_scale > 1 after a backoff).
        let inv_scale = if bad == f32::MAX { 2.0 } else { 1.0 / 512.0 };
        let b = fused.upload(&master, &m, &v, 7, &scaled, inv_scale, ModelDtype::F32);
        let s = StepScalars {
            step: 8,
            ..scalars(true, &mut rng)
        };
        fused.step(
            &b,
            Hyper {
                scalars: s,
                max_norm: Some(1.0),
            },
        );

        let mut grads = scaled.clone();
        assert!(unscale_and_check(&mut grads, inv_scale).0);
        assert_eq!(
            fused.read_f32(&b.stats)[1],
            1.0,
            "{bad} at {pos} of {len} not detected"
        );
        assert_eq!(
            fused.read_u32(&b.step),
            [7],
            "a skipped step does not count"
        );
        assert_eq!(
            fused.read_f32(&b.master),
            master,
            "master changed on a skipped step"
        );
        assert_eq!(fused.read_f32(&b.m), m, "m changed on a skipped step");
        assert_eq!(fused.read_f32(&b.v), v, "v changed on a skipped step");
        let model = fused.read_bytes(&b.model);
        assert!(
            model.iter().all(|&x| x == 0xff),
            "the model copy was written on a skipped step"
        );
    }
}

#[test]
fn consecutive_steps_count_on_the_device_and_follow_the_reference() {
    let seed = Rng::fresh_seed();
    println!("seed {seed} (replay with BURN_DIST_SEED={seed})");
    let mut rng = Rng::new(seed);
    let fused = fused();
    let len = 4 * 513;
    let master = rng.nonzero_vec(len, 1e-3, 2.0);
    let zeros = vec![0.0f32; len];
    let mut b = fused.upload(&master, &zeros, &zeros, 0, &zeros, 1.0, ModelDtype::F32);
    let (mut rp, mut rm, mut rv) = (master.clone(), zeros.clone(), zeros.clone());
    let base = scalars(true, &mut rng);
    for step in 1..=4u32 {
        let grads = rng.nonzero_vec(len, 1e-3, 1.0);
        fused.write_grads(&mut b, &grads);
        fused.step(
            &b,
            Hyper {
                scalars: base,
                max_norm: None,
            },
        );
        let s = StepScalars { step, ..base };
        adam_update(
            &mut rp,
            &mut rm,
            &mut rv,
            &grads,
            1.0,
            false,
            &s,
            ModelCopy::None,
        );
        assert_eq!(fused.read_u32(&b.step), [step]);
        let err = relative_error(&fused.read_f32(&b.master), &to64(&rp));
        assert!(err <= 1e-6, "step {step}: master vs f32 reference {err:e}");
    }
}
