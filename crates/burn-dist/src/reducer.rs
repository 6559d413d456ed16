//! The reducer: a small state machine fed by the backward hooks. It knows buffers, buckets and
//! the communicator, not tensors or modules (the hooks in `sync.rs` convert).
//!
//! Per backward: `start` (the parameters in this rank's graph), `gradient` for each final
//! gradient, `finish`. Gradients are copied into their bucket's flat f32 buffer; a bucket is
//! all-reduced (average over ranks) as soon as its last expected gradient arrives, while backward
//! goes on. Buckets are launched strictly in layout order, so every rank issues the same
//! collectives in the same order whatever order its gradients arrive in.
//!
//! Gradient accumulation: with a window of K micro-batches the buffers accumulate the local sum
//! over the window and only the K-th backward communicates; the result is the mean over ranks
//! and micro-batches (the gradient of one step on the K × world × batch global batch).
//!
//! ZeRO-2 ([`Reducer::shard_gradients`]): the layout is frozen to contiguous ranges of the flat
//! parameter vector, each bucket is reduce-scattered to the owners of its elements, every
//! micro-batch communicates, and the rank keeps only its shard of the gradient
//! ([`crate::gradient_shard`]).
//!
//! Parameters unused on this rank contribute zeros; a usage bitmap (max all-reduce, issued at
//! the start of the communicating backward) tells every rank which parameters were used on none,
//! and those get no gradient anywhere.
//!
//! Where the gradients wait and how a bucket is reduced is the one part that differs between
//! the host path (flat f32 host buffers, host communicator) and the device path (the
//! gradients' own device memory, reduced in place by NCCL or staged through the host; feature
//! `device`, `crate::device`): `Store`. The state
//! machine around it is the same for both. Small control collectives (the usage bitmap, rank
//! 0's ready order) always go through the host communicator of the same group.

use std::collections::HashMap;
use std::sync::Arc;

use burn::tensor::backend::distributed::DistributedParamId;
use burn_dist_comm::{Communicator, HostBuffer, HostCommunicator, Pending, ReduceOp};

use crate::bucket::{BucketConfig, GRAD_ELEM_BYTES, Layout, complete_order};
use crate::error::DistError;
use crate::flat::FlatLayout;
use crate::gradient_shard::{GradientShard, ShardedGradients};
use crate::random::RandomStream;

/// Counters for tests and benches.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReducerStats {
    /// Collectives issued by the reducer (buckets, usage bitmaps, order broadcasts).
    pub collectives: u64,
    /// Gradient bytes copied into bucket buffers.
    pub bytes_copied: u64,
    /// Backward passes seen.
    pub backwards: u64,
    /// Times the layout was rebuilt from an observed ready order.
    pub layout_rebuilds: u64,
    /// Reduced gradient elements that came back to this rank from its bucket reductions: a
    /// whole bucket after an all-reduce, only this rank's own segment of it after ZeRO-2's
    /// reduce-scatter (which is how a test sees that no rank receives another's shard).
    pub reduced_elements_received: u64,
    /// Device path: gradients copied before their in-place reduction, because their memory
    /// was shared, they were a strided view, or cubecl-cuda had padded their rows.
    pub private_copies: u64,
    /// Device path: of `private_copies`, those of private gradients whose only fault was
    /// padded rows (cubecl-cuda pads rows that are not a multiple of 512 bytes, nor a power of
    /// two below that: `burn_dist::cuda_pads_rows` says which shapes).
    pub pitched_copies: u64,
    /// Device path: launches of ready buckets (each waits for the compute stream once); 0 on the
    /// host path.
    pub device_launches: u64,
    /// Device path: collectives issued on device memory, each one NCCL group (one host sync)
    /// or one staged host collective: per bucket one per dtype, at ZeRO-2 too (a bucket's
    /// pieces are one grouped reduce-scatter). ZeroAdam's device all-gather counts here as
    /// well (one counter); 0 on the host path.
    pub device_calls: u64,
    /// Bytes the reducer moved from the backend's memory to the host: on the host path every
    /// gradient it read; on the device path what its collectives staged through the host
    /// (nothing with NCCL) and the rare gradient read for `Ddp::backward`.
    pub bytes_to_host: u64,
    /// Bytes the reducer moved from the host into the backend's memory (the written-back
    /// gradients on the host path; the staged results on the device path).
    pub bytes_to_device: u64,
    /// ZeRO-2 on the device path, streamed to the host (`Ddp::stream_gradient_shard_to_host`):
    /// reads issued of a bucket's range of the gradient shard.
    pub shard_reads: u64,
    /// Of `shard_reads`, those issued while some gradient of the backward was still to come:
    /// the reads that overlap the rest of backward.
    pub shard_reads_in_backward: u64,
    /// ZeRO-2 on the device path: time taking the gradient shard to the host
    /// (`Ddp::take_gradient_shard`) waited for its values, since the start, in nanoseconds:
    /// the streamed reads not over yet, or the whole read when not streamed. What an
    /// offloaded optimizer step waits for the device before its host step can start.
    pub shard_wait_nanos: u64,
}

/// What the reducer tells a test observer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReducerEvent {
    /// The gradient of parameter `param` (visit order) arrived; `last` when it is the last one
    /// this rank expects in this backward.
    Gradient { param: usize, last: bool },
}

type Observer = Box<dyn FnMut(&mut Reducer, ReducerEvent) + Send>;

/// Where the bucket gradients of the window wait, and how a bucket is reduced: the part that
/// differs between the host and the device path. Copy-in ([`Reducer::receive`]), launch
/// ([`Reducer::launch_ready`]) and wait ([`Reducer::wait_bucket`]) each match on it once.
enum Store {
    /// Per bucket: the window's local sum in a flat f32 host buffer, then (after `finish`) the
    /// reduced mean; reduced by the host communicator. Under ZeRO-2 a backward's local
    /// gradients only, allocated when needed and handed to the reduction.
    Host(Vec<Vec<f32>>),
    /// Per parameter: its gradient tensor in device memory, reduced in place by the device
    /// collectives (NCCL, or staged through the host).
    #[cfg(feature = "device")]
    Device(Box<dyn crate::device::DeviceBuckets>),
}

impl Store {
    /// The host buffers, on the host path.
    fn host(&self) -> Option<&[Vec<f32>]> {
        match self {
            Store::Host(buffers) => Some(buffers),
            #[cfg(feature = "device")]
            Store::Device(_) => None,
        }
    }
}

/// A launched bucket's reduction.
enum InFlight {
    Host(Pending<HostBuffer>),
    #[cfg(feature = "device")]
    Device(Vec<burn_dist_device::DevicePending>),
}

impl InFlight {
    /// Whether the reduction is over on every rank, so that taking it in waits for no peer.
    fn is_done(&mut self) -> bool {
        match self {
            InFlight::Host(pending) => pending.is_done(),
            #[cfg(feature = "device")]
            InFlight::Device(pending) => pending.iter_mut().all(|p| p.is_done()),
        }
    }
}

/// A final gradient as the hook hands it over.
pub(crate) enum Incoming<'a> {
    /// Read to the host and flattened to f32 (host path).
    Host(&'a [f32]),
    /// A gradient in device memory (device path), left where it is in Burn's container (the
    /// `target` of [`Reducer::receive`]); `numel` elements.
    #[cfg(feature = "device")]
    Device { numel: usize },
}

impl Incoming<'_> {
    fn len(&self) -> usize {
        match self {
            Incoming::Host(values) => values.len(),
            #[cfg(feature = "device")]
            Incoming::Device { numel } => *numel,
        }
    }
}

/// State of the backward in progress.
struct Step {
    /// Whether the buckets are reduced in this backward (the window's last micro-batch, or
    /// every micro-batch under ZeRO-2).
    reduce: bool,
    /// Whether this backward ends the accumulation window.
    window_end: bool,
    expected: Vec<bool>,
    arrived: Vec<bool>,
    /// Expected gradients still missing, per bucket.
    remaining: Vec<usize>,
    /// Buckets launched so far (always a prefix of the layout).
    launched: usize,
    pending: Vec<Option<InFlight>>,
    usage: Option<Pending<HostBuffer>>,
    ready_order: Vec<usize>,
    /// Where each arrived gradient lives in Burn's container (an erased `*mut FloatTensor`).
    targets: Vec<Option<usize>>,
}

/// What a communicating backward leaves behind for write-back.
pub(crate) struct Finished {
    /// (parameter, erased pointer to its gradient in Burn's container); none under ZeRO-2
    /// and 3, whose reductions live in the owners' shards.
    pub targets: Vec<(usize, usize)>,
}

pub struct Reducer {
    comm: Arc<HostCommunicator>,
    config: BucketConfig,
    numels: Vec<usize>,
    index_of: HashMap<DistributedParamId, usize>,
    layout: Layout,
    /// A layout rebuilt from rank 0's ready order, swapped in when the next window starts.
    next_layout: Option<Layout>,
    rebuilt: bool,
    accumulation: usize,
    micro_batch: usize,
    /// The bucket gradients: host buffers or device tensors.
    store: Store,
    /// ZeRO-2's gradient shard, when the optimizer state is sharded.
    sharded: Option<ShardedGradients>,
    /// ZeRO-2 on the device path: read each bucket's pieces of the shard to the host as soon
    /// as they are final (`Reducer::stream_gradient_shard`), from the next window on.
    stream_shard: bool,
    written: Vec<bool>,
    /// Which parameters produced a gradient in the last finished backward.
    arrived_last: Vec<bool>,
    used_in_window: Vec<bool>,
    /// After a communicating backward: which parameters some rank used.
    used_anywhere: Option<Vec<bool>>,
    step: Option<Step>,
    stats: ReducerStats,
    observer: Option<Observer>,
    /// Set by `Ddp::backward`: hook errors are kept for it instead of panicking.
    pub(crate) caller_collects_errors: bool,
    /// The first error a hook met in the current backward.
    pub(crate) hook_error: Option<DistError>,
    /// The rank's random stream (it lives here because this is the per-rank context).
    pub(crate) random: RandomStream,
    /// Stage 3's sharded parameters, told when a backward ends (their gather schedule does
    /// not run ahead across it); here for the same reason as `random`.
    pub(crate) param_shards: Option<Arc<crate::sharding::ParamShards>>,
}

impl Reducer {
    pub(crate) fn new(
        comm: Arc<HostCommunicator>,
        config: BucketConfig,
        accumulation: usize,
    ) -> Self {
        Reducer {
            config,
            numels: Vec::new(),
            index_of: HashMap::new(),
            layout: Layout {
                buckets: Vec::new(),
                slot: Vec::new(),
            },
            next_layout: None,
            rebuilt: false,
            accumulation: accumulation.max(1),
            micro_batch: 0,
            store: Store::Host(Vec::new()),
            sharded: None,
            stream_shard: false,
            written: Vec::new(),
            arrived_last: Vec::new(),
            used_in_window: Vec::new(),
            used_anywhere: None,
            step: None,
            stats: ReducerStats::default(),
            observer: None,
            caller_collects_errors: false,
            hook_error: None,
            param_shards: None,
            random: RandomStream::new(0, comm.rank()),
            comm,
        }
    }

    /// Registers the parameters to synchronize: their ids and element counts, in module visit
    /// order. Resets the layout to the initial guess.
    pub(crate) fn register(&mut self, params: &[(DistributedParamId, usize)]) {
        self.numels = params.iter().map(|&(_, n)| n).collect();
        self.index_of = params
            .iter()
            .enumerate()
            .map(|(i, &(id, _))| (id, i))
            .collect();
        self.set_layout(Layout::initial(&self.numels, &self.config));
        #[cfg(feature = "device")]
        if let Store::Device(device) = &mut self.store {
            device.register(vec![burn::tensor::DType::F32; params.len()]);
        }
        // A layout rebuilt for the model registered before would be swapped in at the next
        // backward, with that model's slots.
        self.next_layout = None;
        self.rebuilt = false;
        self.sharded = None;
        self.micro_batch = 0;
        self.step = None;
        self.used_anywhere = None;
    }

    /// ZeRO-2: from now on keep only this rank's shard of `flat` (the registered parameters'
    /// canonical flat layout) of the gradient. Freezes the bucket layout to contiguous flat
    /// ranges; call it after `register` and before the first backward.
    pub(crate) fn shard_gradients(&mut self, flat: FlatLayout) -> Result<(), DistError> {
        if flat.numels != self.numels || flat.world != self.comm.world_size() {
            return Err(DistError::LayoutMismatch {
                layout_params: flat.numels.len(),
                layout_ranks: flat.world,
                model_params: self.numels.len(),
                model_ranks: self.comm.world_size(),
            });
        }
        if self.step.is_some() || self.micro_batch != 0 {
            return Err(DistError::ShardingMidWindow);
        }
        let layout = Layout::flat_ordered(&self.numels, &self.config);
        self.set_layout(layout);
        match &mut self.store {
            Store::Host(buffers) => buffers.iter_mut().for_each(|b| *b = Vec::new()),
            // Gradients stay in Burn's tensors; each is reduced in pieces to the owners.
            #[cfg(feature = "device")]
            Store::Device(_) => {}
        }
        let on_device = self.reduces_on_device();
        self.sharded = Some(ShardedGradients::new(
            flat,
            self.comm.rank(),
            &self.layout,
            on_device,
        ));
        // Frozen: the owners' ranges are fixed, so the layout is never rebuilt.
        self.next_layout = None;
        self.rebuilt = true;
        Ok(())
    }

    /// Whether gradients are sharded (ZeRO-2).
    pub fn is_sharded(&self) -> bool {
        self.sharded.is_some()
    }

    /// ZeRO-2: the last finished window's gradient shard. It can be taken once per window.
    pub(crate) fn take_gradient_shard(&mut self) -> Result<GradientShard, DistError> {
        let sharded = self.sharded.as_mut().ok_or(DistError::NotSharded)?;
        let (Some(values), Some(used)) = (sharded.take(), self.used_anywhere.clone()) else {
            return Err(DistError::NoGradientShard { on_device: false });
        };
        // The device path keeps the shard in device memory: a host optimizer reads it.
        #[cfg(feature = "device")]
        let values = match &mut self.store {
            Store::Device(device) => {
                let shard = device.take_shard().ok_or_else(|| {
                    DistError::Usage("the device reducer holds no gradient shard".into())
                })?;
                // Read bucket by bucket during backward when streamed; else read now.
                let started = std::time::Instant::now();
                let values = match device.take_streamed_shard()? {
                    Some(values) => values,
                    None => device.read_shard(shard, self.comm.rank())?,
                };
                self.stats.shard_wait_nanos += started.elapsed().as_nanos() as u64;
                values
            }
            Store::Host(_) => values,
        };
        Ok(GradientShard { values, used })
    }

    /// ZeRO-2 on the device path, for an optimizer that takes the shard on the host
    /// ([`Reducer::take_gradient_shard`]): from the next accumulation window on, each bucket's
    /// pieces of the shard are read to the host as soon as its reduction is taken in on the
    /// window's last micro-batch, overlapped with the rest of backward, instead of all at once
    /// when the shard is taken. Nothing changes on the host path.
    pub(crate) fn stream_gradient_shard(&mut self, on: bool) {
        self.stream_shard = on;
    }

    /// ZeRO-2 on the device path: the last finished window's gradient shard in device memory
    /// (a `CubeTensor<R>` of the store's runtime, erased), and which parameters some rank used.
    /// It can be taken once per window.
    #[cfg(feature = "device")]
    pub(crate) fn take_device_gradient_shard(
        &mut self,
    ) -> Result<(Box<dyn std::any::Any>, Vec<bool>), DistError> {
        let sharded = self.sharded.as_mut().ok_or(DistError::NotSharded)?;
        let (Some(_), Some(used), Store::Device(device)) =
            (sharded.take(), self.used_anywhere.clone(), &mut self.store)
        else {
            return Err(DistError::NoGradientShard { on_device: true });
        };
        if device.streamed() {
            // Its device copy is not the window's mean: taking it would step on a wrong
            // gradient.
            return Err(DistError::Usage(
                "this window's gradient shard was streamed to the host \
                 (Ddp::stream_gradient_shard_to_host is on): take it with \
                 Ddp::take_gradient_shard, or turn streaming off before the window begins"
                    .into(),
            ));
        }
        let shard = device
            .take_shard()
            .ok_or_else(|| DistError::Usage("the device reducer holds no gradient shard".into()))?;
        Ok((shard, used))
    }

    /// ZeRO-2 on the device path: adds `value` to the first element of the finished shard;
    /// false on the host path (test-only fault injection, `crate::testing`).
    #[cfg(feature = "device")]
    pub(crate) fn poison_device_shard(&mut self, value: f32) -> bool {
        match &mut self.store {
            Store::Device(device) => device.add_to_shard_start(value),
            Store::Host(_) => false,
        }
    }

    /// ZeRO-2: the last finished window's gradient shard, in place, before the optimizer takes
    /// it (test-only fault injection, `crate::testing`).
    pub(crate) fn finished_shard_mut(&mut self) -> Option<&mut [f32]> {
        self.sharded.as_mut()?.finished_mut()
    }

    /// Gradient elements the reducer holds now: the bucket buffers and, under ZeRO-2, the
    /// shard.
    pub fn gradient_elements_held(&self) -> usize {
        let buckets = match &self.store {
            Store::Host(buffers) => buffers.iter().map(Vec::len).sum::<usize>(),
            // The gradients stay in Burn's tensors; the reducer holds no buffer of its own.
            #[cfg(feature = "device")]
            Store::Device(_) => 0,
        };
        buckets + self.sharded.as_ref().map_or(0, ShardedGradients::held)
    }

    /// ZeRO-2's flat layout, when gradients are sharded.
    pub fn flat_layout(&self) -> Option<&FlatLayout> {
        self.sharded.as_ref().map(ShardedGradients::flat)
    }

    fn set_layout(&mut self, layout: Layout) {
        match &mut self.store {
            Store::Host(buffers) => {
                *buffers = layout.buckets.iter().map(|b| vec![0.0; b.len]).collect();
            }
            #[cfg(feature = "device")]
            Store::Device(device) => device.begin_window(self.numels.len()),
        }
        self.written = vec![false; self.numels.len()];
        self.used_in_window = vec![false; self.numels.len()];
        self.layout = layout;
    }

    /// The rank's communicator.
    pub(crate) fn comm(&self) -> Arc<HostCommunicator> {
        self.comm.clone()
    }

    /// From now on reduce gradients in place in device memory with `device`, instead of
    /// through host buffers. Call it before `register`.
    #[cfg(feature = "device")]
    pub(crate) fn use_device(&mut self, device: Box<dyn crate::device::DeviceBuckets>) {
        self.store = Store::Device(device);
    }

    /// ZeRO stage 3 on the device path: this rank's shard of the sharded parameters (`shard`:
    /// its bytes in `dtype`) placed in the device store's memory.
    #[cfg(feature = "device")]
    pub(crate) fn device_pieces(
        &self,
        dtype: burn::tensor::DType,
        shard: &[u8],
    ) -> Result<Box<dyn crate::device::DevicePieces>, DistError> {
        match &self.store {
            Store::Device(device) => device.pieces(dtype, shard),
            Store::Host(_) => Err(DistError::Usage(
                "the sharded parameters go to device memory only on the device path".into(),
            )),
        }
    }

    /// Whether gradients are reduced in place in device memory (the device path).
    pub fn reduces_on_device(&self) -> bool {
        match &self.store {
            Store::Host(_) => false,
            #[cfg(feature = "device")]
            Store::Device(_) => true,
        }
    }

    /// Device path: whether gradients whose primitive has type id `primitive` are the device
    /// store's backend's; else the name of the primitive it takes, for the error.
    #[cfg(feature = "device")]
    pub(crate) fn accepts_device(&self, primitive: std::any::TypeId) -> Result<(), &'static str> {
        match &self.store {
            Store::Device(device) if device.accepts(primitive) => Ok(()),
            Store::Device(device) => Err(device.primitive_name()),
            Store::Host(_) => Err("none (the host path)"),
        }
    }

    /// The parameters' dtypes (visit order), which the device path reduces them in.
    pub(crate) fn set_dtypes(&mut self, _dtypes: Vec<burn::tensor::DType>) {
        #[cfg(feature = "device")]
        if let Store::Device(device) = &mut self.store {
            device.register(_dtypes);
        }
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn bucket_config(&self) -> &BucketConfig {
        &self.config
    }

    pub fn stats(&self) -> ReducerStats {
        // The device store counts its own copies (the hook's and the launch's).
        #[cfg(feature = "device")]
        if let Store::Device(device) = &self.store {
            let (copies, traffic) = (device.copies(), device.traffic());
            return ReducerStats {
                private_copies: copies.private,
                pitched_copies: copies.pitched,
                bytes_to_host: traffic.to_host,
                bytes_to_device: traffic.to_device,
                device_launches: device.launches(),
                device_calls: device.device_calls(),
                ..self.stats.clone()
            };
        }
        self.stats.clone()
    }

    /// Counts bytes the hooks moved between the backend's memory and the host (host path).
    pub(crate) fn record_host_traffic(&mut self, to_host: usize, to_device: usize) {
        self.stats.bytes_to_host += to_host as u64;
        self.stats.bytes_to_device += to_device as u64;
    }

    /// The index (visit order) of a marked parameter.
    pub(crate) fn index(&self, id: DistributedParamId) -> Result<usize, DistError> {
        self.index_of
            .get(&id)
            .copied()
            .ok_or(DistError::UnknownParameter {
                id: format!("{id:?}"),
            })
    }

    /// Whether the next backward ends an accumulation window (and so communicates).
    pub fn communicates_next(&self) -> bool {
        self.micro_batch + 1 == self.accumulation
    }

    pub(crate) fn set_observer(&mut self, observer: Option<Observer>) {
        self.observer = observer;
    }

    /// A backward begins; `ids` are the marked parameters in this rank's graph.
    pub(crate) fn start(&mut self, ids: &[DistributedParamId]) -> Result<(), DistError> {
        if self.step.is_some() {
            tracing::warn!("a backward began before the previous one finished; discarding it");
            self.step = None;
        }
        if self.micro_batch == 0 {
            if let Some(layout) = self.next_layout.take() {
                self.set_layout(layout);
            }
            self.written.fill(false);
            self.used_in_window.fill(false);
            self.used_anywhere = None;
            #[cfg(feature = "device")]
            if let Store::Device(device) = &mut self.store {
                device.begin_window(self.numels.len());
            }
            if let Some(sharded) = self.sharded.as_mut() {
                sharded.begin_window();
                #[cfg(feature = "device")]
                if let Store::Device(device) = &mut self.store {
                    device.begin_shard_window(sharded.flat().shard_len, self.stream_shard);
                }
            }
        }
        if self.sharded.is_some() {
            // Each micro-batch's buffers are reduced and handed over: nothing accumulates in them.
            self.written.fill(false);
        }
        let n = self.numels.len();
        let mut expected = vec![false; n];
        for &id in ids {
            let p = self.index(id)?;
            expected[p] = true;
            self.used_in_window[p] = true;
        }
        let remaining = self
            .layout
            .buckets
            .iter()
            .map(|b| b.params.iter().filter(|&&p| expected[p]).count())
            .collect();
        let window_end = self.communicates_next();
        let usage = window_end.then(|| {
            let bitmap = self.used_in_window.iter().map(|&u| u8::from(u)).collect();
            self.stats.collectives += 1;
            self.comm.all_reduce(HostBuffer::U8(bitmap), ReduceOp::Max)
        });
        self.stats.backwards += 1;
        self.step = Some(Step {
            reduce: window_end || self.sharded.is_some(),
            window_end,
            expected,
            arrived: vec![false; n],
            remaining,
            launched: 0,
            pending: (0..self.layout.buckets.len()).map(|_| None).collect(),
            usage,
            ready_order: Vec::new(),
            targets: vec![None; n],
        });
        // Buckets with nothing expected on this rank are ready at once.
        self.launch_ready()
    }

    /// The final gradient of `id` for this backward, flattened to f32; `target` is where it lives.
    pub(crate) fn gradient(
        &mut self,
        id: DistributedParamId,
        values: &[f32],
        target: usize,
    ) -> Result<(), DistError> {
        self.receive(id, Incoming::Host(values), target)
    }

    /// The final gradient of `id` for this backward; `target` is where it lives in Burn's
    /// container.
    pub(crate) fn receive(
        &mut self,
        id: DistributedParamId,
        incoming: Incoming<'_>,
        target: usize,
    ) -> Result<(), DistError> {
        let p = self.index(id)?;
        if incoming.len() != self.numels[p] {
            return Err(DistError::GradientShape {
                param: p,
                expected: self.numels[p],
                got: incoming.len(),
            });
        }
        let step = self.step.as_ref().ok_or(DistError::NoBackward)?;
        if step.arrived[p] {
            return Err(DistError::DuplicateGradient { param: p });
        }
        let (b, offset) = self.layout.slot[p];
        match (&mut self.store, incoming) {
            (Store::Host(buffers), Incoming::Host(values)) => {
                ensure_buffer(buffers, b, &self.layout, self.sharded.is_some());
                let slot = &mut buffers[b][offset..offset + values.len()];
                if self.written[p] {
                    slot.iter_mut().zip(values).for_each(|(s, v)| *s += v);
                } else {
                    slot.copy_from_slice(values);
                }
                self.stats.bytes_copied += (values.len() * 4) as u64;
            }
            #[cfg(feature = "device")]
            // SAFETY: the hook hands over a device gradient only after `accepts_device`
            // matched its primitive type, and `target` points at it in Burn's live container.
            (Store::Device(device), Incoming::Device { .. }) => unsafe {
                device.put(p, target, self.written[p])?;
            },
            #[cfg(feature = "device")]
            (Store::Host(_), Incoming::Device { .. }) | (Store::Device(_), Incoming::Host(_)) => {
                return Err(DistError::Usage(format!(
                    "parameter #{p}: its gradient was handed to the wrong reduction path (host \
                     or device); the path changed during a backward"
                )));
            }
        }
        self.written[p] = true;
        self.used_in_window[p] = true;
        let step = self.step.as_mut().expect("checked above");
        step.arrived[p] = true;
        step.targets[p] = Some(target);
        step.ready_order.push(p);
        if step.expected[p] {
            step.remaining[b] -= 1;
        }
        let last = step.remaining.iter().all(|&r| r == 0);
        self.launch_ready()?;
        self.take_in_finished()?;
        if let Some(mut observer) = self.observer.take() {
            observer(self, ReducerEvent::Gradient { param: p, last });
            self.observer = Some(observer);
        }
        Ok(())
    }

    /// Launches, in layout order, every bucket whose gradients are all in.
    fn launch_ready(&mut self) -> Result<(), DistError> {
        let Some(step) = self.step.as_ref() else {
            return Ok(());
        };
        if !step.reduce {
            return Ok(());
        }
        let first = step.launched;
        let ready = step.remaining[first..]
            .iter()
            .take_while(|&&r| r == 0)
            .count();
        if ready == 0 {
            return Ok(());
        }
        let launched: Vec<InFlight> = match &mut self.store {
            Store::Host(buffers) => (first..first + ready)
                .map(|b| {
                    ensure_buffer(buffers, b, &self.layout, self.sharded.is_some());
                    let bucket = &self.layout.buckets[b];
                    // Parameters this rank never produced a gradient for in the window
                    // contribute zeros.
                    for (&p, &offset) in bucket.params.iter().zip(&bucket.offsets) {
                        if !self.written[p] {
                            buffers[b][offset..offset + self.numels[p]].fill(0.0);
                        }
                    }
                    let buffer = HostBuffer::F32(std::mem::take(&mut buffers[b]));
                    InFlight::Host(match &self.sharded {
                        Some(sharded) => self.comm.reduce_scatter_counts(
                            buffer,
                            ReduceOp::Avg,
                            sharded.counts(b),
                        ),
                        None => self.comm.all_reduce(buffer, ReduceOp::Avg),
                    })
                })
                .collect(),
            // Parameters this rank never produced a gradient for get device zeros there.
            #[cfg(feature = "device")]
            Store::Device(device) => {
                let buckets: Vec<_> = self.layout.buckets[first..first + ready].iter().collect();
                let owners = self.sharded.as_ref().map(ShardedGradients::flat);
                device
                    .launch(&buckets, &self.written, &self.numels, owners)?
                    .into_iter()
                    .map(InFlight::Device)
                    .collect()
            }
        };
        let step = self.step.as_mut().expect("a step in progress");
        for (b, pending) in (first..).zip(launched) {
            step.pending[b] = Some(pending);
            self.stats.collectives += 1;
            step.launched += 1;
        }
        self.bound_in_flight()
    }

    /// Under ZeRO-2 and 3, takes in every launched reduction that is already over, without
    /// waiting: its bucket's gradients (host buffer, or the local gradients on the device)
    /// go as soon as the owners have their pieces, not at the end of backward. It never
    /// blocks, so it is safe where a wait inside backward is not (in-process ranks: Burn's
    /// graph cleanup on one thread locks the graph another thread's backward holds).
    fn take_in_finished(&mut self) -> Result<(), DistError> {
        if self.sharded.is_none() {
            return Ok(());
        }
        let Some(step) = self.step.as_mut() else {
            return Ok(());
        };
        let done: Vec<usize> = (0..step.launched)
            .filter(|&b| step.pending[b].as_mut().is_some_and(InFlight::is_done))
            .collect();
        for b in done {
            self.wait_bucket(b)?;
        }
        Ok(())
    }

    /// Waits for the oldest launched reductions until the buckets still in flight fit in
    /// `BucketConfig::max_in_flight_bytes` (sharded gradients: each finished reduction frees
    /// its whole bucket, host buffer or device gradients, and keeps this rank's segment). A
    /// bucket counts its f32 size on either path.
    fn bound_in_flight(&mut self) -> Result<(), DistError> {
        let (Some(cap), Some(_)) = (self.config.max_in_flight_bytes, &self.sharded) else {
            return Ok(());
        };
        loop {
            let step = self.step.as_ref().expect("a step in progress");
            let in_flight = |b: &usize| step.pending[*b].is_some();
            let bytes: usize = (0..step.launched)
                .filter(in_flight)
                .map(|b| self.layout.buckets[b].len * GRAD_ELEM_BYTES)
                .sum();
            let oldest = (0..step.launched).find(in_flight);
            match oldest {
                Some(b) if bytes > cap => {
                    self.wait_bucket(b)?;
                }
                _ => return Ok(()),
            }
        }
    }

    /// Sets `BucketConfig::max_in_flight_bytes` to `buckets` full buckets when the user left
    /// it unset.
    pub(crate) fn default_in_flight(&mut self, buckets: usize) {
        let bytes = buckets * self.config.bucket_bytes;
        self.config.max_in_flight_bytes.get_or_insert(bytes);
    }

    /// Waits for bucket `b`'s reduction if it has been launched; returns whether it had been.
    pub fn wait_bucket(&mut self, b: usize) -> Result<bool, DistError> {
        let Some(step) = self.step.as_mut() else {
            return Ok(false);
        };
        if b >= step.launched {
            return Ok(false);
        }
        match step.pending[b].take() {
            Some(InFlight::Host(pending)) => {
                let HostBuffer::F32(reduced) = pending.wait()? else {
                    unreachable!("an f32 reduction returns f32")
                };
                self.stats.reduced_elements_received += reduced.len() as u64;
                match (self.sharded.as_mut(), &mut self.store) {
                    (Some(sharded), _) => {
                        sharded.add_segment(b, &reduced, self.micro_batch == 0);
                    }
                    (None, Store::Host(buffers)) => buffers[b] = reduced,
                    #[cfg(feature = "device")]
                    (None, Store::Device(_)) => unreachable!("host reductions run on the host"),
                }
            }
            // Reduced in place: the tensors the store holds are the result. Under ZeRO-2 this
            // rank's pieces of them are its segment of the bucket.
            #[cfg(feature = "device")]
            Some(InFlight::Device(pending)) => {
                for reduction in pending {
                    reduction.wait()?;
                }
                let last = step.window_end;
                let in_backward = step.remaining.iter().any(|&r| r > 0);
                let bucket = &self.layout.buckets[b];
                let received = if let (Some(sharded), Store::Device(device)) =
                    (self.sharded.as_mut(), &mut self.store)
                {
                    let window = (self.micro_batch == 0, last);
                    let added =
                        device.add_owned(bucket, sharded.flat(), self.comm.rank(), window)?;
                    if added.read_issued {
                        self.stats.shard_reads += 1;
                        self.stats.shard_reads_in_backward += u64::from(in_backward);
                    }
                    added.elements
                } else {
                    bucket.len
                };
                self.stats.reduced_elements_received += received as u64;
            }
            None => {}
        }
        Ok(true)
    }

    /// Whether parameter `p`'s gradient reached the reducer in the last finished backward.
    pub(crate) fn arrived_last(&self, p: usize) -> bool {
        self.arrived_last.get(p).copied().unwrap_or(false)
    }

    /// The backward is over. Non-communicating micro-batches return `None` (their gradients
    /// stay in the window's buffers). The communicating one waits for every bucket, agrees on
    /// which parameters were used, rebuilds the layout after the first such step, and returns
    /// where to write the reduced gradients.
    pub(crate) fn finish(&mut self) -> Result<Option<Finished>, DistError> {
        let Some(step) = self.step.as_ref() else {
            return Err(DistError::NoBackward);
        };
        self.arrived_last = step.arrived.clone();
        if !step.reduce {
            self.step = None;
            self.micro_batch += 1;
            return Ok(None);
        }
        // Expected gradients that never came (they should not exist) count as zeros.
        if let Some(step) = self.step.as_mut()
            && step.remaining.iter().any(|&r| r > 0)
        {
            tracing::warn!("some expected gradients did not arrive; reducing zeros for them");
            step.remaining.fill(0);
        }
        self.launch_ready()?;
        for b in 0..self.layout.buckets.len() {
            self.wait_bucket(b)?;
        }
        let mut step = self.step.take().expect("a step in progress");
        if !step.window_end {
            // ZeRO-2 mid-window: this micro-batch is in the shard; nothing to write back.
            self.micro_batch += 1;
            return Ok(None);
        }
        let usage = step
            .usage
            .take()
            .expect("a communicating step has a usage bitmap")
            .wait()?;
        let HostBuffer::U8(usage) = usage else {
            unreachable!("u8 bitmap")
        };
        self.used_anywhere = Some(usage.iter().map(|&u| u > 0).collect());
        if !self.rebuilt {
            self.rebuild_from_rank0(&step.ready_order)?;
        }
        let targets = match self.sharded.as_mut() {
            // The optimizer takes the shard; Burn's container keeps no reduced gradient.
            Some(sharded) => {
                sharded.end_window(self.accumulation);
                #[cfg(feature = "device")]
                if let Store::Device(device) = &mut self.store {
                    device.end_shard_window(self.accumulation);
                }
                Vec::new()
            }
            None => step
                .targets
                .iter()
                .enumerate()
                .filter_map(|(p, t)| t.map(|t| (p, t)))
                .collect(),
        };
        self.micro_batch = 0;
        Ok(Some(Finished { targets }))
    }

    /// See `Ddp::adopt_bucket_order`.
    pub(crate) fn adopt_order(&mut self, order: &[usize]) -> Result<(), DistError> {
        if order.is_empty() || self.sharded.is_some() {
            return Ok(());
        }
        if !crate::bucket::is_permutation(order, self.numels.len()) {
            return Err(DistError::BadBucketOrder {
                params: self.numels.len(),
                got: order.len(),
            });
        }
        self.next_layout = Some(Layout::build(&self.numels, order, &self.config));
        self.rebuilt = true;
        Ok(())
    }

    /// Rank 0's observed ready order, broadcast, becomes everyone's next layout.
    fn rebuild_from_rank0(&mut self, observed: &[usize]) -> Result<(), DistError> {
        let order = complete_order(observed, self.numels.len());
        let bytes: Vec<u8> = order
            .iter()
            .flat_map(|&p| (p as u32).to_le_bytes())
            .collect();
        self.stats.collectives += 1;
        let HostBuffer::U8(bytes) = self.comm.broadcast(HostBuffer::U8(bytes), 0).wait()? else {
            unreachable!("u8 broadcast")
        };
        let order: Vec<usize> = bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4")) as usize)
            .collect();
        self.next_layout = Some(Layout::build(&self.numels, &order, &self.config));
        self.rebuilt = true;
        self.stats.layout_rebuilds += 1;
        Ok(())
    }

    /// After a communicating backward: the mean gradient of parameter `p` over ranks and the
    /// window, or `None` when no rank used it.
    /// Under ZeRO-2 there is no full gradient: always `None`.
    pub fn reduced(&self, p: usize) -> Option<Vec<f32>> {
        if self.sharded.is_some() {
            return None;
        }
        let used = self.used_anywhere.as_ref()?;
        if !used[p] {
            return None;
        }
        let (b, offset) = self.layout.slot[p];
        let scale = 1.0 / self.accumulation as f32;
        #[cfg(feature = "device")]
        if let Store::Device(device) = &self.store {
            return device.read(p, self.window_scale());
        }
        let buffers = self.store.host()?;
        let values = &buffers[b][offset..offset + self.numels[p]];
        Some(if self.accumulation == 1 {
            values.to_vec()
        } else {
            values.iter().map(|v| v * scale).collect()
        })
    }

    /// After a communicating backward on the device path: replaces the gradient at `target` in
    /// Burn's container with `p`'s reduced one (the mean over ranks and micro-batches).
    ///
    /// # Safety
    /// `target` points at the live gradient the hook handed over for `p`.
    #[cfg(feature = "device")]
    pub(crate) unsafe fn write_back_device(
        &mut self,
        p: usize,
        target: usize,
    ) -> Result<(), DistError> {
        let scale = self.window_scale();
        match &mut self.store {
            // SAFETY: as the caller promised.
            Store::Device(device) => unsafe { device.write_back(p, target, scale) },
            Store::Host(_) => Err(DistError::Usage(
                "a device write-back on the host path".into(),
            )),
        }
    }

    /// What the window's sum over micro-batches is multiplied by to make it their mean.
    #[cfg(feature = "device")]
    fn window_scale(&self) -> f32 {
        if self.accumulation == 1 {
            1.0
        } else {
            1.0 / self.accumulation as f32
        }
    }

    /// The layout the next window will use (after the first step, the rebuilt one).
    pub fn next_layout(&self) -> &Layout {
        self.next_layout.as_ref().unwrap_or(&self.layout)
    }
}

/// Under ZeRO-2 bucket buffers live only from a backward's first gradient into them to their
/// reduction.
fn ensure_buffer(buffers: &mut [Vec<f32>], b: usize, layout: &Layout, sharded: bool) {
    if sharded && buffers[b].is_empty() {
        buffers[b] = vec![0.0; layout.buckets[b].len];
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// One backward of a one-rank reducer with two parameters in one bucket: Burn announces
    /// both gradients (`start`) and delivers the first, and the second too if `deliver_both`.
    /// Returns the reducer afterwards and the warnings it logged.
    fn one_bucket_backward(deliver_both: bool) -> (Reducer, String) {
        let comm = HostCommunicator::local_group(1, &Default::default())
            .pop()
            .expect("one rank");
        let mut reducer = Reducer::new(Arc::new(comm), BucketConfig::new(), 1);
        let ids = [DistributedParamId::from(1), DistributedParamId::from(2)];
        reducer.register(&[(ids[0], 3), (ids[1], 2)]);
        assert_eq!(reducer.layout().buckets.len(), 1, "both in one bucket");
        let warnings = warnings_of(|| {
            reducer.start(&ids).unwrap();
            reducer.gradient(ids[0], &[1.0, 2.0, 3.0], 0).unwrap();
            if deliver_both {
                reducer.gradient(ids[1], &[4.0, 5.0], 1).unwrap();
            }
            reducer.finish().unwrap().expect("a communicating backward");
        });
        (reducer, warnings)
    }

    /// What `f` logs at level WARN and above on this thread.
    fn warnings_of(f: impl FnOnce()) -> String {
        #[derive(Clone, Default)]
        struct Captured(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Captured {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_max_level(tracing::Level::WARN)
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        String::from_utf8_lossy(&captured.0.lock().unwrap()).into_owned()
    }

    /// A broken promise that should not happen (an announced gradient that never arrives): the
    /// bucket is still reduced at the end of the backward, the missing gradient as zeros,
    /// where waiting for it would hang every rank; and it is logged.
    #[test]
    fn an_announced_gradient_that_never_arrives_is_reduced_as_zeros() {
        let (reducer, warnings) = one_bucket_backward(false);
        assert_eq!(
            reducer.stats().reduced_elements_received,
            5,
            "the bucket was reduced"
        );
        assert_eq!(reducer.reduced(0), Some(vec![1.0, 2.0, 3.0]));
        assert_eq!(reducer.reduced(1), Some(vec![0.0, 0.0]));
        assert!(warnings.contains("did not arrive"), "{warnings:?}");
    }

    #[test]
    fn a_backward_whose_gradients_all_arrive_logs_no_warning() {
        let (reducer, warnings) = one_bucket_backward(true);
        assert_eq!(reducer.reduced(1), Some(vec![4.0, 5.0]));
        assert_eq!(warnings, "");
    }
}
