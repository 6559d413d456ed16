//! `Ddp`: the user's handle on data-parallel training.
//!
//! ```no_run
//! use burn::backend::Autodiff;
//! use burn::nn::LinearConfig;
//! use burn::optim::{AdamConfig, GradientsParams, Optimizer};
//! use burn::tensor::Tensor;
//! use burn_dist::{Ddp, DdpConfig, DistributedBackend};
//! use burn_flex::{Flex, FlexDevice};
//!
//! type B = Autodiff<DistributedBackend<Flex>>;
//!
//! # fn main() -> burn_dist::Result<()> {
//! // Joins the job burn-dist-run (or torchrun, Slurm) describes; started by hand, a job of one.
//! let mut ddp = Ddp::init(DdpConfig::new())?;
//! // The same weights everywhere (rank 0's), marked for gradient sync.
//! let mut model = ddp.prepare(LinearConfig::new(4, 1).init::<B>(&FlexDevice))?;
//! let mut optim = AdamConfig::new().init();
//! for _step in 0..10 {
//!     let batch = Tensor::<B, 2>::ones([8, 4], &FlexDevice); // this rank's shard of the data
//!     let loss = model.forward(batch).powi_scalar(2).mean();
//!     // Averaged over ranks during backward.
//!     if let Some(grads) = ddp.backward(loss, &model)? {
//!         let (grads, _norm): (GradientsParams, f64) =
//!             burn_dist::clip_grad_norm(&model, grads, Some(1.0));
//!         model = optim.step(1e-3, model, grads);
//!     }
//! }
//! # Ok(())
//! # }
//! ```
//!
//! Without gradient accumulation, plain Burn code works too: `loss.backward()` already returns
//! averaged gradients, and `GradientsParams::from_grads` and the optimizer are unchanged.

use std::sync::{Arc, Mutex};

use burn::config::Config;
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};
use burn_dist_comm::{Communicator, Group, HostBuffer, HostCommunicator};

use crate::bucket::{BucketConfig, Layout};
use crate::context::{self, Scope, SharedReducer, lock};
use crate::error::{DistError, Result};
use crate::flat::FlatLayout;
use crate::gradient_shard::GradientShard;
use crate::join::join;
use crate::model::{
    Overwrite, ParamInfo, StableIds, Survey, distributed_id, first_difference, mark_for_sync,
    stable_param_id,
};
use crate::random::RandomStream;
use crate::reducer::{Reducer, ReducerEvent, ReducerStats};
use crate::sharding::{ParamShards, PrefetchConfig, ShardStats};
use crate::threads::PoolSize;

/// Settings of data-parallel training.
#[derive(Config, Debug)]
pub struct DdpConfig {
    /// Gradient bucket sizes.
    #[config(default = "BucketConfig::new()")]
    pub buckets: BucketConfig,
    /// Micro-batches per optimizer step. Only the last one of each window communicates; the
    /// gradients handed to the optimizer are the mean over ranks and micro-batches.
    #[config(default = 1)]
    pub accumulation_steps: usize,
    /// ZeRO stage 3 (`Ddp::prepare_sharded`): how far ahead of their use the sharded
    /// parameters are gathered, once the first step has recorded their order.
    #[config(default = "PrefetchConfig::new()")]
    pub prefetch: PrefetchConfig,
}

/// A rank's handle on data-parallel training: its communicator, its reducer, its model's
/// parameters.
pub struct Ddp {
    comm: Arc<HostCommunicator>,
    reducer: SharedReducer,
    scope: Scope,
    params: Vec<ParamInfo>,
    accumulation: usize,
    /// Stage 3's gathers ahead of use, for `prepare_sharded`.
    pub(crate) prefetch: PrefetchConfig,
    /// What joining did to rayon's global pool; `None` for an in-process group.
    pool: Option<PoolSize>,
    /// Keeps the store alive on rank 0 for as long as training runs.
    _group: Option<Group>,
    /// ZeRO stage 3: this rank's pieces of the sharded parameters (`Ddp::prepare_sharded`).
    pub(crate) shards: Option<Arc<ParamShards>>,
    /// Device path: the reducer's device collectives (an `Arc<dyn DeviceCollectives<R>>`), for
    /// the optimizer's own collectives on the same device memory.
    #[cfg(feature = "device")]
    device: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

impl Ddp {
    /// Joins the job described by the environment (`burn-dist-run`, torchrun or Slurm
    /// variables) and installs the reducer for the whole process.
    ///
    /// Unless RAYON_NUM_THREADS is set (`burn-dist-run` sets it), rayon's global pool, which
    /// Flex computes on, is built with this rank's share of the host's cores:
    /// `max(1, cores / local ranks)` threads (see [`Ddp::thread_pool`] and docs/guide.md,
    /// "Threads per rank"). Call it before the first tensor operation, which builds the pool.
    ///
    /// Without any launcher variable ([`crate::LAUNCHER_VARS`]: no RANK, WORLD_SIZE, … nor
    /// Slurm's SLURM_PROCID) the process is a job of one rank on its own, and says so in the log
    /// (`tracing`, info): the same program runs by hand and under a launcher.
    pub fn init(config: DdpConfig) -> Result<Ddp> {
        let joined = join()?;
        let mut ddp = Ddp::new(joined.comm, config, Scope::Process, joined.group);
        ddp.pool = Some(joined.pool);
        Ok(ddp)
    }

    /// Joins the job described by the environment, like [`Ddp::init`], and reduces gradients
    /// with NCCL in place on the GPU `device` (one rank per GPU; usually `LOCAL_RANK`), for
    /// `Autodiff<DistributedBackend<B>>` with `B` Burn's `Cuda` (fusion on) or burn-cuda without
    /// fusion ([`crate::CudaBackend`]).
    ///
    /// Bucket gradients are never copied through the host: when a bucket's gradients are all
    /// in, one NCCL group of per-tensor averages runs on the gradients' device memory (docs/gpu.md,
    /// "The in-place path"). Small control collectives (the usage bitmap, the bucket order, the
    /// model check and broadcast of `prepare`) and [`Ddp::communicator`] stay on the host
    /// communicator of the same group. Under ZeRO stage 2 ([`Ddp::shard_gradients`]) each
    /// parameter is reduce-scattered in place to the owners of its pieces. Fails, naming the
    /// library, when libcuda or libnccl cannot be loaded, and without a launcher
    /// ([`DistError::NotLaunched`]: NCCL meets through the job's store), even for one GPU.
    #[cfg(feature = "cuda")]
    pub fn init_nccl<B>(config: DdpConfig, device: &crate::CudaDevice) -> Result<Ddp>
    where
        B: crate::CubeResident<Runtime = burn_cubecl::cubecl::cuda::CudaRuntime>,
    {
        let joined = join()?;
        let group = joined.group.ok_or(DistError::NotLaunched {
            call: "Ddp::init_nccl",
        })?;
        let mut ddp = Ddp::with_nccl::<B>(group, config, device)?;
        ddp.pool = Some(joined.pool);
        Ok(ddp)
    }

    /// [`Ddp::init_nccl`] on a group already joined (e.g. `Group::join` with a `RankInfo`
    /// built by hand): its NCCL communicator is created on GPU `device` through the group's
    /// store, and the reducer is installed for the whole process.
    #[cfg(feature = "cuda")]
    pub fn with_nccl<B>(group: Group, config: DdpConfig, device: &crate::CudaDevice) -> Result<Ddp>
    where
        B: crate::CubeResident<Runtime = burn_cubecl::cubecl::cuda::CudaRuntime>,
    {
        let comm_config = match group.info.timeout {
            Some(timeout) => burn_dist_comm::CommConfig::default().with_timeout(timeout),
            None => burn_dist_comm::CommConfig::default(),
        };
        let nccl = burn_dist_comm::NcclCommunicator::new(
            &group.store,
            group.info.rank,
            group.info.world_size,
            device.index,
            &comm_config,
        )?;
        let collectives = Arc::new(burn_dist_device::NcclCollectives::new(
            Arc::new(nccl),
            Arc::default(),
        ));
        let ddp = Ddp::new(group.comm.clone(), config, Scope::Process, Some(group));
        // Stage 3's gathers share the one NCCL communicator (not yet a lane of their own).
        Ok(ddp.on_device::<B>(collectives.clone(), collectives, device.clone()))
    }

    /// Joins the job described by the environment, like [`Ddp::init`], and keeps gradients in
    /// the device memory of `B` (any burn-cubecl backend, fusion on or off: Burn's `Wgpu`,
    /// `Cuda`…): each bucket's gradients are reduced in place by device collectives staged
    /// through the host communicator ([`crate::StagedCollectives`]). This is the device path
    /// where NCCL is absent, and its CPU twin in the tests (wgpu on Mesa's lavapipe).
    #[cfg(feature = "device")]
    pub fn init_staged<B: crate::CubeResident>(
        config: DdpConfig,
        device: &B::Device,
    ) -> Result<Ddp> {
        let joined = join()?;
        let mut ddp = Ddp::new(joined.comm, config, Scope::Process, joined.group);
        ddp.pool = Some(joined.pool);
        Ok(ddp.on_staged::<B>(device))
    }

    /// [`Ddp::for_thread`] on the device path of [`Ddp::init_staged`]: a rank of an in-process
    /// group whose gradients stay in `B`'s device memory.
    #[cfg(feature = "device")]
    pub fn for_thread_staged<B: crate::CubeResident>(
        comm: HostCommunicator,
        config: DdpConfig,
        device: &B::Device,
    ) -> Ddp {
        Ddp::for_thread(comm, config).on_staged::<B>(device)
    }

    /// The device path of backend `B` with collectives staged through this rank's host
    /// communicator: the main lane for gradients, the gather lane for stage 3's parameters,
    /// their host traffic counted together.
    #[cfg(feature = "device")]
    fn on_staged<B: crate::CubeResident>(self, device: &B::Device) -> Ddp {
        let traffic = Arc::new(crate::TrafficCounter::default());
        let collectives = crate::StagedCollectives::new(self.comm.clone(), traffic.clone());
        let gathers = crate::StagedCollectives::on_gather_lane(self.comm.clone(), traffic);
        self.on_device::<B>(
            Arc::new(collectives),
            Arc::new(gathers),
            B::cube_device(device),
        )
    }

    /// Installs the device store of backend `B` over `collectives` (and `gathers`, for stage
    /// 3's parameters) in this rank's reducer.
    #[cfg(feature = "device")]
    fn on_device<B: crate::CubeResident>(
        mut self,
        collectives: Arc<dyn crate::DeviceCollectives<B::Runtime>>,
        gathers: Arc<dyn crate::DeviceCollectives<B::Runtime>>,
        device: <B::Runtime as burn_cubecl::cubecl::Runtime>::Device,
    ) -> Ddp {
        lock(&self.reducer).use_device(Box::new(crate::device::DeviceStore::<B>::new(
            collectives.clone(),
            gathers,
            device,
        )));
        self.device = Some(Arc::new(collectives));
        self
    }

    /// Device path: the collectives the reducer uses on runtime `R`'s memory (NCCL, or staged
    /// through the host), for an optimizer whose state lives there too; `None` on the host path
    /// or for another runtime.
    #[cfg(feature = "device")]
    pub fn device_collectives<R: burn_cubecl::cubecl::Runtime>(
        &self,
    ) -> Option<Arc<dyn crate::DeviceCollectives<R>>> {
        self.device
            .as_ref()?
            .downcast_ref::<Arc<dyn crate::DeviceCollectives<R>>>()
            .cloned()
    }

    /// Whether this rank reduces gradients in place on the GPU (NCCL: `Ddp::init_nccl`, feature
    /// `cuda`).
    pub fn reduces_on_device(&self) -> bool {
        lock(&self.reducer).reduces_on_device()
    }

    /// A rank of an in-process group (threads as ranks): the reducer serves the calling thread
    /// only, so each thread must build and train its own model.
    pub fn for_thread(comm: HostCommunicator, config: DdpConfig) -> Ddp {
        Ddp::new(Arc::new(comm), config, Scope::Thread, None)
    }

    fn new(
        comm: Arc<HostCommunicator>,
        config: DdpConfig,
        scope: Scope,
        group: Option<Group>,
    ) -> Ddp {
        let accumulation = config.accumulation_steps.max(1);
        let reducer = Reducer::new(comm.clone(), config.buckets.clone(), accumulation);
        let reducer = Arc::new(Mutex::new(reducer));
        context::install(scope, Some(reducer.clone()));
        Ddp {
            comm,
            reducer,
            scope,
            params: Vec::new(),
            accumulation,
            prefetch: config.prefetch,
            pool: None,
            _group: group,
            shards: None,
            #[cfg(feature = "device")]
            device: None,
        }
    }

    /// What [`Ddp::init`] did to rayon's global pool (this rank's share of the cores, or why
    /// not); `None` for a rank of an in-process group ([`Ddp::for_thread`]).
    pub fn thread_pool(&self) -> Option<&PoolSize> {
        self.pool.as_ref()
    }

    /// This rank's place in the job, `0..world_size()`.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Whether this is rank 0, the rank that logs, writes files and shows progress.
    pub fn is_main(&self) -> bool {
        self.rank() == 0
    }

    /// How many ranks the job has.
    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// Micro-batches per optimizer step.
    pub fn accumulation_steps(&self) -> usize {
        self.accumulation
    }

    /// The communicator, for the user's own collectives (e.g. averaging a metric).
    pub fn communicator(&self) -> &HostCommunicator {
        &self.comm
    }

    /// A shared handle on the communicator, for components that outlive a borrow (optimizers).
    pub fn comm(&self) -> Arc<HostCommunicator> {
        self.comm.clone()
    }

    /// Makes `model` identical on every rank and ready for synchronized training: checks that
    /// every rank has the same tensors (names, shapes, dtypes) and fails naming the first
    /// difference, copies rank 0's values to every rank, registers the trainable parameters
    /// with the reducer and marks them for gradient sync. The returned model's float
    /// parameters have ParamIds derived from their place in the model, the same in every
    /// process, so that a model loaded from a record (a resumed run) keeps the ids the reducer
    /// and the optimizers know.
    pub fn prepare<B: AutodiffBackend, M: Module<B>>(&mut self, model: M) -> Result<M> {
        let survey = Survey::of::<B, M>(&model);
        self.check_same_model(&survey.fingerprint, &[])?;
        let rank0 = self
            .comm
            .broadcast(HostBuffer::U8(survey.bytes), 0)
            .wait()?;
        let model = if self.rank() == 0 {
            model
        } else {
            model.map(&mut Overwrite {
                bytes: rank0.as_bytes(),
                at: 0,
            })
        };
        // Ids that a checkpoint's record keeps across processes (see `stable_param_id`).
        let mut floats = survey.floats;
        let ids: Vec<ParamId> = floats
            .iter()
            .enumerate()
            .map(|(i, p)| stable_param_id(i, &p.name, &p.shape))
            .collect();
        for (info, &id) in floats.iter_mut().zip(&ids) {
            info.id = id;
        }
        let model = model.map(&mut StableIds { ids: &ids, next: 0 });
        self.register_params(floats);
        Ok(self.mark(model))
    }

    /// Registers the trainable ones of the model's float parameters (visit order) with the
    /// reducer.
    pub(crate) fn register_params(&mut self, floats: Vec<ParamInfo>) {
        self.params = floats.into_iter().filter(|p| p.require_grad).collect();
        let ids: Vec<_> = self
            .params
            .iter()
            .map(|p| (distributed_id(p.id), p.numel()))
            .collect();
        let dtypes = self.params.iter().map(|p| p.dtype).collect();
        let mut reducer = lock(&self.reducer);
        reducer.register(&ids);
        reducer.set_dtypes(dtypes);
    }

    /// ZeRO stage 3: this rank's pieces of the sharded parameters, once
    /// [`Ddp::prepare_sharded`] has run (for the stage-3 optimizer and checkpoints).
    pub fn param_shards(&self) -> Option<Arc<ParamShards>> {
        self.shards.clone()
    }

    /// ZeRO stage 3: what the sharded parameters hold and cost on this rank (`None` before
    /// [`Ddp::prepare_sharded`]).
    pub fn shard_stats(&self) -> Option<ShardStats> {
        self.shards.as_ref().map(|shards| shards.stats())
    }

    /// Marks every trainable parameter for gradient sync. `prepare` does it, and Burn's
    /// optimizers re-mark the parameters they update; with gradient accumulation call it before
    /// the forward pass of every micro-batch, because each backward consumes the marks.
    pub fn mark<B: AutodiffBackend, M: Module<B>>(&self, model: M) -> M {
        mark_for_sync(model)
    }

    /// Every rank gathers every rank's fingerprint and `settings` (name, value on one line),
    /// in one collective, so every rank reports the same mismatch: a setting first.
    pub(crate) fn check_same_model(
        &self,
        fingerprint: &[String],
        settings: &[(&'static str, String)],
    ) -> Result<()> {
        let mut mine: Vec<&str> = settings.iter().map(|(_, value)| value.as_str()).collect();
        mine.extend(fingerprint.iter().map(String::as_str));
        let all = self.all_gather_bytes(mine.join("\n").into_bytes())?;
        let lines = |text: &[u8]| -> Vec<String> {
            String::from_utf8_lossy(text)
                .lines()
                .map(str::to_string)
                .collect()
        };
        let rank0 = lines(&all[0]);
        let count = settings.len();
        for (rank, text) in all.iter().enumerate().skip(1) {
            let other = lines(text);
            for (i, (setting, _)) in settings.iter().enumerate() {
                if other.get(i) != rank0.get(i) {
                    return Err(DistError::SettingMismatch {
                        setting,
                        rank,
                        here: other.get(i).cloned().unwrap_or_default(),
                        rank0: rank0.get(i).cloned().unwrap_or_default(),
                    });
                }
            }
            let (rank0, other) = (
                &rank0[count.min(rank0.len())..],
                &other[count.min(other.len())..],
            );
            if let Some(difference) = first_difference(rank0, other, rank) {
                return Err(DistError::ModelMismatch(difference));
            }
        }
        Ok(())
    }

    /// Runs `loss.backward()` for one micro-batch with gradients synchronized during it. On the
    /// last micro-batch of an accumulation window (every call when not accumulating) returns the
    /// gradients for the optimizer: the mean over ranks (and micro-batches), including
    /// parameters this rank did not use but others did, and excluding parameters no rank used.
    /// Fails, instead of training on unsynchronized gradients, if a collective failed or a
    /// parameter with a gradient was not marked.
    ///
    /// Under ZeRO stage 2 ([`Ddp::shard_gradients`]) the reduced gradient exists only as each
    /// rank's shard, which the sharded optimizer takes with [`Ddp::take_gradient_shard`]; the
    /// returned container is then empty (Burn's local, unreduced gradients are dropped), so a
    /// stock Burn optimizer given it changes nothing.
    pub fn backward<B: AutodiffBackend, M: AutodiffModule<B>>(
        &mut self,
        loss: Tensor<B, 1>,
        model: &M,
    ) -> Result<Option<GradientsParams>> {
        if self.params.is_empty() {
            return Err(DistError::NotPrepared {
                call: "Ddp::backward",
            });
        }
        if let Some(shards) = &self.shards {
            shards.check_model(model)?;
        }
        let (communicates, sharded, backwards_before) = {
            let mut reducer = lock(&self.reducer);
            reducer.caller_collects_errors = true;
            reducer.hook_error = None;
            (
                reducer.communicates_next(),
                reducer.is_sharded(),
                reducer.stats().backwards,
            )
        };
        let grads = loss.backward();
        let mut reducer = lock(&self.reducer);
        reducer.caller_collects_errors = false;
        if let Some(error) = reducer.hook_error.take() {
            return Err(error);
        }
        if let Some(error) = self.shards.as_ref().and_then(|shards| shards.failure()) {
            return Err(error);
        }
        // Burn calls no hook when the loss reaches no marked parameter. The other ranks still
        // reduce every bucket, so this rank takes part with zeros.
        if reducer.stats().backwards == backwards_before {
            reducer.start(&[])?;
            reducer.finish()?;
        }
        let mut grads = GradientsParams::from_grads(grads, model);
        let mut fix = CompleteGradients {
            reducer: &reducer,
            params: &self.params,
            grads: &mut grads,
            communicated: communicates && !sharded,
            next: 0,
            error: None,
        };
        model.visit(&mut fix);
        if let Some(error) = fix.error {
            return Err(error);
        }
        if sharded {
            grads = GradientsParams::new();
        }
        Ok(communicates.then_some(grads))
    }

    /// ZeRO stage 2: from now on every bucket is reduced straight to the ranks that own its
    /// elements in `flat` (the prepared parameters' canonical flat layout over this group), and
    /// each rank keeps only its shard of the gradient, for [`Ddp::take_gradient_shard`]. The
    /// bucket layout is frozen to contiguous ranges of `flat`, and with gradient accumulation
    /// every micro-batch communicates. Called by the sharded optimizer when it is built.
    pub fn shard_gradients(&self, flat: FlatLayout) -> Result<()> {
        if self.params.is_empty() {
            return Err(DistError::NotPrepared {
                call: "Ddp::shard_gradients",
            });
        }
        lock(&self.reducer).shard_gradients(flat)
    }

    /// ZeRO stage 2: this rank's shard of the last accumulation window's mean gradient, and
    /// which parameters any rank used. Once per window.
    pub fn take_gradient_shard(&self) -> Result<GradientShard> {
        self.sync_handle().take_gradient_shard()
    }

    /// ZeRO stage 2 on the device path, for an optimizer that steps on the host (ZeroAdam's
    /// host step, `ZeroAdam::offloaded`): whether [`Ddp::take_gradient_shard`]'s values are
    /// read to the host during backward, each bucket's range of the shard as soon as its
    /// reduction is taken in on the window's last micro-batch, so that only the last
    /// buckets' reads remain when backward ends. On from the next accumulation window;
    /// off by default; it changes nothing on the host path. The values are the same bit for
    /// bit either way; streamed, the padding past the last parameter (zero) is not read, so
    /// the last rank reads those bytes less.
    pub fn stream_gradient_shard_to_host(&self, on: bool) {
        lock(&self.reducer).stream_gradient_shard(on);
    }

    /// This rank's reducer, for handles that outlive a borrow of `Ddp`.
    pub(crate) fn shared_reducer(&self) -> crate::context::SharedReducer {
        self.reducer.clone()
    }

    /// Fault injection for the overflow tests (burn-dist-testing): adds `value` to the first
    /// element of this rank's finished ZeRO-2 gradient shard, on the host or the device, as if
    /// only this rank's own arithmetic had overflowed after the average. Returns false, and
    /// does nothing, when gradients are not sharded. Panics when no finished shard waits.
    #[doc(hidden)]
    pub fn poison_gradient_shard(&self, value: f32) -> bool {
        self.with_reducer(|reducer| {
            if !reducer.is_sharded() {
                return false;
            }
            #[cfg(feature = "device")]
            if reducer.poison_device_shard(value) {
                return true;
            }
            let shard = reducer
                .finished_shard_mut()
                .expect("a finished gradient shard to overflow: call it after `Ddp::backward`");
            shard[0] += value;
            true
        })
    }

    /// Runs `f` on this rank's reducer (test-only fault injection, `poison_gradient_shard`).
    pub(crate) fn with_reducer<R>(&self, f: impl FnOnce(&mut Reducer) -> R) -> R {
        f(&mut lock(&self.reducer))
    }

    /// Gradient elements (f32) the reducer holds right now: its bucket buffers and, under
    /// ZeRO-2, the gradient shard. Not counted: the gradients inside Burn's own container.
    pub fn gradient_elements_held(&self) -> usize {
        lock(&self.reducer).gradient_elements_held()
    }

    /// Restarts this rank's random stream at (seed, rank, step 0). Random ops (dropout,
    /// initializers) of `DistributedBackend` draw from it while this `Ddp` lives: reproducible,
    /// and different on every rank. See [`crate::random`].
    pub fn seed(&self, seed: u64) {
        let mut reducer = lock(&self.reducer);
        reducer.random = RandomStream::new(seed, self.rank());
    }

    /// The random stream's (seed, step), for checkpoints.
    pub fn random_state(&self) -> (u64, u64) {
        let reducer = lock(&self.reducer);
        (reducer.random.seed, reducer.random.step)
    }

    /// Keys the random stream on `step` (its op counter restarts), so that the draws of a step
    /// do not depend on how many random ops earlier steps made, e.g. after a resume.
    pub fn set_step(&self, step: u64) {
        let mut reducer = lock(&self.reducer);
        reducer.random.step = step;
        reducer.random.counter = 0;
    }

    pub fn stats(&self) -> ReducerStats {
        lock(&self.reducer).stats()
    }

    /// The bucket sizes this rank's reducer uses (`DdpConfig::buckets`, with any default the
    /// mode filled in).
    pub fn bucket_config(&self) -> crate::BucketConfig {
        lock(&self.reducer).bucket_config().clone()
    }

    /// The bucket layout in use.
    pub fn layout(&self) -> Layout {
        lock(&self.reducer).layout().clone()
    }

    /// Lays the buckets out for `order` (every trainable parameter once, in expected ready
    /// order, e.g. a checkpoint's), as the first step's observed order would, and skips that
    /// rebuild. Ignored when `order` is empty or gradients are sharded (ZeRO-2's layout is
    /// frozen); any other order that is not a permutation of the parameters is an error.
    pub fn adopt_bucket_order(&self, order: &[usize]) -> Result<()> {
        lock(&self.reducer).adopt_order(order)
    }

    /// The layout the next accumulation window will use.
    pub fn next_layout(&self) -> Layout {
        lock(&self.reducer).next_layout().clone()
    }

    /// The trainable parameters, in the reducer's order (module visit order).
    pub fn params(&self) -> &[ParamInfo] {
        &self.params
    }

    /// Installs a callback that runs inside the gradient hook (tests of overlap).
    #[doc(hidden)]
    pub fn set_observer(&self, observer: impl FnMut(&mut Reducer, ReducerEvent) + Send + 'static) {
        lock(&self.reducer).set_observer(Some(Box::new(observer)));
    }
}

impl Drop for Ddp {
    fn drop(&mut self) {
        context::uninstall(self.scope, &self.reducer);
    }
}

/// After a backward: checks that every local gradient went through the reducer, and adds the
/// reduced gradients of parameters that other ranks used but this one did not.
struct CompleteGradients<'a> {
    reducer: &'a Reducer,
    params: &'a [ParamInfo],
    grads: &'a mut GradientsParams,
    communicated: bool,
    next: usize,
    error: Option<DistError>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for CompleteGradients<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let Some(info) = self
            .params
            .get(self.next)
            .filter(|info| info.id == param.id)
        else {
            return; // not trainable: the reducer does not track it
        };
        let p = self.next;
        self.next += 1;
        let local = self.grads.get::<B::InnerBackend, D>(param.id).is_some();
        if local && !self.reducer.arrived_last(p) {
            self.error.get_or_insert(DistError::NotMarked {
                param: p,
                name: info.name.clone(),
            });
            return;
        }
        if self.communicated
            && !local
            && let Some(values) = self.reducer.reduced(p)
        {
            let device = param.val().device();
            let data = TensorData::new(values, info.shape.clone()).convert_dtype(info.dtype);
            let grad = Tensor::<B::InnerBackend, D>::from_data(data, (&device, info.dtype));
            self.grads.register(param.id, grad);
        }
    }
}
