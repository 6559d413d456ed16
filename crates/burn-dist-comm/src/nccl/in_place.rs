//! Collectives in place on memory the communicator does not own: the gradients of Burn/cubecl
//! tensors (burn-dist's device reducer). A [`DeviceBuffer`](super::DeviceBuffer) owns a cudarc
//! allocation; these calls take raw device addresses instead, plus an owner object that keeps
//! the memory alive until NCCL is done with it.

use std::any::Any;

use crate::{DType, ReduceOp};

/// `len` elements of `dtype` at device address `ptr` on the communicator's GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawSlice {
    pub ptr: u64,
    pub len: usize,
    pub dtype: DType,
}

/// What one call of an in-place group does with its slice. Each call reads and writes only its
/// own slice (`send == recv`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InPlaceOp {
    /// Every rank ends with the reduction (`ncclAllReduce`).
    AllReduce(ReduceOp),
    /// Only `root` ends with the reduction; the other ranks' slices are left as they were
    /// (`ncclReduce`).
    Reduce { root: usize, op: ReduceOp },
    /// Every rank ends with `root`'s slice (`ncclBroadcast`). A group of one broadcast per
    /// owner is how an all-gather of uneven chunks runs in place.
    Broadcast { root: usize },
}

impl InPlaceOp {
    /// The reduction it applies, if any.
    pub fn reduce(self) -> Option<ReduceOp> {
        match self {
            InPlaceOp::AllReduce(reduce) | InPlaceOp::Reduce { op: reduce, .. } => Some(reduce),
            InPlaceOp::Broadcast { .. } => None,
        }
    }

    /// The rank it reduces to or broadcasts from, if any.
    pub fn root(self) -> Option<usize> {
        match self {
            InPlaceOp::AllReduce(_) => None,
            InPlaceOp::Reduce { root, .. } | InPlaceOp::Broadcast { root } => Some(root),
        }
    }
}

/// The calls of one group (`ncclGroupStart`/`ncclGroupEnd`), and what keeps their memory alive.
pub struct InPlaceGroup {
    pub calls: Vec<(RawSlice, InPlaceOp)>,
    /// Dropped by the NCCL thread once the group has completed (or failed), before the
    /// `Pending` is answered.
    pub keep_alive: Box<dyn Any + Send>,
}

impl std::fmt::Debug for InPlaceGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InPlaceGroup")
            .field("calls", &self.calls)
            .finish_non_exhaustive()
    }
}

impl InPlaceGroup {
    /// Bytes over all calls.
    pub(crate) fn bytes(&self) -> usize {
        self.calls.iter().map(|(s, _)| s.len * s.dtype.size()).sum()
    }
}
