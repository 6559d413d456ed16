//! A training data loader that gives each rank its shard of the data, in a new order every
//! epoch, under burn-train's Learner.
//!
//! Why: the Learner builds its data loader once and calls `iter()` at the start of each epoch.
//! A loader built over one epoch's shard reads that order every epoch, and a loader's own
//! shuffle would permute each rank's shard on its own, so that the global batches would no
//! longer be those of one process reading `world ×` the batch. [`EpochLoader`] counts the
//! `iter()` calls, as PyTorch's `DistributedSampler.set_epoch` would be called, and each epoch
//! reads [`DistributedSampler::indices`] for that epoch.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder, DataLoaderIterator};
use burn::data::dataset::Dataset;
use burn::tensor::backend::Backend;

use crate::DistributedSampler;

/// Each rank's shard of a dataset, for the epoch that the loader is reading.
struct EpochShard<D> {
    inner: D,
    sampler: DistributedSampler,
    epoch: Arc<AtomicU64>,
    /// The indices of the epoch last read, computed once per epoch.
    order: RwLock<(u64, Arc<Vec<usize>>)>,
}

impl<D> EpochShard<D> {
    fn indices<I>(&self) -> Arc<Vec<usize>>
    where
        D: Dataset<I>,
    {
        let epoch = self.epoch.load(Ordering::Acquire);
        {
            let order = self.order.read().unwrap_or_else(|e| e.into_inner());
            if order.0 == epoch {
                return order.1.clone();
            }
        }
        let indices = Arc::new(self.sampler.indices(self.inner.len(), epoch));
        *self.order.write().unwrap_or_else(|e| e.into_inner()) = (epoch, indices.clone());
        indices
    }
}

impl<D: Dataset<I>, I> Dataset<I> for EpochShard<D> {
    fn get(&self, index: usize) -> Option<I> {
        let indices = self.indices();
        indices.get(index).and_then(|&i| self.inner.get(i))
    }

    fn len(&self) -> usize {
        // The same in every epoch.
        self.sampler.per_rank(self.inner.len())
    }
}

/// A data loader over this rank's shard of a dataset ([`DistributedSampler`]), reshuffled
/// every epoch with the seed that every rank shares: the `k`-th `iter()` (counted from 0, or
/// from [`EpochLoader::resume_after`]) reads epoch `k`'s order. Batches are made in order
/// (the shuffle is the sampler's), by Burn's own loader.
pub struct EpochLoader<B: Backend, O> {
    inner: Arc<dyn DataLoader<B, O>>,
    /// The epoch the shard reads, set by `iter()`.
    reading: Arc<AtomicU64>,
    /// The epoch the next `iter()` reads.
    next: Arc<AtomicU64>,
}

impl<B: Backend, O: Send + Clone + std::fmt::Debug + 'static> EpochLoader<B, O> {
    /// This rank's shard of `dataset` in batches of `batch_size` items made by `batcher`.
    pub fn new<I, D, Bt>(
        dataset: D,
        sampler: DistributedSampler,
        batcher: Bt,
        batch_size: usize,
    ) -> Self
    where
        I: Send + Sync + Clone + std::fmt::Debug + 'static,
        D: Dataset<I> + 'static,
        Bt: Batcher<B, I, O> + 'static,
    {
        let reading = Arc::new(AtomicU64::new(0));
        let shard = EpochShard {
            order: RwLock::new((0, Arc::new(sampler.indices(dataset.len(), 0)))),
            inner: dataset,
            sampler,
            epoch: reading.clone(),
        };
        EpochLoader {
            inner: DataLoaderBuilder::new(batcher)
                .batch_size(batch_size)
                .build(shard),
            reading,
            next: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Continues a run resumed from the checkpoint of burn-train's epoch `epoch` (counted from
    /// 1, as `SupervisedTraining::checkpoint` takes it): the next `iter()` reads the order of
    /// the epoch after it, as the uninterrupted run did.
    pub fn resume_after(self, epoch: usize) -> Self {
        self.next.store(epoch as u64, Ordering::Release);
        self
    }

    /// The loader as burn-train takes it.
    pub fn into_arc(self) -> Arc<dyn DataLoader<B, O>> {
        Arc::new(self)
    }
}

impl<B: Backend, O: Send + 'static> EpochLoader<B, O> {
    fn sharing_epochs(&self, inner: Arc<dyn DataLoader<B, O>>) -> Arc<dyn DataLoader<B, O>> {
        Arc::new(EpochLoader {
            inner,
            reading: self.reading.clone(),
            next: self.next.clone(),
        })
    }
}

impl<B: Backend, O: Send + 'static> DataLoader<B, O> for EpochLoader<B, O> {
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<O> + 'a> {
        let epoch = self.next.fetch_add(1, Ordering::AcqRel);
        self.reading.store(epoch, Ordering::Release);
        self.inner.iter()
    }

    fn num_items(&self) -> usize {
        self.inner.num_items()
    }

    /// The same loader on `device`; it keeps counting the epochs of this one.
    fn to_device(&self, device: &B::Device) -> Arc<dyn DataLoader<B, O>> {
        self.sharing_epochs(self.inner.to_device(device))
    }

    fn slice(&self, start: usize, end: usize) -> Arc<dyn DataLoader<B, O>> {
        self.sharing_epochs(self.inner.slice(start, end))
    }
}

#[cfg(test)]
mod tests {
    use burn::data::dataset::InMemDataset;
    use burn_flex::{Flex, FlexDevice};

    use super::*;

    /// Batches of dataset items as they are: the test reads the order back.
    #[derive(Clone)]
    struct Items;

    impl Batcher<Flex, usize, Vec<usize>> for Items {
        fn batch(&self, items: Vec<usize>, _device: &FlexDevice) -> Vec<usize> {
            items
        }
    }

    fn loader(rank: usize, world: usize) -> EpochLoader<Flex, Vec<usize>> {
        let dataset = InMemDataset::new((100..112).collect::<Vec<usize>>());
        EpochLoader::new(dataset, DistributedSampler::new(rank, world, 9), Items, 2)
    }

    fn epoch(loader: &dyn DataLoader<Flex, Vec<usize>>) -> Vec<usize> {
        loader.iter().flatten().collect()
    }

    #[test]
    fn each_epoch_reads_the_samplers_order_for_that_epoch() {
        for (rank, world) in [(0, 1), (1, 2), (2, 3)] {
            // As burn-train uses it: moved to the device once, iterated once per epoch.
            let on_device = loader(rank, world).into_arc().to_device(&FlexDevice);
            let sampler = DistributedSampler::new(rank, world, 9);
            for e in 0..3 {
                let expected: Vec<usize> = sampler.indices(12, e).iter().map(|i| 100 + i).collect();
                assert_eq!(
                    epoch(&*on_device),
                    expected,
                    "rank {rank}/{world}, epoch {e}"
                );
            }
        }
        let single = loader(0, 1);
        assert_ne!(epoch(&single), epoch(&single), "a new order every epoch");
    }

    #[test]
    fn a_resumed_loader_continues_with_the_next_epochs_order() {
        let uninterrupted = loader(1, 2);
        let orders: Vec<Vec<usize>> = (0..3).map(|_| epoch(&uninterrupted)).collect();
        let resumed = loader(1, 2).resume_after(2);
        assert_eq!(epoch(&resumed), orders[2]);
    }
}
