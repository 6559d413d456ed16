//! The launcher's one error type. Each message names the option, variable or rank that is wrong,
//! so the user can fix the command line without reading the source.

use std::io;

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("--nproc-per-node must be at least 1 (got 0)")]
    NoProcesses,

    #[error("--nnodes must be at least 1 (got 0)")]
    NoNodes,

    #[error(
        "--local-ranks-filter: local rank {local_rank} does not exist: with --nproc-per-node \
         {nproc_per_node} local ranks go from 0 to {}",
        nproc_per_node - 1
    )]
    FilteredRankOutOfRange {
        local_rank: u32,
        nproc_per_node: u32,
    },

    #[error("cannot create the log file {path} for rank {rank} (--log-dir): {source}")]
    LogFile {
        rank: u64,
        path: std::path::PathBuf,
        source: io::Error,
    },

    #[error(
        "--node-rank {node_rank} is out of range: with --nnodes {nnodes} it must be below {nnodes}"
    )]
    NodeRankOutOfRange { node_rank: u32, nnodes: u32 },

    #[error(
        "--master-port 0 (pick a free port) only works with --nnodes 1: every node must be told \
         the same port, so pass a fixed --master-port with --nnodes {nnodes}"
    )]
    PortZeroMultiNode { nnodes: u32 },

    #[error(
        "--master-addr {addr} is a loopback address ({ip}), which the other nodes cannot reach: \
         with --nnodes {nnodes} pass an address of node 0 that every node reaches"
    )]
    LoopbackMasterMultiNode {
        addr: String,
        ip: std::net::IpAddr,
        nnodes: u32,
    },

    #[error(
        "--nnodes {nnodes} × --nproc-per-node {nproc_per_node} makes {world} ranks, more than \
         the {max} a job can have"
    )]
    WorldTooLarge {
        nnodes: u32,
        nproc_per_node: u32,
        world: u64,
        max: usize,
    },

    #[error(
        "no command to run: pass it after `--`, e.g. `burn-dist-run --nproc-per-node 2 -- python train.py`"
    )]
    MissingCommand,

    #[error(
        "BURN_DIST_TOKEN is not set: with --nnodes {nnodes} every node must present the same job \
         token, so generate one (e.g. `openssl rand -hex 16`) and export the same BURN_DIST_TOKEN on every node"
    )]
    MissingToken { nnodes: u32 },

    #[error(
        "BURN_DIST_TOKEN is set but empty: unset it, or export the same non-empty token on every node"
    )]
    EmptyToken,

    #[error("cannot generate a random BURN_DIST_TOKEN: {0}")]
    TokenRandomness(getrandom::Error),

    #[error("cannot pick a free port on --master-addr {addr}: {source}")]
    PickPort { addr: String, source: io::Error },

    #[error("elastic rendezvous at {addr}: {problem}")]
    Rendezvous { addr: String, problem: String },

    #[error("--nnodes {text}: {problem} (a node count N, or MIN:MAX for an elastic job)")]
    BadNodeCount { text: String, problem: String },

    #[error(
        "--node-rank cannot be used with --nnodes MIN:MAX: the elastic rendezvous numbers the \
         nodes"
    )]
    NodeRankWithElastic,

    #[error("cannot start rank {rank} (`{program}`): {source}")]
    Spawn {
        rank: u64,
        program: String,
        source: io::Error,
    },

    #[error("cannot install the launcher's handlers for SIGINT, SIGTERM and SIGHUP: {0}")]
    SignalHandlers(io::Error),
}

impl LaunchError {
    /// Mistakes in the command line exit with 2, like clap's own usage errors; failures of the
    /// launcher itself (randomness, ports, spawning) exit with 1.
    pub fn exit_code(&self) -> i32 {
        match self {
            LaunchError::NoProcesses
            | LaunchError::NoNodes
            | LaunchError::FilteredRankOutOfRange { .. }
            | LaunchError::BadNodeCount { .. }
            | LaunchError::NodeRankWithElastic
            | LaunchError::NodeRankOutOfRange { .. }
            | LaunchError::PortZeroMultiNode { .. }
            | LaunchError::LoopbackMasterMultiNode { .. }
            | LaunchError::WorldTooLarge { .. }
            | LaunchError::MissingCommand
            | LaunchError::MissingToken { .. }
            | LaunchError::EmptyToken => 2,
            LaunchError::TokenRandomness(_)
            | LaunchError::PickPort { .. }
            | LaunchError::Spawn { .. }
            | LaunchError::LogFile { .. }
            | LaunchError::Rendezvous { .. }
            | LaunchError::SignalHandlers(_) => 1,
        }
    }
}
