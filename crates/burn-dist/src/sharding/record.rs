//! Burn records of a sharded model (`into_record`, `load_record`), with no rank holding the
//! model whole.
//!
//! Burn gives a parameter two hooks around its records, the `ParamMapper`'s save and load
//! transformations, and `Ddp::prepare_sharded` installs one of each on every sharded parameter,
//! around the parameter's own (Burn's `Linear` has some, to transpose a column-major weight):
//! - **Saving** (`into_record`, on the thread that calls it) gathers the parameter and keeps it
//!   on rank 0 only: rank 0's record holds the full tensor, the other ranks' record a handle
//!   that refuses to be read ([`DistError::RecordOnRankZero`](crate::DistError)) and keeps a
//!   copy of the rank's own piece (1/N of the parameter). So every rank
//!   must take the record, at the same point (burn-train's checkpointer does), only rank 0 can
//!   write it (`burn_dist::train::RankZeroRecorder`), and no rank holds more than one full
//!   parameter at a time unless it writes the record. Turning the record into bytes later
//!   (burn-train does that on its checkpointer thread) communicates nothing.
//! - **Loading** a full record cuts this rank's piece out of each loaded value into the shards
//!   and puts the parameter's handle back, so the model stays sharded and its optimizer still
//!   knows its parameters. Nothing is communicated. A record that `into_record` took of this
//!   same model (kept in memory to roll back to) restores every rank's piece: rank 0's from its
//!   full values, every other rank's from the copy its stand-in kept. A stand-in that only said
//!   "on rank 0" would let rank 0 roll back while the others kept their current pieces, a model
//!   no rank ever had, and nothing would see it (a load communicates nothing).

use std::any::Any;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use burn::module::{Param, ParamMapper};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorPrimitive};

use super::frame::Use;
use super::{ParamHandle, ParamShards, Sharded, ShardedFloat};
use crate::DistributedBackend;
use crate::error::DistError;

/// A float parameter tensor of the stage-3 autodiff backend `B` over `X`.
type Float<B, const D: usize> = Tensor<B, D>;

/// Gives `param` (trainable parameter `index` of `shards`, holding its handle) the record
/// hooks above, around `own`, the mapper it had before it was sharded.
pub(super) fn install<X, B, const D: usize>(
    param: Param<Float<B, D>>,
    shards: &Arc<ParamShards>,
    index: usize,
    device: X::Device,
    own: ParamMapper<Float<B, D>>,
) -> Param<Float<B, D>>
where
    X: Backend,
    B: AutodiffBackend<InnerBackend = DistributedBackend<X, Sharded>>,
{
    shards.own_mappers.store(index, own.clone());
    // Weak: the model's parameters hold the mappers, and the shards must not outlive the last
    // handle because of them (a model prepared again would keep the old pieces alive).
    let (save_shards, load_shards) = (Arc::downgrade(shards), Arc::downgrade(shards));
    let save_own = own.clone();
    // Both transformations are replaced: `own` runs inside the hooks.
    param
        .save_mapper(move |tensor| save::<X, B, D>(tensor, &save_shards, index, &save_own))
        .load_mapper(move |tensor| load::<X, B, D>(tensor, &load_shards, index, &device, &own))
}

/// The save hook: rank 0 gets the gathered parameter (then its own save transformation), the
/// other ranks a handle that stands in their record for it.
fn save<X, B, const D: usize>(
    tensor: Float<B, D>,
    shards: &Weak<ParamShards>,
    index: usize,
    own: &ParamMapper<Float<B, D>>,
) -> Float<B, D>
where
    X: Backend,
    B: AutodiffBackend<InnerBackend = DistributedBackend<X, Sharded>>,
{
    let (Some(shards), Some(handle)) = (shards.upgrade(), handle_of::<X, B, D>(&tensor)) else {
        return own.on_save(tensor); // not sharded any more: as Burn would
    };
    if !handle.is_param_of(&shards, index) {
        return own.on_save(tensor); // a view, or another preparation's handle: as Burn would
    }
    // A read: every rank gathers, in the same order (the order of the model's parameters).
    let full = handle.clone().materialize(Use::Read);
    if shards.rank() == 0 {
        return own.on_save(wrap::<X, B, D>(ShardedFloat::Local(full)));
    }
    drop(full);
    // This rank's piece as it is now, so that loading this record back restores it as rank 0's
    // full value restores rank 0's: a record is a snapshot on every rank.
    let piece = shards.piece_bytes(index);
    wrap::<X, B, D>(ShardedFloat::Param(handle.in_rank_0_record(piece)))
}

/// The load hook: this rank's piece of the loaded value goes into the shards, and the parameter
/// gets its handle back. The loaded value is a full tensor (rank 0's record, or any record read
/// from bytes), or, on the other ranks, the stand-in of this model's own record, which holds
/// this rank's piece at the save.
fn load<X, B, const D: usize>(
    tensor: Float<B, D>,
    shards: &Weak<ParamShards>,
    index: usize,
    device: &X::Device,
    own: &ParamMapper<Float<B, D>>,
) -> Float<B, D>
where
    X: Backend,
    B: AutodiffBackend<InnerBackend = DistributedBackend<X, Sharded>>,
{
    let Some(shards) = shards.upgrade() else {
        return own.on_load(tensor);
    };
    match handle_of::<X, B, D>(&tensor) {
        // This model's own record: the stand-in's piece is restored as it was saved, before any
        // transformation of its own (the save applied none to it).
        Some(handle) if handle.is_param_of(&shards, index) => {
            if let Some(piece) = handle.saved_piece() {
                shards.set_piece(index, piece);
            }
        }
        // Another preparation's handle: the step refuses it by name (`DistError::ShardReplaced`).
        Some(_) => return own.on_load(tensor),
        None => {
            let tensor = own.on_load(tensor);
            let info = shards.info(index);
            if tensor.dims().as_slice() != info.shape.as_slice() {
                let error = DistError::ModelMismatch(format!(
                    "rank {}: loading sharded parameter `{}`: the record's tensor has shape {:?}, \
                     the parameter {:?}",
                    shards.rank(),
                    info.name,
                    tensor.dims(),
                    info.shape
                ));
                crate::error::fail_op(error);
            }
            shards.write_piece(index, tensor.into_data());
        }
    }
    let handle = ParamHandle::<X>::new(shards, index, device.clone());
    wrap::<X, B, D>(ShardedFloat::Param(handle))
}

/// The handle `tensor` holds, if it holds one.
fn handle_of<X, B, const D: usize>(tensor: &Float<B, D>) -> Option<ParamHandle<X>>
where
    X: Backend,
    B: AutodiffBackend<InnerBackend = DistributedBackend<X, Sharded>>,
{
    match tensor.clone().inner().into_primitive() {
        TensorPrimitive::Float(ShardedFloat::Param(handle)) => Some(handle),
        _ => None,
    }
}

/// `float` as a tensor of `B` (no gradient: `transform_for_load` sets the parameter's).
pub(super) fn wrap<X, B, const D: usize>(float: ShardedFloat<X>) -> Float<B, D>
where
    X: Backend,
    B: AutodiffBackend<InnerBackend = DistributedBackend<X, Sharded>>,
{
    let inner =
        Tensor::<DistributedBackend<X, Sharded>, D>::from_primitive(TensorPrimitive::Float(float));
    Tensor::from_inner(inner)
}

/// The mapper a parameter had before it was sharded, if `tensor` is a handle of an earlier
/// preparation that stored it: preparing the model again must wrap that one, not the record
/// hooks of the earlier preparation.
pub(super) fn own_mapper<X, B, const D: usize>(
    tensor: &Float<B, D>,
) -> Option<ParamMapper<Float<B, D>>>
where
    X: Backend,
    B: AutodiffBackend<InnerBackend = DistributedBackend<X, Sharded>>,
{
    let handle = handle_of::<X, B, D>(tensor)?;
    handle.shards().own_mappers.get(handle.index())
}

/// Each sharded parameter's `ParamMapper` from before it was sharded, which the record hooks
/// run inside theirs (`ParamMapper<Tensor<B, D>>`, behind `dyn Any`: `ParamShards` is not
/// generic over the backend).
pub(super) struct OwnMappers {
    mappers: Mutex<Vec<Option<Box<dyn Any + Send + Sync>>>>,
}

impl OwnMappers {
    pub(super) fn new(count: usize) -> Self {
        OwnMappers {
            mappers: Mutex::new((0..count).map(|_| None).collect()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Option<Box<dyn Any + Send + Sync>>>> {
        // Nothing panics while holding it.
        self.mappers.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn store<T: Any + Send + Sync>(&self, index: usize, mapper: T) {
        self.lock()[index] = Some(Box::new(mapper));
    }

    fn get<T: Any + Clone>(&self, index: usize) -> Option<T> {
        self.lock()
            .get(index)?
            .as_ref()?
            .downcast_ref::<T>()
            .cloned()
    }
}
