//! Signals in both directions: the launcher's own SIGINT/SIGTERM/SIGHUP become supervisor events,
//! and the supervisor stops a rank by signalling its whole process group.

use std::sync::mpsc::Sender;
use std::thread;

use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use crate::error::LaunchError;
use crate::supervise::Event;

/// Turns SIGINT, SIGTERM and SIGHUP into `Event::Signal` instead of killing the launcher, so it
/// can stop the ranks first. Install it before the first child is spawned.
pub fn deliver_as_events(events: Sender<Event>) -> Result<(), LaunchError> {
    let mut signals =
        Signals::new([SIGINT, SIGTERM, SIGHUP]).map_err(LaunchError::SignalHandlers)?;
    thread::spawn(move || {
        for signal in signals.forever() {
            if events.send(Event::Signal(signal)).is_err() {
                return;
            }
        }
    });
    Ok(())
}

/// Sends `signal` to every process in the group led by `pgid`. Callers must only pass the pid of a
/// child that has not been reaped yet (see `waiter.rs`), so the id cannot have been reused.
pub fn signal_group(pgid: u32, signal: i32) {
    // SAFETY: killpg has no memory-safety preconditions. An error (ESRCH: the group is already
    // empty) means there is nothing left to stop.
    unsafe {
        libc::killpg(pgid as libc::pid_t, signal);
    }
}
