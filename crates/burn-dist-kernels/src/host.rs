//! The fast host step: the reference's two passes ([`crate::reference`]), vectorized and run
//! on rayon's threads. ZeroAdam's CPU path (state on the host) uses it.
//!
//! Both passes cut the slices into fixed chunks of [`CHUNK`] elements, each a unit of work for
//! one thread, and run each chunk with the widest vector instructions the CPU has (AVX-512 or
//! AVX2 on x86-64, detected at run time; the build's baseline otherwise). The chunk loops are
//! plain Rust that LLVM auto-vectorizes: the same operations as the reference, in the same
//! order, with nothing reassociated and nothing fused (Rust never contracts `a * b + c` into
//! an FMA), so:
//! - [`adam_update`] is **bitwise equal** to [`crate::reference::adam_update`] (the update is
//!   elementwise: chunks, threads and vector width change nothing);
//! - [`unscale_and_check`] returns the same unscaled gradient bit for bit and the same
//!   found-inf; its sum of squares is summed in another order than the reference's sequential
//!   loop (per chunk, [`LANES`] f64 accumulators; then the chunks' f64 partials folded in chunk
//!   order), which depends only on the length, never on the thread count or the CPU. It is
//!   within f64 rounding of the reference's.
//!
//! **Threads**: both functions run on the current rayon pool: rayon's global pool
//! (`RAYON_NUM_THREADS`, else one thread per core), or the pool a caller entered with
//! `ThreadPool::install` (ZeroAdam does with `ZeroAdamConfig::host_threads`).

use half::{bf16, f16};
use rayon::prelude::*;

use crate::reference::{ModelCopy, StepFactors, StepScalars, adam_element, is_non_finite};

/// Elements per unit of work (256 KiB of f32 per buffer): large enough that a thread's
/// scheduling cost vanishes against the work, small enough for 2 threads per 1 Mi elements to
/// share 16 chunks evenly. Fixed, so the sum of squares depends on nothing but the length.
pub const CHUNK: usize = 64 * 1024;

/// Independent f64 accumulators of the sum of squares within a chunk: element `i` of a chunk
/// adds into accumulator `i % LANES`, so the loop vectorizes without reassociation.
pub const LANES: usize = 16;

/// Pass 1, as [`crate::reference::unscale_and_check`]: `g *= inv_scale` in place; returns
/// (found_inf, sum of squares of the unscaled g in f64). The sum is not meaningful when
/// found_inf.
pub fn unscale_and_check(grads: &mut [f32], inv_scale: f32) -> (bool, f64) {
    let partials: Vec<(bool, f64)> = grads
        .par_chunks_mut(CHUNK)
        .map(|grads| on_widest_vectors(Unscale { grads, inv_scale }))
        .collect();
    // In chunk order, whatever thread computed each partial.
    partials
        .into_iter()
        .fold((false, 0.0), |(inf, sum), (chunk_inf, chunk_sum)| {
            (inf | chunk_inf, sum + chunk_sum)
        })
}

/// Pass 2, as [`crate::reference::adam_update`] and bitwise equal to it: if `found_inf`
/// nothing changes; else `g' = g * clip`, the Adam(W) update of `master`/`m`/`v` in f32, and
/// `model` = the new master rounded to nearest even.
///
/// # Panics
/// When the slices do not have the same length.
#[allow(clippy::too_many_arguments)]
pub fn adam_update(
    master: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    grads: &[f32],
    clip: f32,
    found_inf: bool,
    s: &StepScalars,
    model: ModelCopy<'_>,
) {
    let n = master.len();
    assert!(
        m.len() == n && v.len() == n && grads.len() == n && model.len().is_none_or(|l| l == n),
        "host::adam_update: slices of different lengths (master {n}, m {}, v {}, grads {}, \
         model {:?})",
        m.len(),
        v.len(),
        grads.len(),
        model.len()
    );
    if found_inf {
        return;
    }
    match model {
        ModelCopy::None => update_chunks::<f32>(master, m, v, grads, None, clip, s),
        ModelCopy::F32(copy) => update_chunks(master, m, v, grads, Some(copy), clip, s),
        ModelCopy::F16(copy) => update_chunks(master, m, v, grads, Some(copy), clip, s),
        ModelCopy::Bf16(copy) => update_chunks(master, m, v, grads, Some(copy), clip, s),
    }
}

/// An element type of the model copy: the new master weight rounded to nearest even, by the
/// same conversion as the reference's.
trait CopyElement: Copy + Send {
    fn round(p: f32) -> Self;
}

impl CopyElement for f32 {
    fn round(p: f32) -> Self {
        p
    }
}

impl CopyElement for f16 {
    fn round(p: f32) -> Self {
        f16::from_f32(p)
    }
}

impl CopyElement for bf16 {
    fn round(p: f32) -> Self {
        bf16::from_f32(p)
    }
}

/// The update of every chunk, spread over the current rayon pool.
fn update_chunks<T: CopyElement>(
    master: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    grads: &[f32],
    copy: Option<&mut [T]>,
    clip: f32,
    s: &StepScalars,
) {
    let f = s.factors();
    let mut copies: Vec<Option<&mut [T]>> = match copy {
        Some(copy) => copy.chunks_mut(CHUNK).map(Some).collect(),
        None => Vec::new(),
    };
    copies.resize_with(master.len().div_ceil(CHUNK), || None);
    master
        .par_chunks_mut(CHUNK)
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .zip(grads.par_chunks(CHUNK))
        .zip(copies)
        .for_each(|((((p, m), v), g), copy)| {
            on_widest_vectors(Update {
                p,
                m,
                v,
                g,
                clip,
                s,
                f: &f,
            });
            if let Some(copy) = copy {
                for (c, &p) in copy.iter_mut().zip(p.iter()) {
                    *c = T::round(p);
                }
            }
        });
}

/// The work on one chunk, compiled once per instruction set by [`on_widest_vectors`].
trait ChunkWork {
    type Output;
    /// Must be `#[inline(always)]`, down to the loops: it is compiled as part of each of
    /// [`on_widest_vectors`]' wrappers, for that wrapper's instruction set. (A closure would not
    /// do: LLVM compiles it once, for the baseline, and the wrappers call it.)
    fn run(self) -> Self::Output;
}

/// Runs `work` compiled for the widest vector instructions this CPU has.
#[inline(always)]
fn on_widest_vectors<W: ChunkWork>(work: W) -> W::Output {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (detected just above).
            return unsafe { x86::avx512(work) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (detected just above).
            return unsafe { x86::avx2(work) };
        }
    }
    work.run()
}

/// The wrappers of [`on_widest_vectors`]: each compiles the work inlined into it for its
/// instruction set. No FMA is enabled, and it could not change results anyway: Rust never
/// contracts a multiply and an add.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::ChunkWork;

    #[target_feature(enable = "avx512f")]
    pub(super) fn avx512<W: ChunkWork>(work: W) -> W::Output {
        work.run()
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn avx2<W: ChunkWork>(work: W) -> W::Output {
        work.run()
    }
}

/// Pass 1 on one chunk of the gradient.
struct Unscale<'a> {
    grads: &'a mut [f32],
    inv_scale: f32,
}

impl ChunkWork for Unscale<'_> {
    type Output = (bool, f64);
    #[inline(always)]
    fn run(self) -> (bool, f64) {
        unscale_chunk(self.grads, self.inv_scale)
    }
}

/// Pass 2 on one chunk of the shard.
struct Update<'a> {
    p: &'a mut [f32],
    m: &'a mut [f32],
    v: &'a mut [f32],
    g: &'a [f32],
    clip: f32,
    s: &'a StepScalars,
    f: &'a StepFactors,
}

impl ChunkWork for Update<'_> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        update_chunk(self.p, self.m, self.v, self.g, self.clip, self.s, self.f)
    }
}

/// Pass 1 on one chunk: the reference's operations per element; the squares summed into
/// [`LANES`] accumulators (element `i` into `i % LANES`), folded in lane order at the end.
///
/// Inf/NaN is tracked as the largest exponent field seen per lane (all ones iff some element
/// was inf or NaN, the reference's [`is_non_finite`]): an unsigned max, one cheap vector
/// instruction, where an `|=` of bools made LLVM carry a byte mask through six dependent
/// instructions per iteration (a latency chain that made the pass 3× slower).
#[inline(always)]
fn unscale_chunk(grads: &mut [f32], inv_scale: f32) -> (bool, f64) {
    const EXPONENT: u32 = 0x7f80_0000;
    let mut sums = [0.0f64; LANES];
    let mut exponents = [0u32; LANES];
    let mut blocks = grads.chunks_exact_mut(LANES);
    for block in &mut blocks {
        let block: &mut [f32; LANES] = block.try_into().expect("chunks_exact");
        for lane in 0..LANES {
            let g = block[lane] * inv_scale;
            block[lane] = g;
            exponents[lane] = exponents[lane].max(g.to_bits() & EXPONENT);
            sums[lane] += (g as f64) * (g as f64);
        }
    }
    for (lane, g) in blocks.into_remainder().iter_mut().enumerate() {
        *g *= inv_scale;
        exponents[lane] = exponents[lane].max(g.to_bits() & EXPONENT);
        sums[lane] += (*g as f64) * (*g as f64);
    }
    let found_inf = exponents.iter().any(|&e| is_non_finite(f32::from_bits(e)));
    (found_inf, sums.iter().fold(0.0, |total, &s| total + s))
}

/// Pass 2 on one chunk: the reference's element function in a loop specialized (by the const
/// parameters) so that no branch is left in the loop and it vectorizes: on AdamW or Adam + L2,
/// and, for AdamW, on bias corrections that are exactly 1.
///
/// AdamW divides by `1 - beta1^t` and `1 - beta2^t`; in f32 these are exactly 1 once
/// `beta^t < 2^-25` (t > 164 for beta1 = 0.9, t > 17 323 for beta2 = 0.999), and a division
/// by the constant 1 is then folded away. Exact: `x / 1 = x` for every x that is not a
/// signaling NaN, and the dividends here (the new moments) are results of arithmetic, never
/// signaling NaNs. The divider is the bottleneck of the update on one thread.
#[inline(always)]
fn update_chunk(
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[f32],
    clip: f32,
    s: &StepScalars,
    f: &StepFactors,
) {
    let unit = (f.bias_correction1 == 1.0, f.bias_correction2 == 1.0);
    match (s.decoupled, unit) {
        (false, _) => update_loop::<false, false, false>(p, m, v, g, clip, s, f),
        (true, (false, false)) => update_loop::<true, false, false>(p, m, v, g, clip, s, f),
        (true, (true, false)) => update_loop::<true, true, false>(p, m, v, g, clip, s, f),
        (true, (false, true)) => update_loop::<true, false, true>(p, m, v, g, clip, s, f),
        (true, (true, true)) => update_loop::<true, true, true>(p, m, v, g, clip, s, f),
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn update_loop<const DECOUPLED: bool, const UNIT_BC1: bool, const UNIT_BC2: bool>(
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[f32],
    clip: f32,
    s: &StepScalars,
    f: &StepFactors,
) {
    // The same scalars with the specialized ones as constants, so that the element function's
    // branch on `decoupled` and its divisions by a unit bias correction fold away.
    let s = StepScalars {
        decoupled: DECOUPLED,
        ..*s
    };
    let f = StepFactors {
        bias_correction1: if UNIT_BC1 { 1.0 } else { f.bias_correction1 },
        bias_correction2: if UNIT_BC2 { 1.0 } else { f.bias_correction2 },
        ..*f
    };
    for (((p, m), v), &g) in p.iter_mut().zip(m).zip(v).zip(g) {
        *p = adam_element(*p, m, v, g, clip, &s, &f);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference;
    use crate::testing::{Rng, random_scalars};

    /// Lengths around the vector widths, the lane count and the chunk size.
    const LENGTHS: [usize; 9] = [
        0,
        1,
        7,
        LANES + 3,
        1000,
        CHUNK - 1,
        CHUNK,
        CHUNK + 5,
        3 * CHUNK + 17,
    ];

    /// The signature of both `adam_update`s.
    type Update =
        fn(&mut [f32], &mut [f32], &mut [f32], &[f32], f32, bool, &StepScalars, ModelCopy<'_>);

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("thread pool")
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|x| x.to_bits()).collect()
    }

    /// Random state, with exact zeros and subnormal values mixed in.
    fn state(rng: &mut Rng, n: usize) -> [Vec<f32>; 4] {
        let mut master = rng.nonzero_vec(n, 1e-3, 2.0);
        let m: Vec<f32> = (0..n).map(|_| rng.nonzero(1e-6, 1e-1)).collect();
        let v = rng.positive_vec(n, 1e-10, 1e-2);
        let mut grads = rng.nonzero_vec(n, 1e-4, 3.0);
        for _ in 0..n / 50 {
            let i = rng.below(n);
            grads[i] = [0.0, -0.0, 1e-40, -1e-41][rng.below(4)];
            master[rng.below(n)] = [0.0, -0.0, 1e-39][rng.below(3)];
        }
        [master, m, v, grads]
    }

    /// Panics naming the first element where `actual` and `expected` differ in their bits.
    fn assert_bitwise(actual: &[u32], expected: &[u32], what: &str) {
        assert_eq!(actual.len(), expected.len(), "{what}: lengths");
        if let Some(i) = (0..actual.len()).find(|&i| actual[i] != expected[i]) {
            panic!(
                "{what}: element {i} has bits {:#x}, the reference {:#x}",
                actual[i], expected[i]
            );
        }
    }

    /// Steps of the three kinds of AdamW loop: early; `1 - beta1^t` exactly 1 in f32; both
    /// bias corrections exactly 1 (checked: the specialized loops do run).
    fn steps(rng: &mut Rng) -> [u32; 3] {
        let steps = [
            1 + rng.below(20),
            200 + rng.below(100),
            20_000 + rng.below(10_000),
        ];
        let bc = |t: usize| {
            let f = StepScalars {
                step: t as u32,
                ..random_scalars(true, &mut Rng::new(0))
            }
            .factors();
            (f.bias_correction1 == 1.0, f.bias_correction2 == 1.0)
        };
        assert_eq!(steps.map(bc), [(false, false), (true, false), (true, true)]);
        steps.map(|t| t as u32)
    }

    #[test]
    fn update_is_bitwise_the_reference_on_one_and_two_threads() {
        let seed = Rng::fresh_seed();
        println!("seed {seed} (replay with BURN_DIST_SEED={seed})");
        let mut rng = Rng::new(seed);
        for &n in &LENGTHS {
            for (decoupled, weight_decay) in [(true, None), (false, None), (false, Some(0.0))] {
                for step in steps(&mut rng) {
                    let mut s = random_scalars(decoupled, &mut rng);
                    s.step = step;
                    if let Some(wd) = weight_decay {
                        s.weight_decay = wd;
                    }
                    let clip = [1.0, 0.37][rng.below(2)];
                    let [master, m, v, grads] = state(&mut rng, n);
                    let (mut p0, mut m0, mut v0) = (master.clone(), m.clone(), v.clone());
                    let mut copy0 = vec![f16::NAN; n];
                    reference::adam_update(
                        &mut p0,
                        &mut m0,
                        &mut v0,
                        &grads,
                        clip,
                        false,
                        &s,
                        ModelCopy::F16(&mut copy0),
                    );
                    for threads in [1, 2] {
                        let (mut p1, mut m1, mut v1) = (master.clone(), m.clone(), v.clone());
                        let mut copy1 = vec![f16::NAN; n];
                        pool(threads).install(|| {
                            adam_update(
                                &mut p1,
                                &mut m1,
                                &mut v1,
                                &grads,
                                clip,
                                false,
                                &s,
                                ModelCopy::F16(&mut copy1),
                            )
                        });
                        let case = format!("n {n}, {threads} threads, {s:?}, clip {clip}");
                        assert_bitwise(&bits(&p1), &bits(&p0), &format!("master, {case}"));
                        assert_bitwise(&bits(&m1), &bits(&m0), &format!("m, {case}"));
                        assert_bitwise(&bits(&v1), &bits(&v0), &format!("v, {case}"));
                        let copy_bits = |c: &[f16]| {
                            c.iter().map(|x| u32::from(x.to_bits())).collect::<Vec<_>>()
                        };
                        assert_bitwise(
                            &copy_bits(&copy1),
                            &copy_bits(&copy0),
                            &format!("f16 copy, {case}"),
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn every_model_copy_is_the_references() {
        let mut rng = Rng::new(Rng::fresh_seed());
        let n = CHUNK + 9;
        let s = StepScalars {
            step: 3,
            ..random_scalars(true, &mut rng)
        };
        let [master, m, v, grads] = state(&mut rng, n);
        let run = |update: Update, copy: ModelCopy<'_>| {
            let (mut p, mut m, mut v) = (master.clone(), m.clone(), v.clone());
            update(&mut p, &mut m, &mut v, &grads, 1.0, false, &s, copy);
            p
        };
        let (mut f32_ref, mut f32_fast) = (vec![f32::NAN; n], vec![f32::NAN; n]);
        let p = run(reference::adam_update, ModelCopy::F32(&mut f32_ref));
        run(adam_update, ModelCopy::F32(&mut f32_fast));
        assert_eq!(bits(&f32_fast), bits(&f32_ref));
        assert_eq!(bits(&f32_fast), bits(&p), "the f32 copy is the master");
        let (mut b_ref, mut b_fast) = (vec![bf16::NAN; n], vec![bf16::NAN; n]);
        run(reference::adam_update, ModelCopy::Bf16(&mut b_ref));
        run(adam_update, ModelCopy::Bf16(&mut b_fast));
        let b = |c: &[bf16]| c.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(b(&b_fast), b(&b_ref));
        let none = run(adam_update, ModelCopy::None);
        assert_eq!(bits(&none), bits(&p));
    }

    #[test]
    fn found_inf_changes_nothing() {
        let n = CHUNK + 3;
        let s = StepScalars {
            step: 2,
            ..random_scalars(true, &mut Rng::new(7))
        };
        let (mut p, mut m, mut v) = (vec![1.0f32; n], vec![0.5f32; n], vec![0.25f32; n]);
        let mut copy = vec![bf16::from_f32(7.0); n];
        adam_update(
            &mut p,
            &mut m,
            &mut v,
            &vec![1.0; n],
            1.0,
            true,
            &s,
            ModelCopy::Bf16(&mut copy),
        );
        assert!(p.iter().all(|&x| x == 1.0) && m.iter().all(|&x| x == 0.5));
        assert!(v.iter().all(|&x| x == 0.25) && copy.iter().all(|&x| x.to_f32() == 7.0));
    }

    #[test]
    #[should_panic(expected = "slices of different lengths")]
    fn slices_of_different_lengths_are_refused() {
        let s = random_scalars(true, &mut Rng::new(1));
        let (mut p, mut m, mut v) = (vec![0.0f32; 4], vec![0.0f32; 4], vec![0.0f32; 3]);
        adam_update(
            &mut p,
            &mut m,
            &mut v,
            &[0.0; 4],
            1.0,
            false,
            &s,
            ModelCopy::None,
        );
    }

    /// The sum of squares in the order the module documents, written plainly: per chunk,
    /// element `i` into lane `i % LANES`, the lanes folded in order; the chunks in order.
    fn documented_sum_of_squares(unscaled: &[f32]) -> f64 {
        let mut total = 0.0f64;
        for chunk in unscaled.chunks(CHUNK) {
            let mut lanes = [0.0f64; LANES];
            for (i, &g) in chunk.iter().enumerate() {
                lanes[i % LANES] += g as f64 * g as f64;
            }
            total += lanes.iter().fold(0.0, |sum, &lane| sum + lane);
        }
        total
    }

    #[test]
    fn unscale_is_the_reference_and_its_sum_does_not_depend_on_threads() {
        let seed = Rng::fresh_seed();
        println!("seed {seed} (replay with BURN_DIST_SEED={seed})");
        let mut rng = Rng::new(seed);
        // Also many chunks: enough partial sums that another association order shows.
        for &n in LENGTHS.iter().chain(&[37 * CHUNK + 5]) {
            let [_, _, _, grads] = state(&mut rng, n);
            let inv_scale = 1.0 / 1024.0;
            let mut reference_grads = grads.clone();
            let (ref_inf, ref_sum) = reference::unscale_and_check(&mut reference_grads, inv_scale);
            let results: Vec<(bool, u64, Vec<u32>)> = [1, 2, 3]
                .into_iter()
                .map(|threads| {
                    let mut g = grads.clone();
                    let (inf, sum) = pool(threads).install(|| unscale_and_check(&mut g, inv_scale));
                    (inf, sum.to_bits(), bits(&g))
                })
                .collect();
            for (threads, (inf, sum, g)) in [1, 2, 3].iter().zip(&results) {
                let first = &results[0];
                assert_eq!(
                    (inf, sum),
                    (&first.0, &first.1),
                    "n {n}: {threads} threads against 1"
                );
                assert!(
                    g == &first.2,
                    "n {n}: unscaled gradient, {threads} threads against 1"
                );
            }
            let (inf, sum) = (results[0].0, f64::from_bits(results[0].1));
            assert!(!inf && !ref_inf, "n {n}");
            assert!(
                results[0].2 == bits(&reference_grads),
                "n {n}: unscaled gradient against the reference"
            );
            assert_eq!(
                sum.to_bits(),
                documented_sum_of_squares(&reference_grads).to_bits(),
                "n {n}: the sum is not summed in the documented order"
            );
            assert!(
                (sum - ref_sum).abs() <= 1e-12 * ref_sum,
                "n {n}: sum {sum} against the sequential {ref_sum}"
            );
        }
    }

    #[test]
    fn unscale_finds_inf_and_nan_in_any_chunk_and_lane() {
        let mut rng = Rng::new(Rng::fresh_seed());
        let n = 3 * CHUNK + 17;
        for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::MAX] {
            for _ in 0..4 {
                let mut g = rng.nonzero_vec(n, 1e-4, 3.0);
                let at = rng.below(n);
                g[at] = bad;
                // f32::MAX overflows only when unscaling multiplies.
                let (inf, _) = pool(2).install(|| unscale_and_check(&mut g, 2.0));
                assert!(inf, "{bad} at {at} of {n}");
            }
        }
        let mut tail = vec![1.0f32; 2 * LANES + 3];
        *tail.last_mut().unwrap() = f32::NAN;
        assert!(unscale_and_check(&mut tail, 1.0).0, "NaN in the remainder");
    }
}
