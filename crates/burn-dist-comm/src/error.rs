//! The one error type of the communication layer. Every message names what is wrong: which rank,
//! which collective, which variable or address.

use std::path::PathBuf;
use std::time::Duration;

use crate::OpDesc;

/// Everything that can go wrong in a collective, the store or the rendezvous.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CommError {
    /// A peer's connection closed while this rank still needed it: the process died or dropped
    /// its communicator.
    #[error("rank {peer} closed its connection during {op} (did the process die?)")]
    PeerClosed { peer: usize, op: OpDesc },

    /// A peer's connection closed while this rank was idle between collectives.
    #[error("rank {peer} closed its connection (did the process die?)")]
    PeerLost { peer: usize },

    /// A peer sent nothing for the whole timeout.
    #[error("rank {peer} did not answer within {} s during {op}", timeout.as_secs_f32())]
    Timeout {
        peer: usize,
        op: OpDesc,
        timeout: Duration,
    },

    /// This rank's caller stopped the group ([`HostCommunicator::abort`](crate::HostCommunicator::abort)),
    /// for a reason of its own that every peer then reports.
    #[error("{reason}")]
    Cancelled { reason: String },

    /// Another rank failed and told the group why.
    #[error("rank {by} aborted the group: {reason}")]
    Aborted { by: usize, reason: String },

    /// The ranks issued different collectives (order, kind, dtype or size differ).
    #[error(
        "rank {peer} sent {got} while this rank expected {expected} in {op}: \
         every rank must issue the same collectives in the same order with the same sizes"
    )]
    Mismatch {
        peer: usize,
        op: OpDesc,
        expected: String,
        got: String,
        /// The tag of what the peer sent ([`OpDesc::tag`]), 0 for none or an unreadable header.
        got_tag: u32,
    },

    /// Ranks wait for each other on different lanes, each in a collective another has not
    /// issued, so none can go on (found by asking the peers after
    /// [`CommConfig::divergence_grace`](crate::CommConfig::divergence_grace)): their programs
    /// diverged where no header could show it, since headers are compared within a lane.
    #[error(
        "the ranks diverged across the communicator's lanes, each waiting for a collective that \
         another has not issued: {detail}. Every rank must issue the same collectives in the \
         same order on each lane"
    )]
    Diverged { detail: String },

    /// The caller passed arguments that cannot work.
    #[error("invalid {op}: {reason}")]
    InvalidArgument { op: String, reason: String },

    /// A rendezvous variable is missing or malformed.
    #[error("{var}: {problem}")]
    Env { var: String, problem: String },

    /// The TCP store refused a request or could not be reached.
    #[error("store at {addr}: {reason}")]
    Store { addr: String, reason: String },

    /// A peer presented the wrong job token or an impossible rank.
    #[error("rejected connection from {from}: {reason}")]
    Handshake { from: String, reason: String },

    /// The job has no token (`BURN_DIST_TOKEN` empty or unset) while its store listens on an
    /// address other machines can reach: anyone who found the port could join it.
    #[error(
        "BURN_DIST_TOKEN is not set, and the store at {addr} is reachable from other machines: \
         set the same secret on every rank, e.g. `export BURN_DIST_TOKEN=$(openssl rand -hex 16)` \
         before `srun` (which passes the environment on to every task), or run the job on \
         loopback"
    )]
    TokenRequired { addr: String },

    /// Two processes joined the job as the same rank: RANK given twice, or two nodes given the
    /// same `--node-rank`. The job cannot form.
    #[error(
        "rank {rank} joined the job twice (first from {first}, again from {second}): give every \
         process its own RANK, and every node its own --node-rank"
    )]
    DuplicateRank {
        rank: usize,
        first: String,
        second: String,
    },

    /// A file a peer published under `/dev/shm` (a shared-memory arena or ring) is not one this
    /// rank maps: burn-dist creates only regular files of the job's user that no one else may
    /// open (mode 0600), so something else took its place. The set-up then links that peer
    /// without it (the rings, or TCP) and says so in a warning that carries this error.
    #[error("refusing to map {}: {problem}", path.display())]
    SharedFileRefused {
        path: PathBuf,
        problem: SharedFileProblem,
    },

    /// An operating-system error with what we were doing at the time.
    #[error("{context}: {message}")]
    Io { context: String, message: String },

    /// The communicator has been shut down and takes no more work.
    #[error("the communicator of rank {rank} is shut down")]
    ShutDown { rank: usize },
}

/// Why [`CommError::SharedFileRefused`] refused a file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SharedFileProblem {
    /// A directory, a FIFO, a device, a socket or a symbolic link (never followed).
    #[error("it is {0}, not a regular file")]
    NotRegular(&'static str),
    /// Another user's file.
    #[error("it belongs to uid {owner}, not to this process's user (uid {expected})")]
    Owner { owner: u32, expected: u32 },
    /// Open to its group or to others, or not readable and writable by its owner.
    #[error("its mode is {mode:04o}, not 0600 (read and write for its owner alone)")]
    Mode { mode: u32 },
}

impl CommError {
    pub(crate) fn io(context: impl Into<String>, err: std::io::Error) -> Self {
        CommError::Io {
            context: context.into(),
            message: err.to_string(),
        }
    }

    pub(crate) fn invalid(op: impl Into<String>, reason: impl Into<String>) -> Self {
        CommError::InvalidArgument {
            op: op.into(),
            reason: reason.into(),
        }
    }
}

/// The result type of this crate.
pub type Result<T, E = CommError> = std::result::Result<T, E>;
