//! Test scaffolding shared by the unit tests, the integration tests and the benches: a small
//! seeded generator of random, nonzero inputs.

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
