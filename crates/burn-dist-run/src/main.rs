//! `burn-dist-run`: starts one process per rank of a burn-dist job, torchrun style, prefixes
//! their output, and stops them all as soon as one fails. See `cli.rs` for the options.

mod cli;
mod error;
mod job;
mod output;
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
use crate::supervise::Supervisor;

fn main() -> ExitCode {
    let code = run(cli::Args::parse());
    let _ = std::io::stdout().flush();
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

fn run(args: cli::Args) -> i32 {
    let job = match Job::from_args(args, std::env::var_os(TOKEN_VAR)) {
        Ok(job) => job,
        Err(err) => return report(err),
    };
    let (events, received) = mpsc::channel();
    // Before any child exists, so a signal can never kill the launcher and orphan the ranks.
    if let Err(err) = signals::deliver_as_events(events.clone()) {
        return report(err);
    }
    // Once, before the ranks' own output.
    eprintln!("burn-dist-run: {}", job.threads);
    let mut supervisor = Supervisor::new(received, job.grace);
    for local_rank in 0..job.nproc_per_node {
        match spawn::spawn_rank(&job, local_rank, &events) {
            Ok(child) => supervisor.add(job.global_rank(local_rank), child),
            Err(err) => {
                let code = report(err);
                supervisor.abort(job.global_rank(local_rank));
                return code;
            }
        }
    }
    supervisor.run()
}

fn report(err: LaunchError) -> i32 {
    eprintln!("burn-dist-run: {err}");
    err.exit_code()
}
