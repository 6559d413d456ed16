//! Starts one rank: its environment, its own process group, death with the launcher, and the
//! threads that forward its output and report its exit.

use std::io;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Sender;
use std::thread;

use crate::error::LaunchError;
use crate::job::Job;
use crate::output::{Sink, copy_prefixed};
use crate::supervise::Event;
use crate::waiter;

/// Spawns local rank `local_rank`. Must run on the main thread: PR_SET_PDEATHSIG fires when the
/// *thread* that forked the child exits, and only the main thread lives as long as the launcher.
pub fn spawn_rank(
    job: &Job,
    local_rank: u32,
    events: &Sender<Event>,
) -> Result<Child, LaunchError> {
    let rank = job.global_rank(local_rank);
    let (program, args) = job
        .command
        .split_first()
        .ok_or(LaunchError::MissingCommand)?;
    let mut command = Command::new(program);
    command
        .args(args)
        .envs(job.rank_env(local_rank))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own group, so stopping a rank also stops what it started (`sh -c` children,
        // data-loader workers).
        .process_group(0);
    let launcher = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs between fork and exec and only makes async-signal-safe calls,
    // without allocating.
    unsafe {
        command.pre_exec(move || die_with_launcher(launcher));
    }
    let mut child = command.spawn().map_err(|source| LaunchError::Spawn {
        rank,
        program: program.to_string_lossy().into_owned(),
        source,
    })?;

    let index = local_rank as usize;
    let stdout = child.stdout.take().expect("stdout is piped");
    let stderr = child.stderr.take().expect("stderr is piped");
    forward(stdout, rank, Sink::Stdout, index, events.clone());
    forward(stderr, rank, Sink::Stderr, index, events.clone());
    waiter::watch(index, child.id(), events.clone());
    Ok(child)
}

/// In the child: ask for SIGKILL when the launcher dies, so no rank outlives it even if the
/// launcher is SIGKILLed and cannot stop anything itself.
fn die_with_launcher(launcher: libc::pid_t) -> io::Result<()> {
    let kill = libc::SIGKILL as libc::c_ulong;
    // SAFETY: prctl and getppid are async-signal-safe and take no pointers here.
    if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, kill, 0, 0, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // If the launcher died between fork and prctl, the child was already reparented and the
    // death signal will never come: give up instead of running as an orphan.
    if unsafe { libc::getppid() } != launcher {
        return Err(io::Error::from_raw_os_error(libc::ESRCH));
    }
    Ok(())
}

fn forward(
    source: impl io::Read + Send + 'static,
    rank: u64,
    sink: Sink,
    index: usize,
    events: Sender<Event>,
) {
    thread::spawn(move || {
        copy_prefixed(source, rank, sink);
        let _ = events.send(Event::OutputClosed { index });
    });
}
