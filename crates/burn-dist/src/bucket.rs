//! Bucket layout: a pure function from parameter sizes and an expected ready order to buckets.
//!
//! Gradients are copied into flat per-bucket buffers and each bucket is reduced as soon as its
//! last gradient arrives, so buckets should fill in the order backward produces gradients. Before
//! the first step that order is unknown and reverse visit order is the guess (backward visits
//! layers last to first); after it, rank 0's observed order is broadcast and every rank rebuilds
//! the same layout from it. The first bucket is small (1 MiB by default) so that communication
//! starts early; the others are large (25 MiB) so that per-collective overhead stays small, as in
//! PyTorch DDP.

use burn::config::Config;

/// Bucket sizes, in bytes of the f32 gradient buffer.
#[derive(Config, Debug, PartialEq)]
pub struct BucketConfig {
    /// Cap of the first bucket: small, so that the first reduction starts early in backward.
    #[config(default = 1048576)]
    pub first_bucket_bytes: usize,
    /// Cap of every other bucket.
    #[config(default = 26214400)]
    pub bucket_bytes: usize,
    /// Under ZeRO stages 2 and 3, the most bytes of buckets launched and not yet reduced
    /// (counted in f32): past it, the backward waits for the oldest reductions before it goes
    /// on, and their gradients go (host buffers; on the device path, the local gradients). When
    /// the reductions are slower than the backward (ranks sharing few cores, a slow network),
    /// the buckets would otherwise pile up to the size of the whole gradient; reductions that
    /// are over are taken in at every gradient's arrival either way, without waiting. `None`:
    /// no bound, which is the default at stage 2; `Ddp::prepare_sharded` (stage 3) sets 2 ×
    /// `bucket_bytes` when it is `None`, as DeepSpeed keeps two reduce buffers. In-process
    /// ranks (`Ddp::for_thread`) accumulating gradients at stage 2 should leave it unset: a
    /// wait inside backward can meet Burn's graph cleanup on another rank's thread, which
    /// locks every graph of the process (stage 3's first gather of each forward keeps its
    /// ranks in step, so its bound is safe).
    #[config(default = "None")]
    pub max_in_flight_bytes: Option<usize>,
}

/// Bytes per element of the gradient buffers (f32).
pub const GRAD_ELEM_BYTES: usize = 4;

/// One bucket: parameters (indices in module visit order) laid out back to back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    /// Parameters in the order they are expected to become ready.
    pub params: Vec<usize>,
    /// Element offset of each of `params` in the bucket buffer.
    pub offsets: Vec<usize>,
    /// Total elements.
    pub len: usize,
}

/// Where every parameter's gradient lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub buckets: Vec<Bucket>,
    /// For parameter `i` (visit order): (bucket, element offset in it).
    pub slot: Vec<(usize, usize)>,
}

impl Layout {
    /// Lays out parameters of `numels` (visit order) in `order` (a permutation of
    /// `0..numels.len()`, the expected ready order), closing a bucket once it reaches its cap.
    /// A parameter larger than a cap gets a bucket of its own.
    pub fn build(numels: &[usize], order: &[usize], config: &BucketConfig) -> Layout {
        debug_assert!(
            is_permutation(order, numels.len()),
            "order must be a permutation"
        );
        let mut buckets = Vec::new();
        let mut slot = vec![(0, 0); numels.len()];
        let mut current = Bucket {
            params: Vec::new(),
            offsets: Vec::new(),
            len: 0,
        };
        for &param in order {
            slot[param] = (buckets.len(), current.len);
            current.params.push(param);
            current.offsets.push(current.len);
            current.len += numels[param];
            let cap = if buckets.is_empty() {
                config.first_bucket_bytes
            } else {
                config.bucket_bytes
            };
            if current.len * GRAD_ELEM_BYTES >= cap {
                buckets.push(std::mem::replace(
                    &mut current,
                    Bucket {
                        params: Vec::new(),
                        offsets: Vec::new(),
                        len: 0,
                    },
                ));
            }
        }
        if !current.params.is_empty() {
            buckets.push(current);
        }
        Layout { buckets, slot }
    }

    /// The layout used before any order has been observed: reverse visit order.
    pub fn initial(numels: &[usize], config: &BucketConfig) -> Layout {
        let order: Vec<usize> = (0..numels.len()).rev().collect();
        Layout::build(numels, &order, config)
    }

    /// ZeRO-2's layout, frozen for the whole run: the buckets of [`Layout::initial`] (runs of
    /// consecutive parameters, last layer first), each laid out in visit order, so that a
    /// bucket's buffer is one contiguous range of the canonical flat vector and can be
    /// reduce-scattered straight to the shards' owners.
    pub fn flat_ordered(numels: &[usize], config: &BucketConfig) -> Layout {
        let mut layout = Layout::initial(numels, config);
        for (b, bucket) in layout.buckets.iter_mut().enumerate() {
            let lowest = bucket.params.iter().copied().min().unwrap_or(0);
            for (&p, offset) in bucket.params.iter().zip(&mut bucket.offsets) {
                *offset = numels[lowest..p].iter().sum();
                layout.slot[p] = (b, *offset);
            }
        }
        layout
    }

    /// Each bucket's parameters, in ready order (what a checkpoint records).
    pub fn bucket_params(&self) -> Vec<Vec<usize>> {
        self.buckets.iter().map(|b| b.params.clone()).collect()
    }

    /// The lowest parameter (visit order) of bucket `b`: its buffer starts where that
    /// parameter starts in a [`Layout::flat_ordered`] layout.
    pub fn first_param(&self, b: usize) -> usize {
        self.buckets[b].params.iter().copied().min().unwrap_or(0)
    }
}

/// Completes an observed ready order into a full order: the observed parameters first, then
/// the ones that never arrived, in reverse visit order.
pub fn complete_order(observed: &[usize], params: usize) -> Vec<usize> {
    let mut seen = vec![false; params];
    let mut order = Vec::with_capacity(params);
    for &p in observed {
        if p < params && !seen[p] {
            seen[p] = true;
            order.push(p);
        }
    }
    order.extend((0..params).rev().filter(|&p| !seen[p]));
    order
}

/// Whether `order` lists each of `0..n` exactly once.
pub(crate) fn is_permutation(order: &[usize], n: usize) -> bool {
    let mut seen = vec![false; n];
    order.len() == n
        && order
            .iter()
            .all(|&p| p < n && !std::mem::replace(&mut seen[p], true))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(first: usize, rest: usize) -> BucketConfig {
        BucketConfig::new()
            .with_first_bucket_bytes(first)
            .with_bucket_bytes(rest)
    }

    #[test]
    fn every_parameter_has_one_slot_inside_its_bucket() {
        let numels = [10, 300, 7, 64, 64, 1, 500, 3];
        let layout = Layout::initial(&numels, &config(100, 1000));
        let mut count = 0;
        for (b, bucket) in layout.buckets.iter().enumerate() {
            assert_eq!(
                bucket.len,
                bucket.params.iter().map(|&p| numels[p]).sum::<usize>()
            );
            for (&p, &offset) in bucket.params.iter().zip(&bucket.offsets) {
                assert_eq!(layout.slot[p], (b, offset));
                count += 1;
            }
        }
        assert_eq!(count, numels.len());
    }

    #[test]
    fn first_bucket_is_small_and_the_rest_large() {
        // 4-byte elements: first cap 40 bytes = 10 elements, then 400 bytes = 100 elements.
        let numels = [5; 40];
        let layout = Layout::initial(&numels, &config(40, 400));
        let lens: Vec<usize> = layout.buckets.iter().map(|b| b.len).collect();
        assert_eq!(lens, [10, 100, 90]);
        // Reverse visit order: the last parameter is in the first bucket.
        assert_eq!(layout.buckets[0].params, [39, 38]);
    }

    #[test]
    fn oversized_parameter_gets_its_own_bucket() {
        let layout = Layout::build(&[1, 1000, 1], &[0, 1, 2], &config(8, 8));
        let params: Vec<_> = layout.buckets.iter().map(|b| b.params.clone()).collect();
        assert_eq!(params, [vec![0, 1], vec![2]]);
    }

    #[test]
    fn flat_ordered_buckets_are_contiguous_flat_ranges() {
        let numels = [5, 3, 8, 2, 7, 4];
        let layout = Layout::flat_ordered(&numels, &config(40, 60));
        let starts: Vec<usize> = (0..numels.len())
            .map(|p| numels[..p].iter().sum())
            .collect();
        // Same buckets as the initial layout, last layer first.
        let initial = Layout::initial(&numels, &config(40, 60));
        for (b, (bucket, guess)) in layout.buckets.iter().zip(&initial.buckets).enumerate() {
            assert_eq!(bucket.params, guess.params);
            assert_eq!(bucket.len, guess.len);
            let base = starts[layout.first_param(b)];
            for (&p, &offset) in bucket.params.iter().zip(&bucket.offsets) {
                assert_eq!(base + offset, starts[p], "parameter {p}");
                assert_eq!(layout.slot[p], (b, offset));
            }
        }
    }

    #[test]
    fn observed_order_is_completed_with_missing_parameters() {
        assert_eq!(complete_order(&[2, 0], 4), [2, 0, 3, 1]);
        assert_eq!(complete_order(&[], 3), [2, 1, 0]);
        assert_eq!(complete_order(&[1, 1, 9], 2), [1, 0]);
    }

    #[test]
    fn same_inputs_same_layout() {
        let numels = [3, 9, 27, 81];
        let order = complete_order(&[1, 3], 4);
        assert_eq!(
            Layout::build(&numels, &order, &config(16, 64)),
            Layout::build(&numels, &order, &config(16, 64))
        );
    }
}
