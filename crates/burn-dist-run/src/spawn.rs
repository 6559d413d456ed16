//! Starts one rank: its environment, its own process group, death with the launcher, and the
//! threads that forward its output and report its exit.

use std::fs::{self, File};
use std::io;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::thread;

use crate::error::LaunchError;
use crate::job::Job;
use crate::output::{LastLine, Sink, copy_prefixed};
use crate::supervise::Event;
use crate::waiter;

/// A started rank.
pub struct Spawned {
    pub child: Child,
    /// The last line of its own it wrote on its stderr so far (`output::ErrorLines`).
    pub last_error: LastLine,
}

/// Spawns local rank `local_rank`. Must run on the main thread: PR_SET_PDEATHSIG fires when the
/// *thread* that forked the child exits, and only the main thread lives as long as the launcher.
pub fn spawn_rank(
    job: &Job,
    local_rank: u32,
    events: &Sender<Event>,
) -> Result<Spawned, LaunchError> {
    let rank = job.global_rank(local_rank);
    let (out, err) = sinks(job, local_rank)?;
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
    let attempt = job.restart;
    let stdout = child.stdout.take().expect("stdout is piped");
    let stderr = child.stderr.take().expect("stderr is piped");
    let last_error = LastLine::default();
    let ends = |index| (attempt, index, events.clone());
    forward(stdout, rank, out, None, ends(index));
    forward(stderr, rank, err, Some(last_error.clone()), ends(index));
    waiter::watch(attempt, index, child.id(), events.clone());
    Ok(Spawned { child, last_error })
}

/// Where the rank's stdout and stderr go: the launcher's own, or both to the rank's log file
/// of this start when `--local-ranks-filter` hides it.
fn sinks(job: &Job, local_rank: u32) -> Result<(Sink, Sink), LaunchError> {
    if job.shows(local_rank) {
        return Ok((Sink::Stdout, Sink::Stderr));
    }
    let path = job.log_file(local_rank);
    let create = || {
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir)?;
        }
        File::create(&path)
    };
    let file = create().map_err(|source| LaunchError::LogFile {
        rank: job.global_rank(local_rank),
        path: path.clone(),
        source,
    })?;
    let file = Sink::File(Arc::new(Mutex::new(file)));
    Ok((file.clone(), file))
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

/// Copies one stream on its own thread, then reports its end as `(attempt, index)`.
fn forward(
    source: impl io::Read + Send + 'static,
    rank: u64,
    sink: Sink,
    last: Option<LastLine>,
    (attempt, index, events): (u32, usize, Sender<Event>),
) {
    thread::spawn(move || {
        copy_prefixed(source, rank, sink, last);
        let _ = events.send(Event::OutputClosed { attempt, index });
    });
}
