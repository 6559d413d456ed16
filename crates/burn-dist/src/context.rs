//! How a backward hook finds its rank's reducer.
//!
//! The hooks are associated functions that receive only a tensor reference, so the reducer is
//! found through ambient state: one process-wide reducer in production (one process per rank),
//! overridden by a per-thread reducer for in-process test ranks (N ranks as N threads, each
//! with its own model). Backward runs its hooks on the thread that called `backward()`, so a
//! thread's override is exactly its rank. The decision and its alternatives are in
//! docs/decisions.md.

use std::cell::RefCell;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::reducer::Reducer;

/// A rank's reducer, shared by the hooks and the `Ddp` handle.
pub(crate) type SharedReducer = Arc<Mutex<Reducer>>;

static PROCESS: Mutex<Option<SharedReducer>> = Mutex::new(None);

thread_local! {
    static THREAD: RefCell<Option<SharedReducer>> = const { RefCell::new(None) };
}

/// Where a reducer is installed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// For every thread of the process (one process per rank).
    Process,
    /// For the calling thread only (in-process ranks as threads).
    Thread,
}

/// The reducer of the calling thread's rank, if any.
pub(crate) fn current() -> Option<SharedReducer> {
    THREAD
        .with(|t| t.borrow().clone())
        .or_else(|| PROCESS.lock().unwrap_or_else(|e| e.into_inner()).clone())
}

pub(crate) fn install(scope: Scope, reducer: Option<SharedReducer>) {
    match scope {
        Scope::Process => *PROCESS.lock().unwrap_or_else(|e| e.into_inner()) = reducer,
        Scope::Thread => THREAD.with(|t| *t.borrow_mut() = reducer),
    }
}

/// Removes `reducer` from `scope` if it is the one installed there: a `Ddp` dropped after a
/// newer one of the same scope was built leaves the newer one in place.
pub(crate) fn uninstall(scope: Scope, reducer: &SharedReducer) {
    let remove = |slot: &mut Option<SharedReducer>| {
        if slot.as_ref().is_some_and(|r| Arc::ptr_eq(r, reducer)) {
            *slot = None;
        }
    };
    match scope {
        Scope::Process => remove(&mut PROCESS.lock().unwrap_or_else(|e| e.into_inner())),
        Scope::Thread => THREAD.with(|t| remove(&mut t.borrow_mut())),
    }
}

/// Locks a reducer even if a panicking hook poisoned it: its state is reset at the next
/// backward, and refusing every later call would hide the original error.
pub(crate) fn lock(reducer: &SharedReducer) -> MutexGuard<'_, Reducer> {
    reducer.lock().unwrap_or_else(|e| e.into_inner())
}
