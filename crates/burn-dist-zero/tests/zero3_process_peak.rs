//! The process's memory, counted by the allocator itself: on a model whose parameters
//! dominate, 4 ranks (threads of this process) preparing and training at ZeRO stage 3 reach
//! less than half the peak that the same job reaches at stage 2.
//!
//! Its own test binary, because it installs a counting global allocator. The allocator's bytes,
//! not gpt-pretrain's per-rank PSS: the ranks here are threads of one process over in-process
//! channels (no shared buffers), and a per-process figure cannot tell them apart.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::backend::Autodiff;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::Tensor;
use burn_dist::{
    BucketConfig, Ddp, DdpConfig, DistributedAutodiff, DistributedBackend, PrefetchConfig, Sharded,
};
use burn_dist_comm::testing::run_ranks;
use burn_dist_comm::{CommConfig, HostCommunicator};
use burn_dist_testing::{shard_rows, synthetic_rows};
use burn_dist_zero::ZeroAdamConfig;
use burn_flex::{Flex, FlexDevice};

/// Bytes allocated right now, and the most at any time since the last [`reset_peak`].
struct Counting;

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(bytes: usize) {
    let now = CURRENT.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is passed to the system allocator unchanged; only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            grew(layout.size());
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            grew(layout.size());
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let grown = unsafe { System.realloc(ptr, layout, new_size) };
        if !grown.is_null() {
            CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
            grew(new_size);
        }
        grown
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// One run at a time: the counters are the process's.
static SERIAL: Mutex<()> = Mutex::new(());

/// Twelve square layers and a batch of one row per rank: the parameters (1.8 M, 7 MiB in f32)
/// dwarf the activations, and no layer is more than a twelfth of them (the terms that do not
/// shrink with the ranks, a gathered layer and its gradient, stay small, as in a real model).
const SIZES: [usize; 13] = [384; 13];
const WORLD: usize = 4;
const STEPS: usize = 3;

#[derive(Module, Debug)]
struct Wide<B: burn::tensor::backend::Backend> {
    layers: Vec<Linear<B>>,
}

impl<B: burn::tensor::backend::Backend> Wide<B> {
    /// Built the way Burn builds modules: lazily, each parameter initialized on first use.
    fn new(device: &B::Device) -> Self {
        let layers = SIZES
            .windows(2)
            .map(|w| LinearConfig::new(w[0], w[1]).init(device))
            .collect();
        Wide { layers }
    }

    fn forward(&self, mut x: Tensor<B, 2>) -> Tensor<B, 2> {
        for layer in &self.layers {
            x = layer.forward(x);
        }
        x
    }
}

/// The allocator's peak above what was allocated before, over building, preparing and
/// training the model on every rank with ZeroAdam at `stage`.
fn peak_of<B: DistributedAutodiff<Device = FlexDevice>>(stage: u8) -> usize {
    let _one_run = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let comms = HostCommunicator::local_group(WORLD, &CommConfig::default());
    let before = CURRENT.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    run_ranks(comms, |rank, comm| {
        // Buckets of a fraction of the model, as 25 MiB buckets are of a large one, and stage
        // 3's gathers ahead scaled alike (a unit of at most a bucket, as by default): with the
        // default 25 MiB one unit would be the whole model.
        let buckets = BucketConfig::new()
            .with_first_bucket_bytes(64 << 10)
            .with_bucket_bytes(256 << 10);
        let prefetch = PrefetchConfig::new().with_unit_bytes(256 << 10);
        let config = DdpConfig::new()
            .with_buckets(buckets)
            .with_prefetch(prefetch);
        let mut ddp = Ddp::for_thread(comm, config);
        let mut model = B::prepare_model(&mut ddp, Wide::<B>::new(&FlexDevice)).unwrap();
        let mut zero = ZeroAdamConfig::new()
            .with_stage(stage)
            .init::<B, _>(&ddp, &model)
            .unwrap();
        let (first, last) = (SIZES[0], SIZES[SIZES.len() - 1]);
        for step in 0..STEPS {
            let rows = shard_rows(WORLD, rank, WORLD);
            let x = synthetic_rows::<B, 2>(0, step, [WORLD, first], rows.clone(), &FlexDevice);
            let y = synthetic_rows::<B, 2>(1, step, [WORLD, last], rows, &FlexDevice);
            let loss = (model.forward(x) - y).powi_scalar(2).mean();
            let grads = ddp.backward(loss, &model).unwrap().unwrap();
            model = zero.step(1e-3, model, grads, &ddp).unwrap().0;
        }
    });
    PEAK.load(Ordering::Relaxed) - before
}

#[test]
fn stage_three_peaks_under_half_of_stage_two_on_a_model_of_parameters() {
    let params: usize = SIZES.windows(2).map(|w| w[0] * w[1] + w[1]).sum();
    let two = peak_of::<Autodiff<DistributedBackend<Flex>>>(2);
    let three = peak_of::<Autodiff<DistributedBackend<Flex, Sharded>>>(3);
    let per_param = |bytes: usize| bytes as f64 / (WORLD * params) as f64;
    println!(
        "process peak over {WORLD} ranks, {params} parameters: stage 2 {two} B ({:.2} B per \
         parameter per rank), stage 3 {three} B ({:.2}), ratio {:.3}",
        per_param(two),
        per_param(three),
        three as f64 / two as f64
    );
    assert!(
        2 * three < two,
        "stage 3's peak {three} B is not under half of stage 2's {two} B"
    );
}
