//! One rank's shard of ZeroAdam's state and its step (the public handle, which Burn's
//! `Optimizer` trait drives, is `crate::zero_adam`).
//!
//! One step, as llm.c's ZeRO-1 path reads:
//! 1. take this rank's shard of the (already averaged) gradient: from Burn's gradients at
//!    stage 1 (the reducer all-reduced them in full), from the reducer at stage 2 (it reduced
//!    each bucket straight to the owners, so no rank ever held the full reduced gradient);
//! 2. unscale it and check it; agree with every rank on "found inf" and the global norm
//!    (one tiny all-gather, norms summed in f64 in rank order);
//! 3. update the shard's master weights and moments with clipped AdamW (skipped everywhere if
//!    any rank found inf/NaN);
//! 4. all-gather the updated master shards and write them into the model's tensors; at stage
//!    3, where the model's parameters are sharded too, write this rank's updated shard into its
//!    pieces instead (no collective: the next forward gathers).
//!
//! Each rank keeps `3 × shard_len` floats of state instead of `3 × total`.

use std::ops::Range;
use std::sync::Arc;

use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};
use burn_dist::{Ddp, DistError, ParamInfo, ParamShards, SyncHandle, mark_for_sync};
use burn_dist_comm::{Communicator, HostBuffer, HostCommunicator};
#[cfg(feature = "device")]
use burn_dist_kernels::Hyper;
use burn_dist_kernels::{ModelCopy, StepScalars, clip_factor, host};

use crate::config::ZeroAdamConfig;
use crate::error::{Result, ZeroError};
use crate::flat::{FlatLayout, Piece};
use crate::loaded::{NOTE_LEN, Replaced, Stamps};
#[cfg(feature = "device")]
use crate::offload::{OffloadState, Offloaded};
#[cfg(feature = "device")]
use crate::resident::{Resident, ResidentState};

/// This rank's part of ZeroAdam: its shard of the state and what a step needs.
pub(crate) struct Shard {
    pub(crate) config: ZeroAdamConfig,
    comm: Arc<HostCommunicator>,
    pub(crate) params: Vec<ParamInfo>,
    /// Per parameter: whether weight decay applies (`ZeroAdamConfig::decay`).
    decays: Vec<bool>,
    pub(crate) layout: FlatLayout,
    pieces: Vec<Piece>,
    master: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    /// Adam's step count per parameter of this shard (Burn counts per parameter: a parameter
    /// without a gradient in a step does not advance).
    time: Vec<u32>,
    /// Steps skipped because some rank found inf/NaN.
    skipped: u64,
    /// When set, master, m, v and the gradient shard live in the model's device memory (the
    /// host vectors are empty) and the fused kernels update them (feature `device`).
    #[cfg(feature = "device")]
    device: Option<Box<dyn ResidentState>>,
    /// When set, the model and the reducer are on the device and the state stays here, in the
    /// host vectors: the host step runs on the gradient shard read down, and the new shard goes
    /// back up to be gathered on the device (`ZeroAdam::offloaded`, feature `device`).
    #[cfg(feature = "device")]
    offload: Option<Box<dyn OffloadState>>,
    /// The host step's own threads (`ZeroAdamConfig::host_threads`); `None`: rayon's global
    /// pool.
    host_pool: Option<rayon::ThreadPool>,
    /// Stage 3: the model's pieces of the sharded parameters, which the step writes.
    shards: Option<Arc<ParamShards>>,
    /// What the model's parameters were at the end of the last step (or when this was built),
    /// to see those replaced since (`crate::loaded`).
    stamps: Stamps,
    /// Whether the state was imported since the last step: its master weights go with the
    /// loaded model, and win over the model's values.
    imported: bool,
}

/// One rank's optimizer state: its shard of the fp32 master weights and moments, and the
/// per-parameter step counts (identical on every rank).
#[derive(Debug, Clone, PartialEq)]
pub struct OptimizerShard {
    pub rank: usize,
    pub layout: FlatLayout,
    pub master: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    pub time: Vec<u32>,
    pub skipped: u64,
}

/// What a step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// Global L2 norm of the gradient before clipping.
    pub grad_norm: f64,
    /// The factor the gradient was multiplied by (1 when not clipped).
    pub clip: f32,
    /// Whether the step was skipped because some rank's gradient had inf or NaN.
    pub skipped: bool,
}

impl Shard {
    pub(crate) fn new<B: AutodiffBackend, M: AutodiffModule<B>>(
        config: ZeroAdamConfig,
        ddp: &Ddp,
        model: &M,
    ) -> Result<Self> {
        let params = ddp.params().to_vec();
        if params.is_empty() {
            return Err(ZeroError::NotPrepared);
        }
        if !(1..=3).contains(&config.stage) {
            return Err(ZeroError::UnsupportedStage {
                stage: config.stage,
            });
        }
        let shards = sharded_model(&config, ddp)?;
        let decays = config.decay.resolve(&params)?;
        let numels: Vec<usize> = params.iter().map(ParamInfo::numel).collect();
        let layout = FlatLayout::new(&numels, ddp.world_size(), config.align);
        if config.stage >= 2 {
            ddp.shard_gradients(layout.clone())?;
            // The host step takes the shard on the host: on the device path it is read down
            // bucket by bucket during backward (`on_device` turns this off again).
            ddp.stream_gradient_shard_to_host(true);
        }
        let pieces = layout.pieces(ddp.rank());
        let master = match &shards {
            // In f32 the model's pieces are the master weights (`ParamShards::with_master`).
            Some(shards) if shards.holds_f32_shard() => Vec::new(),
            // The model holds this rank's shard already: nothing is gathered.
            Some(shards) => shards.shard_values(),
            None => {
                let mut master = vec![0.0; layout.shard_len];
                let mut read = ReadShard::<B> {
                    params: &params,
                    pieces: &pieces,
                    grads: None,
                    only: None,
                    out: &mut master,
                    present: Vec::new(),
                    has_grad: vec![false; params.len()],
                    _b: Default::default(),
                };
                model.visit(&mut read);
                master
            }
        };
        let host_pool = config.host_threads.map(host_pool).transpose()?;
        let stamps = Stamps::of::<B, M>(&params, shards.as_deref(), model);
        Ok(Shard {
            comm: ddp.comm(),
            time: vec![0; params.len()],
            m: vec![0.0; layout.shard_len],
            v: vec![0.0; layout.shard_len],
            master,
            params,
            decays,
            layout,
            pieces,
            config,
            skipped: 0,
            #[cfg(feature = "device")]
            device: None,
            #[cfg(feature = "device")]
            offload: None,
            host_pool,
            shards,
            stamps,
            imported: false,
        })
    }

    pub(crate) fn state_len(&self) -> usize {
        #[cfg(feature = "device")]
        if self.device.is_some() {
            return 3 * self.layout.shard_len;
        }
        if self.shares_master() {
            return 3 * self.layout.shard_len;
        }
        self.master.len() + self.m.len() + self.v.len()
    }

    pub(crate) fn placement(&self) -> crate::Placement {
        #[cfg(feature = "device")]
        if self.device.is_some() {
            return crate::Placement::Device;
        }
        #[cfg(feature = "device")]
        if self.offload.is_some() {
            return crate::Placement::Offloaded;
        }
        crate::Placement::Host
    }

    /// Stage 3 in f32: the master weights are the model's pieces, not `self.master`.
    fn shares_master(&self) -> bool {
        self.shards.as_ref().is_some_and(|s| s.holds_f32_shard())
    }

    /// This rank's master weights, wherever they live.
    fn master_values(&self) -> Vec<f32> {
        match &self.shards {
            Some(shards) if shards.holds_f32_shard() => shards.shard_values(),
            _ => self.master.clone(),
        }
    }

    /// See `ZeroAdam::on_device`.
    #[cfg(feature = "device")]
    pub(crate) fn on_device<D: burn_dist::CubeResident>(
        &mut self,
        ddp: &Ddp,
        device: &D::Device,
    ) -> Result<()> {
        self.check_not_placed("on_device")?;
        // Stage 3: the step updates the model's pieces in device memory, where they must be.
        let stage3 = match &self.shards {
            Some(shards) => Some(crate::resident::Stage3Pieces(
                shards
                    .device_shard()
                    .ok_or(ZeroError::Stage3OnDevice { asked: "on_device" })?
                    .0,
            )),
            None => None,
        };
        let collectives =
            ddp.device_collectives::<D::Runtime>()
                .ok_or_else(|| ZeroError::NotOnDevicePath {
                    backend: std::any::type_name::<D>(),
                })?;
        let dtype = self.one_dtype()?;
        let steps = self.uniform_step_count(&self.time)?;
        // The step takes the reducer's shard where it is, in device memory.
        ddp.stream_gradient_shard_to_host(false);
        let resident = Resident::<D>::new(
            collectives,
            device,
            self.layout.clone(),
            dtype,
            &self.master,
            &self.m,
            &self.v,
            steps,
            &self.element_decays(),
            ddp.bucket_config().bucket_bytes,
            self.config.stage >= 2,
            stage3,
        )?;
        tracing::info!(device = %resident.name(), "ZeroAdam state moved to the device");
        self.device = Some(Box::new(resident));
        (self.master, self.m, self.v) = (Vec::new(), Vec::new(), Vec::new());
        Ok(())
    }

    /// See `ZeroAdam::offloaded`.
    #[cfg(feature = "device")]
    pub(crate) fn offloaded<D: burn_dist::CubeResident>(
        &mut self,
        ddp: &Ddp,
        device: &D::Device,
    ) -> Result<()> {
        self.check_not_placed("offloaded")?;
        // Stage 3: the step writes the new shard into the model's pieces, which must be in
        // device memory (the host path's pieces are already beside the host state).
        if let Some(shards) = &self.shards {
            shards
                .device_shard()
                .ok_or(ZeroError::Stage3OnDevice { asked: "offloaded" })?;
        }
        let collectives =
            ddp.device_collectives::<D::Runtime>()
                .ok_or_else(|| ZeroError::NotOnDevicePath {
                    backend: std::any::type_name::<D>(),
                })?;
        let offload = Offloaded::<D>::new(
            collectives,
            device,
            self.layout.clone(),
            self.one_dtype()?,
            ddp.bucket_config().bucket_bytes,
        )?;
        tracing::info!(device = %offload.name(), "ZeroAdam's model on the device, its state on the host");
        self.offload = Some(Box::new(offload));
        Ok(())
    }

    /// Refuses to place the state a second time (`asked`: the call that would).
    #[cfg(feature = "device")]
    fn check_not_placed(&self, asked: &'static str) -> Result<()> {
        let placed = match (&self.device, &self.offload) {
            (Some(_), _) => "in device memory (`on_device`)",
            (_, Some(_)) => "offloaded to the host (`offloaded`)",
            (None, None) => return Ok(()),
        };
        Err(ZeroError::AlreadyPlaced { placed, asked })
    }

    /// The one dtype of every parameter, which the device path writes (its gathers and its
    /// model copy are of one type).
    #[cfg(feature = "device")]
    fn one_dtype(&self) -> Result<burn::tensor::DType> {
        let dtype = self.params[0].dtype;
        match self.params.iter().find(|p| p.dtype != dtype) {
            None => Ok(dtype),
            Some(other) => Err(ZeroError::MixedDtypes {
                first: self.params[0].name.clone(),
                first_dtype: format!("{dtype:?}"),
                other: other.name.clone(),
                other_dtype: format!("{:?}", other.dtype),
            }),
        }
    }

    /// Per element of this shard: whether weight decay applies (padding does; nothing reads
    /// it).
    #[cfg(feature = "device")]
    fn element_decays(&self) -> Vec<bool> {
        let mut decays = vec![true; self.layout.shard_len];
        for piece in &self.pieces {
            decays[piece.in_shard.clone()].fill(self.decays[piece.param]);
        }
        decays
    }

    #[cfg(feature = "device")]
    pub(crate) fn traffic(&self) -> Option<burn_dist::Traffic> {
        match (&self.device, &self.offload) {
            (Some(device), _) => Some(device.traffic()),
            (_, Some(offload)) => Some(offload.traffic()),
            (None, None) => None,
        }
    }

    #[cfg(feature = "device")]
    /// The step count every parameter shares in `time` (per parameter), as the device's single
    /// counter needs.
    fn uniform_step_count(&self, time: &[u32]) -> Result<u32> {
        let first = time.first().copied().unwrap_or(0);
        match time.iter().position(|&t| t != first) {
            None => Ok(first),
            Some(i) => Err(ZeroError::UnevenStepCounts {
                param: self.params[i].name.clone(),
                steps: time[i],
                first: self.params[0].name.clone(),
                first_steps: first,
            }),
        }
    }

    pub(crate) fn export(&self) -> OptimizerShard {
        #[cfg(feature = "device")]
        let [master, m, v] = match &self.device {
            Some(device) => device.state(),
            None => [self.master_values(), self.m.clone(), self.v.clone()],
        };
        #[cfg(not(feature = "device"))]
        let [master, m, v] = [self.master_values(), self.m.clone(), self.v.clone()];
        OptimizerShard {
            rank: self.comm.rank(),
            layout: self.layout.clone(),
            master,
            m,
            v,
            time: self.time.clone(),
            skipped: self.skipped,
        }
    }

    /// Whether [`Shard::import`] takes `shard`, checked with nothing changed: this rank's
    /// layout, and on the device path one step count for every parameter.
    pub(crate) fn check_import(&self, shard: &OptimizerShard) -> Result<()> {
        if shard.layout != self.layout || shard.rank != self.comm.rank() {
            return Err(ZeroError::ShardMismatch {
                rank: shard.rank,
                shard_len: shard.layout.shard_len,
                world: shard.layout.world,
                expected_rank: self.comm.rank(),
                expected_shard_len: self.layout.shard_len,
                expected_world: self.layout.world,
            });
        }
        #[cfg(feature = "device")]
        if self.device.is_some() {
            self.uniform_step_count(&shard.time)?;
        }
        Ok(())
    }

    pub(crate) fn import(&mut self, shard: OptimizerShard) -> Result<()> {
        // Checked before anything changes.
        self.check_import(&shard)?;
        #[cfg(feature = "device")]
        if self.device.is_some() {
            let steps = self.uniform_step_count(&shard.time)?;
            if let Some(device) = self.device.as_mut() {
                device.load(&shard.master, &shard.m, &shard.v, steps)?;
            }
            // Stage 3: the model's pieces are the master weights (in f32 the load wrote them in
            // place), rounded below f32; what was gathered ahead from them is stale either way.
            if let Some(shards) = &self.shards {
                match shards.device_shard() {
                    Some((_, burn::tensor::DType::F32)) => shards.pieces_changed(),
                    _ => shards.write_shard(&shard.master),
                }
            }
            self.time = shard.time;
            self.skipped = shard.skipped;
            self.imported = true;
            return Ok(());
        }
        self.time = shard.time;
        self.m = shard.m;
        self.v = shard.v;
        self.skipped = shard.skipped;
        // Stage 3: the model's parameters are this shard of the master weights (in f32 they
        // are the master weights).
        match &self.shards {
            Some(shards) if shards.holds_f32_shard() => shards.write_shard(&shard.master),
            Some(shards) => {
                shards.write_shard(&shard.master);
                self.master = shard.master;
            }
            None => self.master = shard.master,
        }
        self.imported = true;
        Ok(())
    }

    pub(crate) fn skipped_steps(&self) -> u64 {
        self.skipped
    }

    /// One step on the gradients of a loss scaled by `1 / inv_scale` (see
    /// `ZeroAdam::step_scaled`).
    pub(crate) fn step<B: AutodiffBackend, M: AutodiffModule<B>>(
        &mut self,
        lr: f64,
        model: M,
        grads: GradientsParams,
        sync: &SyncHandle,
        inv_scale: f32,
    ) -> Result<(M, StepReport)> {
        if let Some(shards) = &self.shards {
            shards.check_model(&model)?;
        }
        // The parameters replaced since the last step (a record loaded), whose values the
        // update starts from (`crate::loaded`).
        let now = Stamps::of::<B, M>(&self.params, self.shards.as_deref(), &model);
        let replaced = Replaced {
            params: self.stamps.replaced_in(&now),
            imported: self.imported,
        };
        #[cfg(feature = "device")]
        let stepped = match self.device.is_some() {
            true => self.step_on_device::<B, M>(lr, model, grads, sync, inv_scale, &replaced),
            false => self.host_step::<B, M>(lr, model, grads, sync, inv_scale, &replaced),
        };
        #[cfg(not(feature = "device"))]
        let stepped = self.host_step::<B, M>(lr, model, grads, sync, inv_scale, &replaced);
        let (model, report) = stepped?;
        // Stage 3's stamps are the loads seen above (the step's own writes are not loads);
        // stages 1 and 2 stamp the tensors the step leaves in the model.
        self.stamps = match now {
            Stamps::Loads(_) => now,
            Stamps::Nodes(_) => Stamps::of::<B, M>(&self.params, None, &model),
        };
        self.imported = false;
        Ok((model, report))
    }

    /// [`Shard::step`] with the state on the host.
    fn host_step<B: AutodiffBackend, M: AutodiffModule<B>>(
        &mut self,
        lr: f64,
        model: M,
        grads: GradientsParams,
        sync: &SyncHandle,
        inv_scale: f32,
        replaced: &Replaced,
    ) -> Result<(M, StepReport)> {
        // 1. This rank's shard of the gradient. Offloaded at stage 1: reduced on the device,
        // this rank's pieces read down here; at stages 2 and 3 the reducer's shard, read down
        // during backward (`Ddp::stream_gradient_shard_to_host`), as on the host path.
        #[cfg(feature = "device")]
        let offloaded = match self.offload.as_deref_mut() {
            Some(offload) if self.config.stage == 1 => {
                Some(crate::offload::gradient_to_host::<B, M>(
                    offload,
                    &self.params,
                    &self.pieces,
                    self.layout.shard_len,
                    &model,
                    &grads,
                )?)
            }
            _ => None,
        };
        #[cfg(not(feature = "device"))]
        let offloaded = None;
        let (mut grad, present, has_grad) = if let Some(offloaded) = offloaded {
            offloaded
        } else if self.config.stage >= 2 {
            let shard = sync.take_gradient_shard()?;
            let present = self.pieces.iter().map(|p| shard.used[p.param]).collect();
            (shard.values, present, shard.used)
        } else {
            let mut grad = vec![0.0f32; self.layout.shard_len];
            let mut read = ReadShard::<B> {
                params: &self.params,
                pieces: &self.pieces,
                grads: Some(&grads),
                only: None,
                out: &mut grad,
                present: Vec::new(),
                has_grad: vec![false; self.params.len()],
                _b: Default::default(),
            };
            model.visit(&mut read);
            let (present, has_grad) = (read.present, read.has_grad);
            (grad, present, has_grad)
        };

        // 2. Agree on found-inf and the global norm.
        let (found_inf, sum_sq) = on_threads(self.host_pool.as_ref(), || {
            host::unscale_and_check(&mut grad, inv_scale)
        });
        let (report, _) = self.conclude(found_inf, sum_sq, &has_grad, replaced)?;
        let (found_inf, clip) = (report.skipped, report.clip);
        // Every rank found the same parameters replaced: their values become the master
        // weights the update starts from.
        self.take_replaced::<B, M>(&model, replaced);

        // 3. Clipped Adam(W) on the shard, parameter by parameter (Burn keeps a step count per
        //    parameter, and a parameter without a gradient is left alone).
        let scalars = |step, decays| self.config.scalars(lr, step, decays);
        if !found_inf {
            let (m, v) = (&mut self.m, &mut self.v);
            let mut update = |master: &mut [f32]| {
                on_threads(self.host_pool.as_ref(), || {
                    let runs = update_runs(&self.pieces, &present, &self.time, &self.decays);
                    for (r, step, decays) in runs {
                        host::adam_update(
                            &mut master[r.clone()],
                            &mut m[r.clone()],
                            &mut v[r.clone()],
                            &grad[r],
                            clip,
                            false,
                            &scalars(step, decays),
                            ModelCopy::None,
                        );
                    }
                })
            };
            match &self.shards {
                // Stage 3 in f32: the master weights are the model's pieces, stepped in place.
                Some(shards) if shards.holds_f32_shard() => {
                    shards.with_master(update);
                }
                _ => update(&mut self.master),
            }
        }

        // 4. Stage 3: the model's pieces are this shard; the next forward gathers them.
        if let Some(shards) = &self.shards {
            if !found_inf && !shards.holds_f32_shard() {
                shards.write_shard(&self.master);
            }
            let model = model.map(&mut FreshLeaves { shards });
            return Ok((mark_for_sync(model), report));
        }
        // 4. Offloaded: the new shard up, every rank's new parameters gathered on the device.
        #[cfg(feature = "device")]
        if let Some(offload) = self.offload.as_deref_mut() {
            let model = crate::offload::write_back::<B, M>(
                offload,
                &self.params,
                &self.master,
                found_inf,
                model,
            )?;
            return Ok((mark_for_sync(model), report));
        }
        // 4. Everyone gets every updated shard.
        let full = self
            .comm
            .all_gather(
                HostBuffer::F32(self.master.clone()),
                self.layout.padded_len(),
            )
            .wait()?;
        let HostBuffer::F32(full) = full else {
            unreachable!("f32 all-gather")
        };
        let model = model.map(&mut WriteParams::<B> {
            params: &self.params,
            layout: &self.layout,
            flat: &full,
            _b: Default::default(),
        });
        Ok((mark_for_sync(model), report))
    }

    /// Takes the model's values of the parameters `replaced` names into this shard's master
    /// weights, unless they are the model's pieces (stage 3 in f32: the load wrote them) or the
    /// imported state's master weights win (`crate::loaded`).
    fn take_replaced<B: AutodiffBackend, M: AutodiffModule<B>>(
        &mut self,
        model: &M,
        replaced: &Replaced,
    ) {
        if !replaced.takes_values() {
            return;
        }
        self.log_taken(replaced);
        match &self.shards {
            Some(shards) if shards.holds_f32_shard() => {}
            // The pieces hold the loaded values, in the parameters' dtype.
            Some(shards) => {
                let values = shards.shard_values();
                for piece in replaced_pieces(&self.pieces, replaced) {
                    let range = piece.in_shard.clone();
                    self.master[range.clone()].copy_from_slice(&values[range]);
                }
            }
            None => model.visit(&mut ReadShard::<B> {
                params: &self.params,
                pieces: &self.pieces,
                grads: None,
                only: Some(&replaced.params),
                out: &mut self.master,
                present: Vec::new(),
                has_grad: vec![false; self.params.len()],
                _b: Default::default(),
            }),
        }
    }

    /// [`Shard::take_replaced`] on the device path: the values are copied on the device,
    /// converted to f32, into the master weights.
    #[cfg(feature = "device")]
    fn take_replaced_on_device<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        device: &mut dyn ResidentState,
        model: &M,
        replaced: &Replaced,
    ) -> Result<()> {
        if !replaced.takes_values() {
            return Ok(());
        }
        self.log_taken(replaced);
        match &self.shards {
            // Stage 3 in f32: the pieces are the master weights, which the load wrote.
            Some(shards) if shards.holds_f32_shard() => Ok(()),
            Some(shards) => match shards.device_shard() {
                Some((_, burn::tensor::DType::F32)) => Ok(()),
                // Below f32 the pieces are the device state's model copy.
                _ => replaced_pieces(&self.pieces, replaced)
                    .try_for_each(|piece| device.take_master_from_model_copy(piece)),
            },
            None => {
                let mut take = crate::resident::TakeMaster::<B> {
                    params: &self.params,
                    pieces: &self.pieces,
                    replaced: &replaced.params,
                    device,
                    error: None,
                    _b: Default::default(),
                };
                model.visit(&mut take);
                take.error.map_or(Ok(()), Err)
            }
        }
    }

    fn log_taken(&self, replaced: &Replaced) {
        tracing::info!(
            rank = self.comm.rank(),
            params = replaced.params.len(),
            first = %self.params[replaced.params[0]].name,
            "ZeroAdam: parameters replaced since the last step (a record loaded?); the step goes \
             on from their values, which become the master weights (the moments are kept)"
        );
    }

    /// Agrees with every rank on found-inf and the global norm (from this shard's), counts the
    /// step (per parameter that had a gradient) or the skip, and reports; also returns the
    /// total sum of squares.
    fn conclude(
        &mut self,
        found_inf: bool,
        sum_sq: f64,
        has_grad: &[bool],
        replaced: &Replaced,
    ) -> Result<(StepReport, f64)> {
        let (found_inf, total_sum_sq) = self.agree(found_inf, sum_sq, replaced)?;
        let report = StepReport {
            grad_norm: total_sum_sq.sqrt(),
            clip: clip_factor(total_sum_sq, self.config.max_grad_norm),
            skipped: found_inf,
        };
        if found_inf {
            self.skipped += 1;
        } else {
            // Every rank counts every parameter's steps, so that any rank's checkpoint (and any
            // resharding) knows them all.
            for (time, &stepped) in self.time.iter_mut().zip(has_grad) {
                *time += u32::from(stepped);
            }
        }
        Ok((report, total_sum_sq))
    }

    /// The step of `ZeroAdam::on_device`: the gradient shard, the update and the new
    /// parameters stay in device memory.
    #[cfg(feature = "device")]
    fn step_on_device<B: AutodiffBackend, M: AutodiffModule<B>>(
        &mut self,
        lr: f64,
        model: M,
        grads: GradientsParams,
        sync: &SyncHandle,
        inv_scale: f32,
        replaced: &Replaced,
    ) -> Result<(M, StepReport)> {
        let mut device = self.device.take().expect("called on the device path");
        let stepped =
            self.device_step::<B, M>(&mut *device, lr, model, grads, sync, inv_scale, replaced);
        self.device = Some(device);
        stepped
    }

    #[cfg(feature = "device")]
    #[allow(clippy::too_many_arguments)]
    fn device_step<B: AutodiffBackend, M: AutodiffModule<B>>(
        &mut self,
        device: &mut dyn ResidentState,
        lr: f64,
        model: M,
        grads: GradientsParams,
        sync: &SyncHandle,
        inv_scale: f32,
        replaced: &Replaced,
    ) -> Result<(M, StepReport)> {
        // 1. This rank's shard of the gradient, on the device.
        let has_grad = crate::resident::gradient_on_device::<B, M>(
            self.config.stage,
            &self.params,
            &self.pieces,
            &model,
            &grads,
            sync,
            &mut *device,
        )?;
        if let Some(p) = has_grad.iter().position(|&h| !h) {
            return Err(ZeroError::MissingGradient {
                param: self.params[p].name.clone(),
            });
        }
        // 2. Agree on found-inf and the global norm (two scalars each way).
        let (found_inf, sum_sq) = device.check(inv_scale)?;
        let (report, total_sum_sq) = self.conclude(found_inf, sum_sq, &has_grad, replaced)?;
        // Every rank found the same parameters replaced: their values become the master
        // weights the update starts from (on the device, ordered before the update).
        self.take_replaced_on_device::<B, M>(device, &model, replaced)?;
        // 3. The kernels skip the update themselves when found-inf, and count the step.
        let hyper = Hyper {
            scalars: self.config.scalars(lr, 0, true),
            max_norm: self.config.max_grad_norm,
        };
        device.update(report.skipped, total_sum_sq, hyper)?;
        // 4. Stage 3: the step wrote the model's pieces in place; the next forward gathers.
        if let Some(shards) = &self.shards {
            shards.pieces_changed();
            let model = model.map(&mut FreshLeaves { shards });
            return Ok((mark_for_sync(model), report));
        }
        if report.skipped {
            // Nothing changed, and the kernels wrote no model copy (before a first step that
            // was not skipped there is none to gather).
            return Ok((mark_for_sync(model), report));
        }
        // 4. Every rank's new parameters, device to device, into the model, a group at a time.
        let mut write = crate::new_params::WriteDeviceParams::<B> {
            params: &self.params,
            device,
            error: None,
            _b: Default::default(),
        };
        let model = model.map(&mut write);
        match write.error {
            Some(error) => Err(error),
            None => Ok((mark_for_sync(model), report)),
        }
    }

    /// Every rank's (found_inf, sum of squares), gathered and folded in rank order in f64, so
    /// every rank reaches the same decision and the same clip factor. A total beyond f32's
    /// range counts as an overflow, on the host path as on the device path (whose kernels sum
    /// the squares in f32): the gradient holds an element whose square, Adam's `v`, is inf in
    /// f32.
    ///
    /// Every rank also brings which parameters it found replaced since the last step
    /// (`Replaced::note`, zeros when none): ranks that differ fail, all of them.
    ///
    /// At stage 3 every rank also brings the digest and the count of its uses of the sharded
    /// parameters during the step (`ParamShards::end_step`): ranks whose sequences differ fail,
    /// every one of them naming the first rank that differs from rank 0, and which phases have
    /// a new gather schedule to share (`ParamShards::new_schedules`), which must be the same.
    fn agree(&self, found_inf: bool, sum_sq: f64, replaced: &Replaced) -> Result<(bool, f64)> {
        let uses = self.shards.as_ref().map(|shards| shards.end_step());
        let new_schedules = self.shards.as_ref().map_or(0, |s| s.new_schedules());
        let mut mine = sum_sq.to_le_bytes().to_vec();
        mine.extend_from_slice(&[u8::from(found_inf), new_schedules]);
        // Where the later parts lie, from what came before them.
        let note_at = mine.len();
        mine.extend_from_slice(&replaced.note());
        let uses_at = mine.len();
        if let Some((digest, count)) = uses {
            mine.extend_from_slice(&digest.to_le_bytes());
            mine.extend_from_slice(&count.to_le_bytes());
        }
        let (world, per_rank) = (self.comm.world_size(), mine.len());
        let all = self
            .comm
            .all_gather(HostBuffer::U8(mine), per_rank * world)
            .wait()?;
        let all = all.as_bytes();
        let mut total = 0.0f64;
        let mut any_inf = false;
        for rank in all.chunks_exact(per_rank) {
            total += f64::from_le_bytes(rank[..8].try_into().expect("8 bytes"));
            any_inf |= rank[8] != 0;
        }
        if uses.is_some() {
            // The digest and the count of uses end each rank's part.
            let count =
                |rank: &[u8]| u64::from_le_bytes(rank[uses_at + 8..].try_into().expect("8 bytes"));
            let rank0 = &all[..per_rank];
            if let Some((rank, other)) = all
                .chunks_exact(per_rank)
                .enumerate()
                .find(|(_, other)| other[uses_at..] != rank0[uses_at..])
            {
                return Err(ZeroError::Dist(DistError::UseSequence {
                    rank,
                    uses: count(other),
                    rank0_uses: count(rank0),
                }));
            }
        }
        // Which parameters each rank found replaced since the last step (`crate::loaded`).
        replaced.check_agreed(
            all.chunks_exact(per_rank)
                .map(|rank| &rank[note_at..note_at + NOTE_LEN]),
            &self.params,
        )?;
        if let Some(shards) = &self.shards {
            // The ranks used the parameters in the same order: a recorded one becomes the
            // gather schedule, once every rank has one for the same phases.
            let every_rank: Vec<u8> = all.chunks_exact(per_rank).map(|rank| rank[9]).collect();
            shards.check_new_schedules(&every_rank)?;
            shards.adopt_schedules()?;
        }
        Ok((any_inf || !(total as f32).is_finite(), total))
    }
}

/// Stage 3's sharded model (`Ddp::prepare_sharded`), and a check that the stage and the model
/// go together: stage 3 needs the sharded model, and stages 1 and 2 would replace its
/// parameters by full tensors.
fn sharded_model(config: &ZeroAdamConfig, ddp: &Ddp) -> Result<Option<Arc<ParamShards>>> {
    let shards = ddp.param_shards();
    match (config.stage, &shards) {
        (3, None) => Err(ZeroError::StageAndModel {
            stage: 3,
            state: "prepared by `Ddp::prepare` (its parameters are not sharded)",
        }),
        (1 | 2, Some(_)) => Err(ZeroError::StageAndModel {
            stage: config.stage,
            state: "whose parameters are sharded (`Ddp::prepare_sharded`)",
        }),
        (3, Some(_)) if config.align != burn_dist::SHARD_ALIGN => Err(ZeroError::Stage3Align {
            align: config.align,
            model_align: burn_dist::SHARD_ALIGN,
        }),
        _ => Ok(shards),
    }
}

/// Stage 3's write-back into the model: every sharded parameter becomes a fresh autodiff leaf
/// over the same handle (whose pieces now hold the new values), as a Burn optimizer's step
/// leaves fresh leaves behind.
struct FreshLeaves<'a> {
    shards: &'a ParamShards,
}

impl<B: AutodiffBackend> ModuleMapper<B> for FreshLeaves<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        if !self.shards.params().iter().any(|p| p.id == param.id) {
            return param;
        }
        let (id, tensor, mapper) = param.consume();
        Param::from_mapped_value(
            id,
            Tensor::from_inner(tensor.inner()).require_grad(),
            mapper,
        )
    }
}

/// This rank's pieces of the parameters `replaced` names.
fn replaced_pieces<'a>(
    pieces: &'a [Piece],
    replaced: &'a Replaced,
) -> impl Iterator<Item = &'a Piece> + 'a {
    pieces
        .iter()
        .filter(|piece| replaced.params.contains(&piece.param))
}

/// The host step's thread pool of `threads` threads.
fn host_pool(threads: usize) -> Result<rayon::ThreadPool> {
    if threads == 0 {
        return Err(ZeroError::HostThreads {
            threads,
            reason: "give at least 1, or None for rayon's global pool".into(),
        });
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("zero-adam-host-{i}"))
        .build()
        .map_err(|e| ZeroError::HostThreads {
            threads,
            reason: e.to_string(),
        })
}

/// Runs `work` on `pool`, or on the current rayon pool (the global one) when `None`.
fn on_threads<R: Send>(pool: Option<&rayon::ThreadPool>, work: impl FnOnce() -> R + Send) -> R {
    match pool {
        Some(pool) => pool.install(work),
        None => work(),
    }
}

/// The shard ranges the host step updates, each with its step count and whether it decays:
/// the pieces that had a gradient (`present`, per piece), adjacent ones with the same step
/// count and decay merged, so that a model whose parameters all step together and all decay
/// is one range (one parallel update of the whole shard, less its padding) instead of one per
/// parameter.
fn update_runs(
    pieces: &[Piece],
    present: &[bool],
    time: &[u32],
    decays: &[bool],
) -> Vec<(Range<usize>, u32, bool)> {
    let mut runs: Vec<(Range<usize>, u32, bool)> = Vec::new();
    for (piece, _) in pieces.iter().zip(present).filter(|(_, present)| **present) {
        let (step, decay) = (time[piece.param], decays[piece.param]);
        match runs.last_mut() {
            Some((run, run_step, run_decay))
                if run.end == piece.in_shard.start && *run_step == step && *run_decay == decay =>
            {
                run.end = piece.in_shard.end;
            }
            _ => runs.push((piece.in_shard.clone(), step, decay)),
        }
    }
    runs
}

impl ZeroAdamConfig {
    /// The update's scalars at learning rate `lr` and step `step`, for parameters that decay
    /// (`decays`) or not.
    fn scalars(&self, lr: f64, step: u32, decays: bool) -> StepScalars {
        StepScalars {
            lr: lr as f32,
            beta1: self.beta_1,
            beta2: self.beta_2,
            eps: self.epsilon,
            weight_decay: if decays { self.weight_decay } else { 0.0 },
            decoupled: self.decoupled_weight_decay,
            step,
        }
    }
}

/// Copies, for every piece of this rank's shard, either the parameter's values (building the
/// master weights) or its gradient, into `out`; records which pieces had a gradient.
struct ReadShard<'a, B: AutodiffBackend> {
    params: &'a [ParamInfo],
    pieces: &'a [Piece],
    grads: Option<&'a GradientsParams>,
    /// When given, only these parameters' pieces (the replaced ones, `crate::loaded`).
    only: Option<&'a [usize]>,
    out: &'a mut [f32],
    /// Per piece: whether its parameter had a gradient.
    present: Vec<bool>,
    /// Per parameter (all of them, not only this shard's): whether it had a gradient.
    has_grad: Vec<bool>,
    _b: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for ReadShard<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let Some(index) = self.params.iter().position(|p| p.id == param.id) else {
            return;
        };
        if self.only.is_some_and(|only| !only.contains(&index)) {
            return;
        }
        if let Some(grads) = self.grads {
            self.has_grad[index] = grads.get::<B::InnerBackend, D>(param.id).is_some();
        }
        for piece in self.pieces.iter().filter(|p| p.param == index) {
            let values = match self.grads {
                None => Some(param.val().into_data()),
                Some(grads) => grads
                    .get::<B::InnerBackend, D>(param.id)
                    .map(|g| g.into_data()),
            };
            self.present.push(values.is_some());
            if let Some(values) = values {
                let values = values
                    .convert::<f32>()
                    .into_vec::<f32>()
                    .expect("f32 values");
                self.out[piece.in_shard.clone()].copy_from_slice(&values[piece.within.clone()]);
            }
        }
    }
}

/// Writes the gathered flat master weights into the model's tensors, in their dtype.
struct WriteParams<'a, B: AutodiffBackend> {
    params: &'a [ParamInfo],
    layout: &'a FlatLayout,
    flat: &'a [f32],
    _b: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleMapper<B> for WriteParams<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let Some(index) = self.params.iter().position(|p| p.id == param.id) else {
            return param;
        };
        let (id, tensor, mapper) = param.consume();
        let info = &self.params[index];
        let start = self.layout.offsets[index];
        let values = self.flat[start..start + info.numel()].to_vec();
        let data = TensorData::new(values, info.shape.clone()).convert_dtype(info.dtype);
        Param::from_mapped_value(id, burn_dist::replace_values(&tensor, data), mapper)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(param: usize, in_shard: Range<usize>) -> Piece {
        Piece {
            param,
            within: 0..in_shard.len(),
            in_shard,
        }
    }

    #[test]
    fn update_runs_merge_adjacent_pieces_of_one_step_count() {
        let pieces = [
            piece(0, 0..5),
            piece(1, 5..9),
            piece(2, 9..20),
            piece(3, 20..21),
        ];
        let all = [true; 4];
        assert_eq!(
            update_runs(&pieces, &all, &[3, 3, 3, 3], &all),
            [(0..21, 3, true)]
        );
        assert_eq!(
            update_runs(&pieces, &all, &[3, 3, 2, 3], &all),
            [(0..9, 3, true), (9..20, 2, true), (20..21, 3, true)],
            "a parameter with another step count is its own run"
        );
        assert_eq!(
            update_runs(&pieces, &all, &[3; 4], &[true, false, false, true]),
            [(0..5, 3, true), (5..20, 3, false), (20..21, 3, true)],
            "parameters that do not decay are runs of their own"
        );
    }

    #[test]
    fn update_runs_leave_out_pieces_without_a_gradient() {
        let pieces = [piece(0, 0..5), piece(1, 5..9), piece(2, 9..20)];
        assert_eq!(
            update_runs(&pieces, &[true, false, true], &[4, 4, 4], &[true; 3]),
            [(0..5, 4, true), (9..20, 4, true)],
            "the runs on either side of a piece without a gradient are not joined"
        );
        assert!(update_runs(&pieces, &[false; 3], &[4, 4, 4], &[true; 3]).is_empty());
    }
}
