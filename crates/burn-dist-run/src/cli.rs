//! Command-line arguments. Parsing only: cross-option checks live in `job.rs`, so they can report
//! errors in the launcher's own words and be unit-tested without clap.

use std::ffi::OsString;

use clap::Parser;

/// Run one process per rank of a burn-dist job on this node, torchrun style.
///
/// Each process gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
/// MASTER_PORT and BURN_DIST_TOKEN in its environment, and RAYON_NUM_THREADS and OMP_NUM_THREADS
/// set to its share of the cores (cores / N, at least 1) unless they are already set. Its output
/// is prefixed with `[rank R]`.
/// When one rank fails, the others are stopped and the launcher exits with the failed rank's code,
/// or, with `--max-restarts`, starts every rank again (BURN_DIST_RESTART_COUNT says which start).
#[derive(Debug, Parser)]
#[command(
    name = "burn-dist-run",
    version,
    override_usage = "burn-dist-run [OPTIONS] -- <COMMAND> [ARGS]..."
)]
pub struct Args {
    /// Processes (ranks) to start on this node.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub nproc_per_node: u32,

    /// Nodes in the job: N, or MIN:MAX for an elastic job whose launchers meet at
    /// --master-addr:--master-port before every start and are numbered there.
    #[arg(long, default_value = "1", value_name = "N|MIN:MAX")]
    pub nnodes: String,

    /// This node's index, from 0 to nnodes - 1 (default 0); not with --nnodes MIN:MAX.
    #[arg(long, value_name = "R")]
    pub node_rank: Option<u32>,

    /// With --nnodes MIN:MAX: how long a round of the rendezvous waits for more nodes once MIN
    /// have joined.
    #[arg(long, default_value_t = 10, value_name = "S")]
    pub rdzv_last_call_secs: u64,

    /// Address of the node that runs rank 0; every rank connects there. With --nnodes MIN:MAX:
    /// where the launchers meet (the launcher that binds it hosts the rendezvous).
    #[arg(long, default_value = "127.0.0.1", value_name = "ADDR")]
    pub master_addr: String,

    /// Port of the rendezvous store on the master; 0 picks a free port (single node only). With
    /// --nnodes MIN:MAX: the launchers' rendezvous port (the store's is picked each start).
    #[arg(long, default_value_t = 29500, value_name = "PORT")]
    pub master_port: u16,

    /// One node on loopback with a free port: the same as `--nnodes 1 --master-addr 127.0.0.1
    /// --master-port 0`.
    #[arg(long, conflicts_with_all = ["nnodes", "node_rank", "master_addr", "master_port"])]
    pub standalone: bool,

    /// When a rank fails, stop every rank and start them all again, at most this many times.
    /// The program finds its newest checkpoint itself; BURN_DIST_RESTART_COUNT tells it which
    /// restart this is. A start that fails the same way as the one before ends the job.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub max_restarts: u32,

    /// Show only these local ranks' output (e.g. `0` or `0,3`); the others' goes to
    /// `<log-dir>/attempt-<restart>/rank-<R>.log`.
    #[arg(long, value_delimiter = ',', value_name = "RANKS")]
    pub local_ranks_filter: Option<Vec<u32>>,

    /// Where `--local-ranks-filter` puts the output of the ranks it hides.
    #[arg(long, default_value = "burn-dist-logs", value_name = "DIR")]
    pub log_dir: std::path::PathBuf,

    /// Seconds the other ranks get to exit on their own after one fails, and again after SIGTERM
    /// before SIGKILL.
    #[arg(long, default_value_t = 5, value_name = "S")]
    pub stop_grace_secs: u64,

    /// The program each rank runs, and its arguments.
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "COMMAND"
    )]
    pub command: Vec<OsString>,
}
