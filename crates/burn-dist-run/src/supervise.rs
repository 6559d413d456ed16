//! Fail-fast supervision: watch every rank, and when one fails (or the launcher is signalled)
//! stop the others in three steps: time to exit on their own, SIGTERM, SIGKILL.
//!
//! Everything arrives as an `Event` on one channel, so every wait is a `recv_timeout` against a
//! deadline and the order of events is the order the supervisor acts on.

use std::process::{Child, ExitStatus};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use crate::output::LastLine;
use crate::restarts::{Failure, Outcome};
use crate::signals::signal_group;
use crate::spawn::Spawned;
use crate::status::{describe, describe_failure, describe_signal, signal_name};

/// The launcher's message prefix.
const ME: &str = "burn-dist-run";

/// How long after a first failure that was an error exit the launcher waits for a rank killed
/// by a signal to be reported (see `settle_first_failure`): far more than the kernel needs to
/// finish tearing down a killed process, even on a loaded machine, and short next to the grace
/// period that follows.
const SETTLE: Duration = Duration::from_millis(500);

/// What the supervisor waits for. Events of a rank carry the start of the job (`attempt`) it
/// belongs to, so that a late one from an earlier start is not taken for the current one's.
pub enum Event {
    /// The child of local rank `index` ended (it is not reaped yet; see `waiter.rs`).
    Exited {
        attempt: u32,
        index: usize,
        status: ExitStatus,
    },
    /// One of the two output streams of local rank `index` reached end of file.
    OutputClosed { attempt: u32, index: usize },
    /// The launcher received this signal.
    Signal(i32),
}

struct Rank {
    rank: u64,
    /// Also the id of the rank's process group.
    pid: u32,
    /// Reaped only at the very end, so `pid` stays reserved while the supervisor may signal it.
    child: Child,
    status: Option<ExitStatus>,
    open_outputs: u8,
    /// The last signal the launcher sent while the rank was still running.
    stopped_with: Option<i32>,
    /// The last line of its own on its stderr (`output::ErrorLines`).
    last_error: LastLine,
}

impl Rank {
    fn running(&self) -> bool {
        self.status.is_none()
    }

    /// Its group may still hold processes: the rank runs, or something it started keeps its
    /// output open.
    fn live(&self) -> bool {
        self.running() || self.open_outputs > 0
    }

    fn failed(&self) -> bool {
        self.status.is_some_and(|s| !s.success())
    }
}

/// How `stop` begins.
enum Start {
    /// Give the ranks the grace period to exit on their own first.
    AfterGrace,
    /// Send SIGTERM at once, for this reason.
    Now(String),
}

#[derive(PartialEq)]
enum Wait {
    Done,
    TimedOut,
    /// The launcher was signalled while waiting: the user does not want to wait any longer.
    Signalled(i32),
}

pub struct Supervisor {
    ranks: Vec<Rank>,
    events: Receiver<Event>,
    /// The start of the job whose ranks these are.
    attempt: u32,
    grace: Duration,
    first_failure: Option<usize>,
    signal: Option<i32>,
}

impl Supervisor {
    /// Supervises start `attempt` of the job (0: the first).
    pub fn new(events: Receiver<Event>, grace: Duration, attempt: u32) -> Self {
        Supervisor {
            ranks: Vec::new(),
            events,
            attempt,
            grace,
            first_failure: None,
            signal: None,
        }
    }

    /// Adds the next local rank; its events must use index = the number of ranks added before.
    pub fn add(&mut self, rank: u64, spawned: Spawned) {
        let Spawned { child, last_error } = spawned;
        self.ranks.push(Rank {
            rank,
            pid: child.id(),
            child,
            status: None,
            open_outputs: 2,
            stopped_with: None,
            last_error,
        });
    }

    /// The channel back, for the supervisor of the next start.
    pub fn into_events(self) -> Receiver<Event> {
        self.events
    }

    /// Supervises until every rank has ended and its output is drained; returns how the start
    /// ended: the rank that failed first, if one did, and the signal the launcher received, if
    /// it did.
    pub fn run(&mut self) -> Outcome {
        while self.ranks.iter().any(Rank::running) {
            let event = self
                .recv(None)
                .expect("the signal thread keeps the channel open");
            if let Some(signal) = self.handle(event) {
                self.stop(Start::Now(launcher_received(signal)));
                break;
            }
            if self.first_failure.is_some() {
                if let Some(signal) = self.settle_first_failure() {
                    self.stop(Start::Now(launcher_received(signal)));
                    break;
                }
                self.announce_failure(self.first_failure.expect("a failure was recorded"));
                self.stop(Start::AfterGrace);
                break;
            }
        }
        self.drain_output();
        self.finish()
    }

    /// Stops the ranks already started when rank `rank` could not be spawned.
    pub fn abort(&mut self, rank: u64) {
        self.stop(Start::Now(format!("rank {rank} could not be started")));
        self.drain_output();
        self.finish();
    }

    /// Records an event. Returns the signal if the launcher was signalled.
    fn handle(&mut self, event: Event) -> Option<i32> {
        match event {
            Event::Exited { attempt, .. } | Event::OutputClosed { attempt, .. }
                if attempt != self.attempt =>
            {
                None
            }
            Event::Exited { index, status, .. } => {
                self.ranks[index].status = Some(status);
                // Ranks ending after the launcher was signalled were stopped by it, not failing.
                if !status.success() && self.first_failure.is_none() && self.signal.is_none() {
                    self.first_failure = Some(self.likeliest_first_failure(index));
                }
                None
            }
            Event::OutputClosed { index, .. } => {
                self.ranks[index].open_outputs -= 1;
                None
            }
            Event::Signal(signal) => {
                self.signal.get_or_insert(signal);
                Some(signal)
            }
        }
    }

    /// The rank to name as the one that failed first, when `reported` is the first failure
    /// event. Events arrive in the order the watcher threads ran, not the order the ranks died:
    /// a rank killed by a signal and a peer that exited with an error after seeing it die can
    /// arrive either way round on a loaded machine. A rank already dead by a signal when the
    /// first failure arrives is the likelier cause (its peer's error is usually about it), so
    /// it is named; otherwise `reported`.
    fn likeliest_first_failure(&mut self, reported: usize) -> usize {
        use std::os::unix::process::ExitStatusExt;
        let by_signal = |status: ExitStatus| status.signal().is_some();
        if self.ranks[reported].status.is_some_and(by_signal) {
            return reported;
        }
        for (index, rank) in self.ranks.iter_mut().enumerate() {
            if index == reported || !rank.running() {
                continue;
            }
            if let Some(status) = crate::waiter::ended_already(rank.pid)
                && by_signal(status)
            {
                // Its own event is still on its way; recording the status now is the same.
                rank.status = Some(status);
                return index;
            }
        }
        reported
    }

    /// Takes in the events of a short window after a first failure that was an error exit,
    /// and names a rank found killed by a signal there instead. A rank that exits with an
    /// error because its peer was killed can be reported before the peer's death: the kernel
    /// closes the dead process's sockets before the process becomes waitable, and under load
    /// the survivor can read the end of file, report it and exit in between. Returns the
    /// signal if the launcher is signalled meanwhile.
    fn settle_first_failure(&mut self) -> Option<i32> {
        use std::os::unix::process::ExitStatusExt;
        let first = self.first_failure?;
        if self.ranks[first]
            .status
            .is_some_and(|s| s.signal().is_some())
        {
            return None;
        }
        let deadline = Instant::now() + SETTLE;
        while let Some(event) = self.recv(Some(deadline)) {
            let exited = match event {
                Event::Exited {
                    attempt,
                    index,
                    status,
                } if attempt == self.attempt => Some((index, status)),
                _ => None,
            };
            if let Some(signal) = self.handle(event) {
                return Some(signal);
            }
            if let Some((index, status)) = exited
                && status.signal().is_some()
            {
                self.first_failure = Some(index);
                return None;
            }
        }
        None
    }

    fn announce_failure(&self, index: usize) {
        let failed = &self.ranks[index];
        let others = self.ranks.iter().filter(|r| r.running()).count();
        let plan = match others {
            0 => "no other rank is running".to_owned(),
            1 => "stopping the other 1 rank".to_owned(),
            n => format!("stopping the other {n} ranks"),
        };
        eprintln!(
            "{ME}: rank {} (pid {}) failed first: {}; {plan}",
            failed.rank,
            failed.pid,
            describe_failure(failed.status.expect("a failed rank has a status"))
        );
    }

    /// Stops every live rank: optionally a grace period to exit on their own (they usually
    /// notice the dead peer and report it better than we can), then SIGTERM, then SIGKILL. A
    /// signal to the launcher skips the rest of the current wait.
    fn stop(&mut self, start: Start) {
        let grace = self.grace.as_secs_f64();
        match start {
            Start::AfterGrace => match self.wait_all_done(Some(Instant::now() + self.grace)) {
                Wait::Done => return,
                Wait::TimedOut => {
                    self.send_to_live(libc::SIGTERM, &format!("still running after {grace} s"))
                }
                Wait::Signalled(s) => self.send_to_live(libc::SIGTERM, &launcher_received(s)),
            },
            Start::Now(why) => self.send_to_live(libc::SIGTERM, &why),
        }
        match self.wait_all_done(Some(Instant::now() + self.grace)) {
            Wait::Done => return,
            Wait::TimedOut => self.send_to_live(
                libc::SIGKILL,
                &format!("still running {grace} s after SIGTERM"),
            ),
            Wait::Signalled(s) => self.send_to_live(libc::SIGKILL, &launcher_received(s)),
        }
        // SIGKILL cannot be refused, so waiting for the exits needs no deadline.
        while self.ranks.iter().any(Rank::running) {
            let event = self
                .recv(None)
                .expect("the signal thread keeps the channel open");
            if let Some(signal) = self.handle(event) {
                eprintln!(
                    "{ME}: received {}; SIGKILL was already sent, still waiting for {} to end",
                    signal_label(signal),
                    ranks_list(self.ranks.iter().filter(|r| r.running()))
                );
            }
        }
    }

    /// After every rank has ended, waits for their output to be drained. Output still open means
    /// a process the rank started lives on; it is stopped like a rank, and if even SIGKILL to the
    /// group does not close the output (the holder left the group), we give up on it.
    fn drain_output(&mut self) {
        let grace = self.grace.as_secs_f64();
        match self.wait_all_done(Some(Instant::now() + self.grace)) {
            Wait::Done => return,
            Wait::TimedOut => self.stop(Start::Now(format!(
                "they ended, but processes they started still hold their output open after {grace} s"
            ))),
            Wait::Signalled(s) => self.stop(Start::Now(launcher_received(s))),
        }
        if self.wait_all_done(Some(Instant::now() + self.grace)) != Wait::Done {
            eprintln!(
                "{ME}: not waiting any longer for the output of {}: a process outside their \
                 process groups holds it open",
                ranks_list(self.ranks.iter().filter(|r| r.live()))
            );
        }
    }

    /// Kills what is left in the groups, reaps the ranks, prints the summary and returns how
    /// the start ended.
    fn finish(&mut self) -> Outcome {
        for rank in &mut self.ranks {
            // A process that closed its output but stayed in the rank's group must not outlive
            // the launcher either. The leader is still unreaped, so the group id is safe to use.
            signal_group(rank.pid, libc::SIGKILL);
            let _ = rank.child.wait();
        }
        let first = self.first_failure;
        let failed = first
            .into_iter()
            .chain((0..self.ranks.len()).filter(|&i| Some(i) != first && self.ranks[i].failed()));
        for index in failed {
            let rank = &self.ranks[index];
            let note = match (Some(index) == first, rank.stopped_with) {
                (true, _) => " (failed first)".to_owned(),
                (false, Some(signal)) => {
                    format!(" (stopped by the launcher with {})", signal_label(signal))
                }
                (false, None) => String::new(),
            };
            let status = rank.status.expect("every rank has been reaped");
            eprintln!(
                "{ME}: summary: rank {} (pid {}) {}{note}",
                rank.rank,
                rank.pid,
                describe(status)
            );
        }
        let failure = first.map(|index| {
            let rank = &self.ranks[index];
            let last_error = rank.last_error.lock().unwrap_or_else(|e| e.into_inner());
            Failure {
                rank: rank.rank,
                pid: rank.pid,
                status: rank.status.expect("failed rank status"),
                last_error: last_error.clone(),
            }
        });
        Outcome {
            failure,
            signal: self.signal,
        }
    }

    fn send_to_live(&mut self, signal: i32, when: &str) {
        let live: Vec<usize> = (0..self.ranks.len())
            .filter(|&i| self.ranks[i].live())
            .collect();
        if live.is_empty() {
            return;
        }
        eprintln!(
            "{ME}: sending {} to the process groups of {} ({when})",
            signal_label(signal),
            ranks_list(live.iter().map(|&i| &self.ranks[i]))
        );
        for index in live {
            let rank = &mut self.ranks[index];
            signal_group(rank.pid, signal);
            if rank.running() {
                rank.stopped_with = Some(signal);
            }
        }
    }

    /// Waits until every rank has ended and drained its output, the deadline passes, or the
    /// launcher is signalled.
    fn wait_all_done(&mut self, deadline: Option<Instant>) -> Wait {
        while self.ranks.iter().any(Rank::live) {
            let Some(event) = self.recv(deadline) else {
                return Wait::TimedOut;
            };
            if let Some(signal) = self.handle(event) {
                return Wait::Signalled(signal);
            }
        }
        Wait::Done
    }

    /// The next event, or None once `deadline` has passed.
    fn recv(&self, deadline: Option<Instant>) -> Option<Event> {
        match deadline {
            None => self.events.recv().ok(),
            Some(deadline) => {
                let left = deadline.saturating_duration_since(Instant::now());
                self.events.recv_timeout(left).ok()
            }
        }
    }
}

pub fn signal_label(signal: i32) -> String {
    signal_name(signal).map_or_else(|| describe_signal(signal), str::to_owned)
}

pub fn launcher_received(signal: i32) -> String {
    format!("the launcher received {}", signal_label(signal))
}

/// "rank 2" or "ranks 0, 1, 3".
fn ranks_list<'a>(ranks: impl Iterator<Item = &'a Rank>) -> String {
    let ids: Vec<String> = ranks.map(|r| r.rank.to_string()).collect();
    match ids.len() {
        0 => "no rank".to_owned(),
        1 => format!("rank {}", ids[0]),
        _ => format!("ranks {}", ids.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use std::os::unix::process::ExitStatusExt;

    use super::*;
    use crate::waiter::exit_status_without_reaping;

    /// A supervisor of two children: `sleep 1000` (local rank 0) and `sh -c 'exit 3'` (rank 1),
    /// the second already ended; returns it with rank 1's status.
    fn sleeper_and_failure() -> (Supervisor, ExitStatus) {
        let (_events, receiver) = std::sync::mpsc::channel();
        let mut supervisor = Supervisor::new(receiver, Duration::from_secs(1), 0);
        let sleeper = Command::new("sleep").arg("1000").spawn().unwrap();
        let failure = Command::new("sh").args(["-c", "exit 3"]).spawn().unwrap();
        let failed = exit_status_without_reaping(failure.id()).unwrap();
        let spawned = |child| Spawned {
            child,
            last_error: LastLine::default(),
        };
        supervisor.add(0, spawned(sleeper));
        supervisor.add(1, spawned(failure));
        (supervisor, failed)
    }

    fn kill_and_reap(supervisor: &mut Supervisor) {
        for rank in &mut supervisor.ranks {
            let _ = rank.child.kill();
            let _ = rank.child.wait();
        }
    }

    #[test]
    fn a_rank_killed_by_a_signal_is_named_first_even_when_a_peers_exit_arrives_first() {
        let (mut supervisor, failed) = sleeper_and_failure();
        let killed = supervisor.ranks[0].pid;
        // SAFETY: kill(2) of our own child; no memory is touched.
        assert_eq!(unsafe { libc::kill(killed as i32, libc::SIGKILL) }, 0);
        exit_status_without_reaping(killed).unwrap();
        // Rank 1's error exit is reported before rank 0's death, as a loaded machine may do.
        supervisor.handle(Event::Exited {
            attempt: 0,
            index: 1,
            status: failed,
        });
        assert_eq!(supervisor.first_failure, Some(0));
        kill_and_reap(&mut supervisor);
    }

    /// The killed rank's death is reported only after its peer's error exit (it was not yet
    /// waitable when that exit arrived): the settle window still names it.
    #[test]
    fn a_death_by_signal_reported_just_after_the_first_failure_is_named_first() {
        let (events, receiver) = std::sync::mpsc::channel();
        let (mut supervisor, failed) = sleeper_and_failure();
        supervisor.events = receiver;
        supervisor.handle(Event::Exited {
            attempt: 0,
            index: 1,
            status: failed,
        });
        assert_eq!(supervisor.first_failure, Some(1), "rank 0 is still running");
        let killed = ExitStatus::from_raw(libc::SIGKILL);
        events
            .send(Event::Exited {
                attempt: 0,
                index: 0,
                status: killed,
            })
            .unwrap();
        assert_eq!(supervisor.settle_first_failure(), None);
        assert_eq!(supervisor.first_failure, Some(0));
        kill_and_reap(&mut supervisor);
    }

    /// A late event of an earlier start (its index is a rank of this one too) changes nothing.
    #[test]
    fn events_of_another_start_are_ignored() {
        let (mut supervisor, failed) = sleeper_and_failure();
        supervisor.attempt = 1;
        supervisor.handle(Event::Exited {
            attempt: 0,
            index: 1,
            status: failed,
        });
        supervisor.handle(Event::OutputClosed {
            attempt: 0,
            index: 1,
        });
        assert_eq!(supervisor.first_failure, None);
        assert!(supervisor.ranks[1].running());
        assert_eq!(supervisor.ranks[1].open_outputs, 2);
        kill_and_reap(&mut supervisor);
    }

    #[test]
    fn the_reported_rank_is_named_when_no_other_rank_died() {
        let (mut supervisor, failed) = sleeper_and_failure();
        supervisor.handle(Event::Exited {
            attempt: 0,
            index: 1,
            status: failed,
        });
        assert_eq!(supervisor.first_failure, Some(1));
        assert!(supervisor.ranks[0].running());
        kill_and_reap(&mut supervisor);
    }
}
