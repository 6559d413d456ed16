//! The autodiff backends over the decorator, in either mode, for code generic over both.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::module::Module;
use burn::tensor::backend::{AutodiffBackend, Backend};

use crate::{Ddp, DistributedBackend, Replicated, Result, Sharded};

/// `Autodiff<DistributedBackend<B, P>, C>` for either mode `P` and any checkpointing strategy
/// `C`: code generic over this trait prepares a model the way its backend's mode needs,
/// [`Ddp::prepare`] when replicated, [`Ddp::prepare_sharded`] when sharded (ZeRO stage 3).
pub trait DistributedAutodiff: AutodiffBackend {
    /// Whether the parameters are sharded (the [`Sharded`] mode).
    const SHARDED: bool;

    /// Prepares `model` for synchronized training in this backend's mode.
    fn prepare_model<M: Module<Self>>(ddp: &mut Ddp, model: M) -> Result<M>;
}

impl<B: Backend, C: CheckpointStrategy> DistributedAutodiff
    for Autodiff<DistributedBackend<B, Replicated>, C>
{
    const SHARDED: bool = false;

    fn prepare_model<M: Module<Self>>(ddp: &mut Ddp, model: M) -> Result<M> {
        ddp.prepare(model)
    }
}

impl<B: Backend, C: CheckpointStrategy> DistributedAutodiff
    for Autodiff<DistributedBackend<B, Sharded>, C>
{
    const SHARDED: bool = true;

    fn prepare_model<M: Module<Self>>(ddp: &mut Ddp, model: M) -> Result<M> {
        ddp.prepare_sharded(model)
    }
}
