//! Data sharding: each rank reads a disjoint slice of the dataset, reshuffled every epoch with a
//! seed shared by all ranks, so that the global batch is the per-rank batch times the world size.
//!
//! The permutation is computed here with a fixed algorithm (Fisher–Yates over SplitMix64), not
//! with a library RNG, so the data order of a run is reproducible across crate versions and is
//! the same on every rank. Like PyTorch's `DistributedSampler`, the index list is first made
//! divisible by the world size, by repeating indices from its start (`drop_last = false`) or by
//! dropping its tail (`drop_last = true`); rank `r` then takes every world-th index from `r`.

use burn_dataset::Dataset;

/// Which indices of a dataset rank `rank` of `world` reads in an epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistributedSampler {
    pub world: usize,
    pub rank: usize,
    /// Shared by every rank; each epoch's order depends on (seed, epoch) only.
    pub seed: u64,
    pub shuffle: bool,
    pub drop_last: bool,
}

impl DistributedSampler {
    /// Shuffled every epoch, tail padded.
    pub fn new(rank: usize, world: usize, seed: u64) -> Self {
        DistributedSampler {
            world,
            rank,
            seed,
            shuffle: true,
            drop_last: false,
        }
    }

    /// Items each rank reads per epoch from a dataset of `len` items.
    pub fn per_rank(&self, len: usize) -> usize {
        if self.drop_last {
            len / self.world
        } else {
            len.div_ceil(self.world)
        }
    }

    /// This rank's indices into a dataset of `len` items for `epoch`, in reading order.
    pub fn indices(&self, len: usize, epoch: u64) -> Vec<usize> {
        self.indices_from(len, epoch, 0)
    }

    /// This rank's remaining indices for `epoch` once `consumed` items of the epoch's global
    /// order have been read, by any number of ranks: resumes the data stream exactly where a
    /// checkpoint's `samples_consumed` left it, at any world size.
    pub fn indices_from(&self, len: usize, epoch: u64, consumed: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..len).collect();
        if self.shuffle {
            shuffle(&mut order, mix(self.seed ^ mix(epoch.wrapping_add(0x5EED))));
        }
        let remaining = &order[consumed.min(len)..];
        let per_rank = self.per_rank(remaining.len());
        let padded = (0..per_rank * self.world).map(|i| remaining[i % remaining.len().max(1)]);
        padded.skip(self.rank).step_by(self.world).collect()
    }
}

/// SplitMix64 finalizer.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fisher–Yates with a SplitMix64 stream (bias of `% (i + 1)` is below 2⁻⁴⁰ for any dataset
/// that fits in memory, and it does not matter for ordering data).
fn shuffle(items: &mut [usize], seed: u64) {
    let mut state = seed;
    for i in (1..items.len()).rev() {
        state = mix(state);
        let j = (state % (i as u64 + 1)) as usize;
        items.swap(i, j);
    }
}

/// A rank's shard of a Burn dataset for one epoch (see [`DistributedSampler`]).
pub struct ShardedDataset<D> {
    inner: D,
    indices: Vec<usize>,
}

impl<D> ShardedDataset<D> {
    /// The shard of `inner` that `sampler` gives for `epoch`.
    pub fn new<I>(inner: D, sampler: &DistributedSampler, epoch: u64) -> Self
    where
        D: Dataset<I>,
    {
        ShardedDataset {
            indices: sampler.indices(inner.len(), epoch),
            inner,
        }
    }
}

impl<D: Dataset<I>, I> Dataset<I> for ShardedDataset<D> {
    fn get(&self, index: usize) -> Option<I> {
        self.indices.get(index).and_then(|&i| self.inner.get(i))
    }

    fn len(&self) -> usize {
        self.indices.len()
    }
}

#[cfg(test)]
mod tests {
    use burn_dataset::InMemDataset;

    use super::*;

    fn sampler(world: usize, rank: usize, drop_last: bool) -> DistributedSampler {
        DistributedSampler {
            drop_last,
            ..DistributedSampler::new(rank, world, 42)
        }
    }

    #[test]
    fn ranks_read_disjoint_slices_that_cover_the_dataset() {
        for world in 1..=4 {
            let mut all: Vec<usize> = (0..world)
                .flat_map(|r| sampler(world, r, false).indices(12, 3))
                .collect();
            all.sort();
            assert_eq!(all, (0..12).collect::<Vec<_>>(), "world {world}");
        }
    }

    #[test]
    fn tail_is_padded_or_dropped_the_same_way_on_every_rank() {
        let padded: Vec<_> = (0..3)
            .map(|r| sampler(3, r, false).indices(10, 0))
            .collect();
        assert!(padded.iter().all(|s| s.len() == 4));
        let dropped: Vec<_> = (0..3).map(|r| sampler(3, r, true).indices(10, 0)).collect();
        assert!(dropped.iter().all(|s| s.len() == 3));
        let mut distinct: Vec<usize> = dropped.concat();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), 9, "dropping keeps the shards disjoint");
    }

    #[test]
    fn epochs_reshuffle_reproducibly() {
        let s = sampler(2, 1, false);
        assert_eq!(s.indices(100, 5), s.indices(100, 5));
        assert_ne!(s.indices(100, 5), s.indices(100, 6));
        let unshuffled = DistributedSampler {
            shuffle: false,
            ..s
        };
        assert_eq!(
            unshuffled.indices(100, 9),
            (0..50).map(|i| 2 * i + 1).collect::<Vec<_>>()
        );
    }

    #[test]
    fn resuming_at_another_world_size_reads_exactly_the_rest_of_the_epoch() {
        // 2 ranks read 3 steps of 1 item each (6 items globally), then 3 ranks resume.
        let before: Vec<usize> = (0..3)
            .flat_map(|step| (0..2).map(move |r| sampler(2, r, true).indices(20, 4)[step]))
            .collect();
        let mut after: Vec<usize> = (0..3)
            .flat_map(|r| sampler(3, r, true).indices_from(20, 4, 6))
            .collect();
        let order: Vec<usize> = sampler(1, 0, true).indices(20, 4);
        assert_eq!(
            before,
            order[..6],
            "the first 6 items of the global order were read"
        );
        // 14 items remain; 3 ranks with the tail dropped read the next 12 of them.
        let mut rest = order[6..18].to_vec();
        after.sort();
        rest.sort();
        assert_eq!(
            after, rest,
            "the resumed ranks read the rest of the global order"
        );
    }

    #[test]
    fn sharded_dataset_reads_through_the_sampler() {
        let data = InMemDataset::new((0..10).map(|i| i * 10).collect::<Vec<usize>>());
        let s = sampler(2, 0, true);
        let shard = ShardedDataset::new(data, &s, 1);
        let expected: Vec<usize> = s.indices(10, 1).iter().map(|i| i * 10).collect();
        assert_eq!(shard.iter().collect::<Vec<_>>(), expected);
    }
}
