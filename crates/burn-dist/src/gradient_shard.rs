//! ZeRO-2's gradient shard: what the reducer keeps instead of full gradients when the optimizer
//! state is sharded.
//!
//! Each bucket is one contiguous range of the canonical flat vector ([`Layout::flat_ordered`]).
//! Its reduction is a reduce-scatter whose chunks are the bucket's intersections with the
//! ranks' shards, so every element is reduced straight to the one rank that owns it and no rank
//! ever holds another rank's reduced gradient. The owner adds its segment into its shard; with
//! gradient accumulation every micro-batch is reduced this way, so the full-size local sum is
//! never kept across micro-batches.

use crate::bucket::Layout;
use crate::flat::FlatLayout;

/// A window's reduced gradient, this rank's shard of it.
#[derive(Debug, Clone, PartialEq)]
pub struct GradientShard {
    /// The mean gradient over ranks and micro-batches of the elements of this rank's shard
    /// ([`FlatLayout::shard`]), padding included (zero).
    pub values: Vec<f32>,
    /// Per parameter (visit order): whether any rank used it in the window. A parameter no rank
    /// used has no gradient (its elements here are zero) and must not be stepped.
    pub used: Vec<bool>,
}

pub(crate) struct ShardedGradients {
    flat: FlatLayout,
    rank: usize,
    /// Per bucket: where its buffer starts in the flat vector, and each rank's element count.
    starts: Vec<usize>,
    counts: Vec<Vec<usize>>,
    /// This rank's shard of the window's sum over micro-batches of the mean over ranks.
    shard: Vec<f32>,
    /// Whether `shard` holds a finished window that the optimizer has not taken yet.
    ready: bool,
    /// The device path keeps the shard's values in device memory (`crate::device`): here only
    /// the bookkeeping, and `shard` stays empty.
    on_device: bool,
}

impl ShardedGradients {
    pub(crate) fn new(flat: FlatLayout, rank: usize, layout: &Layout, on_device: bool) -> Self {
        let starts: Vec<usize> = (0..layout.buckets.len())
            .map(|b| {
                flat.offsets
                    .get(layout.first_param(b))
                    .copied()
                    .unwrap_or(0)
            })
            .collect();
        let counts = layout
            .buckets
            .iter()
            .zip(&starts)
            .map(|(bucket, &start)| owner_counts(&flat, start..start + bucket.len))
            .collect();
        ShardedGradients {
            shard: if on_device {
                Vec::new()
            } else {
                vec![0.0; flat.shard_len]
            },
            on_device,
            flat,
            rank,
            starts,
            counts,
            ready: false,
        }
    }

    pub(crate) fn flat(&self) -> &FlatLayout {
        &self.flat
    }

    /// Every rank's element count of bucket `b`, for the reduce-scatter.
    pub(crate) fn counts(&self, b: usize) -> Vec<usize> {
        self.counts[b].clone()
    }

    /// A new accumulation window starts: forget the last one.
    pub(crate) fn begin_window(&mut self) {
        self.ready = false;
        if self.on_device {
            return;
        }
        if self.shard.len() == self.flat.shard_len {
            self.shard.fill(0.0);
        } else {
            self.shard = vec![0.0; self.flat.shard_len];
        }
    }

    /// Adds this rank's reduced segment of bucket `b` into the shard (copies it on the first
    /// micro-batch of the window, so that without accumulation the shard is bit for bit the
    /// reduction).
    pub(crate) fn add_segment(&mut self, b: usize, segment: &[f32], first_micro_batch: bool) {
        if segment.is_empty() {
            return; // the bucket lies outside this rank's shard
        }
        let start = self.segment_start(b);
        let target = &mut self.shard[start..start + segment.len()];
        if first_micro_batch {
            target.copy_from_slice(segment);
        } else {
            target.iter_mut().zip(segment).for_each(|(t, s)| *t += s);
        }
    }

    /// The window is over: the sum over `micro_batches` becomes their mean.
    /// Where bucket `b`'s segment of this rank's shard starts in the shard.
    pub(crate) fn segment_start(&self, b: usize) -> usize {
        let before: usize = self.counts[b][..self.rank].iter().sum();
        self.starts[b] + before - self.flat.shard(self.rank).start
    }

    pub(crate) fn end_window(&mut self, micro_batches: usize) {
        if micro_batches > 1 {
            let scale = 1.0 / micro_batches as f32;
            self.shard.iter_mut().for_each(|v| *v *= scale);
        }
        self.ready = true;
    }

    /// The finished window's shard, once.
    pub(crate) fn take(&mut self) -> Option<Vec<f32>> {
        std::mem::take(&mut self.ready).then(|| std::mem::take(&mut self.shard))
    }

    /// The finished window's shard, in place, before the optimizer takes it (test-only fault
    /// injection, `crate::testing`).
    pub(crate) fn finished_mut(&mut self) -> Option<&mut [f32]> {
        self.ready.then_some(self.shard.as_mut_slice())
    }

    /// Gradient elements held (the shard; empty once taken).
    pub(crate) fn held(&self) -> usize {
        self.shard.len()
    }
}

/// How many elements of the flat range `range` each rank's shard holds.
pub(crate) fn owner_counts(flat: &FlatLayout, range: std::ops::Range<usize>) -> Vec<usize> {
    (0..flat.world)
        .map(|q| flat.in_shard(range.clone(), q).len())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::BucketConfig;

    #[test]
    fn bucket_counts_split_each_bucket_at_the_shard_boundaries() {
        let numels = [5, 3, 8, 2, 7, 4];
        let config = BucketConfig::new()
            .with_first_bucket_bytes(40)
            .with_bucket_bytes(60);
        let layout = Layout::flat_ordered(&numels, &config);
        for world in 1..=4 {
            let flat = FlatLayout::new(&numels, world, 4);
            let sharded = ShardedGradients::new(flat.clone(), 0, &layout, false);
            let mut owned = vec![0; world];
            for (b, bucket) in layout.buckets.iter().enumerate() {
                let counts = sharded.counts(b);
                assert_eq!(counts.iter().sum::<usize>(), bucket.len, "bucket {b}");
                counts.iter().enumerate().for_each(|(q, n)| owned[q] += n);
            }
            // Every element of every shard (less its padding) comes from exactly one bucket.
            for (q, &n) in owned.iter().enumerate() {
                let shard = flat.shard(q);
                let real = flat.total.min(shard.end).saturating_sub(shard.start);
                assert_eq!(n, real, "world {world} rank {q}");
            }
        }
    }
}
