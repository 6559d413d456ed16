//! Tensors that a use of a parameter made, kept for the same parameter's next use when the
//! schedule says so (a tied embedding's use in forward, kept for the LM head at its end): that
//! use then gathers nothing.
//!
//! # Every rank drops its kept tensors at the same points
//!
//! [`KeptTensors::drop_all`] is the one function that drops them all, and `Gathers` calls it
//! at four points only: at the step's end (`Gathers::end_step`), when the schedule says so (a
//! change of phase, or a use off the plan: `Decision::forget_kept` in `Gathers::fetch`), when
//! the pieces change (`Gathers::forget_ahead`) and when the window does
//! (`Gathers::set_window`, set on every rank alike). Each is the same point of the same
//! program, or of the same agreed schedule, on every rank; a call anywhere else, or on some
//! ranks only, breaks the rule.
//!
//! Why the ranks must agree: a use whose tensor is still kept gathers nothing, while a use
//! whose tensor was dropped gathers it again, alone, and a gather is a collective. A rank that
//! still held the tensor would skip the all-gather its peers issue: they would wait for it
//! until the divergence check or the collective timeout stops them. ([`KeptTensors::keep`]
//! also drops a parameter's earlier kept tensor when it keeps a new one, which the schedule,
//! the same on every rank, decides.)

use std::any::Any;
use std::sync::{Arc, Mutex, MutexGuard};

use super::ledger::UseLedger;

/// The kept tensors of one rank, at most one per parameter; their bytes stay counted live in
/// the ledger while they are kept.
pub(super) struct KeptTensors {
    kept: Mutex<Vec<KeptTensor>>,
    ledger: Arc<UseLedger>,
}

/// A backend's float primitive made for one use of parameter `index`, kept for a later one.
struct KeptTensor {
    index: usize,
    /// The parameter's bytes, counted live while it is kept.
    bytes: usize,
    /// `B::FloatTensorPrimitive` (the sharding types are not generic over the backend).
    tensor: Box<dyn Any + Send>,
}

impl KeptTensors {
    pub(super) fn new(ledger: Arc<UseLedger>) -> Self {
        KeptTensors {
            kept: Mutex::new(Vec::new()),
            ledger,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<KeptTensor>> {
        // Nothing panics while holding it.
        self.kept.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps `tensor` (parameter `index`'s, of `bytes`) for a later use, which the schedule
    /// says is of the same parameter; its bytes, counted live by the use that made it, stay
    /// live until then.
    pub(super) fn keep(&self, index: usize, bytes: usize, tensor: Box<dyn Any + Send>) {
        let replaced = {
            let mut kept = self.lock();
            let at = kept.iter().position(|k| k.index == index);
            let replaced = at.map(|at| kept.swap_remove(at));
            kept.push(KeptTensor {
                index,
                bytes,
                tensor,
            });
            replaced
        };
        // The schedule serves a parameter's kept tensor before keeping another, so this is
        // only a tensor whose use did not come.
        if let Some(replaced) = replaced {
            self.ledger.release(replaced.bytes);
        }
    }

    /// The tensor kept for parameter `index`, its bytes still live (the use that takes it
    /// holds them now); `None` if it was dropped since.
    pub(super) fn take(&self, index: usize) -> Option<Box<dyn Any + Send>> {
        let mut kept = self.lock();
        let at = kept.iter().position(|k| k.index == index)?;
        Some(kept.swap_remove(at).tensor)
    }

    /// Drops every kept tensor: their bytes are no longer live. See the module docs for the
    /// points where this may be called.
    pub(super) fn drop_all(&self) {
        let kept = std::mem::take(&mut *self.lock());
        for kept in kept {
            self.ledger.release(kept.bytes);
        }
    }
}
