//! One rank's pieces of the sharded parameters, the gather, and what they cost (counted).

use std::any::Any;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};
use burn_backend::{Backend, DType};
use burn_dist_comm::{CommError, HostBuffer, HostCommunicator};

use super::frame::{self, Use};
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
}

/// What a model's parameter tensor holds, as [`ParamShards::holding`] sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holding {
    /// A handle to sharded parameter `index`, seen whole (`whole`) or through views.
    Handle { index: usize, whole: bool },
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
/// Made by `Ddp::prepare_sharded`; ZeroAdam (stage 3) reads its shard of the parameters from it
/// once and writes the updated shard into it after every step, and burn-dist-zero's
/// checkpoints save the pieces.
pub struct ParamShards {
    comm: Arc<HostCommunicator>,
    layout: FlatLayout,
    params: Vec<ShardedParamInfo>,
    /// This rank's piece of each parameter, in its dtype (empty where it holds none).
    pieces: RwLock<Vec<Vec<u8>>>,
    state: Mutex<State>,
    probe: Probe,
}

#[derive(Default)]
struct State {
    stats: ShardStats,
    /// FNV-1a over the indices of this step's uses.
    digest: u64,
    /// The first failed gather, returned by later calls that can return errors.
    failure: Option<(usize, CommError)>,
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

impl ParamShards {
    pub(crate) fn new(
        comm: Arc<HostCommunicator>,
        layout: FlatLayout,
        params: Vec<ShardedParamInfo>,
        pieces: Vec<Vec<u8>>,
        probe: Probe,
    ) -> Self {
        let shard_bytes = pieces.iter().map(Vec::len).sum();
        comm.label_tags(params.iter().map(|p| p.name.clone()).collect());
        ParamShards {
            comm,
            layout,
            params,
            pieces: RwLock::new(pieces),
            state: Mutex::new(State {
                stats: ShardStats {
                    shard_bytes,
                    ..ShardStats::default()
                },
                digest: FNV_OFFSET,
                failure: None,
            }),
            probe,
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
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
        self.state().stats
    }

    /// Parameter `index` from every rank's piece, as `B`'s tensor on `device`. Counts a use;
    /// wanted for an op ([`Use::Op`]) inside one, it is held by the op's frame and live until
    /// the op returns.
    ///
    /// Ops cannot return errors, so a failed gather panics with [`DistError::Gather`], which
    /// names the parameter, this rank and the cause (for diverged ranks: the other rank's
    /// parameter too); the group is aborted, so every peer fails at its next collective.
    pub(crate) fn gather<B: Backend>(
        self: &Arc<Self>,
        index: usize,
        device: &B::Device,
        wanted: Use,
    ) -> B::FloatTensorPrimitive {
        let info = &self.params[index];
        let elem = info.dtype.size();
        let piece = self.pieces.read().unwrap_or_else(|e| e.into_inner())[index].clone();
        let counts = info.counts.iter().map(|&n| n * elem).collect();
        let tag = u32::try_from(index + 1).expect("fewer than 2^32 parameters");
        let gathered = self
            .comm
            .all_gather_counts(HostBuffer::U8(piece), counts, tag)
            .wait();
        let bytes = match gathered {
            Ok(HostBuffer::U8(bytes)) => bytes,
            Ok(_) => unreachable!("a u8 all-gather returns u8"),
            Err(source) => {
                self.state().failure.get_or_insert((index, source.clone()));
                let error = self.gather_error(index, source);
                panic!("burn-dist: {error}");
            }
        };
        let counted = frame::hold(self, info.bytes(), wanted);
        self.count(index, counted);
        let data = TensorData::from_bytes_vec(bytes, info.shape.clone(), info.dtype);
        B::float_from_data(data, device)
    }

    fn gather_error(&self, index: usize, source: CommError) -> DistError {
        DistError::Gather {
            rank: self.rank(),
            param: index,
            name: self.params[index].name.clone(),
            source: Box::new(source),
        }
    }

    fn count(&self, index: usize, counted: Use) {
        let bytes = self.params[index].bytes();
        let mut state = self.state();
        state.digest = (state.digest ^ index as u64).wrapping_mul(FNV_PRIME);
        let stats = &mut state.stats;
        stats.uses += 1;
        match counted {
            Use::Op => {
                stats.gathers += 1;
                stats.gathered_bytes += bytes as u64;
                stats.live_bytes += bytes;
                stats.peak_live_bytes = stats.peak_live_bytes.max(stats.live_bytes);
            }
            Use::Read => stats.reads += 1,
        }
    }

    /// Fault injection for the divergence tests: counts a use of parameter `index` on this
    /// rank alone, with no collective, as a use served from a prefetched gather will be, so
    /// that only the step's agreement on the digests can see the ranks differ.
    #[doc(hidden)]
    pub fn inject_use(&self, index: usize) {
        self.count(index, Use::Read);
    }

    /// The op that held `bytes` of gathered parameters returned.
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

    /// Ends the current step's accounting: returns the digest of its sequence of uses and
    /// their count, which every rank must agree on, and starts the next step (uses, digest and
    /// peak start again; the peak becomes `last_step_peak_bytes`).
    pub fn end_step(&self) -> (u64, u64) {
        let mut state = self.state();
        let ended = (state.digest, state.stats.uses);
        state.digest = FNV_OFFSET;
        let stats = &mut state.stats;
        stats.uses = 0;
        stats.last_step_peak_bytes = stats.peak_live_bytes;
        stats.peak_live_bytes = stats.live_bytes;
        ended
    }

    /// This rank's shard of the flat vector of parameters as f32 (padding zero): where the
    /// stage-3 optimizer's master weights start.
    pub fn shard_values(&self) -> Vec<f32> {
        let mut shard = vec![0.0f32; self.layout.shard_len];
        let pieces = self.pieces.read().unwrap_or_else(|e| e.into_inner());
        for piece in self.layout.pieces(self.rank()) {
            let info = &self.params[piece.param];
            let data = TensorData::from_bytes_vec(
                pieces[piece.param].clone(),
                vec![piece.within.len()],
                info.dtype,
            );
            let values = data.convert::<f32>().into_vec::<f32>().expect("f32 values");
            shard[piece.in_shard].copy_from_slice(&values);
        }
        shard
    }

    /// Replaces this rank's pieces by `shard` (this rank's shard of the flat vector, f32), in
    /// each parameter's dtype: the stage-3 optimizer's write-back. Every handle gathers the new
    /// values from then on; nothing is communicated.
    pub fn write_shard(&self, shard: &[f32]) {
        assert_eq!(shard.len(), self.layout.shard_len, "a shard of the layout");
        let mut pieces = self.pieces.write().unwrap_or_else(|e| e.into_inner());
        for piece in self.layout.pieces(self.rank()) {
            let info = &self.params[piece.param];
            let values = shard[piece.in_shard].to_vec();
            let data = TensorData::new(values, vec![piece.within.len()]).convert_dtype(info.dtype);
            pieces[piece.param] = data.into_bytes().to_vec();
        }
    }

    /// This rank's piece of parameter `index`, in its dtype (for checkpoints).
    pub fn piece_bytes(&self, index: usize) -> Vec<u8> {
        self.pieces.read().unwrap_or_else(|e| e.into_inner())[index].clone()
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
        if holds != Some(Holding::Handle { index, whole: true }) {
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
