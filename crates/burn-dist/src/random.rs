//! The random stream of a rank: counter-based, keyed on (seed, rank, step, op counter).
//!
//! Burn's backends draw random tensors (dropout masks, initializations) from one process-wide
//! generator. For data-parallel training that is wrong twice: in-process ranks would interleave
//! draws nondeterministically, and nothing makes ranks differ in a controlled way. Under a
//! `Ddp`, `DistributedBackend` draws instead from this stream: value `i` of the `c`-th random op
//! of step `s` on rank `r` is a pure function of (seed, r, s, c, i). Runs are reproducible, ranks
//! get independent masks, and the same values come out on every backend (they are generated
//! on the host, then uploaded). The generator is SplitMix64, written here so that streams never
//! change with a dependency upgrade.

use burn::tensor::Distribution;

/// Where a rank is in its random stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RandomStream {
    pub seed: u64,
    pub rank: u64,
    pub step: u64,
    /// Random ops drawn so far in this step.
    pub counter: u64,
}

impl RandomStream {
    pub fn new(seed: u64, rank: usize) -> Self {
        RandomStream {
            seed,
            rank: rank as u64,
            step: 0,
            counter: 0,
        }
    }

    /// The key of the next random op.
    pub fn next_key(&mut self) -> u64 {
        let key = mix(mix(mix(mix(self.seed) ^ self.rank) ^ self.step) ^ self.counter);
        self.counter += 1;
        key
    }
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Uniform in [0, 1) with 53 random bits, from value `i` of the op keyed `key`.
fn unit(key: u64, i: u64) -> f64 {
    (mix(key ^ mix(i)) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// `n` values of `distribution` for the op keyed `key`.
pub fn sample(key: u64, n: usize, distribution: Distribution) -> Vec<f64> {
    let uniform = |i: usize| unit(key, i as u64);
    match distribution {
        Distribution::Default => (0..n).map(uniform).collect(),
        Distribution::Uniform(low, high) => {
            (0..n).map(|i| low + (high - low) * uniform(i)).collect()
        }
        Distribution::Bernoulli(p) => (0..n)
            .map(|i| f64::from(u8::from(uniform(i) < p)))
            .collect(),
        Distribution::Normal(mean, std) => (0..n)
            .map(|i| {
                // Box–Muller on two independent uniforms of value i.
                let u1 = 1.0 - unit(key, 2 * i as u64 + (1 << 62));
                let u2 = unit(key, 2 * i as u64 + 1 + (1 << 62));
                mean + std * (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
            })
            .collect(),
    }
}

/// `n` values from the calling rank's stream, or `None` when no `Ddp` serves this thread (the
/// inner backend's own generator is used then).
pub(crate) fn draw(n: usize, distribution: Distribution) -> Option<Vec<f64>> {
    let shared = crate::context::current()?;
    let key = crate::context::lock(&shared).random.next_key();
    Some(sample(key, n, distribution))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moments(v: &[f64]) -> (f64, f64) {
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        (
            mean,
            v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64,
        )
    }

    #[test]
    fn distributions_have_their_moments() {
        let n = 200_000;
        let (m, var) = moments(&sample(1, n, Distribution::Uniform(-1.0, 3.0)));
        assert!(
            (m - 1.0).abs() < 0.02 && (var - 16.0 / 12.0).abs() < 0.02,
            "{m} {var}"
        );
        let (m, var) = moments(&sample(2, n, Distribution::Normal(2.0, 0.5)));
        assert!(
            (m - 2.0).abs() < 0.01 && (var - 0.25).abs() < 0.01,
            "{m} {var}"
        );
        let (m, _) = moments(&sample(3, n, Distribution::Bernoulli(0.3)));
        assert!((m - 0.3).abs() < 0.01, "{m}");
        let v = sample(4, n, Distribution::Default);
        assert!(v.iter().all(|x| (0.0..1.0).contains(x)));
    }

    #[test]
    fn streams_are_reproducible_and_differ_by_rank_step_and_op() {
        let draw = |rank: usize, step: u64, ops: usize| {
            let mut s = RandomStream::new(7, rank);
            s.step = step;
            (0..ops)
                .map(|_| sample(s.next_key(), 4, Distribution::Default))
                .last()
                .unwrap()
        };
        assert_eq!(draw(0, 0, 1), draw(0, 0, 1));
        assert_ne!(draw(0, 0, 1), draw(1, 0, 1));
        assert_ne!(draw(0, 0, 1), draw(0, 1, 1));
        assert_ne!(draw(0, 0, 1), draw(0, 0, 2));
    }
}
