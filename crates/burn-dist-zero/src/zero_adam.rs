//! `ZeroAdam`: Adam(W) whose fp32 master weights and moments are sharded across ranks, as a
//! Burn optimizer.
//!
//! Two ways to drive it, one step underneath (`crate::shard`):
//! - Burn's [`Optimizer`] trait, like `AdamConfig::new().init()`: burn-train's `Learner` and any
//!   loop written against the trait. Its record is the whole state, gathered from every rank
//!   to rank 0 ([`ZeroAdamRecord`]), so Burn's recorders save it on rank 0 and it loads at any
//!   world size.
//! - [`ZeroAdam::step`] and [`ZeroAdam::step_scaled`], which return errors as values and a
//!   [`StepReport`], and burn-dist-zero's sharded checkpoints ([`crate::checkpoint`]), where
//!   each rank writes only its shard.
//!
//! A `ZeroAdam` is a handle: clones share the one state of this rank (Burn's trait asks for
//! `Clone`; burn-train clones the optimizer only to replace it with a loaded one).

use std::sync::{Arc, Mutex, MutexGuard};

use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, MultiGradientsParams, Optimizer};
use burn::record::{PrecisionSettings, Record};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn_dist::{Ddp, DistError, GradScaler, SyncCheck};
use burn_dist_comm::{Communicator, HostBuffer};
use serde::{Deserialize, Serialize};

use crate::config::ZeroAdamConfig;
use crate::error::{Result, ZeroError};
use crate::flat::FlatLayout;
use crate::shard::{OptimizerShard, Shard, StepReport};

/// Adam(W) with sharded state. Build it with [`ZeroAdamConfig::init`].
#[derive(Clone)]
pub struct ZeroAdam {
    shard: Arc<Mutex<Shard>>,
    layout: Arc<FlatLayout>,
    /// The trait's steps check that backward synchronized their gradients.
    check: SyncCheck,
}

/// ZeroAdam's whole state as a Burn record: every parameter's fp32 master weights and moments,
/// concatenated in the reducer's parameter order (module visit order), gathered from every
/// rank to rank 0 (the other ranks' records are empty: `numels` is). The shard layout is not
/// in it, so it loads at any world size. Its floats are stored as they are, f32, whatever the
/// recorder's precision settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ZeroAdamRecord {
    pub master: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    /// Elements of each parameter, to refuse a record of another model.
    pub numels: Vec<u64>,
    /// Adam's step count per parameter.
    pub time: Vec<u32>,
    /// Steps skipped because a gradient was not finite.
    pub skipped: u64,
}

impl<B: Backend> Record<B> for ZeroAdamRecord {
    type Item<S: PrecisionSettings> = ZeroAdamRecord;

    fn into_item<S: PrecisionSettings>(self) -> Self::Item<S> {
        self
    }

    fn from_item<S: PrecisionSettings>(item: Self::Item<S>, _device: &B::Device) -> Self {
        item
    }
}

/// Where [`ZeroAdam`]'s state lives ([`ZeroAdam::placement`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// In host memory, updated by the host step, beside a model on the host path.
    Host,
    /// In the model's device memory, updated by the fused kernels ([`ZeroAdam::on_device`]).
    Device,
    /// In host memory, updated by the host step, beside a model and a reducer in device
    /// memory ([`ZeroAdam::offloaded`]).
    Offloaded,
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Placement::Host => "host memory (the host path)",
            Placement::Device => "device memory (on_device)",
            Placement::Offloaded => "host memory beside the device model (offloaded)",
        })
    }
}

impl ZeroAdam {
    pub(crate) fn new<B: AutodiffBackend, M: AutodiffModule<B>>(
        config: ZeroAdamConfig,
        ddp: &Ddp,
        model: &M,
    ) -> Result<Self> {
        let shard = Shard::new::<B, M>(config, ddp, model)?;
        Ok(ZeroAdam {
            layout: Arc::new(shard.layout.clone()),
            shard: Arc::new(Mutex::new(shard)),
            check: SyncCheck::new(ddp.sync_handle()),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Shard> {
        // A panic inside a step leaves no half-written state that a later call could read
        // silently: the panic itself ends the rank.
        self.shard.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The flat layout and this rank's shard of it.
    pub fn layout(&self) -> &FlatLayout {
        &self.layout
    }

    /// Optimizer-state floats this rank holds (master weights, first and second moments), on
    /// the host or on the device.
    pub fn state_len(&self) -> usize {
        self.lock().state_len()
    }

    /// Where the state lives and which step updates it.
    pub fn placement(&self) -> Placement {
        self.lock().placement()
    }

    /// Moves the optimizer state into the device memory of the model's backend `D` (a
    /// burn-cubecl backend, fusion on or off, with `ddp` on the device path:
    /// `Ddp::init_nccl::<D>`, `Ddp::init_staged::<D>`). From then on a step runs entirely
    /// there: the gradient shard is gathered from the gradients on the device (stage 1), the
    /// fused kernels of `burn-dist-kernels` update master weights and moments in place, and
    /// the new parameters are all-gathered device to device in the model's dtype by the
    /// reducer's collectives; only a few scalars cross to the host ([`ZeroAdam::traffic`]).
    /// Every parameter must then have a gradient at every step (the kernels count steps for
    /// the whole shard, Burn per parameter), and all parameters must share one dtype.
    #[cfg(feature = "device")]
    pub fn on_device<D: burn_dist::CubeResident>(
        self,
        ddp: &Ddp,
        device: &D::Device,
    ) -> Result<Self> {
        self.lock().on_device::<D>(ddp, device)?;
        Ok(self)
    }

    /// Keeps the optimizer state (f32 master weights, moments) in host memory while the model
    /// and the reducer live in the device memory of backend `D` (a burn-cubecl backend, fusion
    /// on or off, with `ddp` on the device path: `Ddp::init_nccl::<D>`, `Ddp::init_staged::<D>`):
    /// the alternative to [`ZeroAdam::on_device`] when the state does not fit the device.
    /// ZeRO stages 1 to 3.
    ///
    /// Each step the gradient is reduced on the device as with `on_device`, this rank's shard
    /// of it is read to the host once (`4 · shard_len` bytes; at stages 2 and 3 bucket by
    /// bucket during backward, `Ddp::stream_gradient_shard_to_host`, on for every ZeroAdam
    /// but `on_device`'s; at stage 1 after backward), the host step updates the state
    /// (the host path's step: clipping, loss scaling and per-parameter step counts included),
    /// and the new shard in the model's dtype goes back up (`p · shard_len` bytes): at stages 1
    /// and 2 to be all-gathered device to device into the model, as with `on_device`; at stage
    /// 3 into the model's pieces, which must be in device memory (a model prepared with
    /// `Ddp::prepare_sharded` on the device path; otherwise [`ZeroError::Stage3OnDevice`]).
    /// Between steps the device holds only the parameters (at stage 3, this rank's pieces of
    /// them). All parameters must share one dtype.
    #[cfg(feature = "device")]
    pub fn offloaded<D: burn_dist::CubeResident>(
        self,
        ddp: &Ddp,
        device: &D::Device,
    ) -> Result<Self> {
        self.lock().offloaded::<D>(ddp, device)?;
        Ok(self)
    }

    /// Bytes the optimizer and the reducer's device collectives have moved between host and
    /// device so far (they share one counter); `None` on the host path.
    #[cfg(feature = "device")]
    pub fn traffic(&self) -> Option<burn_dist::Traffic> {
        self.lock().traffic()
    }

    /// This rank's optimizer state, for burn-dist-zero's sharded checkpoints.
    pub fn export(&self) -> OptimizerShard {
        self.lock().export()
    }

    /// Replaces this rank's state with `shard`, which must have this rank's layout (resharding
    /// a checkpoint written at another world size happens before, in `checkpoint`).
    pub fn import(&mut self, shard: OptimizerShard) -> Result<()> {
        self.lock().import(shard)
    }

    /// Whether [`ZeroAdam::import`] would take `shard`, with nothing changed (a checkpoint's
    /// load asks before any rank changes anything).
    pub(crate) fn check_import(&self, shard: &OptimizerShard) -> Result<()> {
        self.lock().check_import(shard)
    }

    /// Steps skipped so far because a gradient was not finite.
    pub fn skipped_steps(&self) -> u64 {
        self.lock().skipped_steps()
    }

    /// One optimizer step with learning rate `lr` on gradients averaged over ranks: `grads` as
    /// `Ddp::backward` returned them (at stage 2 that container is empty and the gradient shard
    /// comes from the reducer).
    pub fn step<B: AutodiffBackend, M: AutodiffModule<B>>(
        &mut self,
        lr: f64,
        model: M,
        grads: GradientsParams,
        ddp: &Ddp,
    ) -> Result<(M, StepReport)> {
        self.lock()
            .step::<B, M>(lr, model, grads, &ddp.sync_handle(), 1.0)
    }

    /// One step on gradients of a loss scaled by `scaler`: unscaled inside the fused pass,
    /// skipped on every rank if any rank's gradient is not finite, and the scale updated. A
    /// skipped step does not advance Adam's step count (nor, so, its bias correction); a
    /// learning-rate schedule driven by the caller's step counter moves on regardless.
    pub fn step_scaled<B: AutodiffBackend, M: AutodiffModule<B>>(
        &mut self,
        lr: f64,
        model: M,
        grads: GradientsParams,
        ddp: &Ddp,
        scaler: &mut GradScaler,
    ) -> Result<(M, StepReport)> {
        let inv_scale = 1.0 / scaler.scale();
        let stepped = self
            .lock()
            .step::<B, M>(lr, model, grads, &ddp.sync_handle(), inv_scale)?;
        scaler.update(stepped.1.skipped);
        Ok(stepped)
    }

    /// Every parameter's state (master weights, moments: each `layout.total` floats, in flat
    /// order), gathered to rank 0 only, and this rank's shard (step counts and skips). The
    /// other ranks get empty vectors: they never hold more than a few chunks of the state.
    fn gather_to_rank_0(&self) -> Result<([Vec<f32>; 3], OptimizerShard)> {
        let shard = self.export();
        let comm = self.check.handle().comm();
        let (world, shard_len) = (self.layout.world, self.layout.shard_len);
        let on_rank_0 = comm.rank() == 0;
        let mut full: [Vec<f32>; 3] = Default::default();
        if on_rank_0 {
            full.iter_mut()
                .for_each(|part| *part = vec![0.0; self.layout.padded_len()]);
        }
        // Chunk c of every rank's shard in one all-gather: rank 0 places each rank's chunk,
        // the others drop theirs at once.
        for start in (0..shard_len).step_by(RECORD_CHUNK) {
            let end = (start + RECORD_CHUNK).min(shard_len);
            let pending: Vec<_> = [&shard.master, &shard.m, &shard.v]
                .into_iter()
                .map(|part| {
                    let chunk = HostBuffer::F32(part[start..end].to_vec());
                    comm.all_gather(chunk, world * (end - start))
                })
                .collect();
            for (part, pending) in full.iter_mut().zip(pending) {
                let HostBuffer::F32(chunks) = pending.wait()? else {
                    unreachable!("f32 all-gather")
                };
                if on_rank_0 {
                    for (rank, chunk) in chunks.chunks_exact(end - start).enumerate() {
                        let at = rank * shard_len + start;
                        part[at..at + chunk.len()].copy_from_slice(chunk);
                    }
                }
            }
        }
        full.iter_mut()
            .for_each(|part| part.truncate(self.layout.total));
        Ok((full, shard))
    }

    /// Loads the whole state of a record: this rank's shard of it.
    fn load(&mut self, record: ZeroAdamRecord) -> Result<()> {
        let layout = &self.layout;
        let numels: Vec<usize> = record.numels.iter().map(|&n| n as usize).collect();
        if numels.is_empty() && !layout.numels.is_empty() {
            return Err(ZeroError::RecordNotOnRankZero);
        }
        if numels != layout.numels {
            return Err(ZeroError::RecordMismatch {
                expected: layout.numels.len(),
                expected_elements: layout.total,
                got: numels.len(),
                got_elements: numels.iter().sum(),
            });
        }
        let rank = self.check.handle().rank();
        let range = layout.shard(rank);
        let slice = |full: &[f32]| -> Vec<f32> {
            let mut shard = vec![0.0; layout.shard_len];
            let end = range.end.min(layout.total);
            if range.start < end {
                shard[..end - range.start].copy_from_slice(&full[range.start..end]);
            }
            shard
        };
        let shard = OptimizerShard {
            rank,
            layout: (**layout).clone(),
            master: slice(&record.master),
            m: slice(&record.m),
            v: slice(&record.v),
            time: record.time,
            skipped: record.skipped,
        };
        self.import(shard)
    }
}

/// Floats of each rank's shard that one all-gather of [`ZeroAdam`]'s record carries (4 MiB),
/// so that the ranks other than 0 hold a few chunks of the state at a time, not all of it.
const RECORD_CHUNK: usize = 1 << 20;

/// Burn's trait cannot return an error: fail with the whole message.
fn or_panic<T>(result: Result<T>) -> T {
    result.unwrap_or_else(|error| panic!("ZeroAdam: {error}"))
}

impl<M, B> Optimizer<M, B> for ZeroAdam
where
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    type Record = ZeroAdamRecord;

    /// [`ZeroAdam::step`] on the gradients that backward averaged (or, at stage 2, the
    /// reducer's shard of them), after checking that a synchronized backward produced them.
    fn step(&mut self, lr: f64, module: M, grads: GradientsParams) -> M {
        self.check.expect_synced();
        let handle = self.check.handle().clone();
        or_panic(self.lock().step::<B, M>(lr, module, grads, &handle, 1.0)).0
    }

    fn step_multi(&mut self, _lr: f64, _module: M, _grads: MultiGradientsParams) -> M {
        panic!("{}", DistError::MultiDevice)
    }

    /// Gathers every rank's shard to rank 0: a collective, so every rank must call it at the
    /// same point (burn-train's checkpointers do, with their default strategy, which saves
    /// every epoch). Only rank 0's record holds the state: save it on rank 0
    /// (`burn_dist::train::RankZeroRecorder`); the other ranks' record is empty and refuses to
    /// load.
    fn to_record(&self) -> ZeroAdamRecord {
        let ([master, m, v], shard) = or_panic(self.gather_to_rank_0());
        let numels = match self.check.handle().rank() {
            0 => self.layout.numels.iter().map(|&n| n as u64).collect(),
            _ => Vec::new(),
        };
        ZeroAdamRecord {
            master,
            m,
            v,
            numels,
            time: shard.time,
            skipped: shard.skipped,
        }
    }

    fn load_record(mut self, record: ZeroAdamRecord) -> Self {
        or_panic(self.load(record));
        self
    }
}
