//! `burn-dist-run`: starts one process per rank of a burn-dist job, torchrun style, prefixes
//! their output, and stops them all as soon as one fails; with `--max-restarts`, then starts
//! them all again. See `cli.rs` for the options.

mod cli;
mod error;
mod job;
mod output;
mod rendezvous;
mod restarts;
mod signals;
mod spawn;
mod status;
mod supervise;
mod waiter;

use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::ffi::OsStrExt;
use std::process::ExitCode;
use std::sync::mpsc;
use std::time::Duration;

use burn_dist_comm::env::resolve_master;

use clap::Parser;

use crate::error::LaunchError;
use crate::job::{Elastic, Job, TOKEN_VAR};
use crate::restarts::{Next, Restarts};
use crate::supervise::Supervisor;

fn main() -> ExitCode {
    let code = run(cli::Args::parse());
    let _ = std::io::stdout().flush();
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

fn run(args: cli::Args) -> i32 {
    let mut job = match Job::from_args(args, std::env::var_os(TOKEN_VAR)) {
        Ok(job) => job,
        Err(err) => return report(err),
    };
    let (events, mut received) = mpsc::channel();
    // Before any child exists, so a signal can never kill the launcher and orphan the ranks.
    if let Err(err) = signals::deliver_as_events(events.clone()) {
        return report(err);
    }
    // Once, before the ranks' own output.
    eprintln!("burn-dist-run: {}", job.threads);
    announce_hidden_output(&job);
    let hosting = match host_rendezvous(&job) {
        Ok(hosting) => hosting,
        Err(err) => return report(err),
    };
    let mut restarts = Restarts::new(job.max_restarts);
    loop {
        if job.elastic.is_some() {
            job = match meet(&job, hosting, &received) {
                Ok(job) => job,
                Err(Stopped::Failed(err)) => return report(err),
                Err(Stopped::Signalled(signal)) => {
                    eprintln!(
                        "burn-dist-run: {} while waiting at the rendezvous; exiting",
                        supervise::launcher_received(signal)
                    );
                    return 128 + signal;
                }
            };
        }
        let mut supervisor = Supervisor::new(received, job.grace, job.restart);
        let outcome = match start(&job, &events, &mut supervisor) {
            Ok(()) => supervisor.run(),
            // A rank that cannot be started will not start the next time either.
            Err(code) => return code,
        };
        received = supervisor.into_events();
        if restarts.after(outcome) == Next::Finish {
            break;
        }
        job = match job.restarted() {
            Ok(job) => job,
            Err(err) => return report(err),
        };
    }
    for line in restarts.summary() {
        eprintln!("{line}");
    }
    let code = restarts.exit_code();
    if code != 0 {
        eprintln!("burn-dist-run: exiting with code {code}");
    }
    code
}

/// How long a launcher of an elastic job waits for a round of the rendezvous to close.
const JOIN_TIMEOUT: Duration = Duration::from_secs(600);

/// For an elastic job, hosts its rendezvous if this launcher is the first on its address;
/// returns whether it does.
fn host_rendezvous(job: &Job) -> Result<bool, LaunchError> {
    let Some(elastic) = &job.elastic else {
        return Ok(false);
    };
    let rounds = rendezvous::Rounds {
        min: elastic.min,
        max: elastic.max,
        nproc_per_node: job.nproc_per_node,
        last_call: elastic.last_call,
        token: job.token.as_bytes().to_vec(),
    };
    let hosting = rendezvous::host_if_first(rendezvous_addr(elastic)?, rounds)?;
    if hosting {
        eprintln!(
            "burn-dist-run: hosting the elastic rendezvous on {}:{} ({} to {} nodes)",
            elastic.rendezvous_addr, elastic.rendezvous_port, elastic.min, elastic.max
        );
    }
    Ok(hosting)
}

fn rendezvous_addr(elastic: &Elastic) -> Result<SocketAddr, LaunchError> {
    resolve_master(&elastic.rendezvous_addr, elastic.rendezvous_port).map_err(|e| {
        LaunchError::Rendezvous {
            addr: format!("{}:{}", elastic.rendezvous_addr, elastic.rendezvous_port),
            problem: e.to_string(),
        }
    })
}

/// Why the launcher stopped waiting at the rendezvous without a place.
enum Stopped {
    Failed(LaunchError),
    Signalled(i32),
}

/// Joins the next round of the elastic rendezvous; returns this start of the job as placed.
/// The wait may be long (until enough nodes come), so a signal to the launcher ends it.
fn meet(
    job: &Job,
    hosting: bool,
    events: &mpsc::Receiver<supervise::Event>,
) -> Result<Job, Stopped> {
    let elastic = job.elastic.as_ref().expect("an elastic job");
    let addr = rendezvous_addr(elastic).map_err(Stopped::Failed)?;
    let (token, nproc) = (job.token.as_bytes().to_vec(), job.nproc_per_node);
    let (done, placed) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(rendezvous::join(addr, &token, nproc, hosting, JOIN_TIMEOUT));
    });
    let placed = loop {
        if let Ok(placed) = placed.recv_timeout(Duration::from_millis(100)) {
            break placed.map_err(Stopped::Failed)?;
        }
        // Only signals matter here: what else is queued belongs to the ranks of a start that
        // has ended.
        while let Ok(event) = events.try_recv() {
            if let supervise::Event::Signal(signal) = event {
                return Err(Stopped::Signalled(signal));
            }
        }
    };
    let job = job.placed(&placed);
    eprintln!(
        "burn-dist-run: rendezvous: this is node {} of {} (world size {}); the store is at {}:{}",
        job.node_rank,
        job.nnodes,
        job.world_size(),
        job.master_addr,
        job.master_port
    );
    Ok(job)
}

/// Starts every rank of this node for one start of the job; when one cannot be started, says
/// why, stops those already running and returns the exit code.
fn start(
    job: &Job,
    events: &mpsc::Sender<supervise::Event>,
    supervisor: &mut Supervisor,
) -> Result<(), i32> {
    for local_rank in 0..job.nproc_per_node {
        match spawn::spawn_rank(job, local_rank, events) {
            Ok(spawned) => supervisor.add(job.global_rank(local_rank), spawned),
            Err(err) => {
                let code = report(err);
                supervisor.abort(job.global_rank(local_rank));
                return Err(code);
            }
        }
    }
    Ok(())
}

/// Says once where the output of the ranks that `--local-ranks-filter` hides goes.
fn announce_hidden_output(job: &Job) {
    let hidden: Vec<String> = (0..job.nproc_per_node)
        .filter(|&l| !job.shows(l))
        .map(|l| job.global_rank(l).to_string())
        .collect();
    if !hidden.is_empty() {
        eprintln!(
            "burn-dist-run: the output of rank{} {} goes to {}/attempt-<restart>/rank-<rank>.log",
            if hidden.len() == 1 { "" } else { "s" },
            hidden.join(", "),
            job.log_dir.display()
        );
    }
}

fn report(err: LaunchError) -> i32 {
    eprintln!("burn-dist-run: {err}");
    err.exit_code()
}
