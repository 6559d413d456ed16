//! `--max-restarts`: how one start of the job ended, whether to start it again, and the summary
//! of every start that the launcher prints at its exit.

use std::process::ExitStatus;

use crate::status::{describe, exit_code};
use crate::supervise::launcher_received;

/// The launcher's message prefix.
const ME: &str = "burn-dist-run";

/// The rank that failed first in a start.
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    pub rank: u64,
    pub pid: u32,
    pub status: ExitStatus,
    /// The last line of its own it wrote on its stderr (not a panic's notes or backtrace:
    /// `output::ErrorLines`), if any.
    pub last_error: Option<String>,
}

impl Failure {
    /// Whether this failure repeats `earlier`: the same rank ending the same way after the same
    /// last line on its stderr. A deterministic failure (a bad argument, a missing file, a bug
    /// at a given step) repeats all three, and restarting it again would only spin; a rank
    /// killed from outside (the OOM killer, a lost node, a preemption) or a transient error
    /// seldom does, as the line usually carries a pid, a step or a peer.
    pub fn repeats(&self, earlier: &Failure) -> bool {
        self.rank == earlier.rank
            && self.status == earlier.status
            && self.last_error == earlier.last_error
    }

    /// "rank 1 (pid 4242) failed first: exited with code 3 (last error line: `error: …`)".
    pub fn describe(&self) -> String {
        let line = match &self.last_error {
            Some(line) => format!(" (last error line: `{line}`)"),
            None => String::new(),
        };
        format!(
            "rank {} (pid {}) failed first: {}{line}",
            self.rank,
            self.pid,
            describe(self.status)
        )
    }
}

/// How one start of the job ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// The rank that failed first, if one did.
    pub failure: Option<Failure>,
    /// The signal the launcher received, if it did.
    pub signal: Option<i32>,
}

impl Outcome {
    /// 0, the first failed rank's code (128 + signal if it was killed), or 128 + the signal the
    /// launcher received.
    pub fn exit_code(&self) -> i32 {
        match (&self.failure, self.signal) {
            (Some(failure), _) => exit_code(failure.status),
            (None, Some(signal)) => 128 + signal,
            (None, None) => 0,
        }
    }
}

/// What the launcher does after a start has ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    Restart,
    Finish,
}

/// Every start of the job so far, and what was decided after each.
pub struct Restarts {
    max: u32,
    starts: Vec<(Outcome, String)>,
}

impl Restarts {
    pub fn new(max_restarts: u32) -> Restarts {
        Restarts {
            max: max_restarts,
            starts: Vec::new(),
        }
    }

    /// Records how the latest start ended, says what happens next (on stderr as well) and
    /// returns it. A start is restarted only when a rank failed, the launcher was not told to
    /// stop, restarts are left, and the failure does not repeat the previous start's.
    pub fn after(&mut self, outcome: Outcome) -> Next {
        let used = self.starts.len() as u32;
        let previous = self.starts.last().and_then(|(o, _)| o.failure.as_ref());
        let (next, verdict) = match (&outcome.failure, outcome.signal) {
            (_, Some(signal)) => (
                Next::Finish,
                format!("stopped: {}", launcher_received(signal)),
            ),
            (None, None) => (Next::Finish, "succeeded".to_owned()),
            (Some(_), None) if self.max == 0 => (Next::Finish, "failed".to_owned()),
            (Some(failure), None) if previous.is_some_and(|p| failure.repeats(p)) => (
                Next::Finish,
                format!(
                    "failed the same way as the start before (same rank, same end, same last \
                     error line): not restarting, this failure looks deterministic; \
                     {} of --max-restarts {} used",
                    used, self.max
                ),
            ),
            (Some(_), None) if used >= self.max => (
                Next::Finish,
                format!("failed with no restart left (--max-restarts {})", self.max),
            ),
            (Some(failure), None) => {
                eprintln!(
                    "{ME}: restart {} of at most {}: {}; starting every rank again",
                    used + 1,
                    self.max,
                    failure.describe()
                );
                (Next::Restart, "restarted".to_owned())
            }
        };
        if next == Next::Finish && self.max > 0 && outcome.failure.is_some() {
            eprintln!("{ME}: {verdict}");
        }
        self.starts.push((outcome, verdict));
        next
    }

    /// The lines of the exit summary: one per start with its end and what followed, when
    /// restarts were allowed; none otherwise (the supervisor's own summary says it all).
    pub fn summary(&self) -> Vec<String> {
        if self.max == 0 {
            return Vec::new();
        }
        let restarts = self.starts.len().saturating_sub(1);
        let mut lines = vec![format!(
            "{ME}: summary: {} start{}, {restarts} restart{} of at most {}",
            self.starts.len(),
            plural(self.starts.len()),
            plural(restarts),
            self.max
        )];
        for (index, (outcome, verdict)) in self.starts.iter().enumerate() {
            let which = match index {
                0 => "first start".to_owned(),
                n => format!("restart {n}"),
            };
            let end = match &outcome.failure {
                Some(failure) => format!("{}; ", failure.describe()),
                None => String::new(),
            };
            lines.push(format!("{ME}: summary: {which}: {end}{verdict}"));
        }
        lines
    }

    /// The exit code of the latest start (0 before any).
    pub fn exit_code(&self) -> i32 {
        self.starts.last().map_or(0, |(o, _)| o.exit_code())
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;

    use super::*;

    fn failed(rank: u64, code: i32, line: &str) -> Outcome {
        Outcome {
            failure: Some(Failure {
                rank,
                pid: 100 + rank as u32,
                status: ExitStatus::from_raw(code << 8),
                last_error: Some(line.to_owned()),
            }),
            signal: None,
        }
    }

    const SUCCEEDED: Outcome = Outcome {
        failure: None,
        signal: None,
    };

    #[test]
    fn failures_are_restarted_until_the_limit() {
        let mut restarts = Restarts::new(2);
        assert_eq!(restarts.after(failed(1, 1, "a")), Next::Restart);
        assert_eq!(restarts.after(failed(0, 1, "b")), Next::Restart);
        assert_eq!(restarts.after(failed(1, 1, "c")), Next::Finish);
        assert_eq!(restarts.exit_code(), 1);
        let summary = restarts.summary();
        assert_eq!(summary.len(), 4, "{summary:?}");
        assert!(summary[0].ends_with("3 starts, 2 restarts of at most 2"));
        assert!(summary[3].ends_with("failed with no restart left (--max-restarts 2)"));
    }

    #[test]
    fn a_failure_that_repeats_the_previous_one_is_not_restarted() {
        let mut restarts = Restarts::new(5);
        assert_eq!(restarts.after(failed(1, 3, "boom")), Next::Restart);
        assert_eq!(restarts.after(failed(1, 3, "boom")), Next::Finish);
        assert_eq!(restarts.exit_code(), 3);
        assert!(restarts.summary()[2].contains("failed the same way as the start before"));
        // Another rank, another code or another line is another failure.
        for other in [
            failed(0, 3, "boom"),
            failed(1, 4, "boom"),
            failed(1, 3, "bang"),
        ] {
            let mut restarts = Restarts::new(5);
            restarts.after(failed(1, 3, "boom"));
            assert_eq!(restarts.after(other), Next::Restart);
        }
    }

    #[test]
    fn success_a_signal_or_no_restarts_finish() {
        assert_eq!(Restarts::new(3).after(SUCCEEDED), Next::Finish);
        let signalled = Outcome {
            signal: Some(libc::SIGTERM),
            ..failed(0, 1, "x")
        };
        assert_eq!(Restarts::new(3).after(signalled), Next::Finish);
        let mut none = Restarts::new(0);
        assert_eq!(none.after(failed(0, 1, "x")), Next::Finish);
        assert!(none.summary().is_empty());
    }
}
