//! Test scaffolding shared by the unit tests, the integration tests, the benches and the GPU
//! check: a small seeded generator of random, nonzero inputs, and the kernel checks themselves,
//! generic over the cubecl runtime, so that `tests/kernels_on_wgpu.rs` (wgpu/lavapipe) and
//! `burn-dist-gpu-check kernels` (CUDA) run the same functions.
//!
//! Each `check_*` function panics with a message naming the case when the kernels disagree
//! with the reference, as a test does.
//!
//! Inputs are random and never zero; outputs that are pure outputs (the model copy, the partial
//! sums, `stats`, `factors`) start poisoned with NaN bits, so an unwritten element fails the
//! comparison.

use cubecl::Runtime;
use half::{bf16, f16};

use crate::{
    FusedAdam, Hyper, ModelCopy, ModelDtype, StepScalars, adam_update, adam_update_f64,
    clip_factor, relative_error, unscale_and_check,
};

/// SplitMix64: small, seedable, good enough for test inputs.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// A fresh seed for each run, taken from `BURN_DIST_SEED` when set (to replay a failure),
    /// else from the clock. Tests print it.
    pub fn fresh_seed() -> u64 {
        if let Some(seed) = std::env::var("BURN_DIST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
        {
            return seed;
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0x9e37_79b9);
        now ^ (std::process::id() as u64) << 32
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform index in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// A nonzero value of random sign whose magnitude is log-uniform in `[lo, hi)`.
    pub fn nonzero(&mut self, lo: f32, hi: f32) -> f32 {
        let (l, h) = ((lo as f64).ln(), (hi as f64).ln());
        let mag = (l + (h - l) * self.unit()).exp() as f32;
        if self.next_u64() & 1 == 0 { mag } else { -mag }
    }

    /// `n` nonzero values, see [`Rng::nonzero`].
    pub fn nonzero_vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.nonzero(lo, hi)).collect()
    }

    /// `n` positive values (second moments), log-uniform in `[lo, hi)`.
    pub fn positive_vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.nonzero(lo, hi).abs()).collect()
    }
}

/// Random step scalars around the usual values (lr ≈ 1e-3, weight decay 0.01 to 0.11).
pub fn random_scalars(decoupled: bool, rng: &mut Rng) -> StepScalars {
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

/// How large a case's inputs are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Regime {
    /// As in training: master weights 1e-2 to 2, `v` 1e-8 to 1e-2, scaled gradients 1e-2 to
    /// 1e3 (unscaled by 1/1024). Here `sqrt(v̂)` dwarfs eps (1e-8): eps hardly shows.
    Typical,
    /// Weights, moments and gradients so small (`v` 1e-20 to 1e-16, unscaled gradients 1e-10
    /// to 1e-8, weights 1e-9 to 1e-7, so that an L2 decay term does not hide them) that
    /// `sqrt(v̂)` is of the order of eps: eps decides the update. A kernel that drops eps, or
    /// applies it where the other variant does (AdamW's `sqrt(v̂) + eps` against Adam's
    /// `sqrt(v) + eps·sqrt(1 − β₂ᵗ)`), misses the reference by far more than the tolerance;
    /// each case asserts that it would.
    EpsBound,
}

impl Regime {
    /// Random nonzero `(master, m, v, scaled gradients)` of `len` elements in this regime.
    #[allow(clippy::type_complexity)]
    fn inputs(self, rng: &mut Rng, len: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        match self {
            Regime::Typical => {
                let (master, m, v) = random_state(rng, len);
                (master, m, v, rng.nonzero_vec(len, 1e-2, 1e3))
            }
            Regime::EpsBound => {
                let master = rng.nonzero_vec(len, 1e-9, 1e-7);
                let v = rng.positive_vec(len, 1e-20, 1e-16);
                let m = moments_within(rng, &v);
                (master, m, v, rng.nonzero_vec(len, 1e-7, 1e-5))
            }
        }
    }
}

/// First moments with `|m| < sqrt(v)`, of random sign.
fn moments_within(rng: &mut Rng, v: &[f32]) -> Vec<f32> {
    v.iter()
        .map(|v| v.sqrt() * rng.nonzero(1e-2, 1.0))
        .collect()
}

/// Random nonzero state `(master, m, v)` shaped like real moments: `|m| < sqrt(v)`
/// (Cauchy–Schwarz on the moving averages), so that the update stays around `lr` as in
/// training.
pub fn random_state(rng: &mut Rng, len: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let master = rng.nonzero_vec(len, 1e-2, 2.0);
    let v = rng.positive_vec(len, 1e-8, 1e-2);
    let m = moments_within(rng, &v);
    (master, m, v)
}

fn to64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&x| x as f64).collect()
}

fn f32_from_bytes(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Asserts that a 16-bit model copy (`bytes`) holds, element for element, `round(master)` with
/// the rounding `to_bits` of its type (round to nearest even).
fn assert_half_copy(name: &str, bytes: &[u8], master: &[f32], to_bits: impl Fn(f32) -> u16) {
    assert_eq!(
        bytes.len(),
        2 * master.len(),
        "{name} copy: {} bytes for {} elements",
        bytes.len(),
        master.len()
    );
    let want = master.iter().map(|&x| to_bits(x));
    let bad = u16_from_bytes(bytes)
        .zip(want)
        .filter(|(a, b)| a != b)
        .count();
    assert_eq!(
        bad,
        0,
        "{name} copy: {bad} of {} elements differ from RNE(master)",
        master.len()
    );
}

fn u16_from_bytes(bytes: &[u8]) -> impl Iterator<Item = u16> + '_ {
    bytes
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
}

/// A vectorized length whose pass 1 has more cubes (300) than a cube has units
/// ([`crate::kernels::CUBE_SIZE`], 256): `reduce_partials` must loop over its partials, not
/// take one each.
const MORE_CUBES_THAN_UNITS: usize = 4 * 256 * 300;

/// One case: random state of `regime` at a random step, one fused step on the device,
/// compared with the f32 reference and the f64 evaluation; the model copy of `dtype` must be
/// the master rounded to nearest even, every element written.
#[allow(clippy::too_many_arguments)] // one knob of the case each
pub fn check_step<R: Runtime>(
    fused: &FusedAdam<R>,
    rng: &mut Rng,
    len: usize,
    decoupled: bool,
    clip: bool,
    dtype: ModelDtype,
    regime: Regime,
) {
    let (master, m, v, scaled) = regime.inputs(rng, len);
    let inv_scale = 1.0 / 1024.0;
    let steps_taken = rng.below(50) as u32;
    let s = StepScalars {
        step: steps_taken + 1,
        ..random_scalars(decoupled, rng)
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
    let clip64 = max_norm.map_or(1.0, |n| (n as f64 / (sum_sq.sqrt() + 1e-6)).min(1.0));
    let (p64, m64, v64) = f64_step(&master, &m, &v, &grads, clip64, &s);
    if regime == Regime::EpsBound {
        assert_eps_decides(&master, &m, &v, &grads, clip64, &s, &p64);
    }
    let (kp, km, kv) = (
        fused.read_f32(&b.master),
        fused.read_f32(&b.m),
        fused.read_f32(&b.v),
    );
    // The bias corrections `1 − βᵗ` are f32, as Burn computes them, and lose up to ~6e-5 of
    // their value to cancellation at small t. In a typical case the update is a thousandth of
    // the weight and that does not show; where the update is the whole weight (EpsBound) it
    // does, so there the master's oracle at 1e-6 is the f32 reference below (Burn's formulas
    // bit for bit), and the f64 evaluation only bounds it at 1e-4.
    let master_tolerance = match regime {
        Regime::Typical => 1e-6,
        Regime::EpsBound => 1e-4,
    };
    for (name, k, r, tolerance) in [
        ("master", &kp, &p64, master_tolerance),
        ("m", &km, &m64, 1e-6),
        ("v", &kv, &v64, 1e-6),
    ] {
        let err = relative_error(k, r);
        assert!(
            err <= tolerance,
            "{name}: ‖kernel−ref64‖/‖ref64‖ = {err:e} (len {len}, {regime:?})"
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
    assert!(
        err32 <= 1e-6,
        "master vs f32 reference: {err32:e} (len {len}, {regime:?})"
    );

    // The model copy: every element written, and equal to the master rounded to nearest even.
    let bytes = fused.read_bytes(&b.model);
    match dtype {
        ModelDtype::None => {}
        ModelDtype::F32 => assert_eq!(f32_from_bytes(&bytes), kp, "f32 model copy"),
        ModelDtype::F16 => assert_half_copy("f16", &bytes, &kp, |x| f16::from_f32(x).to_bits()),
        ModelDtype::Bf16 => assert_half_copy("bf16", &bytes, &kp, |x| bf16::from_f32(x).to_bits()),
    }
}

/// The f64 evaluation of one update from the f32 state: (master, m, v).
fn f64_step(
    master: &[f32],
    m: &[f32],
    v: &[f32],
    grads: &[f32],
    clip: f64,
    s: &StepScalars,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut p64, mut m64, mut v64) = (to64(master), to64(m), to64(v));
    adam_update_f64(&mut p64, &mut m64, &mut v64, &to64(grads), clip, false, s);
    (p64, m64, v64)
}

/// Asserts that eps decides this case: the f64 update without eps, and with eps where the
/// other variant puts it, are both far (1e-3) from `reference`, so that a kernel making either
/// mistake fails the 1e-6 comparison. The misplacement divides eps by `sqrt(1 − β₂ᵗ)`: for
/// Adam that is AdamW's plain `+ eps`; for AdamW it is eps added before the bias correction.
fn assert_eps_decides(
    master: &[f32],
    m: &[f32],
    v: &[f32],
    grads: &[f32],
    clip: f64,
    s: &StepScalars,
    reference: &[f64],
) {
    let bc2_sqrt = (1.0 - (s.beta2 as f64).powi(s.step as i32)).sqrt();
    for (mistake, eps) in [
        ("no eps", 0.0),
        ("eps misplaced", (s.eps as f64 / bc2_sqrt) as f32),
    ] {
        let wrong = StepScalars { eps, ..*s };
        let (p, _, _) = f64_step(master, m, v, grads, clip, &wrong);
        let p: Vec<f32> = p.iter().map(|&x| x as f32).collect();
        let distance = relative_error(&p, reference);
        assert!(
            distance > 1e-3,
            "the case is meant to depend on eps, but {mistake} moves the update by only \
             {distance:e} (decoupled: {})",
            s.decoupled
        );
    }
}

/// The fused step equals the f64 reference on vectorized, odd, one-cube and many-cube
/// lengths, with and without clipping, AdamW and Adam + L2, and without a model copy; and, on
/// the vectorized and the scalar path, with inputs small enough that eps decides the update
/// ([`Regime::EpsBound`]).
pub fn check_fused_step_equals_f64_reference<R: Runtime>(fused: &FusedAdam<R>, rng: &mut Rng) {
    // Typical inputs on every path: vectorized (multiple of 4), odd (scalar path), one
    // partial cube, more cubes than `reduce_partials` has units; eps-bound inputs on the
    // vectorized and the scalar path.
    let cases: [(Regime, &[usize]); 2] = [
        (
            Regime::Typical,
            &[4 * 256 * 37, 12_345, 3, MORE_CUBES_THAN_UNITS],
        ),
        (Regime::EpsBound, &[4 * 256 * 3, 1001]),
    ];
    for (regime, lens) in cases {
        for (i, &len) in lens.iter().enumerate() {
            for decoupled in [true, false] {
                let clip = i % 2 == 0;
                check_step(fused, rng, len, decoupled, clip, ModelDtype::F32, regime);
            }
        }
    }
    check_step(
        fused,
        rng,
        4096,
        true,
        false,
        ModelDtype::None,
        Regime::Typical,
    );
}

/// The `dtype` (f16 or bf16) model copy is the master rounded to nearest even, checked value
/// by value, on the vectorized path (vector size 4, as production shards are laid out) and on
/// the scalar path (an odd length), for AdamW and Adam + L2. Panics, naming the dtype, when the
/// runtime does not support it: a caller that expects that skips the call, and says so.
pub fn check_half_precision_copy<R: Runtime>(
    fused: &FusedAdam<R>,
    rng: &mut Rng,
    dtype: ModelDtype,
) {
    assert!(
        matches!(dtype, ModelDtype::F16 | ModelDtype::Bf16),
        "{dtype:?} is not a half-precision copy"
    );
    assert!(
        fused.supports(dtype),
        "this runtime does not support {dtype:?} (WGSL has no bf16; f16 needs shader-f16): the \
         {dtype:?} copy cannot be checked here"
    );
    let vectorized = 4 * 1000;
    assert_eq!(
        fused.vector_size(vectorized),
        4,
        "{vectorized} elements should take the vector-size-4 path"
    );
    for (len, clip) in [(vectorized, true), (vectorized + 3, false)] {
        for decoupled in [true, false] {
            check_step(fused, rng, len, decoupled, clip, dtype, Regime::Typical);
        }
    }
}

/// [`check_half_precision_copy`] for f16 and bf16 where the runtime supports them. Returns
/// the dtypes it does not support, which were skipped.
pub fn check_half_precision_copies<R: Runtime>(
    fused: &FusedAdam<R>,
    rng: &mut Rng,
) -> Vec<ModelDtype> {
    let mut skipped = Vec::new();
    for dtype in [ModelDtype::F16, ModelDtype::Bf16] {
        if fused.supports(dtype) {
            check_half_precision_copy(fused, rng, dtype);
        } else {
            skipped.push(dtype);
        }
    }
    skipped
}

/// An inf, -inf, NaN, or a finite value that overflows when unscaled is detected, and the
/// step is skipped: no state changes, the step counter does not advance, no model copy.
pub fn check_inf_and_nan_skip_the_step<R: Runtime>(fused: &FusedAdam<R>, rng: &mut Rng) {
    for (case, bad) in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::MAX]
        .into_iter()
        .enumerate()
    {
        let len = [4 * 300, 777, MORE_CUBES_THAN_UNITS, 8][case];
        let (master, m, v) = random_state(rng, len);
        let mut scaled = rng.nonzero_vec(len, 1e-2, 1e3);
        // In the many-cube case, in the last cube: a partial that only `reduce_partials`' loop
        // reaches.
        let pos = if len == MORE_CUBES_THAN_UNITS {
            len - 1 - rng.below(4 * 256)
        } else {
            rng.below(len)
        };
        scaled[pos] = bad;
        // f32::MAX is finite but overflows when unscaled by 2 (inv_scale > 1 after a backoff).
        let inv_scale = if bad == f32::MAX { 2.0 } else { 1.0 / 512.0 };
        let b = fused.upload(&master, &m, &v, 7, &scaled, inv_scale, ModelDtype::F32);
        let s = StepScalars {
            step: 8,
            ..random_scalars(true, rng)
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

/// A gradient of finite elements whose sum of squares overflows f32 skips the step like an
/// inf: no element is flagged, but the total is infinite (its clip factor would be 0, and
/// `v = g²` would hold inf). `finalize` must decide on the total, not on the flag alone.
pub fn check_overflowing_norm_skips_the_step<R: Runtime>(fused: &FusedAdam<R>, rng: &mut Rng) {
    let len = 4 * 300;
    let (master, m, v) = random_state(rng, len);
    let mut scaled = rng.nonzero_vec(len, 1e-2, 1e3);
    let pos = rng.below(len);
    scaled[pos] = 1e20; // finite; its square (1e40) is not
    let b = fused.upload(&master, &m, &v, 7, &scaled, 1.0, ModelDtype::F32);
    fused.step(
        &b,
        Hyper {
            scalars: random_scalars(true, rng),
            max_norm: None,
        },
    );
    let stats = fused.read_f32(&b.stats);
    assert_eq!(stats[1], 0.0, "a finite element was flagged as non-finite");
    assert_eq!(
        stats[0],
        f32::INFINITY,
        "the sum of squares did not overflow"
    );
    assert_eq!(
        fused.read_u32(&b.step),
        [7],
        "an overflowing norm counts as a skipped step"
    );
    assert_eq!(fused.read_f32(&b.master), master, "master changed");
    assert_eq!(fused.read_f32(&b.v), v, "v changed");
}

/// The kernels read and write the first `len` elements of their buffers and nothing past them,
/// where the buffers are longer (a shard handed over as a view of a larger allocation): each
/// buffer gets a tail of NaN (the gradient, the partials: read, they would flag an inf) or of
/// sentinels (master, moments, model copy: written, they would change), and the step must equal
/// the one on exact buffers, bitwise, with every tail untouched. On the vectorized path with a
/// partial cube, and on the scalar path.
pub fn check_kernels_stay_within_len<R: Runtime>(fused: &FusedAdam<R>, rng: &mut Rng) {
    use cubecl::prelude::CubeElement;
    const TAIL: usize = 8;
    const SENTINEL: f32 = 12345.0;
    for len in [4 * 300, 777] {
        let (master, m, v) = random_state(rng, len);
        let scaled = rng.nonzero_vec(len, 1e-2, 1e3);
        let hyper = Hyper {
            scalars: random_scalars(true, rng),
            max_norm: Some(1.0),
        };
        let upload = || fused.upload(&master, &m, &v, 3, &scaled, 1.0 / 1024.0, ModelDtype::F32);
        let exact = upload();
        fused.step(&exact, hyper);

        let client = fused.client();
        let with_tail = |x: &[f32], tail: f32| {
            let mut padded = x.to_vec();
            padded.extend([tail; TAIL]);
            client.create_from_slice(f32::as_bytes(&padded))
        };
        let mut padded = upload();
        let partials = fused.read_f32(&padded.partial_sq).len();
        padded.master = with_tail(&master, SENTINEL);
        padded.m = with_tail(&m, SENTINEL);
        padded.v = with_tail(&v, SENTINEL);
        padded.grads = with_tail(&scaled, f32::NAN);
        padded.model = with_tail(&vec![f32::NAN; len], SENTINEL);
        padded.partial_sq = with_tail(&vec![f32::NAN; partials], f32::NAN);
        padded.partial_inf = with_tail(&vec![f32::NAN; partials], f32::NAN);
        fused.step(&padded, hyper);

        let stats = fused.read_f32(&padded.stats);
        assert_eq!(stats[1], 0.0, "len {len}: found an inf past the end");
        assert_eq!(stats, fused.read_f32(&exact.stats), "len {len}: stats");
        for (name, exact, padded, tail) in [
            ("master", &exact.master, &padded.master, SENTINEL),
            ("m", &exact.m, &padded.m, SENTINEL),
            ("v", &exact.v, &padded.v, SENTINEL),
            ("model", &exact.model, &padded.model, SENTINEL),
            ("gradient", &exact.grads, &padded.grads, f32::NAN),
        ] {
            let (exact, padded) = (fused.read_f32(exact), fused.read_f32(padded));
            assert_eq!(padded[..len], exact[..], "len {len}: {name} differs");
            assert!(
                padded[len..].iter().all(|&x| x.to_bits() == tail.to_bits()),
                "len {len}: {name} written past the end: {:?}",
                &padded[len..]
            );
        }
    }
}

/// Four consecutive steps count on the device and follow the f32 reference.
pub fn check_consecutive_steps<R: Runtime>(fused: &FusedAdam<R>, rng: &mut Rng) {
    let len = 4 * 513;
    let master = rng.nonzero_vec(len, 1e-3, 2.0);
    let zeros = vec![0.0f32; len];
    let mut b = fused.upload(&master, &zeros, &zeros, 0, &zeros, 1.0, ModelDtype::F32);
    let (mut rp, mut rm, mut rv) = (master.clone(), zeros.clone(), zeros.clone());
    let base = random_scalars(true, rng);
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

/// The decay mask ([`FusedAdam::set_decay_mask`]): elements whose flag is off step with no
/// weight decay, the others with it, in AdamW and in Adam + L2, on the vectorized and the
/// scalar path, with runs of either kind that start and end inside a vector and one word of the
/// mask. Each element is held to the f32 reference run on its own run of flags; the decay is
/// large (a factor of 0.9 per step in AdamW; in Adam + L2 the parameter added to the
/// gradient), so an element stepped under the wrong flag misses by far more than the tolerance
/// (at least 10 times it, asserted against the kernel decaying everything).
pub fn check_decay_mask<R: Runtime>(fused: &FusedAdam<R>, rng: &mut Rng) {
    for (len, decoupled) in [(4 * 300, true), (4 * 300, false), (777, true)] {
        let (master, m, v) = random_state(rng, len);
        let grads = rng.nonzero_vec(len, 1e-3, 1.0);
        // Runs of 1 to 40 elements, alternately decayed and exempt.
        let mut decays = Vec::with_capacity(len);
        let mut flag = rng.below(2) == 0;
        while decays.len() < len {
            let run = (1 + rng.below(40)).min(len - decays.len());
            decays.extend(std::iter::repeat_n(flag, run));
            flag = !flag;
        }
        let s = StepScalars {
            lr: 0.1,
            weight_decay: 1.0,
            step: 1,
            ..random_scalars(decoupled, rng)
        };
        let hyper = Hyper {
            scalars: s,
            max_norm: None,
        };
        let run = |mask: Option<&[bool]>| {
            let mut b = fused.upload(&master, &m, &v, 0, &grads, 1.0, ModelDtype::None);
            if let Some(mask) = mask {
                fused.set_decay_mask(&mut b, mask);
            }
            fused.step(&b, hyper);
            fused.read_f32(&b.master)
        };
        let masked = run(Some(&decays));
        let unmasked = run(None);
        let exempt = StepScalars {
            weight_decay: 0.0,
            ..s
        };
        let mut at = 0;
        for (decays, run) in runs(&decays) {
            let r = at..at + run;
            at += run;
            let (mut rp, mut rm, mut rv) = (
                master[r.clone()].to_vec(),
                m[r.clone()].to_vec(),
                v[r.clone()].to_vec(),
            );
            let scalars = if decays { s } else { exempt };
            adam_update(
                &mut rp,
                &mut rm,
                &mut rv,
                &grads[r.clone()],
                1.0,
                false,
                &scalars,
                ModelCopy::None,
            );
            let what = format!("len {len}, decoupled {decoupled}, elements {r:?} (decay {decays})");
            let err = relative_error(&masked[r.clone()], &to64(&rp));
            assert!(err <= 1e-6, "{what}: kernel vs f32 reference {err:e}");
            if !decays {
                // Stepped with decay, the run must miss the reference by well over the
                // tolerance above. Not by a fixed 1e-3: in Adam + L2 the decay only enters
                // through the gradient, and a short run can move by less (3.7e-4 seen once
                // on a run of one element, seed 1796347010790199969).
                let wrong = relative_error(&unmasked[r.clone()], &to64(&rp));
                assert!(
                    wrong > 1e-5,
                    "{what}: the case is meant to tell, but decaying moves it by {wrong:e}"
                );
            }
        }
    }
}

/// `flags` as runs: (flag, length).
fn runs(flags: &[bool]) -> Vec<(bool, usize)> {
    let mut out: Vec<(bool, usize)> = Vec::new();
    for &flag in flags {
        match out.last_mut() {
            Some((f, n)) if *f == flag => *n += 1,
            _ => out.push((flag, 1)),
        }
    }
    out
}

/// The benches' bandwidth yardstick, [`FusedAdam::copy`], copies every element and writes
/// nothing past `len` (a copy that did less would flatter the fused step's ratio to it), on the
/// vectorized path with cubes past the end, and on the scalar path.
pub fn check_bandwidth_copy<R: Runtime>(fused: &FusedAdam<R>, rng: &mut Rng) {
    use cubecl::prelude::CubeElement;
    const PAST_THE_END: usize = 8;
    for len in [4 * 300, 777, 1 << 16] {
        let input = rng.nonzero_vec(len + PAST_THE_END, 1e-3, 1.0);
        let client = fused.client();
        let src = client.create_from_slice(f32::as_bytes(&input));
        let dst = client.create_from_slice(f32::as_bytes(&vec![f32::NAN; len + PAST_THE_END]));
        fused.copy(&src, &dst, len);
        let out = fused.read_f32(&dst);
        assert_eq!(
            out[..len],
            input[..len],
            "copy of {len}: an element differs"
        );
        assert!(
            out[len..].iter().all(|x| x.is_nan()),
            "copy of {len}: written past the end"
        );
    }
}

/// What to do when no Vulkan driver is found: the wgpu tests run on Mesa's software driver.
#[cfg(feature = "wgpu")]
pub const NO_VULKAN_ADAPTER: &str = "cubecl's wgpu runtime found no Vulkan adapter. On a machine \
     without a GPU the kernel tests run on Mesa's software driver (lavapipe): install it with \
     `apt-get install mesa-vulkan-drivers libvulkan1` (Debian/Ubuntu; `cargo xtask test` does \
     this itself), or your distribution's Mesa Vulkan package";

/// cubecl's wgpu client on the default adapter, for the tests and benches that run the kernels
/// on machines without a GPU (Mesa's lavapipe).
///
/// Without a Vulkan driver cubecl panics deep inside its adapter selection ("No possible
/// adapter available"); this catches that and fails with [`NO_VULKAN_ADAPTER`], which names
/// the package to install.
#[cfg(feature = "wgpu")]
pub fn wgpu_client() -> cubecl::prelude::ComputeClient<cubecl::wgpu::WgpuRuntime> {
    use cubecl::wgpu::{WgpuDevice, WgpuRuntime};
    std::panic::catch_unwind(|| WgpuRuntime::client(&WgpuDevice::DefaultDevice))
        .unwrap_or_else(|_| panic!("{NO_VULKAN_ADAPTER}"))
}
