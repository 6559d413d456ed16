//! Test-only fault points of a save: a pause to kill a rank inside a checkpoint write (the
//! crash tests), and injected disk errors (the disk-failure tests). Both are read from the
//! environment so that real processes under `burn-dist-run` can be told; the disk error can
//! also be set on one thread, for tests whose ranks are threads of one process. Unset, each
//! costs one environment lookup per file written.

use std::cell::RefCell;
use std::io;

/// Environment variable of the crash tests' fault point: `after-shard:<step>` makes every rank
/// that has written its shard of step `<step>` announce it on stderr and wait to be killed,
/// before any manifest exists; `after-shard:<step>:<rank>` only rank `<rank>` (a rank whose
/// disk is too slow: the others time out waiting for it); `after-shard:<step>:<rank>:<start>`
/// only in start `<start>` of the job (`burn_dist_comm::env::restart_count`, 0 for the first),
/// so that the launcher's restart runs past it. Under `checkpoint::AsyncSaver` the pause is in
/// the background writer, and training goes on.
pub const PAUSE_VAR: &str = "BURN_DIST_CHECKPOINT_PAUSE";

/// Environment variable of the disk-failure tests' fault point: `<file>:<step>:<rank>:<error>`
/// makes rank `<rank>`'s write of `<file>` (`shard`, `model`, `manifest` or `shared-check`) in
/// the save of step `<step>` fail with `<error>` (`ENOSPC` or `EIO`) after half of its bytes,
/// as a full or broken disk would.
pub const FAULT_VAR: &str = "BURN_DIST_CHECKPOINT_FAULT";

thread_local! {
    static THREAD_FAULT: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Sets (or with `None` clears) a [`FAULT_VAR`]-style disk fault for saves called on this
/// thread only, overriding the environment. For tests whose ranks are threads.
#[doc(hidden)]
pub fn inject_fault_on_this_thread(spec: Option<&str>) {
    THREAD_FAULT.with(|fault| *fault.borrow_mut() = spec.map(str::to_string));
}

/// The injected error for rank `rank` writing `file` in the save of `step`, if one is set.
pub(crate) fn injected_error(file: &str, rank: usize, step: u64) -> Option<io::Error> {
    let spec = THREAD_FAULT
        .with(|fault| fault.borrow().clone())
        .or_else(|| std::env::var(FAULT_VAR).ok())?;
    let mut parts = spec.splitn(4, ':');
    let (at_file, at_step, at_rank, error) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if at_file != file || at_step != step.to_string() || at_rank != rank.to_string() {
        return None;
    }
    let errno = match error {
        "ENOSPC" => libc::ENOSPC,
        "EIO" => libc::EIO,
        other => panic!("{FAULT_VAR}: unknown error {other:?} (ENOSPC or EIO)"),
    };
    Some(io::Error::from_raw_os_error(errno))
}

/// Waits forever (to be killed) at `point` of the save of `step`, if [`PAUSE_VAR`] asks so.
pub(crate) fn pause_point(point: &str, rank: usize, step: u64) {
    let here = format!("{point}:{step}");
    let wanted = std::env::var(PAUSE_VAR).is_ok_and(|wanted| {
        wanted == here
            || wanted == format!("{here}:{rank}")
            || burn_dist_comm::env::restart_count()
                .is_ok_and(|start| wanted == format!("{here}:{rank}:{start}"))
    });
    if wanted {
        eprintln!(
            "burn-dist: checkpoint of step {step} paused at {point} on rank {rank} (pid {})",
            std::process::id()
        );
        loop {
            std::thread::park();
        }
    }
}
