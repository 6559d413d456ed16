//! A seeded random stream for everything this example draws on the host (the initial weights,
//! the synthetic corpus): SplitMix64, a fixed algorithm, so a seed means the same model and the
//! same corpus in every build and on every machine.

/// SplitMix64's increment of the state per draw.
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// The stream as it is after `draws` more calls of [`next_u64`](Self::next_u64), without
    /// making them: each call adds one constant to the state.
    pub fn skipped(&self, draws: u64) -> Self {
        SplitMix64 {
            state: self.state.wrapping_add(draws.wrapping_mul(GAMMA)),
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GAMMA);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1), with 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `0..n` (the modulo bias is below n/2⁶⁴: irrelevant here).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Standard normal (Box–Muller; one value per call from exactly two draws, the second value
    /// is dropped for simplicity).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform(); // in (0, 1]: ln is finite
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skipped_stream_continues_where_the_draws_would_have_left_it() {
        let mut drawn = SplitMix64::new(11);
        let skipped = drawn.skipped(1000);
        (0..1000).for_each(|_| _ = drawn.next_u64());
        assert_eq!(drawn.next_u64(), skipped.clone().next_u64());
    }

    #[test]
    fn normal_has_unit_moments() {
        let mut rng = SplitMix64::new(9);
        let n = 200_000;
        let xs: Vec<f64> = (0..n).map(|_| rng.normal()).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(
            mean.abs() < 0.01 && (var - 1.0).abs() < 0.01,
            "{mean} {var}"
        );
    }
}
