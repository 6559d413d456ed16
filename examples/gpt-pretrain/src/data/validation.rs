//! Which validation windows an evaluation reads, and each rank's share of them.
//!
//! Real text is not uniform: a validation split is a run of documents that differ in topic and
//! style, and its first windows are one stretch of one document. Evaluating them (as this
//! example once did) measured one document; on 5 MB of plays the figure was 0.09 nats/token
//! above the whole split's. So an evaluation reads either the whole split, or, when that is
//! more than `--eval-sequences`, a stratified sample: the split cut into that many equal strata
//! and one window drawn from each with the run's seed. The sample covers every part of the
//! split, is the same at every evaluation (so the curve compares like with like), and the same
//! at every world size (the ranks split it, they do not draw it).

use crate::rng::SplitMix64;

/// How many validation windows an evaluation reads: `--eval-sequences N|all`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvalWindows {
    /// Every window of the split.
    All,
    /// The whole split if it has at most this many windows, else an evenly spread sample of
    /// this many.
    AtMost(usize),
}

impl EvalWindows {
    /// `all` or a positive count.
    pub fn parse(text: &str) -> Result<EvalWindows, String> {
        if text == "all" {
            return Ok(EvalWindows::All);
        }
        match text.parse::<usize>() {
            Ok(0) | Err(_) => Err(format!(
                "`{text}`: give a positive number of windows, or `all`"
            )),
            Ok(n) => Ok(EvalWindows::AtMost(n)),
        }
    }
}

/// The windows every evaluation reads, in increasing order, out of `total`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EvalPlan {
    pub windows: Vec<usize>,
    pub total: usize,
}

impl EvalPlan {
    /// The plan for a split of `total` windows: all of them, or one seeded draw from each of
    /// `n` equal strata.
    pub fn new(total: usize, wanted: EvalWindows, seed: u64) -> EvalPlan {
        let windows = match wanted {
            EvalWindows::AtMost(n) if n < total => {
                let mut rng = SplitMix64::new(seed ^ VALIDATION_STREAM);
                (0..n)
                    .map(|i| {
                        // Stratum i is [i·total/n, (i+1)·total/n): never empty, as n < total.
                        let (lo, hi) = (i * total / n, (i + 1) * total / n);
                        lo + rng.below(hi - lo)
                    })
                    .collect()
            }
            _ => (0..total).collect(),
        };
        EvalPlan { windows, total }
    }

    /// Whether every window of the split is read.
    pub fn is_whole_split(&self) -> bool {
        self.windows.len() == self.total
    }

    /// Rank `rank` of `world`'s share: every world-th window from `rank`, in batches of at most
    /// `batch`, each with its weight in the mean (its number of windows).
    ///
    /// Every rank gets the same number of batches: at ZeRO stage 3 each forward gathers the
    /// parameters from every rank, so a rank with one batch fewer would leave the others
    /// waiting in a gather. A rank whose share runs out first reads one window with weight 0.
    pub fn share(&self, rank: usize, world: usize, batch: usize) -> Vec<(Vec<usize>, usize)> {
        let mine: Vec<usize> = self
            .windows
            .iter()
            .copied()
            .skip(rank)
            .step_by(world)
            .collect();
        let most = self.windows.len().div_ceil(world);
        let batches = most.div_ceil(batch);
        let mut out: Vec<(Vec<usize>, usize)> = mine
            .chunks(batch)
            .map(|chunk| (chunk.to_vec(), chunk.len()))
            .collect();
        while out.len() < batches {
            out.push((vec![self.windows[0]], 0));
        }
        out
    }

    /// One line for the log: how many windows of how many, and how they were chosen.
    pub fn describe(&self, seq: usize) -> String {
        let windows = self.windows.len();
        if self.is_whole_split() {
            format!(
                "validation: all {windows} windows of {} tokens in the split",
                seq + 1
            )
        } else {
            format!(
                "validation: {windows} of the split's {} windows of {} tokens, one drawn from each of {windows} equal stretches with the run's seed (--eval-sequences all: every window)",
                self.total,
                seq + 1
            )
        }
    }
}

/// Mixed into the run's seed so that the sample is not correlated with the weights' stream.
const VALIDATION_STREAM: u64 = 0x7661_6c69_6461_7465;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_split_is_evaluated_whole_and_a_large_one_by_strata() {
        let whole = EvalPlan::new(300, EvalWindows::AtMost(512), 1);
        assert_eq!(whole.windows, (0..300).collect::<Vec<_>>());
        assert!(whole.is_whole_split());
        assert_eq!(EvalPlan::new(5000, EvalWindows::All, 1).windows.len(), 5000);

        let sample = EvalPlan::new(1000, EvalWindows::AtMost(64), 7);
        assert_eq!(sample.windows.len(), 64);
        assert!(!sample.is_whole_split());
        for (i, &w) in sample.windows.iter().enumerate() {
            let (lo, hi) = (i * 1000 / 64, (i + 1) * 1000 / 64);
            assert!((lo..hi).contains(&w), "window {w} outside stratum {i}");
        }
        assert_eq!(sample, EvalPlan::new(1000, EvalWindows::AtMost(64), 7));
        assert_ne!(sample, EvalPlan::new(1000, EvalWindows::AtMost(64), 8));
        // Spread over the split, not its start: the last stratum is the split's end.
        assert!(*sample.windows.last().unwrap() >= 1000 - 1000 / 64);
    }

    #[test]
    fn the_ranks_split_the_plan_into_the_same_number_of_batches() {
        let plan = EvalPlan::new(1000, EvalWindows::AtMost(37), 3);
        for world in [1, 2, 3, 4] {
            let shares: Vec<_> = (0..world).map(|r| plan.share(r, world, 4)).collect();
            let batches = shares[0].len();
            assert!(shares.iter().all(|s| s.len() == batches), "world {world}");
            let mut read: Vec<usize> = shares
                .iter()
                .flatten()
                .filter(|(_, weight)| *weight > 0)
                .flat_map(|(windows, _)| windows.clone())
                .collect();
            read.sort();
            assert_eq!(read, plan.windows, "world {world}: each window once");
            let weights: usize = shares.iter().flatten().map(|(_, w)| w).sum();
            assert_eq!(weights, 37, "world {world}");
        }
    }

    #[test]
    fn the_flag_takes_a_count_or_all() {
        assert_eq!(EvalWindows::parse("all"), Ok(EvalWindows::All));
        assert_eq!(EvalWindows::parse("12"), Ok(EvalWindows::AtMost(12)));
        assert!(EvalWindows::parse("0").unwrap_err().contains("positive"));
        assert!(EvalWindows::parse("some").is_err());
    }
}
