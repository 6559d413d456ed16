//! One thread per child that learns how it ended, without reaping it.
//!
//! Leaving the child a zombie until the supervisor reaps it at the very end keeps its pid (which is
//! also its process group id) reserved. So the launcher can signal the group, to stop grandchildren
//! a failed rank left behind, with no risk of hitting an unrelated process that reused the pid.

use std::io;
use std::mem::MaybeUninit;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::mpsc::Sender;
use std::thread;

use crate::supervise::Event;

/// Reports the end of the child `pid`, local rank `index` of start `attempt`.
pub fn watch(attempt: u32, index: usize, pid: u32, events: Sender<Event>) {
    thread::spawn(move || {
        let status = exit_status_without_reaping(pid).unwrap_or_else(|err| {
            eprintln!("burn-dist-run: cannot wait for pid {pid}: {err}; counting it as failed");
            ExitStatus::from_raw(1 << 8)
        });
        // The supervisor outlives every sender that matters; a send error means it has gone.
        let _ = events.send(Event::Exited {
            attempt,
            index,
            status,
        });
    });
}

/// Blocks until `pid` has exited and returns its status, leaving it waitable (WNOWAIT).
pub(crate) fn exit_status_without_reaping(pid: u32) -> io::Result<ExitStatus> {
    ended_without_reaping(pid, 0).map(|status| status.expect("a blocking waitid returns a status"))
}

/// How `pid` ended if it already has, without waiting and without reaping it.
pub fn ended_already(pid: u32) -> Option<ExitStatus> {
    ended_without_reaping(pid, libc::WNOHANG).ok().flatten()
}

/// waitid(2) on `pid` with WEXITED | WNOWAIT | `extra`; `None` when WNOHANG found it running.
fn ended_without_reaping(pid: u32, extra: libc::c_int) -> io::Result<Option<ExitStatus>> {
    let info = loop {
        let mut info = MaybeUninit::<libc::siginfo_t>::zeroed();
        // SAFETY: `info` is a valid siginfo_t buffer for the kernel to fill.
        let rc = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                info.as_mut_ptr(),
                libc::WEXITED | libc::WNOWAIT | extra,
            )
        };
        if rc == 0 {
            // SAFETY: waitid succeeded, so the kernel filled `info` (zeroed if, under WNOHANG,
            // the child is still running).
            break unsafe { info.assume_init() };
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    };
    // SAFETY: for a SIGCHLD-style siginfo from waitid, si_pid is a valid union member.
    if unsafe { info.si_pid() } == 0 {
        return Ok(None);
    }
    // SAFETY: for a SIGCHLD-style siginfo from waitid, si_status is the valid union member.
    let status = unsafe { info.si_status() };
    // Rebuild the raw wait(2) status that ExitStatus decodes.
    let raw = match info.si_code {
        libc::CLD_EXITED => (status & 0xff) << 8,
        libc::CLD_KILLED => status & 0x7f,
        libc::CLD_DUMPED => (status & 0x7f) | 0x80,
        code => {
            return Err(io::Error::other(format!(
                "unexpected waitid si_code {code}"
            )));
        }
    };
    Ok(Some(ExitStatus::from_raw(raw)))
}
