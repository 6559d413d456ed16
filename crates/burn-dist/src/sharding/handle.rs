//! A handle to a sharded parameter: what a model's parameter tensor holds under ZeRO stage 3.

use core::fmt;
use std::sync::Arc;

use burn_backend::{Backend, DType, Shape};

use super::ParamShards;
use super::frame::Use;
use super::schedule::Phase;
use crate::backend::View;
use crate::error::DistError;

/// Parameter `index` of a rank's [`ParamShards`], seen through `views`, on `device`.
///
/// Cloning is cheap (an `Arc`, the device and the views): autodiff clones it into the state of
/// every op that uses the parameter, so backward gathers it again instead of keeping a copy.
/// The values are the pieces' at the time of the gather: after an optimizer step the same
/// handle gathers the new values.
pub struct ParamHandle<B: Backend> {
    shards: Arc<ParamShards>,
    index: usize,
    device: B::Device,
    views: Vec<View>,
    /// Shape and dtype after the views.
    shape: Shape,
    dtype: DType,
    /// Which gather schedule its uses follow.
    phase: Phase,
    /// It stands in a record, on a rank other than 0, for a parameter that `into_record`
    /// gathered to rank 0 only (`super::record`): it refuses to gather, and holds this rank's
    /// piece as it was at the save (in the parameter's dtype, empty where this rank holds
    /// none), which loading the record back into the same model writes again.
    saved_piece: Option<Arc<[u8]>>,
}

impl<B: Backend> Clone for ParamHandle<B> {
    fn clone(&self) -> Self {
        ParamHandle {
            shards: self.shards.clone(),
            index: self.index,
            device: self.device.clone(),
            views: self.views.clone(),
            shape: self.shape.clone(),
            dtype: self.dtype,
            phase: self.phase,
            saved_piece: self.saved_piece.clone(),
        }
    }
}

impl<B: Backend> fmt::Debug for ParamHandle<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ParamHandle")
            .field("param", &self.index)
            .field("name", &self.shards.info(self.index).name)
            .field("shape", &self.shape)
            .field("dtype", &self.dtype)
            .field("views", &self.views)
            .field("phase", &self.phase)
            .field("in_rank_0_record", &self.saved_piece.is_some())
            .finish()
    }
}

impl<B: Backend> ParamHandle<B> {
    /// The whole parameter `index` of `shards`, on `device`.
    pub(crate) fn new(shards: Arc<ParamShards>, index: usize, device: B::Device) -> Self {
        let info = shards.info(index);
        let (shape, dtype) = (Shape::from(info.shape.clone()), info.dtype);
        ParamHandle {
            shards,
            index,
            device,
            views: Vec::new(),
            shape,
            dtype,
            phase: Phase::Train,
            saved_piece: None,
        }
    }

    /// This handle as it stands in a record whose values only rank 0 holds, keeping `piece`,
    /// this rank's piece of the parameter at the save.
    pub(crate) fn in_rank_0_record(mut self, piece: Vec<u8>) -> Self {
        self.saved_piece = Some(piece.into());
        self
    }

    /// This rank's piece at the save, for a handle that stands in rank 0's record.
    pub(crate) fn saved_piece(&self) -> Option<&[u8]> {
        self.saved_piece.as_deref()
    }

    /// Whether it is parameter `index` of `shards`, whole (in a record or in the model).
    pub(crate) fn is_param_of(&self, shards: &ParamShards, index: usize) -> bool {
        std::ptr::eq(Arc::as_ptr(&self.shards), shards) && self.index == index && self.is_whole()
    }

    /// Which parameter (visit order among the trainable ones).
    pub fn index(&self) -> usize {
        self.index
    }

    /// Which rank's [`ParamShards`] it refers to, as an address (to tell preparations apart).
    pub fn shards_address(&self) -> usize {
        Arc::as_ptr(&self.shards) as usize
    }

    pub(crate) fn shards(&self) -> &Arc<ParamShards> {
        &self.shards
    }

    /// Whether it is the parameter itself, not a view of it.
    pub fn is_whole(&self) -> bool {
        self.views.is_empty()
    }

    pub(crate) fn shape(&self) -> Shape {
        self.shape.clone()
    }

    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }

    pub(crate) fn device(&self) -> &B::Device {
        &self.device
    }

    /// The same parameter seen through one more view.
    pub(crate) fn with_view(mut self, view: View) -> Self {
        self.shape = view.shape(&self.shape);
        if let View::Cast(dtype) = view {
            self.dtype = dtype.into();
        }
        self.views.push(view);
        self
    }

    /// The same handle, its uses following `phase`'s schedule.
    pub(crate) fn in_phase(mut self, phase: Phase) -> Self {
        self.phase = phase;
        self
    }

    /// The same handle on another device: the pieces live on the host, so nothing moves
    /// until a gather uploads the parameter there.
    pub(crate) fn on_device(mut self, device: &B::Device) -> Self {
        self.device = device.clone();
        self
    }

    /// A tensor of `B` with the handle's shape, dtype and device and one element of memory
    /// (zeros, expanded), for an op that reads only those.
    pub(crate) fn stand_in(&self) -> B::FloatTensorPrimitive {
        let one = Shape::from(vec![1; self.shape.num_dims()]);
        let dtype = burn_backend::FloatDType::from(self.dtype);
        B::float_expand(B::float_zeros(one, &self.device, dtype), self.shape.clone())
    }

    /// Gathers the parameter from every rank's piece and replays the views: `B`'s tensor, for
    /// an op (live until it returns) or a read.
    ///
    /// Fails (unwinds) with [`DistError::RecordOnRankZero`] for a handle that stands in rank 0's
    /// record.
    pub(crate) fn materialize(self, wanted: Use) -> B::FloatTensorPrimitive {
        if self.saved_piece.is_some() {
            crate::error::fail_op(DistError::RecordOnRankZero {
                rank: self.shards.rank(),
                name: self.shards.info(self.index).name.clone(),
            });
        }
        let full = self
            .shards
            .gather::<B>(self.index, &self.device, wanted, self.phase);
        self.views
            .into_iter()
            .fold(full, |tensor, view| view.apply::<B>(tensor))
    }
}
