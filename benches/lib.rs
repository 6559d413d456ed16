//! Criterion benchmarks live beside this file; see docs/perf/.
//!
//! Shared by the `ddp_overhead` bench and the `ddp_params` binary: the world-size-1 DDP setup
//! and the check that every step really ran the full reducer. Without that check a bench or an
//! equivalence run could pass while the hooks silently did nothing.

use burn::backend::Autodiff;
use burn_dist::{BucketConfig, Ddp, DdpConfig, DistributedBackend, Layout, ReducerStats};
use burn_dist_comm::{CommConfig, HostCommunicator};
use burn_dist_models::TransformerBlock;
use burn_dist_models::step::{
    BENCH_BUCKET_BYTES, BENCH_FIRST_BUCKET_BYTES, float_params, trainable_f32_bytes,
};
use burn_flex::Flex;

/// The decorated backend: in this workspace burn-dist turns Burn's `distributed` feature on,
/// so plain `Autodiff<Flex>` does not compile here (its reference lives in `plain/`).
pub type DdpFlex = Autodiff<DistributedBackend<Flex>>;

pub fn bench_buckets() -> BucketConfig {
    BucketConfig::new()
        .with_first_bucket_bytes(BENCH_FIRST_BUCKET_BYTES)
        .with_bucket_bytes(BENCH_BUCKET_BYTES)
}

/// A one-rank in-process group whose reducer serves the calling thread.
pub fn world_size_1() -> Ddp {
    let comm = HostCommunicator::local_group(1, &CommConfig::default()).remove(0);
    Ddp::for_thread(comm, DdpConfig::new().with_buckets(bench_buckets()))
}

/// The bench model prepared on a one-rank group, with the check of the reducer's work: what
/// both the bench and the parameter-writing binary start from.
pub fn prepared_world_size_1() -> (Ddp, TransformerBlock<DdpFlex>, ReducerCheck) {
    let mut ddp = world_size_1();
    let model = ddp
        .prepare(burn_dist_models::step::BENCH.model::<DdpFlex>(&burn_flex::FlexDevice))
        .expect("prepare");
    let check = ReducerCheck::new(&ddp, &model);
    (ddp, model, check)
}

/// Asserts, step by step, the reducer's work: per step one all-reduce per bucket plus the usage
/// bitmap (the first step also the ready-order broadcast), every trainable f32 byte copied once,
/// one backward. Panics otherwise. The expected counts come from the model and the bucket
/// config, not from the reducer's own view, except the rebuilt layout's bucket count (it
/// depends on the observed ready order).
pub struct ReducerCheck {
    last: ReducerStats,
    /// Buckets of the layout the next step uses.
    buckets: u64,
    /// Buckets of the initial layout (reverse visit order), used by the first step.
    pub initial_buckets: u64,
    /// 4 × trainable elements.
    pub bytes_per_step: u64,
    pub steps: u64,
}

impl ReducerCheck {
    /// Call right after `Ddp::prepare`, before the first step.
    pub fn new(ddp: &Ddp, model: &TransformerBlock<DdpFlex>) -> Self {
        let numels: Vec<usize> = float_params::<DdpFlex, _>(model)
            .iter()
            .map(Vec::len)
            .collect();
        let bytes_per_step = trainable_f32_bytes::<DdpFlex, _>(model);
        assert_eq!(
            bytes_per_step,
            4 * numels.iter().sum::<usize>() as u64,
            "every float parameter of the transformer is trainable"
        );
        let initial = Layout::initial(&numels, &bench_buckets());
        assert_eq!(ddp.layout(), initial, "the reducer's initial layout");
        assert_eq!(ddp.stats(), ReducerStats::default(), "no step yet");
        ReducerCheck {
            last: ReducerStats::default(),
            buckets: initial.buckets.len() as u64,
            initial_buckets: initial.buckets.len() as u64,
            bytes_per_step,
            steps: 0,
        }
    }

    /// Buckets of the layout in use (after the first step, the rebuilt one).
    pub fn buckets(&self) -> u64 {
        self.buckets
    }

    /// Call after every step.
    pub fn after_step(&mut self, ddp: &Ddp) {
        let now = ddp.stats();
        let first = self.steps == 0;
        let step = self.steps + 1;
        let expected = ReducerStats {
            collectives: self.last.collectives + self.buckets + 1 + u64::from(first),
            bytes_copied: self.last.bytes_copied + self.bytes_per_step,
            backwards: self.last.backwards + 1,
            layout_rebuilds: 1,
            // Every bucket is all-reduced: each rank receives every gradient element.
            reduced_elements_received: self.last.reduced_elements_received
                + self.bytes_per_step / 4,
            // The host path never copies a gradient privately (those are the NCCL path's).
            private_copies: 0,
            pitched_copies: 0,
            device_launches: 0,
            device_calls: 0,
            // Each f32 gradient is read to the host and its mean written back.
            bytes_to_host: self.last.bytes_to_host + self.bytes_per_step,
            bytes_to_device: self.last.bytes_to_device + self.bytes_per_step,
            // No gradient shard on a replicated run.
            shard_reads: 0,
            shard_reads_in_backward: 0,
            shard_wait_nanos: 0,
        };
        assert_eq!(
            now, expected,
            "step {step}: reducer counters (with {} buckets)",
            self.buckets
        );
        if first {
            self.buckets = ddp.next_layout().buckets.len() as u64;
            assert!(
                self.buckets >= 3,
                "the bench model should span at least 3 buckets, got {}",
                self.buckets
            );
        }
        self.last = now;
        self.steps = step;
    }
}
