//! How long a gathered parameter lives: until the op that gathered it returns.
//!
//! Every op of the sharded decorator runs inside [`op`], which opens a frame on this thread.
//! A parameter gathered for the op is moved into `B`'s op, which consumes it, so its memory is
//! gone when the op returns (unless `B` returns a view of it, which the decorator avoids by
//! recording views on handles instead of computing them). The frame counts its bytes as *live*
//! in the rank's [`ParamShards`] until then: that count, and its peak, are what the memory
//! tests assert. A gather outside any op (reading values, a hook that meets a handle) is a
//! [`Use::Read`], counted apart: training should have none.

use std::cell::RefCell;
use std::sync::Arc;

use super::ParamShards;

/// Why a handle is materialized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Use {
    /// As the argument of an op: live until the op returns.
    Op,
    /// Outside any op (`into_data`, a gradient hook): a read.
    Read,
}

#[derive(Default)]
struct Frames {
    /// Ops running on this thread (the decorator's ops do not nest, but `B`'s could call
    /// back into code that runs ours, so depth is counted, not assumed to be one).
    depth: usize,
    /// Parameters gathered by the running ops, with their bytes.
    held: Vec<(Arc<ParamShards>, usize)>,
}

thread_local! {
    static FRAMES: RefCell<Frames> = RefCell::new(Frames::default());
}

/// Closes the frame opened by [`op`], also when the op panics.
struct Close {
    mark: usize,
}

impl Drop for Close {
    fn drop(&mut self) {
        let released = FRAMES.with(|frames| {
            let mut frames = frames.borrow_mut();
            frames.depth -= 1;
            frames.held.split_off(self.mark)
        });
        for (shards, bytes) in released {
            shards.release(bytes);
        }
    }
}

/// Runs one op in a frame: what it gathers is released when it returns.
#[inline]
pub(crate) fn op<R>(run: impl FnOnce() -> R) -> R {
    let mark = FRAMES.with(|frames| {
        let mut frames = frames.borrow_mut();
        frames.depth += 1;
        frames.held.len()
    });
    let _close = Close { mark };
    run()
}

/// How a gather wanted as `wanted` is counted: as an op's ([`Use::Op`]) only inside an op.
pub(crate) fn counted_as(wanted: Use) -> Use {
    let in_op = FRAMES.with(|frames| frames.borrow().depth > 0);
    match (wanted, in_op) {
        (Use::Op, true) => Use::Op,
        _ => Use::Read,
    }
}

/// Holds `bytes` of a parameter gathered for the op running on this thread until it returns.
pub(crate) fn hold(shards: &Arc<ParamShards>, bytes: usize) {
    FRAMES.with(|frames| frames.borrow_mut().held.push((shards.clone(), bytes)));
}
