//! `burn-dist-run`: starts one process per rank of a burn-dist job, torchrun style, prefixes
//! their output, and stops them all as soon as one fails; with `--max-restarts`, then starts
//! them all again. See `cli.rs` for the options.

mod cli;
mod error;
mod job;
mod output;
mod restarts;
mod signals;
mod spawn;
mod status;
mod supervise;
mod waiter;

use std::io::Write;
use std::process::ExitCode;
use std::sync::mpsc;

use clap::Parser;

use crate::error::LaunchError;
use crate::job::{Job, TOKEN_VAR};
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
    let mut restarts = Restarts::new(job.max_restarts);
    loop {
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
