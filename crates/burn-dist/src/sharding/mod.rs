//! ZeRO stage 3: the [`Sharded`] mode of the decorator, in which every rank keeps only its piece
//! of each trainable parameter.
//!
//! # How a model runs sharded without being changed
//!
//! `Ddp::prepare_sharded` replaces each trainable parameter's tensor by a *handle*
//! ([`ShardedFloat::Param`]): the parameter's full shape and dtype, and a reference to this
//! rank's [`ParamShards`], which holds this rank's piece of every parameter (its intersection
//! with this rank's shard of the canonical flat layout, [`FlatLayout`](crate::FlatLayout)).
//! Every other float tensor is a local tensor of `B` ([`ShardedFloat::Local`]).
//!
//! - **An op that receives a handle gathers it** (`ParamShards::gather`, then `gathers.rs`:
//!   one uneven all-gather of the pieces, tagged with the parameter), replays the handle's
//!   views, calls `B`'s op, and the full copy is dropped when the op returns (`frame.rs`
//!   counts it as live until then).
//! - **From the second step on the gathers run ahead** (`schedule.rs` decides, `gathers.rs`
//!   gathers): the first step records the order of the uses, every rank agrees on it at the
//!   optimizer step, and later steps gather the next units of adjacent parameters (a layer's
//!   weight and bias) while the current op runs, within [`PrefetchConfig`]'s window.
//! - **Autodiff saves what an op received**, and for a parameter that is the handle (a cheap
//!   clone), so backward gathers the parameter again where it needs it: FSDP's re-gather in
//!   backward, with no wrapper around any module.
//! - **Shape ops on a handle are recorded**, not computed (`View`): the consumer of
//!   `weight.transpose()` then saves a handle too.
//! - **Metadata never gathers**: shape and dtype are the handle's, `float_device` its device,
//!   `to_device` moves the handle.
//! - **Gradients** are full local tensors, reduced exactly as at ZeRO stage 2 (each bucket
//!   reduce-scattered to the owners; the local gradient released at once).
//! - **The optimizer step** (ZeroAdam at stage 3) updates this rank's shard of the master
//!   weights and writes it into the pieces ([`ParamShards::write_shard`]): no all-gather; the
//!   next forward gathers.
//!
//! Collective order now follows the user's program, so ranks that run different programs
//! diverge. Every gather carries its parameter as a tag (`CommError::Mismatch` names both
//! sides' parameters); a rank left waiting in a gather while a peer waits on the main lane is
//! found by the communicator within seconds (`CommError::Diverged` names both waits); and
//! every use is hashed, with its phase and how it was served, into a digest the optimizer step
//! compares across ranks (`DistError::UseSequence`).

mod agreement;
mod check;
mod frame;
mod gathers;
mod handle;
mod kept;
mod ledger;
mod piece_store;
mod pool;
mod prepare;
mod record;
mod schedule;
mod shards;

use core::fmt;

use burn_backend::{Backend, DType, Shape, TensorMetadata};

pub use handle::ParamHandle;
pub use ledger::ShardStats;
pub use prepare::SHARD_ALIGN;
pub use schedule::{Phase, PrefetchConfig};
pub use shards::{Holding, ParamShards, ShardedParamInfo};

use crate::backend::{Mode, View};

/// The ZeRO stage 3 mode of [`DistributedBackend`](crate::DistributedBackend): train with
/// `Autodiff<DistributedBackend<B, Sharded>>`, prepare the model with `Ddp::prepare_sharded`
/// and step it with ZeroAdam at stage 3. See the [module docs](self).
#[derive(Clone, Copy, Default, Debug)]
pub struct Sharded;

/// The float tensor primitive of `DistributedBackend<B, Sharded>`.
pub enum ShardedFloat<B: Backend> {
    /// A tensor of `B` (activations, gradients, buffers, parameters that are not sharded).
    Local(B::FloatTensorPrimitive),
    /// A sharded parameter, possibly through views: gathered by the op that uses it.
    Param(ParamHandle<B>),
}

impl<B: Backend> Clone for ShardedFloat<B> {
    fn clone(&self) -> Self {
        match self {
            ShardedFloat::Local(tensor) => ShardedFloat::Local(tensor.clone()),
            ShardedFloat::Param(handle) => ShardedFloat::Param(handle.clone()),
        }
    }
}

impl<B: Backend> fmt::Debug for ShardedFloat<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShardedFloat::Local(tensor) => f.debug_tuple("Local").field(tensor).finish(),
            ShardedFloat::Param(handle) => f.debug_tuple("Param").field(handle).finish(),
        }
    }
}

impl<B: Backend> TensorMetadata for ShardedFloat<B> {
    fn dtype(&self) -> DType {
        match self {
            ShardedFloat::Local(tensor) => tensor.dtype(),
            ShardedFloat::Param(handle) => handle.dtype(),
        }
    }

    fn shape(&self) -> Shape {
        match self {
            ShardedFloat::Local(tensor) => tensor.shape(),
            ShardedFloat::Param(handle) => handle.shape(),
        }
    }
}

impl<B: Backend> Mode<B> for Sharded {
    type Float = ShardedFloat<B>;

    #[inline]
    fn op<R>(run: impl FnOnce() -> R) -> R {
        frame::op(run)
    }

    #[inline]
    fn enter(tensor: Self::Float) -> B::FloatTensorPrimitive {
        match tensor {
            ShardedFloat::Local(tensor) => tensor,
            ShardedFloat::Param(handle) => handle.materialize(frame::Use::Op),
        }
    }

    fn enter_meta(tensor: Self::Float) -> B::FloatTensorPrimitive {
        match tensor {
            ShardedFloat::Local(tensor) => tensor,
            ShardedFloat::Param(handle) => handle.stand_in(),
        }
    }

    #[inline]
    fn leave(tensor: B::FloatTensorPrimitive) -> Self::Float {
        ShardedFloat::Local(tensor)
    }

    fn view(tensor: Self::Float, view: View) -> Self::Float {
        match tensor {
            ShardedFloat::Local(tensor) => ShardedFloat::Local(view.apply::<B>(tensor)),
            ShardedFloat::Param(handle) => ShardedFloat::Param(handle.with_view(view)),
        }
    }

    // A handle passes as it is: nothing to detach on the inner backend.
    fn detach(tensor: Self::Float) -> Self::Float {
        match tensor {
            ShardedFloat::Local(tensor) => ShardedFloat::Local(B::float_detach(tensor)),
            param @ ShardedFloat::Param(_) => param,
        }
    }

    fn to_device(tensor: Self::Float, device: &B::Device) -> Self::Float {
        match tensor {
            ShardedFloat::Local(tensor) => ShardedFloat::Local(B::float_to_device(tensor, device)),
            ShardedFloat::Param(handle) => ShardedFloat::Param(handle.on_device(device)),
        }
    }

    fn device(tensor: &Self::Float) -> B::Device {
        match tensor {
            ShardedFloat::Local(tensor) => B::float_device(tensor),
            ShardedFloat::Param(handle) => handle.device().clone(),
        }
    }

    fn set_require_grad(tensor: Self::Float, require_grad: bool) -> Self::Float {
        match tensor {
            ShardedFloat::Local(tensor) => {
                ShardedFloat::Local(B::float_set_require_grad(tensor, require_grad))
            }
            // On the inner backend only `Param::valid` (Burn's evaluation model) clears it: its
            // parameters follow the evaluation schedule.
            ShardedFloat::Param(handle) => {
                ShardedFloat::Param(handle.in_phase(match require_grad {
                    true => Phase::Train,
                    false => Phase::Eval,
                }))
            }
        }
    }

    fn is_require_grad(tensor: &Self::Float) -> bool {
        match tensor {
            ShardedFloat::Local(tensor) => B::float_is_require_grad(tensor),
            ShardedFloat::Param(_) => false,
        }
    }

    fn read(tensor: Self::Float) -> B::FloatTensorPrimitive {
        match tensor {
            ShardedFloat::Local(tensor) => tensor,
            ShardedFloat::Param(handle) => handle.materialize(frame::Use::Read),
        }
    }

    fn local_mut(tensor: &mut Self::Float) -> &mut B::FloatTensorPrimitive {
        if let ShardedFloat::Param(handle) = tensor {
            *tensor = ShardedFloat::Local(handle.clone().materialize(frame::Use::Read));
        }
        match tensor {
            ShardedFloat::Local(tensor) => tensor,
            ShardedFloat::Param(_) => unreachable!("made local above"),
        }
    }
}
