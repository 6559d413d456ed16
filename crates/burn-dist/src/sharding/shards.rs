//! [`ParamShards`]: one rank's sharded parameters, what every parameter handle of its model
//! refers to. It holds one part per job and adds only what joins them:
//! - `piece_store.rs`: this rank's pieces, and every write into them;
//! - `gathers.rs`: the gather path (schedule, unit gathers, pooled buffers, kept tensors);
//! - `ledger.rs`: what the uses cost, their digest, and the first failure;
//! - `agreement.rs`: how the ranks agree on the schedules at the optimizer step;
//! - `check.rs`: that the model still holds its shards;
//! - `record.rs`: the parameters' own record mappers, around which the record hooks run.

use std::any::Any;
use std::sync::Arc;

use burn::module::{Module, ParamId};
use burn::tensor::TensorData;
use burn::tensor::backend::AutodiffBackend;
use burn_backend::{Backend, DType};
use burn_dist_comm::{CommError, Communicator, HostCommunicator};

use super::frame::{self, Use};
use super::gathers::{Fetched, Gathers};
use super::ledger::{ShardStats, UseLedger};
use super::piece_store::PieceStore;
use super::record::OwnMappers;
use super::schedule::{BACKWARD_END, Phase, PrefetchConfig};
use crate::error::{DistError, Result};
use crate::flat::FlatLayout;

/// A sharded parameter, as every rank knows it.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardedParamInfo {
    pub id: ParamId,
    /// Dotted path in the module, e.g. `layers.0.weight`.
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
    /// Elements of the parameter (flattened) that each rank's piece holds, in rank order: its
    /// intersections with the ranks' shards of the flat layout (many are 0).
    pub counts: Vec<usize>,
}

impl ShardedParamInfo {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes of the whole parameter in its dtype.
    pub fn bytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }
}

/// What a model's parameter tensor holds, as [`ParamShards::holding`] sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holding {
    /// A handle to sharded parameter `index` of the [`ParamShards`] at address `shards`, seen
    /// whole (`whole`) or through views.
    Handle {
        index: usize,
        whole: bool,
        shards: usize,
    },
    /// A full local tensor.
    Local,
}

/// Tells a float primitive of the sharded decorator (behind `dyn Any`) apart; written where
/// the inner backend is known (`Ddp::prepare_sharded`), used where it is not (the optimizer,
/// `Ddp::backward`, which are generic over any autodiff backend).
pub(crate) type Probe = Box<dyn Fn(&dyn Any) -> Option<Holding> + Send + Sync>;

/// One rank's pieces of every sharded parameter and its communicator: what every parameter
/// handle of the rank's model refers to.
///
/// Made by `Ddp::prepare_sharded`. ZeroAdam (stage 3) steps this rank's shard in place when
/// every parameter is f32 ([`ParamShards::with_master`]: the pieces *are* its master weights,
/// so the model costs no extra copy), else it reads its master weights from the pieces once
/// and writes them back in the parameters' dtype after every step; burn-dist-zero's
/// checkpoints save the pieces.
pub struct ParamShards {
    comm: Arc<HostCommunicator>,
    params: Arc<[ShardedParamInfo]>,
    pieces: Arc<PieceStore>,
    gathers: Gathers,
    ledger: Arc<UseLedger>,
    probe: Probe,
    pub(super) own_mappers: OwnMappers,
}

impl ParamShards {
    /// `pieces`: this rank's piece of each parameter, in its dtype.
    pub(crate) fn new(
        comm: Arc<HostCommunicator>,
        layout: FlatLayout,
        params: Vec<ShardedParamInfo>,
        pieces: Vec<Vec<u8>>,
        probe: Probe,
        prefetch: PrefetchConfig,
    ) -> Self {
        comm.label_tags(params.iter().map(|p| p.name.clone()).collect());
        let shard_bytes = pieces.iter().map(Vec::len).sum();
        let count = params.len();
        let params: Arc<[ShardedParamInfo]> = params.into();
        let pieces = Arc::new(PieceStore::new(params.clone(), layout, comm.rank(), pieces));
        let ledger = Arc::new(UseLedger::new(shard_bytes));
        let gathers = Gathers::new(
            comm.clone(),
            params.clone(),
            pieces.clone(),
            ledger.clone(),
            prefetch,
        );
        ParamShards {
            comm,
            params,
            pieces,
            gathers,
            ledger,
            probe,
            own_mappers: OwnMappers::new(count),
        }
    }

    /// Moves this rank's pieces into device memory (`place` uploads this rank's shard of the
    /// flat layout, given as bytes of the parameters' dtype): the device path of stage 3, whose
    /// gathers then write every rank's pieces into fresh device buffers. The parameters must
    /// share one dtype there, as ZeroAdam's device step needs.
    #[cfg(feature = "device")]
    pub(crate) fn on_device(
        self,
        place: impl FnOnce(DType, &[u8]) -> Result<Box<dyn crate::device::DevicePieces>>,
    ) -> Result<Self> {
        let Some(first) = self.params.first() else {
            return Ok(self);
        };
        if let Some(other) = self.params.iter().find(|p| p.dtype != first.dtype) {
            return Err(DistError::Usage(format!(
                "ZeRO stage 3 on the device path needs one dtype for every sharded parameter: \
                 `{}` is {:?} but `{}` is {:?}",
                first.name, first.dtype, other.name, other.dtype
            )));
        }
        self.pieces.place_on_device(first.dtype, place)?;
        Ok(self)
    }

    /// The device path: this rank's shard buffer of the pieces and its dtype, which ZeroAdam's
    /// stage-3 step on the device updates in place (call [`ParamShards::pieces_changed`]
    /// after); `None` on the host path.
    #[cfg(feature = "device")]
    pub fn device_shard(&self) -> Option<(burn_cubecl::cubecl::server::Handle, DType)> {
        self.pieces.device_shard()
    }

    /// The pieces were changed in place on the device (ZeroAdam's stage-3 step there): what
    /// was gathered ahead from them is stale. Every rank calls it at the same point.
    pub fn pieces_changed(&self) {
        self.gathers.forget_ahead();
    }

    /// The canonical flat layout of the trainable parameters over this group: this rank's
    /// pieces are its shard of it.
    pub fn layout(&self) -> &FlatLayout {
        self.pieces.layout()
    }

    /// The sharded parameters, in visit order (the reducer's order).
    pub fn params(&self) -> &[ShardedParamInfo] {
        &self.params
    }

    pub(crate) fn info(&self, index: usize) -> &ShardedParamInfo {
        &self.params[index]
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn stats(&self) -> ShardStats {
        let mut stats = self.ledger.stats();
        stats.off_schedule = self.gathers.off_schedule();
        (stats.reused_buffers, stats.pooled_bytes) = self.gathers.pooled();
        stats.gathered_in_place = self.comm.gather_lane().direct_collectives();
        stats
    }

    /// Parameter `index` from every rank's piece, as `B`'s tensor on `device`. Counts a use;
    /// wanted for an op ([`Use::Op`]) inside one, it is held by the op's frame and live until
    /// the op returns.
    ///
    /// Ops cannot return errors, so a failed gather unwinds with [`DistError::Gather`] (written
    /// once on stderr first, with no backtrace: `error::fail_op`), which
    /// names the parameter, this rank and the cause (for diverged ranks: the other rank's
    /// parameter too); the group is aborted, so every peer fails at its next collective.
    pub(crate) fn gather<B: Backend>(
        self: &Arc<Self>,
        index: usize,
        device: &B::Device,
        wanted: Use,
        phase: Phase,
    ) -> B::FloatTensorPrimitive {
        let counted = frame::counted_as(wanted);
        // Only ops follow the schedule: a read is no part of a step's order of uses.
        let fetched = match counted {
            Use::Op => self.gathers.fetch(index, phase),
            Use::Read => self
                .gathers
                .alone(index)
                .map(|part| Fetched::Part { part, keep: false }),
        };
        let (part, keep) = match fetched.unwrap_or_else(|source| self.failed(index, source)) {
            Fetched::Kept { keep } => match self.gathers.take_kept::<B>(index) {
                Some(tensor) => {
                    // Its bytes are live since the use that kept it.
                    self.ledger.count_again(index, phase);
                    return self.keep_or_hold::<B>(index, tensor, keep, counted);
                }
                // Dropped since the use that kept it, because the pieces changed or an
                // evaluation came between: every rank dropped it alike (`kept.rs` says why
                // they must), and gathers it again.
                None => {
                    let part = self.gathers.alone(index);
                    (
                        part.unwrap_or_else(|source| self.failed(index, source)),
                        keep,
                    )
                }
            },
            Fetched::Part { part, keep } => (part, keep),
        };
        let info = &self.params[index];
        self.ledger.count(index, info.bytes(), counted, phase);
        let tensor = part.into_tensor::<B>(info, device);
        self.keep_or_hold::<B>(index, tensor, keep, counted)
    }

    /// Parameter `index`'s tensor for this use, its bytes live: kept for a later use when
    /// `keep` (live past this op, until that use's op returns; the two share its memory, so it
    /// is counted once), else released when the op returns (a read's were never counted live).
    fn keep_or_hold<B: Backend>(
        self: &Arc<Self>,
        index: usize,
        tensor: B::FloatTensorPrimitive,
        keep: bool,
        counted: Use,
    ) -> B::FloatTensorPrimitive {
        if keep {
            self.gathers.keep::<B>(index, tensor.clone());
        } else if counted == Use::Op {
            frame::hold(self, self.params[index].bytes());
        }
        tensor
    }

    /// A gather of parameter `index` failed: recorded as this rank's failure, and the op
    /// fails with it (ops cannot return errors: `error::fail_op`).
    fn failed(&self, index: usize, source: CommError) -> ! {
        self.ledger.fail(index, source.clone());
        crate::error::fail_op(self.gather_error(index, source))
    }

    fn gather_error(&self, index: usize, source: CommError) -> DistError {
        DistError::Gather {
            rank: self.rank(),
            param: index,
            name: self.params[index].name.clone(),
            source: Box::new(source),
        }
    }

    /// `bytes` of gathered parameters are no longer held: the op that held them returned.
    pub(crate) fn release(&self, bytes: usize) {
        self.ledger.release(bytes);
    }

    /// The first gather that failed on this rank, as an error (`Ddp::backward` and the
    /// optimizer return it; the op that met it panicked).
    pub fn failure(&self) -> Option<DistError> {
        let (index, source) = self.ledger.failure()?;
        Some(self.gather_error(index, source))
    }

    /// Fault injection for the divergence tests: counts a use of parameter `index` on this
    /// rank alone, with no collective, as a use served from a prefetched gather will be, so
    /// that only the step's agreement on the digests can see the ranks differ.
    #[doc(hidden)]
    pub fn inject_use(&self, index: usize) {
        let bytes = self.params[index].bytes();
        self.ledger.count(index, bytes, Use::Read, Phase::Train);
    }

    /// Fault injection for the schedule tests: records a use of parameter `index` in this
    /// rank's schedule alone, with no gather and no trace in the step's digest, as a digest
    /// collision would leave it, so that only the check of the recorded orders can see it. For
    /// a step without a schedule yet (the first): under one it would also take a gather's
    /// place.
    #[doc(hidden)]
    pub fn inject_recorded_use(&self, index: usize) {
        self.gathers.record_use_alone(index);
    }

    /// How far ahead this rank gathers (see [`PrefetchConfig`]); every rank must set the same.
    pub fn prefetch(&self) -> PrefetchConfig {
        self.gathers.window()
    }

    /// Sets how far ahead gathers go from the next use on, on every rank alike
    /// ([`PrefetchConfig::OFF`]: each parameter gathered on demand, alone, and the schedules
    /// forgotten).
    pub fn set_prefetch(&self, window: PrefetchConfig) {
        self.gathers.set_window(window);
    }

    /// The agreed order of uses of `phase` (parameter indices), and the parameters each of its
    /// gathers covers; `None` before the first optimizer step.
    pub fn schedule(&self, phase: Phase) -> Option<(Vec<usize>, Vec<std::ops::Range<usize>>)> {
        self.gathers.plan(phase)
    }

    /// A backward pass of this rank ended (the reducer's end-of-backward hook): the schedule
    /// records it, and gathers ahead wait for it. The step's digest counts it, so that ranks
    /// whose backward passes end at different points fail the step's agreement.
    pub(crate) fn end_backward(&self) {
        self.gathers.end_backward();
        self.ledger.hash_entry(BACKWARD_END);
    }

    /// Which phases (bit [`Phase`] `Train` = 1, `Eval` = 2) have a new gather schedule to agree
    /// on, recorded in the step that [`ParamShards::end_step`] ended: [`ParamShards::adopt_schedules`]
    /// shares one per bit, so every rank must have the same bits
    /// ([`ParamShards::check_new_schedules`]) before it runs.
    pub fn new_schedules(&self) -> u8 {
        super::agreement::new_schedules(&self.gathers)
    }

    /// Checks every rank's [`ParamShards::new_schedules`] (index = rank; the step's agreement
    /// gathers them) against rank 0's: a rank that differs is [`DistError::NewSchedules`] on
    /// every rank alike.
    pub fn check_new_schedules(&self, every_rank: &[u8]) -> Result<()> {
        super::agreement::check_new_schedules(every_rank)
    }

    /// After every rank agreed on the step's sequence of uses (the step's digest) and on which
    /// phases have a new one ([`ParamShards::check_new_schedules`]): rank 0's recorded sequence
    /// of each such phase is shared, every rank checks its own against it, and once every rank
    /// has, they become the phases' schedules. A rank whose sequence differs fails with
    /// [`DistError::Schedule`] and aborts the group, as [`ParamShards::check_model`] does.
    pub fn adopt_schedules(&self) -> Result<()> {
        super::agreement::adopt_schedules(&self.comm, &self.gathers, &self.params)
    }

    /// Ends the current step's accounting: returns the digest of its sequence of uses (each
    /// with its phase and how it was served) and their count, which every rank must agree on,
    /// and starts the next step (uses, digest and peak start again; the peak becomes
    /// `last_step_peak_bytes`).
    pub fn end_step(&self) -> (u64, u64) {
        self.gathers.end_step();
        self.ledger.end_step()
    }

    /// Whether this rank's shard is f32 and so can serve as the optimizer's master weights
    /// ([`ParamShards::with_master`]).
    pub fn holds_f32_shard(&self) -> bool {
        self.pieces.holds_f32_shard()
    }

    /// Runs `update` on this rank's shard of the flat vector, in place, when every parameter is
    /// f32 (the stage-3 optimizer's step on its master weights, which are the pieces every
    /// handle gathers from); `None`, without running it, otherwise.
    pub fn with_master<R>(&self, update: impl FnOnce(&mut [f32]) -> R) -> Option<R> {
        self.gathers.forget_ahead();
        self.pieces.with_master(update)
    }

    /// This rank's shard of the flat vector of parameters as f32 (padding zero).
    pub fn shard_values(&self) -> Vec<f32> {
        self.pieces.shard_values()
    }

    /// Replaces this rank's pieces by `shard` (this rank's shard of the flat vector, f32), in
    /// each parameter's dtype: the stage-3 optimizer's write-back when its master weights are
    /// its own (or a checkpoint's). Every handle gathers the new values from then on; nothing is
    /// communicated.
    pub fn write_shard(&self, shard: &[f32]) {
        self.gathers.forget_ahead();
        self.pieces.write_shard(shard);
    }

    /// Cuts this rank's piece of parameter `index` out of `full` (all of its values, in any
    /// float dtype) and keeps it in the parameter's dtype: a full record or checkpoint loaded
    /// into the sharded model, one parameter at a time. Nothing is communicated.
    pub fn write_piece(&self, index: usize, full: TensorData) {
        let piece = self.cut_piece(index, full);
        self.set_piece(index, &piece);
    }

    /// This rank's piece of parameter `index` cut out of `full` (all of its values, in any
    /// float dtype), in the parameter's dtype; empty where this rank holds none of it. Nothing
    /// changes: [`ParamShards::set_piece`] writes it (a checkpoint's load cuts every piece
    /// before the ranks agree, and writes them after).
    pub fn cut_piece(&self, index: usize, full: TensorData) -> Vec<u8> {
        self.pieces.cut_piece(index, full)
    }

    /// Replaces this rank's piece of parameter `index` by `piece` (in the parameter's dtype,
    /// as [`ParamShards::cut_piece`] or [`ParamShards::piece_bytes`] gave it). Nothing is
    /// communicated.
    pub fn set_piece(&self, index: usize, piece: &[u8]) {
        // On every rank alike, holding a piece or not: what it drops decides what is gathered
        // ahead next, which must be the same everywhere; and the ranks compare what was loaded.
        self.gathers.forget_ahead();
        self.pieces.set_piece(index, piece);
    }

    /// Per parameter: how many times [`ParamShards::set_piece`] wrote into its pieces (a
    /// record or a checkpoint loaded), on every rank alike, whether it holds a piece or not.
    /// ZeroAdam, whose master weights below f32 are its own, compares it at every step with
    /// what it saw at its last one, and takes the loaded values.
    pub fn loads(&self) -> Vec<u64> {
        self.pieces.loads()
    }

    /// This rank's piece of parameter `index`, in its dtype (for a gather or a checkpoint).
    pub fn piece_bytes(&self, index: usize) -> Vec<u8> {
        self.pieces.with_piece(index, <[u8]>::to_vec)
    }

    /// What a float primitive of the model holds; `None` when it is not a primitive of the
    /// sharded decorator at all (another backend).
    pub fn holding(&self, primitive: &dyn Any) -> Option<Holding> {
        (self.probe)(primitive)
    }

    /// Checks that every sharded parameter of `model` still holds its shard (a whole handle of
    /// its own index): a write that replaced one is [`DistError::ShardReplaced`], and the group
    /// is aborted with it, so that the other ranks stop too instead of waiting for this one's
    /// gathers.
    pub fn check_model<B: AutodiffBackend, M: Module<B>>(&self, model: &M) -> Result<()> {
        let Some(index) = super::check::first_replaced(self, model) else {
            return Ok(());
        };
        let error = DistError::ShardReplaced {
            rank: self.rank(),
            param: index,
            name: self.params[index].name.clone(),
        };
        self.comm.abort(error.to_string());
        Err(error)
    }
}

impl std::fmt::Debug for ParamShards {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParamShards")
            .field("rank", &self.rank())
            .field("params", &self.params.len())
            .field("stats", &self.stats())
            .finish()
    }
}
