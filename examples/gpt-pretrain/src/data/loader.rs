//! Which training windows each rank reads at each step, through burn-dist's
//! [`DistributedSampler`], so that the data a step trains on does not depend on the world size.
//!
//! Every epoch has a global order of the windows (shuffled with the shared seed). Step `k` of
//! the epoch trains on the global batch `order[k·G .. (k+1)·G]`; rank `r` of `W` reads every
//! W-th window of it from `r` (the sampler's slicing), `G/W` windows, split into the
//! accumulation micro-batches. So N ranks with `G/N` windows each train on exactly the windows
//! that 1 rank with `G` reads. Each epoch has `⌊windows / G⌋` full steps; the tail of the order
//! is left for the next epoch's shuffle. The position is the number of windows consumed by all
//! ranks (a checkpoint's `samples_consumed`), so a run resumes at any world size exactly where it
//! stopped.

use burn_dist::DistributedSampler;

#[derive(Debug)]
pub struct Loader {
    sampler: DistributedSampler,
    windows: usize,
    global_batch: usize,
    steps_per_epoch: u64,
    epoch: u64,
    step_in_epoch: u64,
    /// This rank's remaining windows of the epoch, in reading order.
    indices: Vec<usize>,
    at: usize,
}

impl Loader {
    /// Rank `rank` of `world` reading `windows` windows in global batches of `global_batch`,
    /// `consumed` windows having been read already (by all ranks together).
    pub fn new(
        rank: usize,
        world: usize,
        seed: u64,
        windows: usize,
        global_batch: usize,
        consumed: u64,
    ) -> Result<Loader, String> {
        if global_batch == 0 || !global_batch.is_multiple_of(world) {
            return Err(format!(
                "the global batch {global_batch} is not a positive multiple of the world size {world}"
            ));
        }
        let steps_per_epoch = (windows / global_batch) as u64;
        if steps_per_epoch == 0 {
            return Err(format!(
                "the training split has {windows} windows, fewer than one global batch of {global_batch}: use more data or a smaller --global-batch or --context"
            ));
        }
        let per_epoch = steps_per_epoch * global_batch as u64;
        let mut loader = Loader {
            sampler: DistributedSampler::new(rank, world, seed),
            windows,
            global_batch,
            steps_per_epoch,
            epoch: consumed / per_epoch,
            step_in_epoch: (consumed % per_epoch) / global_batch as u64,
            indices: Vec::new(),
            at: 0,
        };
        loader.start_epoch((consumed % per_epoch) as usize);
        Ok(loader)
    }

    fn start_epoch(&mut self, consumed_in_epoch: usize) {
        self.indices = self
            .sampler
            .indices_from(self.windows, self.epoch, consumed_in_epoch);
        self.at = 0;
    }

    /// This rank's windows for the next step (`global_batch / world` of them).
    pub fn next_step(&mut self) -> Vec<usize> {
        if self.step_in_epoch == self.steps_per_epoch {
            self.epoch += 1;
            self.step_in_epoch = 0;
            self.start_epoch(0);
        }
        let per_rank = self.global_batch / self.sampler.world;
        let step = self.indices[self.at..self.at + per_rank].to_vec();
        self.at += per_rank;
        self.step_in_epoch += 1;
        step
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn global_steps(world: usize, steps: usize, consumed: u64) -> Vec<Vec<usize>> {
        let mut loaders: Vec<Loader> = (0..world)
            .map(|r| Loader::new(r, world, 5, 50, 8, consumed).unwrap())
            .collect();
        (0..steps)
            .map(|_| {
                let mut batch: Vec<usize> =
                    loaders.iter_mut().flat_map(|l| l.next_step()).collect();
                batch.sort();
                batch
            })
            .collect()
    }

    #[test]
    fn every_world_size_trains_on_the_same_global_batches_across_epochs() {
        // 50 windows, batches of 8: 6 steps per epoch; 14 steps cross two epoch boundaries.
        let one = global_steps(1, 14, 0);
        assert_eq!(global_steps(2, 14, 0), one);
        assert_eq!(global_steps(4, 14, 0), one);
        assert_eq!(global_steps(8, 14, 0), one);
        assert_ne!(one[0], one[6], "a new epoch reshuffles");
        for step in &one {
            let mut distinct = step.clone();
            distinct.dedup();
            assert_eq!(distinct.len(), 8, "no window twice in a batch");
        }
    }

    #[test]
    fn resuming_from_the_consumed_count_continues_the_same_stream_at_any_world_size() {
        let straight = global_steps(2, 14, 0);
        for world in [1, 2, 4] {
            assert_eq!(
                global_steps(world, 9, 5 * 8),
                straight[5..],
                "world {world}"
            );
        }
    }

    #[test]
    fn too_little_data_and_bad_batches_are_errors() {
        assert!(
            Loader::new(0, 1, 0, 7, 8, 0)
                .unwrap_err()
                .contains("7 windows")
        );
        assert!(
            Loader::new(0, 3, 0, 70, 8, 0)
                .unwrap_err()
                .contains("world size 3")
        );
    }
}
