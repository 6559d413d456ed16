//! One rank's pieces of the sharded parameters, the gather, and what they cost (counted).

use std::any::Any;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};
use burn_backend::{Backend, DType};
use burn_dist_comm::{CommError, HostCommunicator};

use super::frame::{self, Use};
use super::pool::GatherPool;
use super::prefetch::{Fetched, Part, UnitGather};
use super::schedule::{Phase, PrefetchConfig, Scheduler};
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

/// What sharding costs and holds on one rank (counted, not estimated).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShardStats {
    /// Bytes of the pieces this rank holds, in the parameters' dtype.
    pub shard_bytes: usize,
    /// Gathers made for ops since the start, and their bytes (whole parameters).
    pub gathers: u64,
    pub gathered_bytes: u64,
    /// Bytes of gathered parameters held right now by running ops.
    pub live_bytes: usize,
    /// The most `live_bytes` held at once since the current step began.
    pub peak_live_bytes: usize,
    /// The same for the last finished step (`ParamShards::end_step`).
    pub last_step_peak_bytes: usize,
    /// Parameters materialized outside any op (read to the host, met in a gradient hook):
    /// zero in a training loop.
    pub reads: u64,
    /// Uses (gathers and reads) since the current step began, hashed into the step's digest.
    pub uses: u64,
    /// Gathers issued ahead of their use by the schedule (each of one unit of adjacent
    /// parameters), since the start.
    pub prefetched: u64,
    /// Uses the schedule did not expect (each makes its round gather on demand and be recorded
    /// again), since the start.
    pub off_schedule: u64,
    /// Schedules agreed and adopted, since the start (one per phase at the first step).
    pub schedules: u64,
    /// Time ops waited for gathers to arrive, since the start, in nanoseconds.
    pub wait_nanos: u64,
    /// Host gathers written into a buffer an earlier gather of the same size left, instead of
    /// fresh memory, since the start (the pool holds at most the previous step's peak of
    /// gathered bytes).
    pub reused_buffers: u64,
    /// Bytes of such buffers pooled, free for the next gathers, right now.
    pub pooled_bytes: usize,
    /// Uses served by the tensor that an earlier use of the same round made of the same
    /// parameter and kept, with no gather (a tied embedding's first use in forward, kept for
    /// the LM head at its end, and the head's first use in backward), since the start.
    pub served_again: u64,
    /// Host gathers that read the peers' pieces straight out of their shared buffers (every
    /// rank on this host, linked through shared memory), since the start; the others went
    /// through the links.
    pub gathered_in_place: u64,
    /// Bytes gathered that no use took, since the start: parameters a unit carries between
    /// those its uses need (a bias between two weights backward needs), and gathers ahead that
    /// a use off the schedule dropped. Gathers moved these on top of `gathered_bytes`.
    pub unused_bytes: u64,
}

impl ShardStats {
    /// `bytes` of gathered parameters more are held (by an op, or gathered ahead).
    pub(super) fn hold(&mut self, bytes: usize) {
        self.live_bytes += bytes;
        self.peak_live_bytes = self.peak_live_bytes.max(self.live_bytes);
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
    pub(super) comm: Arc<HostCommunicator>,
    layout: FlatLayout,
    pub(super) params: Vec<ShardedParamInfo>,
    /// Where each parameter's piece lies in this rank's shard (`None`: it holds none of it).
    in_shard: Vec<Option<Range<usize>>>,
    /// Which of the parameter's elements that piece holds (the device path's gathers place it).
    #[cfg(feature = "device")]
    within: Vec<Option<Range<usize>>>,
    held: RwLock<Held>,
    state: Mutex<State>,
    /// The gather schedules and the gathers in flight ahead of their use.
    pub(super) scheduler: Mutex<Scheduler<UnitGather>>,
    probe: Probe,
    /// Each parameter's `ParamMapper` from before it was sharded (`record.rs` wraps it).
    pub(super) own_mappers: Mutex<Vec<Option<Box<dyn Any + Send + Sync>>>>,
    /// The host gathers' buffers, reused from step to step (`pool.rs`).
    pub(super) pool: Arc<GatherPool>,
    /// Tensors that uses made, kept for their parameters' later uses when the schedule says so
    /// ([`Fetched::Kept`]): at most one per parameter.
    kept: Mutex<Vec<KeptTensor>>,
    /// Per parameter: how many times values from outside the optimizer were written into its
    /// pieces ([`ParamShards::set_piece`]: a record or a checkpoint loaded), so that an
    /// optimizer with master weights of its own sees the load ([`ParamShards::loads`]).
    loads: Vec<AtomicU64>,
}

/// A backend's float primitive made for one use of parameter `index`, kept for a later one.
struct KeptTensor {
    /// Its parameter, whose bytes are counted live while it is kept.
    index: usize,
    /// `B::FloatTensorPrimitive` (`ParamShards` is not generic over the backend).
    tensor: Box<dyn Any + Send>,
}

/// This rank's part of the sharded parameters.
enum Held {
    /// Every sharded parameter is f32: this rank's shard of the flat layout itself (padding
    /// zero), which is also the stage-3 optimizer's master weights.
    F32(Vec<f32>),
    /// Each parameter's piece in its own dtype (empty where this rank holds none).
    Pieces(Vec<Vec<u8>>),
    /// The device path: this rank's shard in device memory, in the parameters' one dtype
    /// (`crate::device::DevicePieces`); gathers fill fresh device buffers.
    #[cfg(feature = "device")]
    Device(Box<dyn crate::device::DevicePieces>),
}

#[derive(Default)]
pub(super) struct State {
    pub(super) stats: ShardStats,
    /// FNV-1a over the indices of this step's uses.
    digest: u64,
    /// The first failed gather, returned by later calls that can return errors.
    failure: Option<(usize, CommError)>,
    /// Orders recorded at the last step's end, per phase, to be agreed on and adopted.
    pub(super) candidates: [Option<Vec<usize>>; 2],
}

/// How a use was served, as the step's digest counts it.
#[derive(Clone, Copy)]
enum DigestedUse {
    /// Gathered for an op.
    Op = 0,
    /// Gathered outside any op (a read).
    Read = 1,
    /// Served by the tensor an earlier use kept, with no gather.
    Kept = 2,
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

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
        use burn_dist_comm::Communicator;
        let shard_bytes = pieces.iter().map(Vec::len).sum();
        let count = params.len();
        comm.label_tags(params.iter().map(|p| p.name.clone()).collect());
        let mut in_shard = vec![None; params.len()];
        #[cfg(feature = "device")]
        let mut within = vec![None; params.len()];
        for piece in layout.pieces(comm.rank()) {
            in_shard[piece.param] = Some(piece.in_shard);
            #[cfg(feature = "device")]
            {
                within[piece.param] = Some(piece.within);
            }
        }
        let held = if params.iter().all(|p| p.dtype == DType::F32) {
            let mut shard = vec![0.0f32; layout.shard_len];
            for (range, piece) in in_shard.iter().zip(&pieces) {
                if let Some(range) = range {
                    // Bytes of no particular alignment: read element by element.
                    let values = piece
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")));
                    shard[range.clone()]
                        .iter_mut()
                        .zip(values)
                        .for_each(|(s, v)| *s = v);
                }
            }
            Held::F32(shard)
        } else {
            Held::Pieces(pieces)
        };
        ParamShards {
            comm,
            layout,
            params,
            in_shard,
            #[cfg(feature = "device")]
            within,
            held: RwLock::new(held),
            state: Mutex::new(State {
                stats: ShardStats {
                    shard_bytes,
                    ..ShardStats::default()
                },
                digest: FNV_OFFSET,
                failure: None,
                candidates: [None, None],
            }),
            scheduler: Mutex::new(Scheduler::new(prefetch)),
            probe,
            own_mappers: Mutex::new((0..count).map(|_| None).collect()),
            pool: Arc::default(),
            kept: Mutex::new(Vec::new()),
            loads: (0..count).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Moves this rank's pieces into device memory (`place` uploads this rank's shard of the
    /// flat layout, given as bytes of the parameters' dtype): the device path of stage 3, whose
    /// gathers then write every rank's pieces into fresh device buffers. The parameters must
    /// share one dtype there, as ZeroAdam's device step needs.
    #[cfg(feature = "device")]
    pub(crate) fn on_device(
        mut self,
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
        let dtype = first.dtype;
        let held = self.held.get_mut().unwrap_or_else(|e| e.into_inner());
        let shard = match &*held {
            Held::F32(shard) => bytemuck::cast_slice(shard).to_vec(),
            Held::Pieces(pieces) => {
                let elem = dtype.size();
                let mut shard = vec![0u8; self.layout.shard_len * elem];
                for (range, piece) in self.in_shard.iter().zip(pieces) {
                    if let Some(range) = range {
                        shard[range.start * elem..range.end * elem].copy_from_slice(piece);
                    }
                }
                shard
            }
            Held::Device(_) => return Ok(self),
        };
        *held = Held::Device(place(dtype, &shard)?);
        Ok(self)
    }

    /// The device path: this rank's shard buffer of the pieces and its dtype, which ZeroAdam's
    /// stage-3 step on the device updates in place (call [`ParamShards::pieces_changed`]
    /// after); `None` on the host path.
    #[cfg(feature = "device")]
    pub fn device_shard(&self) -> Option<(burn_cubecl::cubecl::server::Handle, DType)> {
        match &*self.held() {
            Held::Device(pieces) => Some(pieces.shard()),
            _ => None,
        }
    }

    /// The pieces were changed in place on the device (ZeroAdam's stage-3 step there): what
    /// was gathered ahead from them is stale. Every rank calls it at the same point.
    pub fn pieces_changed(&self) {
        self.forget_ahead();
    }

    /// The device path: issues the gather of parameters `params` (adjacent) into fresh device
    /// buffers, tagged `tag`; `None` on the host path.
    #[cfg(feature = "device")]
    pub(super) fn issue_on_device(
        &self,
        params: Range<usize>,
        tag: u32,
    ) -> Option<std::result::Result<Box<dyn crate::device::DeviceGathering>, CommError>> {
        let Held::Device(pieces) = &*self.held() else {
            return None;
        };
        let parts: Vec<crate::device::GatherPart> = params
            .map(|i| crate::device::GatherPart {
                shape: self.params[i].shape.clone(),
                counts: self.params[i].counts.clone(),
                mine: self.in_shard[i].clone().zip(self.within[i].clone()),
            })
            .collect();
        Some(pieces.issue(&parts, tag))
    }

    pub(super) fn state(&self) -> MutexGuard<'_, State> {
        // Counters only: a panic while one was held leaves nothing half-written that matters.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The canonical flat layout of the trainable parameters over this group: this rank's
    /// pieces are its shard of it.
    pub fn layout(&self) -> &FlatLayout {
        &self.layout
    }

    /// The sharded parameters, in visit order (the reducer's order).
    pub fn params(&self) -> &[ShardedParamInfo] {
        &self.params
    }

    pub(crate) fn info(&self, index: usize) -> &ShardedParamInfo {
        &self.params[index]
    }

    pub fn rank(&self) -> usize {
        use burn_dist_comm::Communicator;
        self.comm.rank()
    }

    pub fn stats(&self) -> ShardStats {
        let mut stats = self.state().stats;
        stats.off_schedule = self.scheduler().off_plan;
        stats.reused_buffers = self.pool.reused();
        stats.pooled_bytes = self.pool.free_bytes();
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
            Use::Op => self.fetch(index, phase),
            Use::Read => self
                .gather_alone(index)
                .map(|part| Fetched::Part { part, keep: false }),
        };
        let (part, keep) = match fetched.unwrap_or_else(|source| self.failed(index, source)) {
            Fetched::Kept { keep } => match self.take_kept::<B>(index) {
                Some(tensor) => {
                    // Its bytes are live since the use that kept it.
                    self.count_again(index, phase);
                    return self.keep_or_hold::<B>(index, tensor, keep, counted);
                }
                // Dropped since the use that kept it, because the pieces changed or an
                // evaluation came between: every rank dropped it alike (`drop_kept` says why
                // they must), and gathers it again.
                None => {
                    let part = self.gather_alone(index);
                    (
                        part.unwrap_or_else(|source| self.failed(index, source)),
                        keep,
                    )
                }
            },
            Fetched::Part { part, keep } => (part, keep),
        };
        self.count(index, counted, phase);
        let tensor = self.materialize::<B>(index, part, device);
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
            self.keep(index, Box::new(tensor.clone()));
        } else if counted == Use::Op {
            frame::hold(self, self.params[index].bytes());
        }
        tensor
    }

    /// A gather of parameter `index` failed: recorded as this rank's failure, and the op
    /// fails with it (ops cannot return errors: `error::fail_op`).
    fn failed(&self, index: usize, source: CommError) -> ! {
        self.state().failure.get_or_insert((index, source.clone()));
        crate::error::fail_op(self.gather_error(index, source))
    }

    /// The backend's tensor of parameter `index` from its gathered part.
    fn materialize<B: Backend>(
        &self,
        index: usize,
        part: Part,
        device: &B::Device,
    ) -> B::FloatTensorPrimitive {
        let info = &self.params[index];
        match part {
            Part::Host(bytes) => {
                let data = TensorData::from_bytes(bytes, info.shape.clone(), info.dtype);
                B::float_from_data(data, device)
            }
            // The device store was built for the inner backend of this decorator: its
            // primitives are `B`'s.
            #[cfg(feature = "device")]
            Part::Device(tensor) => {
                *tensor
                    .downcast::<B::FloatTensorPrimitive>()
                    .unwrap_or_else(|_| {
                        panic!(
                            "burn-dist: the device pieces of `{}` are not `{}`'s tensors",
                            info.name,
                            std::any::type_name::<B>()
                        )
                    })
            }
        }
    }

    /// Keeps `tensor` (parameter `index`'s, `B::FloatTensorPrimitive`) for a later use, which
    /// the schedule says is of the same parameter; its bytes, counted live by the use that made
    /// it, stay live until then.
    fn keep(&self, index: usize, tensor: Box<dyn Any + Send>) {
        let replaced = {
            let mut kept = self.kept();
            let at = kept.iter().position(|k| k.index == index);
            let replaced = at.map(|at| kept.swap_remove(at));
            kept.push(KeptTensor { index, tensor });
            replaced
        };
        // The schedule serves a parameter's kept tensor before keeping another, so this is
        // only a tensor whose use did not come.
        if let Some(replaced) = replaced {
            self.release_kept(replaced);
        }
    }

    /// The tensor kept for this use of parameter `index` (the schedule, the same on every
    /// rank, announced it when an earlier use was served), its bytes still live; `None` if it
    /// was dropped since.
    fn take_kept<B: Backend>(&self, index: usize) -> Option<B::FloatTensorPrimitive> {
        let kept = {
            let mut kept = self.kept();
            let at = kept.iter().position(|k| k.index == index)?;
            kept.swap_remove(at)
        };
        let tensor = kept
            .tensor
            .downcast::<B::FloatTensorPrimitive>()
            .unwrap_or_else(|_| {
                panic!(
                    "burn-dist: the tensor kept for `{}` is not `{}`'s",
                    self.params[index].name,
                    std::any::type_name::<B>()
                )
            });
        Some(*tensor)
    }

    /// Drops the tensors kept for later uses (their uses did not come, the step ended, or the
    /// pieces changed).
    ///
    /// **Every rank drops its kept tensors at the same points**, and this is the one function
    /// that drops them all: at the step's end ([`ParamShards::end_step`]), when the schedule says
    /// so (`Decision::forget_kept` in [`ParamShards::fetch`]: a change of phase, or a use off
    /// the plan), when the pieces change ([`ParamShards::forget_ahead`]) and when the window
    /// does ([`ParamShards::set_prefetch`], set on every rank alike). Each is the same point of
    /// the same program, or of the same agreed schedule, on every rank; a call anywhere else,
    /// or on some ranks only, breaks the rule.
    ///
    /// Why the ranks must agree: a use whose tensor is still kept gathers nothing, while a use
    /// whose tensor was dropped gathers it again, alone (the `None` branch of
    /// [`ParamShards::gather`]), and a gather is a collective. A rank that still held the
    /// tensor would skip the all-gather its peers issue: they would wait for it until the
    /// collective timeout, or meet its next gather under another tag. (`keep` also drops a
    /// parameter's earlier kept tensor when it keeps a new one, which the schedule, the same on
    /// every rank, decides.)
    pub(super) fn drop_kept(&self) {
        let kept = std::mem::take(&mut *self.kept());
        for kept in kept {
            self.release_kept(kept);
        }
    }

    /// A kept tensor is dropped: its parameter's bytes are no longer live.
    fn release_kept(&self, kept: KeptTensor) {
        self.release(self.params[kept.index].bytes());
    }

    fn kept(&self) -> MutexGuard<'_, Vec<KeptTensor>> {
        // Nothing panics while holding it.
        self.kept.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn gather_error(&self, index: usize, source: CommError) -> DistError {
        DistError::Gather {
            rank: self.rank(),
            param: index,
            name: self.params[index].name.clone(),
            source: Box::new(source),
        }
    }

    /// One more entry of the step's sequence (a parameter index, or the end of a backward).
    pub(super) fn hash_into_digest(&self, entry: usize) {
        let mut state = self.state();
        state.digest = (state.digest ^ entry as u64).wrapping_mul(FNV_PRIME);
    }

    /// One more use of the step's sequence: parameter `index`, with how it was served
    /// (`served`: [`DigestedUse`]) and its phase, so that ranks that used the same parameters
    /// in another phase, or one as a read where another's op gathered it, differ.
    fn hash_use(&self, index: usize, served: DigestedUse, phase: Phase) {
        self.hash_into_digest(index);
        self.hash_into_digest(2 * served as usize + phase.slot());
    }

    /// A use served by the tensor an earlier use kept ([`Fetched::Kept`]): one more use
    /// of the step's sequence, and no gather (its bytes are live already).
    fn count_again(&self, index: usize, phase: Phase) {
        self.hash_use(index, DigestedUse::Kept, phase);
        let mut state = self.state();
        state.stats.uses += 1;
        state.stats.served_again += 1;
    }

    pub(super) fn count(&self, index: usize, counted: Use, phase: Phase) {
        let bytes = self.params[index].bytes();
        let served = match counted {
            Use::Op => DigestedUse::Op,
            Use::Read => DigestedUse::Read,
        };
        self.hash_use(index, served, phase);
        let mut state = self.state();
        let stats = &mut state.stats;
        stats.uses += 1;
        match counted {
            Use::Op => {
                stats.gathers += 1;
                stats.gathered_bytes += bytes as u64;
                stats.hold(bytes);
            }
            Use::Read => stats.reads += 1,
        }
    }

    /// Fault injection for the divergence tests: counts a use of parameter `index` on this
    /// rank alone, with no collective, as a use served from a prefetched gather will be, so
    /// that only the step's agreement on the digests can see the ranks differ.
    #[doc(hidden)]
    pub fn inject_use(&self, index: usize) {
        self.count(index, Use::Read, Phase::Train);
    }

    /// `bytes` of gathered parameters are no longer held: the op that held them returned, or
    /// what was gathered ahead was taken or dropped.
    pub(crate) fn release(&self, bytes: usize) {
        let mut state = self.state();
        state.stats.live_bytes = state.stats.live_bytes.saturating_sub(bytes);
    }

    /// The first gather that failed on this rank, as an error (`Ddp::backward` and the
    /// optimizer return it; the op that met it panicked).
    pub fn failure(&self) -> Option<DistError> {
        let failure = self.state().failure.clone();
        failure.map(|(index, source)| self.gather_error(index, source))
    }

    /// Which phases (bit [`Phase`] `Train` = 1, `Eval` = 2) have a new gather schedule to agree
    /// on, recorded in the step that [`ParamShards::end_step`] ended: [`ParamShards::adopt_schedules`]
    /// shares one per bit, so every rank must have the same bits
    /// ([`ParamShards::check_new_schedules`]) before it runs.
    pub fn new_schedules(&self) -> u8 {
        let state = self.state();
        Phase::ALL
            .into_iter()
            .filter(|phase| state.candidates[phase.slot()].is_some())
            .map(|phase| 1 << phase.slot())
            .sum()
    }

    /// Checks every rank's [`ParamShards::new_schedules`] (index = rank; the step's agreement
    /// gathers them) against rank 0's: a rank that differs is [`DistError::NewSchedules`] on
    /// every rank alike.
    pub fn check_new_schedules(&self, every_rank: &[u8]) -> Result<()> {
        let rank0 = every_rank.first().copied().unwrap_or(0);
        for (rank, &bits) in every_rank.iter().enumerate() {
            let differ = bits ^ rank0;
            if let Some(phase) = Phase::ALL
                .into_iter()
                .find(|phase| differ & (1 << phase.slot()) != 0)
            {
                return Err(DistError::NewSchedules {
                    rank,
                    phase,
                    here: bits & (1 << phase.slot()) != 0,
                });
            }
        }
        Ok(())
    }

    /// Ends the current step's accounting: returns the digest of its sequence of uses (each
    /// with its phase and how it was served) and their count, which every rank must agree on,
    /// and starts the next step (uses, digest and
    /// peak start again; the peak becomes `last_step_peak_bytes`).
    pub fn end_step(&self) -> (u64, u64) {
        let (candidates, dropped) = self.scheduler().end_step();
        self.discard(dropped);
        self.drop_kept();
        let mut state = self.state();
        state.candidates = candidates;
        let ended = (state.digest, state.stats.uses);
        state.digest = FNV_OFFSET;
        let stats = &mut state.stats;
        stats.uses = 0;
        stats.last_step_peak_bytes = stats.peak_live_bytes;
        stats.peak_live_bytes = stats.live_bytes;
        // From the second step on, the pool holds what the gathers held at most in a step.
        self.pool.end_step();
        ended
    }

    fn held(&self) -> std::sync::RwLockReadGuard<'_, Held> {
        self.held.read().unwrap_or_else(|e| e.into_inner())
    }

    fn held_mut(&self) -> std::sync::RwLockWriteGuard<'_, Held> {
        self.held.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether this rank's shard is f32 and so can serve as the optimizer's master weights
    /// ([`ParamShards::with_master`]).
    pub fn holds_f32_shard(&self) -> bool {
        matches!(*self.held(), Held::F32(_))
    }

    /// Runs `update` on this rank's shard of the flat vector, in place, when every parameter is
    /// f32 (the stage-3 optimizer's step on its master weights, which are the pieces every
    /// handle gathers from); `None`, without running it, otherwise.
    pub fn with_master<R>(&self, update: impl FnOnce(&mut [f32]) -> R) -> Option<R> {
        self.forget_ahead();
        match &mut *self.held_mut() {
            Held::F32(shard) => Some(update(shard)),
            _ => None,
        }
    }

    /// This rank's shard of the flat vector of parameters as f32 (padding zero).
    pub fn shard_values(&self) -> Vec<f32> {
        let pieces = match &*self.held() {
            Held::F32(shard) => return shard.clone(),
            Held::Pieces(pieces) => pieces.clone(),
            #[cfg(feature = "device")]
            Held::Device(pieces) => return pieces.shard_values(),
        };
        let mut shard = vec![0.0f32; self.layout.shard_len];
        for ((range, piece), info) in self.in_shard.iter().zip(pieces).zip(&self.params) {
            if let Some(range) = range {
                let data = TensorData::from_bytes_vec(piece, vec![range.len()], info.dtype);
                let values = data.convert::<f32>().into_vec::<f32>().expect("f32 values");
                shard[range.clone()].copy_from_slice(&values);
            }
        }
        shard
    }

    /// Replaces this rank's pieces by `shard` (this rank's shard of the flat vector, f32), in
    /// each parameter's dtype: the stage-3 optimizer's write-back when its master weights are
    /// its own (or a checkpoint's). Every handle gathers the new values from then on; nothing is
    /// communicated.
    pub fn write_shard(&self, shard: &[f32]) {
        self.forget_ahead();
        assert_eq!(shard.len(), self.layout.shard_len, "a shard of the layout");
        match &mut *self.held_mut() {
            Held::F32(held) => held.copy_from_slice(shard),
            Held::Pieces(pieces) => {
                for ((range, piece), info) in self.in_shard.iter().zip(pieces).zip(&self.params) {
                    if let Some(range) = range {
                        let values = shard[range.clone()].to_vec();
                        let data =
                            TensorData::new(values, vec![range.len()]).convert_dtype(info.dtype);
                        *piece = data.into_bytes().to_vec();
                    }
                }
            }
            #[cfg(feature = "device")]
            Held::Device(pieces) => pieces.write_shard(shard),
        }
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
        let Some(within) = self.within_param(index) else {
            return Vec::new(); // this rank holds none of it
        };
        let elem = self.params[index].dtype.size();
        let bytes = full.convert_dtype(self.params[index].dtype).into_bytes();
        bytes[within.start * elem..within.end * elem].to_vec()
    }

    /// Replaces this rank's piece of parameter `index` by `piece` (in the parameter's dtype,
    /// as [`ParamShards::cut_piece`] or [`ParamShards::piece_bytes`] gave it). Nothing is
    /// communicated.
    pub fn set_piece(&self, index: usize, piece: &[u8]) {
        // On every rank alike, holding a piece or not: what it drops decides what is gathered
        // ahead next, which must be the same everywhere; and the ranks compare what was loaded.
        self.forget_ahead();
        self.loads[index].fetch_add(1, Ordering::Relaxed);
        let Some(in_shard) = self.in_shard[index].clone() else {
            return; // this rank holds none of it
        };
        let elem = self.params[index].dtype.size();
        assert_eq!(
            piece.len(),
            in_shard.len() * elem,
            "burn-dist: the piece of `{}` written on rank {} has another size than the rank's",
            self.params[index].name,
            self.rank()
        );
        match &mut *self.held_mut() {
            Held::F32(shard) => copy_f32_bytes(&mut shard[in_shard], piece),
            Held::Pieces(pieces) => pieces[index] = piece.to_vec(),
            #[cfg(feature = "device")]
            Held::Device(pieces) => pieces.write(in_shard, piece),
        }
    }

    /// Per parameter: how many times [`ParamShards::set_piece`] wrote into its pieces (a
    /// record or a checkpoint loaded), on every rank alike, whether it holds a piece or not.
    /// ZeroAdam, whose master weights below f32 are its own, compares it at every step with
    /// what it saw at its last one, and takes the loaded values.
    pub fn loads(&self) -> Vec<u64> {
        self.loads
            .iter()
            .map(|count| count.load(Ordering::Relaxed))
            .collect()
    }

    /// Which of parameter `index`'s elements this rank's piece holds (`None`: none of them).
    fn within_param(&self, index: usize) -> Option<Range<usize>> {
        self.layout
            .pieces(self.rank())
            .into_iter()
            .find(|p| p.param == index)
            .map(|p| p.within)
    }

    /// This rank's piece of parameter `index`, in its dtype (for a gather or a checkpoint).
    pub fn piece_bytes(&self, index: usize) -> Vec<u8> {
        self.with_piece(index, <[u8]>::to_vec)
    }

    /// Shows this rank's piece of parameter `index`, in its dtype, to `visit` (a gather copies
    /// it straight into its buffer); empty where this rank holds none of it.
    pub(crate) fn with_piece<R>(&self, index: usize, visit: impl FnOnce(&[u8]) -> R) -> R {
        match &*self.held() {
            Held::F32(shard) => match self.in_shard[index].clone() {
                Some(range) => visit(bytemuck::cast_slice(&shard[range])),
                None => visit(&[]),
            },
            Held::Pieces(pieces) => visit(&pieces[index]),
            #[cfg(feature = "device")]
            Held::Device(pieces) => {
                let bytes = self.in_shard[index]
                    .clone()
                    .map_or_else(Vec::new, |range| pieces.read(range));
                visit(&bytes)
            }
        }
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
        let mut check = CheckHandles {
            shards: self,
            found: None,
        };
        model.visit(&mut check);
        match check.found {
            None => Ok(()),
            Some(index) => {
                let error = DistError::ShardReplaced {
                    rank: self.rank(),
                    param: index,
                    name: self.params[index].name.clone(),
                };
                self.comm.abort(error.to_string());
                Err(error)
            }
        }
    }
}

/// Copies the f32 values in `bytes` (little endian, of no particular alignment) into `out`.
fn copy_f32_bytes(out: &mut [f32], bytes: &[u8]) {
    let values = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")));
    out.iter_mut().zip(values).for_each(|(o, v)| *o = v);
}

/// Finds the first sharded parameter that is not a whole handle of its own index.
struct CheckHandles<'a> {
    shards: &'a ParamShards,
    found: Option<usize>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for CheckHandles<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if self.found.is_some() {
            return;
        }
        let Some(index) = self.shards.params.iter().position(|p| p.id == param.id) else {
            return;
        };
        let primitive = param.val().inner().into_primitive().tensor();
        let holds = self.shards.holding(&primitive);
        // A handle of another `ParamShards` is one of an earlier preparation of the model, whose
        // pieces this rank's optimizer no longer steps.
        let own = Holding::Handle {
            index,
            whole: true,
            shards: self.shards as *const ParamShards as usize,
        };
        if holds != Some(own) {
            self.found = Some(index);
        }
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
