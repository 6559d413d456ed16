//! The fused step as CubeCL kernels, generic over the cubecl runtime `R`.
//!
//! Four launches per step, none of which waits for the host:
//! 1. [`unscale_check`] (one pass over the shard, vectorized): `g *= inv_scale` in place,
//!    inf/NaN detection and the sum of squares; each cube writes one partial sum and one
//!    found-inf flag to device memory (WGSL has no f32 atomics, so no atomics: a tree reduction
//!    in shared memory per cube, then a second tiny reduction);
//! 2. [`reduce_partials`] (one cube): the partials to `stats = [sum_sq, found_inf]`. ZeroAdam
//!    all-reduces `stats` (sum) across ranks at this point;
//! 3. [`finalize`] (one unit): found-inf, the clip factor, the step counter (advanced only
//!    when no inf was found, so a skipped step does not count, as in PyTorch's GradScaler) and
//!    the bias corrections, written to a `factors` buffer;
//! 4. [`adam_step`] (one pass, vectorized): reads `factors`; does nothing when found-inf, else
//!    the clipped Adam(W) update of master, m, v and the model-dtype copy, as
//!    [`crate::reference::adam_update`] computes it.

use cubecl::prelude::*;

use crate::reference::StepScalars;

/// Units per cube of the elementwise passes and of the reductions (a power of two).
pub const CUBE_SIZE: u32 = 256;

/// Layout of the `factors` buffer written by [`finalize`] and read by [`adam_step`].
mod f {
    pub const FOUND_INF: usize = 0;
    pub const CLIP: usize = 1;
    pub const BC1: usize = 2;
    pub const BC2: usize = 3;
    pub const COMBINED: usize = 4;
    pub const EPS: usize = 5;
    pub const LEN: usize = 6;
}

/// Layout of the `hyper` buffer uploaded by the host each step (no read back).
mod h {
    pub const LR: usize = 0;
    pub const BETA1: usize = 1;
    pub const BETA2: usize = 2;
    pub const EPS: usize = 3;
    pub const WEIGHT_DECAY: usize = 4;
    /// `1 - lr * weight_decay`, computed in f64 on the host as Burn's AdamW does.
    pub const DECAY: usize = 5;
    /// Max norm of global-norm clipping; `<= 0`: no clipping.
    pub const MAX_NORM: usize = 6;
    pub const ONE_MINUS_BETA1: usize = 7;
    pub const ONE_MINUS_BETA2: usize = 8;
    pub const LEN: usize = 9;
}

/// True where all exponent bits are set (inf or NaN), tested on the bits: no fast-math
/// folding and no reliance on WGSL's (absent) `isnan`.
#[cube]
fn non_finite(x: f32) -> bool {
    let bits = u32::reinterpret(x);
    (bits & 0x7f80_0000u32) == 0x7f80_0000u32
}

/// Tree reduction of `sq` (sum) and `inf` (max) over the units of a cube; unit 0 holds the
/// result when it returns.
#[cube]
fn cube_reduce(sq: &mut SharedMemory<f32>, inf: &mut SharedMemory<f32>) {
    let mut stride = CUBE_DIM / 2;
    while stride > 0 {
        if UNIT_POS < stride {
            let u = UNIT_POS as usize;
            let o = (UNIT_POS + stride) as usize;
            sq[u] = sq[u] + sq[o];
            inf[u] = f32::max(inf[u], inf[o]);
        }
        sync_cube();
        stride /= 2;
    }
}

/// Pass 1: unscale in place, detect inf/NaN, sum the squares; one partial per cube.
#[cube(launch)]
pub fn unscale_check<N: Size>(
    grads: &mut Array<Vector<f32, N>>,
    inv_scale: &Array<f32>,
    partial_sq: &mut Array<f32>,
    partial_inf: &mut Array<f32>,
    n_vectors: u32,
) {
    let mut sq = SharedMemory::<f32>::new(CUBE_SIZE as usize);
    let mut inf = SharedMemory::<f32>::new(CUBE_SIZE as usize);
    let mut local_sq = 0.0f32;
    let mut local_inf = 0.0f32;
    if ABSOLUTE_POS < n_vectors as usize {
        let g = grads[ABSOLUTE_POS] * Vector::new(inv_scale[0]);
        grads[ABSOLUTE_POS] = g;
        #[unroll]
        for k in 0..N::value() {
            let x = g[k];
            local_sq += x * x;
            if non_finite(x) {
                local_inf = 1.0;
            }
        }
    }
    sq[UNIT_POS as usize] = local_sq;
    inf[UNIT_POS as usize] = local_inf;
    sync_cube();
    cube_reduce(&mut sq, &mut inf);
    if UNIT_POS == 0 {
        partial_sq[CUBE_POS] = sq[0];
        partial_inf[CUBE_POS] = inf[0];
    }
}

/// The partials of [`unscale_check`] to `stats = [sum_sq, found_inf (0 or 1)]`; one cube.
#[cube(launch)]
pub fn reduce_partials(
    partial_sq: &Array<f32>,
    partial_inf: &Array<f32>,
    stats: &mut Array<f32>,
    n_partials: u32,
) {
    let mut sq = SharedMemory::<f32>::new(CUBE_SIZE as usize);
    let mut inf = SharedMemory::<f32>::new(CUBE_SIZE as usize);
    let mut local_sq = 0.0f32;
    let mut local_inf = 0.0f32;
    let mut i = UNIT_POS;
    while i < n_partials {
        local_sq += partial_sq[i as usize];
        local_inf = f32::max(local_inf, partial_inf[i as usize]);
        i += CUBE_DIM;
    }
    sq[UNIT_POS as usize] = local_sq;
    inf[UNIT_POS as usize] = local_inf;
    sync_cube();
    cube_reduce(&mut sq, &mut inf);
    if UNIT_POS == 0 {
        stats[0] = sq[0];
        stats[1] = inf[0];
    }
}

/// `x^t` by square-and-multiply in f32 (the algorithm of compiler-rt's `__powisf2`, which
/// Rust's `f32::powi` calls).
#[cube]
fn powi(x: f32, t: u32) -> f32 {
    let mut base = x;
    let mut e = t;
    let mut r = 1.0f32;
    while e > 0 {
        if e % 2 == 1 {
            r *= base;
        }
        e /= 2;
        if e > 0 {
            base *= base;
        }
    }
    r
}

/// One unit: found-inf, clip factor, step counter and bias corrections, from `stats` (after the
/// cross-rank all-reduce, if any) and the host's `hyper`.
#[cube(launch)]
pub fn finalize(
    stats: &Array<f32>,
    hyper: &Array<f32>,
    step: &mut Array<u32>,
    factors: &mut Array<f32>,
    #[comptime] decoupled: bool,
) {
    if UNIT_POS == 0 {
        let sum_sq = stats[0];
        let found = stats[1] > 0.0 || non_finite(sum_sq);
        let mut t = step[0];
        if !found {
            t += 1;
        }
        step[0] = t;
        let max_norm = hyper[h::MAX_NORM];
        let mut clip = 1.0f32;
        if max_norm > 0.0 {
            clip = f32::min(1.0, max_norm / (f32::sqrt(sum_sq) + 1e-6));
        }
        let p1 = powi(hyper[h::BETA1], t);
        let p2 = powi(hyper[h::BETA2], t);
        let bc2_sqrt = f32::sqrt(1.0 - p2);
        let mut found_f = 0.0f32;
        if found {
            found_f = 1.0;
        }
        factors[f::FOUND_INF] = found_f;
        factors[f::CLIP] = clip;
        factors[f::BC1] = 1.0 - p1;
        factors[f::BC2] = 1.0 - p2;
        factors[f::COMBINED] = bc2_sqrt / (1.0 - p1);
        if decoupled {
            factors[f::EPS] = hyper[h::EPS];
        } else {
            factors[f::EPS] = hyper[h::EPS] * bc2_sqrt;
        }
    }
}

/// Pass 2: the clipped Adam(W) update of master, m, v, and the model-dtype copy, in the
/// operation order of [`crate::reference::adam_update`]; nothing when found-inf.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
pub fn adam_step<M: Float, N: Size>(
    master: &mut Array<Vector<f32, N>>,
    m: &mut Array<Vector<f32, N>>,
    v: &mut Array<Vector<f32, N>>,
    grads: &Array<Vector<f32, N>>,
    model: &mut Array<Vector<M, N>>,
    factors: &Array<f32>,
    hyper: &Array<f32>,
    decay_mask: &Array<u32>,
    n_vectors: u32,
    #[comptime] decoupled: bool,
    #[comptime] write_model: bool,
    #[comptime] masked: bool,
) {
    let i = ABSOLUTE_POS;
    if i < n_vectors as usize && factors[f::FOUND_INF] == 0.0 {
        let p = master[i];
        let mut g = grads[i] * Vector::new(factors[f::CLIP]);
        let wd = hyper[h::WEIGHT_DECAY];
        // Per element: the weight decay (L2) and the decay factor (AdamW), or 0 and 1 where
        // the mask exempts the element (`p · 0 + g` is g and `p · 1` is p, as the host step
        // computes them with a decay of 0).
        let mut wd_v = Vector::<f32, N>::new(wd);
        let mut decay_v = Vector::<f32, N>::new(hyper[h::DECAY]);
        if masked {
            #[unroll]
            for k in 0..N::value() {
                let e = i * N::value() + k;
                let bit = (decay_mask[e / 32] >> (e % 32) as u32) & 1u32;
                if bit == 0 {
                    wd_v[k] = 0.0;
                    decay_v[k] = 1.0;
                }
            }
        }
        if !decoupled && wd != 0.0 {
            g = p * wd_v + g;
        }
        let m1 = m[i] * Vector::new(hyper[h::BETA1]) + g * Vector::new(hyper[h::ONE_MINUS_BETA1]);
        let v1 =
            v[i] * Vector::new(hyper[h::BETA2]) + (g * g) * Vector::new(hyper[h::ONE_MINUS_BETA2]);
        let lr = Vector::new(hyper[h::LR]);
        let eps = Vector::new(factors[f::EPS]);
        let p1 = if decoupled {
            let m_hat = m1 / Vector::new(factors[f::BC1]);
            let v_hat = v1 / Vector::new(factors[f::BC2]);
            let delta = m_hat / (Vector::sqrt(v_hat) + eps);
            p * decay_v - delta * lr
        } else {
            let delta = (m1 * Vector::new(factors[f::COMBINED])) / (Vector::sqrt(v1) + eps);
            p - delta * lr
        };
        m[i] = m1;
        v[i] = v1;
        master[i] = p1;
        if write_model {
            model[i] = Vector::cast_from(p1);
        }
    }
}

/// A plain copy, vectorized like the passes: the bandwidth yardstick of the benches.
#[cube(launch)]
pub fn copy<N: Size>(
    input: &Array<Vector<f32, N>>,
    output: &mut Array<Vector<f32, N>>,
    n_vectors: u32,
) {
    if ABSOLUTE_POS < n_vectors as usize {
        output[ABSOLUTE_POS] = input[ABSOLUTE_POS];
    }
}

/// The host's per-step scalars, as uploaded to the `hyper` buffer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hyper {
    /// Learning rate, betas, eps, weight decay and its kind; `step` is ignored (the step
    /// counter lives on the device, see [`StepBuffers::step`]).
    pub scalars: StepScalars,
    /// Global-norm clipping: `Some(max_norm)`.
    pub max_norm: Option<f32>,
}

impl Hyper {
    fn to_vec(self) -> [f32; h::LEN] {
        let s = self.scalars;
        let mut out = [0.0f32; h::LEN];
        out[h::LR] = s.lr;
        out[h::BETA1] = s.beta1;
        out[h::BETA2] = s.beta2;
        out[h::EPS] = s.eps;
        out[h::WEIGHT_DECAY] = s.weight_decay;
        out[h::DECAY] = s.factors().decay;
        out[h::MAX_NORM] = self.max_norm.unwrap_or(0.0);
        out[h::ONE_MINUS_BETA1] = 1.0 - s.beta1;
        out[h::ONE_MINUS_BETA2] = 1.0 - s.beta2;
        out
    }
}

/// The model-dtype copy that [`adam_step`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelDtype {
    /// No copy.
    None,
    /// f32.
    F32,
    /// f16 (needs the runtime's f16 support; WGSL: the `shader-f16` extension).
    F16,
    /// bf16 (not in WGSL: CUDA only).
    Bf16,
}

/// The device buffers of one flat shard: fp32 master weights, moments, the gradient (unscaled
/// in place by pass 1), the model-dtype copy, and the small per-step buffers.
pub struct StepBuffers {
    /// Number of f32 elements in the shard (a multiple of the vector size).
    pub len: usize,
    /// fp32 master weights.
    pub master: cubecl::server::Handle,
    /// First moment.
    pub m: cubecl::server::Handle,
    /// Second moment.
    pub v: cubecl::server::Handle,
    /// Gradient, unscaled in place by pass 1.
    pub grads: cubecl::server::Handle,
    /// The model-dtype copy (a 1-vector dummy with [`ModelDtype::None`]).
    pub model: cubecl::server::Handle,
    /// Its dtype.
    pub model_dtype: ModelDtype,
    /// `[1 / loss_scale]` (written by the scaler, on the device).
    pub inv_scale: cubecl::server::Handle,
    /// Per-cube partial sums of squares of pass 1.
    pub partial_sq: cubecl::server::Handle,
    /// Per-cube found-inf flags of pass 1.
    pub partial_inf: cubecl::server::Handle,
    /// `[sum_sq, found_inf]`: what ZeroAdam all-reduces (sum) between the passes.
    pub stats: cubecl::server::Handle,
    /// `[t]`: the number of steps taken (skipped steps do not count).
    pub step: cubecl::server::Handle,
    /// Written by [`finalize`], read by [`adam_step`]: found-inf, clip, bias corrections.
    pub factors: cubecl::server::Handle,
    /// The vector size the passes use.
    pub vector_size: usize,
    /// Which elements weight decay applies to, one bit each (bit `e % 32` of word `e / 32`);
    /// `None`: every element ([`FusedAdam::set_decay_mask`]).
    pub decay_mask: Option<cubecl::server::Handle>,
}

/// The fused ZeroAdam step on runtime `R`.
pub struct FusedAdam<R: Runtime> {
    client: ComputeClient<R>,
}

impl<R: Runtime> FusedAdam<R> {
    /// A fused step on `client`'s device.
    pub fn new(client: ComputeClient<R>) -> Self {
        Self { client }
    }

    /// The compute client.
    pub fn client(&self) -> &ComputeClient<R> {
        &self.client
    }

    /// The widest vector size (≤ 4) that divides `len` and that the runtime offers for f32.
    pub fn vector_size(&self, len: usize) -> usize {
        self.client
            .io_optimized_vector_sizes(size_of::<f32>())
            .filter(|&s| s <= 4 && len.is_multiple_of(s))
            .max()
            .unwrap_or(1)
    }

    /// The cube count of an elementwise pass over `n_vectors` (spread over two dimensions
    /// past the 65 535 cubes one dimension allows) and its number of cubes, which is the
    /// number of partials of pass 1 (cubes past the end contribute zeros).
    fn cubes(&self, n_vectors: usize) -> (CubeCount, usize) {
        let count = cubecl::calculate_cube_count_elemwise(
            &self.client,
            n_vectors.max(1),
            CubeDim::new_1d(CUBE_SIZE),
        );
        let total = match &count {
            CubeCount::Static(x, y, z) => (*x as usize) * (*y as usize) * (*z as usize),
            CubeCount::Dynamic(_) => unreachable!("elementwise cube counts are static"),
        };
        (count, total)
    }

    /// Uploads a shard: master weights, moments (zeros for a fresh optimizer), the number of
    /// steps already taken, the gradient, and a model copy of `model_dtype` (poisoned with NaN
    /// bits until a step writes it).
    #[allow(clippy::too_many_arguments)]
    pub fn upload(
        &self,
        master: &[f32],
        m: &[f32],
        v: &[f32],
        steps_taken: u32,
        grads: &[f32],
        inv_scale: f32,
        model_dtype: ModelDtype,
    ) -> StepBuffers {
        let c = &self.client;
        let len = master.len();
        assert!(
            m.len() == len && v.len() == len && grads.len() == len,
            "upload: buffers of different lengths (master {len}, m {}, v {}, grads {})",
            m.len(),
            v.len(),
            grads.len()
        );
        let vector_size = self.vector_size(len);
        let (_, cubes) = self.cubes(len / vector_size);
        let model_bytes = match model_dtype {
            ModelDtype::None => vector_size * 4,
            ModelDtype::F32 => len * 4,
            ModelDtype::F16 | ModelDtype::Bf16 => len * 2,
        };
        StepBuffers {
            len,
            master: c.create_from_slice(f32::as_bytes(master)),
            m: c.create_from_slice(f32::as_bytes(m)),
            v: c.create_from_slice(f32::as_bytes(v)),
            grads: c.create_from_slice(f32::as_bytes(grads)),
            model: c.create_from_slice(&vec![0xffu8; model_bytes]),
            model_dtype,
            inv_scale: c.create_from_slice(f32::as_bytes(&[inv_scale])),
            partial_sq: c.create_from_slice(f32::as_bytes(&vec![f32::NAN; cubes])),
            partial_inf: c.create_from_slice(f32::as_bytes(&vec![f32::NAN; cubes])),
            stats: c.create_from_slice(f32::as_bytes(&[f32::NAN; 2])),
            step: c.create_from_slice(u32::as_bytes(&[steps_taken])),
            factors: c.create_from_slice(f32::as_bytes(&[f32::NAN; f::LEN])),
            vector_size,
            decay_mask: None,
        }
    }

    /// Which of the shard's elements weight decay applies to (`decays[e]` for element `e`;
    /// all of them until this is called). A mask of all `true` is no mask.
    pub fn set_decay_mask(&self, b: &mut StepBuffers, decays: &[bool]) {
        assert_eq!(decays.len(), b.len, "set_decay_mask: one flag per element");
        b.decay_mask = (!decays.iter().all(|&d| d)).then(|| {
            let mut words = vec![0u32; b.len.div_ceil(32)];
            for (e, _) in decays.iter().enumerate().filter(|(_, d)| **d) {
                words[e / 32] |= 1 << (e % 32);
            }
            self.client.create_from_slice(u32::as_bytes(&words))
        });
    }

    /// Pass 1 and its reduction: unscale `grads` in place and write `stats`.
    pub fn unscale_and_check(&self, b: &StepBuffers) {
        let n_vectors = b.len / b.vector_size;
        let (cubes, n_partials) = self.cubes(n_vectors);
        unsafe {
            unscale_check::launch::<R>(
                &self.client,
                cubes,
                CubeDim::new_1d(CUBE_SIZE),
                b.vector_size,
                ArrayArg::from_raw_parts(b.grads.clone(), n_vectors),
                ArrayArg::from_raw_parts(b.inv_scale.clone(), 1),
                ArrayArg::from_raw_parts(b.partial_sq.clone(), n_partials),
                ArrayArg::from_raw_parts(b.partial_inf.clone(), n_partials),
                n_vectors as u32,
            );
            reduce_partials::launch::<R>(
                &self.client,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(CUBE_SIZE),
                ArrayArg::from_raw_parts(b.partial_sq.clone(), n_partials),
                ArrayArg::from_raw_parts(b.partial_inf.clone(), n_partials),
                ArrayArg::from_raw_parts(b.stats.clone(), 2),
                n_partials as u32,
            );
        }
    }

    /// Found-inf, clip factor, step counter and bias corrections from `stats` (all-reduced
    /// across ranks before this, if any), then pass 2. `hyper` is uploaded, never read back.
    pub fn update(&self, b: &StepBuffers, hyper: Hyper) {
        let hyper_handle = self
            .client
            .create_from_slice(f32::as_bytes(&hyper.to_vec()));
        let decoupled = hyper.scalars.decoupled;
        let n_vectors = b.len / b.vector_size;
        unsafe {
            finalize::launch::<R>(
                &self.client,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(1),
                ArrayArg::from_raw_parts(b.stats.clone(), 2),
                ArrayArg::from_raw_parts(hyper_handle.clone(), h::LEN),
                ArrayArg::from_raw_parts(b.step.clone(), 1),
                ArrayArg::from_raw_parts(b.factors.clone(), f::LEN),
                decoupled,
            );
        }
        let write_model = b.model_dtype != ModelDtype::None;
        let model_len = if write_model { n_vectors } else { 1 };
        let masked = b.decay_mask.is_some();
        // Without a mask the kernel never reads it: any one-word buffer stands in.
        let (mask, mask_len) = match &b.decay_mask {
            Some(mask) => (mask.clone(), b.len.div_ceil(32)),
            None => (b.step.clone(), 1),
        };
        macro_rules! launch {
            ($m:ty) => {
                unsafe {
                    adam_step::launch::<$m, R>(
                        &self.client,
                        self.cubes(n_vectors).0,
                        CubeDim::new_1d(CUBE_SIZE),
                        b.vector_size,
                        ArrayArg::from_raw_parts(b.master.clone(), n_vectors),
                        ArrayArg::from_raw_parts(b.m.clone(), n_vectors),
                        ArrayArg::from_raw_parts(b.v.clone(), n_vectors),
                        ArrayArg::from_raw_parts(b.grads.clone(), n_vectors),
                        ArrayArg::from_raw_parts(b.model.clone(), model_len),
                        ArrayArg::from_raw_parts(b.factors.clone(), f::LEN),
                        ArrayArg::from_raw_parts(hyper_handle.clone(), h::LEN),
                        ArrayArg::from_raw_parts(mask.clone(), mask_len),
                        n_vectors as u32,
                        decoupled,
                        write_model,
                        masked,
                    )
                }
            };
        }
        match b.model_dtype {
            ModelDtype::None | ModelDtype::F32 => launch!(f32),
            ModelDtype::F16 => launch!(half::f16),
            ModelDtype::Bf16 => launch!(half::bf16),
        }
    }

    /// Replaces the gradient (the next micro-batch's), keeping the shard's state.
    pub fn write_grads(&self, b: &mut StepBuffers, grads: &[f32]) {
        assert_eq!(grads.len(), b.len, "write_grads: wrong length");
        b.grads = self.client.create_from_slice(f32::as_bytes(grads));
    }

    /// Whether the runtime can store and compute in `dtype` (f16 on WGSL needs `shader-f16`;
    /// bf16 has no WGSL type at all).
    pub fn supports(&self, dtype: ModelDtype) -> bool {
        let props = self.client.properties();
        match dtype {
            ModelDtype::None | ModelDtype::F32 => true,
            ModelDtype::F16 => props.supports_type(half::f16::as_type_native_unchecked()),
            ModelDtype::Bf16 => props.supports_type(half::bf16::as_type_native_unchecked()),
        }
    }

    /// The whole single-rank step: pass 1, its reduction, finalize, pass 2; no host read.
    pub fn step(&self, b: &StepBuffers, hyper: Hyper) {
        self.unscale_and_check(b);
        self.update(b, hyper);
    }

    /// Copies `len` f32 from `input` to `output` with the passes' launch shape (benches).
    pub fn copy(
        &self,
        input: &cubecl::server::Handle,
        output: &cubecl::server::Handle,
        len: usize,
    ) {
        let vector_size = self.vector_size(len);
        let n_vectors = len / vector_size;
        unsafe {
            copy::launch::<R>(
                &self.client,
                self.cubes(n_vectors).0,
                CubeDim::new_1d(CUBE_SIZE),
                vector_size,
                ArrayArg::from_raw_parts(input.clone(), n_vectors),
                ArrayArg::from_raw_parts(output.clone(), n_vectors),
                n_vectors as u32,
            );
        }
    }

    /// Waits until every launched kernel has run.
    pub fn sync(&self) {
        cubecl::future::block_on(self.client.sync()).expect("device sync");
    }

    /// Reads an f32 buffer back (tests, checkpoints).
    pub fn read_f32(&self, handle: &cubecl::server::Handle) -> Vec<f32> {
        let bytes = self
            .client
            .read_one(handle.clone())
            .expect("read back an f32 buffer");
        f32::from_bytes(&bytes).to_vec()
    }

    /// Reads a u32 buffer back.
    pub fn read_u32(&self, handle: &cubecl::server::Handle) -> Vec<u32> {
        let bytes = self
            .client
            .read_one(handle.clone())
            .expect("read back a u32 buffer");
        u32::from_bytes(&bytes).to_vec()
    }

    /// Reads raw bytes back.
    pub fn read_bytes(&self, handle: &cubecl::server::Handle) -> Vec<u8> {
        self.client
            .read_one(handle.clone())
            .expect("read back a buffer")
            .to_vec()
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;

    /// Past wgpu's 65 535 cubes in one dimension the cube count spreads over two. Every cube
    /// launched must have a partial (pass 1's cube `CUBE_POS` writes one, `reduce_partials`
    /// reads them all), and the cubes must cover every vector.
    #[test]
    fn the_partials_count_every_cube_launched() {
        let fused = FusedAdam::new(crate::testing::wgpu_client());
        let max_x = fused.client().properties().hardware.max_cube_count.0 as usize;
        for n_vectors in [1, 256, 257, max_x * 256, max_x * 256 + 1, 1 << 26] {
            let (count, partials) = fused.cubes(n_vectors);
            let CubeCount::Static(x, y, z) = count else {
                panic!("{n_vectors} vectors: a dynamic cube count")
            };
            let launched = x as usize * y as usize * z as usize;
            assert!(
                partials >= launched,
                "{n_vectors} vectors: {launched} cubes launched ({x}, {y}, {z}), {partials} partials"
            );
            assert!(
                partials * CUBE_SIZE as usize >= n_vectors,
                "{n_vectors} vectors: {partials} cubes of {CUBE_SIZE} do not cover them"
            );
        }
    }
}
