//! The learning rate: linear warmup, then cosine decay to a floor (GPT-2/GPT-3, nanoGPT, llm.c).
//!
//! A pure function of the step rather than one of Burn's `LrScheduler`s: those are stateful
//! (each `step()` advances them), so a resumed run would have to replay them, while a function
//! of the checkpoint's step resumes exactly by construction.

/// `max_lr` reached linearly over `warmup` steps, then cosine decay to `min_lr` at `total`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CosineSchedule {
    pub max_lr: f64,
    pub min_lr: f64,
    pub warmup: usize,
    pub total: usize,
}

impl CosineSchedule {
    /// The learning rate of step `step` (0-based):
    /// - `step < warmup`: `max_lr · (step + 1) / warmup` (never 0, as in llm.c);
    /// - then `min_lr + ½(1 + cos(π·r))·(max_lr − min_lr)`, `r = (step − warmup)/(total − warmup)`;
    /// - `step ≥ total`: `min_lr`.
    pub fn lr(&self, step: usize) -> f64 {
        if step < self.warmup {
            return self.max_lr * (step + 1) as f64 / self.warmup as f64;
        }
        if step >= self.total {
            return self.min_lr;
        }
        let ratio = (step - self.warmup) as f64 / (self.total - self.warmup) as f64;
        let coeff = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos());
        self.min_lr + coeff * (self.max_lr - self.min_lr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: CosineSchedule = CosineSchedule {
        max_lr: 1e-3,
        min_lr: 1e-4,
        warmup: 10,
        total: 110,
    };

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-15
    }

    #[test]
    fn warmup_is_linear_and_reaches_the_peak() {
        assert!(close(S.lr(0), 1e-4));
        assert!(close(S.lr(4), 5e-4));
        assert!(close(S.lr(9), 1e-3));
        assert!(close(S.lr(10), 1e-3), "the decay starts at the peak");
    }

    #[test]
    fn cosine_passes_the_midpoint_and_ends_at_the_floor() {
        assert!(
            close(S.lr(60), 5.5e-4),
            "halfway: the mean of peak and floor"
        );
        assert!(close(
            S.lr(35),
            1e-4 + 0.5 * (1.0 + (std::f64::consts::PI / 4.0).cos()) * 9e-4
        ));
        assert!(close(S.lr(110), 1e-4));
        assert!(close(S.lr(10_000), 1e-4));
        let lrs: Vec<f64> = (10..=110).map(|s| S.lr(s)).collect();
        assert!(lrs.windows(2).all(|w| w[1] <= w[0]), "monotone decay");
    }

    #[test]
    fn no_warmup_starts_at_the_peak() {
        let s = CosineSchedule { warmup: 0, ..S };
        assert!(close(s.lr(0), 1e-3));
    }
}
