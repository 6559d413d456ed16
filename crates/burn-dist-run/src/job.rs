//! What every rank of this node is told: validated options, the resolved master port and the job
//! token, turned into each child's environment.

use std::ffi::OsString;
use std::net::{IpAddr, Ipv4Addr, TcpListener};
use std::path::PathBuf;
use std::time::Duration;

use burn_dist_comm::ThreadShare;
use burn_dist_comm::env::{MAX_WORLD_SIZE, RESTART_VAR, resolve_master};

use crate::cli::Args;
use crate::error::LaunchError;

/// The variable that carries the job token; peers present it to each other so that a stray
/// process (or another job on the same port) cannot join.
pub const TOKEN_VAR: &str = "BURN_DIST_TOKEN";

#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    pub nproc_per_node: u32,
    /// Nodes in this start of the job (for an elastic job, as the rendezvous numbered them).
    pub nnodes: u32,
    pub node_rank: u32,
    pub master_addr: String,
    /// Never 0: a requested 0 has been replaced by a free port.
    pub master_port: u16,
    /// The port asked for; 0 picks a new free port at every restart.
    pub requested_port: u16,
    pub token: OsString,
    pub command: Vec<OsString>,
    pub grace: Duration,
    /// Each rank's share of this node's cores, for the thread-count variables the user left
    /// unset.
    pub threads: ThreadShare,
    pub max_restarts: u32,
    /// Which start of the job this is: 0, then 1 after the first restart, ...
    pub restart: u32,
    /// The local ranks whose output is shown (`--local-ranks-filter`); None: all.
    pub shown: Option<Vec<u32>>,
    /// Where the hidden ranks' output goes.
    pub log_dir: PathBuf,
    /// Set for `--nnodes MIN:MAX`.
    pub elastic: Option<Elastic>,
}

/// An elastic job's node range and rendezvous.
#[derive(Debug, Clone, PartialEq)]
pub struct Elastic {
    pub min: u32,
    pub max: u32,
    /// `--master-addr` and `--master-port`: where the launchers meet.
    pub rendezvous_addr: String,
    pub rendezvous_port: u16,
    pub last_call: Duration,
}

/// `--nnodes` read: a fixed count, or an elastic range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct NodeCount {
    min: u32,
    max: u32,
    elastic: bool,
}

fn node_count(text: &str) -> Result<NodeCount, LaunchError> {
    let bad = |problem: &str| LaunchError::BadNodeCount {
        text: text.to_owned(),
        problem: problem.to_owned(),
    };
    let number = |n: &str| n.trim().parse::<u32>().map_err(|_| bad("not a number"));
    let (min, max, elastic) = match text.split_once(':') {
        None => {
            let n = number(text)?;
            (n, n, false)
        }
        Some((min, max)) => (number(min)?, number(max)?, true),
    };
    if min == 0 && !elastic {
        return Err(LaunchError::NoNodes);
    }
    if min == 0 {
        return Err(bad("MIN must be at least 1"));
    }
    if min > max {
        return Err(bad("MIN is above MAX"));
    }
    Ok(NodeCount { min, max, elastic })
}

impl Job {
    /// Checks the options, then resolves the port and token, and each rank's share of this node's
    /// cores. `env_token` is the launcher's own BURN_DIST_TOKEN, passed in so tests need not
    /// touch the process environment.
    pub fn from_args(args: Args, env_token: Option<OsString>) -> Result<Job, LaunchError> {
        let args = standalone(args);
        let nodes = node_count(&args.nnodes)?;
        validate(&args, nodes)?;
        let threads = ThreadShare::from_env(args.nproc_per_node as usize);
        // The token check comes before picking a port: it is a usage error and costs no I/O.
        let token = resolve_token(env_token, nodes)?;
        let elastic = nodes.elastic.then(|| Elastic {
            min: nodes.min,
            max: nodes.max,
            rendezvous_addr: args.master_addr.clone(),
            rendezvous_port: args.master_port,
            last_call: Duration::from_secs(args.rdzv_last_call_secs),
        });
        // An elastic job's store port comes from the rendezvous.
        let master_port = match elastic {
            Some(_) => args.master_port,
            None => resolve_port(&args.master_addr, args.master_port)?,
        };
        Ok(Job {
            nproc_per_node: args.nproc_per_node,
            nnodes: nodes.max,
            node_rank: args.node_rank.unwrap_or(0),
            master_addr: args.master_addr,
            master_port,
            requested_port: args.master_port,
            token,
            command: args.command,
            grace: Duration::from_secs(args.stop_grace_secs),
            threads,
            max_restarts: args.max_restarts,
            restart: 0,
            shown: args.local_ranks_filter,
            log_dir: args.log_dir,
            elastic,
        })
    }

    /// This start of an elastic job, with the place and the store the rendezvous gave it.
    pub fn placed(&self, at: &crate::rendezvous::Assignment) -> Job {
        Job {
            nnodes: at.nnodes,
            node_rank: at.node_rank,
            master_addr: at.master_addr.clone(),
            master_port: at.master_port,
            ..self.clone()
        }
    }

    /// The job's next start: the restart count one higher and, where the port was left to the
    /// launcher, a new free port (the old one may still be held by a process of the failed
    /// start that is slow to die).
    pub fn restarted(&self) -> Result<Job, LaunchError> {
        Ok(Job {
            restart: self.restart + 1,
            master_port: resolve_port(&self.master_addr, self.requested_port)?,
            ..self.clone()
        })
    }

    /// Whether local rank `local_rank`'s output is shown (else it goes to its log file).
    pub fn shows(&self, local_rank: u32) -> bool {
        self.shown
            .as_ref()
            .is_none_or(|shown| shown.contains(&local_rank))
    }

    /// The log file of local rank `local_rank` in this start, for a rank whose output is hidden.
    pub fn log_file(&self, local_rank: u32) -> PathBuf {
        self.log_dir
            .join(format!("attempt-{}", self.restart))
            .join(format!("rank-{}.log", self.global_rank(local_rank)))
    }

    pub fn world_size(&self) -> u64 {
        u64::from(self.nnodes) * u64::from(self.nproc_per_node)
    }

    pub fn global_rank(&self, local_rank: u32) -> u64 {
        u64::from(self.node_rank) * u64::from(self.nproc_per_node) + u64::from(local_rank)
    }

    /// The variables set for the child with this local rank, on top of the launcher's own
    /// environment.
    pub fn rank_env(&self, local_rank: u32) -> Vec<(&'static str, OsString)> {
        let threads = self.threads.env().into_iter();
        let threads = threads.map(|(var, value)| (var, OsString::from(value)));
        let mut env = vec![
            ("RANK", self.global_rank(local_rank).to_string().into()),
            ("WORLD_SIZE", self.world_size().to_string().into()),
            ("LOCAL_RANK", local_rank.to_string().into()),
            ("LOCAL_WORLD_SIZE", self.nproc_per_node.to_string().into()),
            ("GROUP_RANK", self.node_rank.to_string().into()),
            ("MASTER_ADDR", self.master_addr.clone().into()),
            ("MASTER_PORT", self.master_port.to_string().into()),
            (TOKEN_VAR, self.token.clone()),
            (RESTART_VAR, self.restart.to_string().into()),
        ];
        env.extend(threads);
        env
    }
}

/// `--standalone` is one node on loopback with a port the launcher picks (clap has already
/// refused it together with the options it sets).
fn standalone(args: Args) -> Args {
    if !args.standalone {
        return args;
    }
    Args {
        nnodes: "1".into(),
        node_rank: None,
        master_addr: Ipv4Addr::LOCALHOST.to_string(),
        master_port: 0,
        ..args
    }
}

fn validate(args: &Args, nodes: NodeCount) -> Result<(), LaunchError> {
    if args.nproc_per_node == 0 {
        return Err(LaunchError::NoProcesses);
    }
    let filter = args.local_ranks_filter.iter().flatten();
    if let Some(&local_rank) = filter.into_iter().find(|&&r| r >= args.nproc_per_node) {
        return Err(LaunchError::FilteredRankOutOfRange {
            local_rank,
            nproc_per_node: args.nproc_per_node,
        });
    }
    match (args.node_rank, nodes.elastic) {
        (Some(_), true) => return Err(LaunchError::NodeRankWithElastic),
        (Some(node_rank), false) if node_rank >= nodes.max => {
            return Err(LaunchError::NodeRankOutOfRange {
                node_rank,
                nnodes: nodes.max,
            });
        }
        _ => {}
    }
    let world = u64::from(nodes.max) * u64::from(args.nproc_per_node);
    if world > MAX_WORLD_SIZE as u64 {
        return Err(LaunchError::WorldTooLarge {
            nnodes: nodes.max,
            nproc_per_node: args.nproc_per_node,
            world,
            max: MAX_WORLD_SIZE,
        });
    }
    if args.master_port == 0 && (nodes.max > 1 || nodes.elastic) {
        return Err(LaunchError::PortZeroMultiNode { nnodes: nodes.max });
    }
    // A name is resolved as the ranks will resolve it: `$(hostname)` maps to 127.0.1.1 on many
    // distributions. `localhost` is loopback by definition (RFC 6761), even where no
    // /etc/hosts says so (a bare container). Another name that does not resolve is left for
    // the ranks to report.
    let loopback = || {
        if is_localhost_name(&args.master_addr) {
            return Some(IpAddr::from(Ipv4Addr::LOCALHOST));
        }
        let master = resolve_master(&args.master_addr, args.master_port).ok()?;
        master.ip().is_loopback().then_some(master.ip())
    };
    // An elastic job may put every node on one host (they all reach its rendezvous on
    // loopback); a static one with several nodes may not.
    if nodes.max > 1
        && !nodes.elastic
        && let Some(ip) = loopback()
    {
        return Err(LaunchError::LoopbackMasterMultiNode {
            addr: args.master_addr.clone(),
            ip,
            nnodes: nodes.max,
        });
    }
    if args.command.is_empty() {
        return Err(LaunchError::MissingCommand);
    }
    Ok(())
}

/// `localhost`, or a name under it, in any case, with or without the root's trailing dot.
fn is_localhost_name(name: &str) -> bool {
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    name == "localhost" || name.ends_with(".localhost")
}

/// A token the user exported is passed through unchanged. A single node may mint its own; several
/// nodes cannot, because each launcher would mint a different one.
fn resolve_token(env_token: Option<OsString>, nodes: NodeCount) -> Result<OsString, LaunchError> {
    match env_token {
        Some(token) if token.is_empty() => Err(LaunchError::EmptyToken),
        Some(token) => Ok(token),
        None if nodes.max > 1 || nodes.elastic => {
            Err(LaunchError::MissingToken { nnodes: nodes.max })
        }
        None => random_token().map(OsString::from),
    }
}

/// 16 random bytes as 32 lowercase hex characters.
fn random_token() -> Result<String, LaunchError> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(LaunchError::TokenRandomness)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Port 0 means "any free port": bind it on the master address, read what the kernel chose and
/// release it for rank 0's store. Another process could take it in between; that window is the
/// same one torchrun accepts.
fn resolve_port(addr: &str, port: u16) -> Result<u16, LaunchError> {
    if port != 0 {
        return Ok(port);
    }
    let pick = || TcpListener::bind((addr, 0))?.local_addr().map(|a| a.port());
    pick().map_err(|source| LaunchError::PickPort {
        addr: addr.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn args(cli: &[&str]) -> Args {
        Args::try_parse_from(std::iter::once("burn-dist-run").chain(cli.iter().copied())).unwrap()
    }

    fn env_of(job: &Job, local_rank: u32, name: &str) -> String {
        let env = job.rank_env(local_rank);
        let (_, value) = env.iter().find(|(n, _)| *n == name).unwrap();
        value.to_str().unwrap().to_owned()
    }

    /// A master address for multi-node jobs in these tests: TEST-NET-1, never contacted.
    const REMOTE_MASTER: &str = "192.0.2.1";

    #[test]
    fn ranks_of_the_second_node_follow_the_first_nodes() {
        let cli = [
            "--master-addr",
            REMOTE_MASTER,
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--nproc-per-node",
            "3",
            "--",
            "x",
        ];
        let job = Job::from_args(args(&cli), Some("t".into())).unwrap();
        let ranks: Vec<String> = (0..3).map(|l| env_of(&job, l, "RANK")).collect();
        assert_eq!(ranks, ["3", "4", "5"]);
        assert_eq!(env_of(&job, 2, "WORLD_SIZE"), "6");
        assert_eq!(env_of(&job, 2, "LOCAL_RANK"), "2");
        assert_eq!(env_of(&job, 2, "LOCAL_WORLD_SIZE"), "3");
        assert_eq!(env_of(&job, 2, "GROUP_RANK"), "1");
        assert_eq!(env_of(&job, 0, TOKEN_VAR), "t");
    }

    #[test]
    fn single_node_mints_a_32_hex_char_token() {
        let job = Job::from_args(args(&["--", "x"]), None).unwrap();
        let token = job.token.to_str().unwrap();
        assert_eq!(token.len(), 32);
        assert!(token.bytes().all(|b| b.is_ascii_hexdigit()));
    }

    #[test]
    fn multi_node_without_token_is_refused() {
        let cli = ["--master-addr", REMOTE_MASTER, "--nnodes", "2", "--", "x"];
        let err = Job::from_args(args(&cli), None).unwrap_err();
        assert!(matches!(err, LaunchError::MissingToken { nnodes: 2 }));
        assert!(
            err.to_string()
                .contains("export the same BURN_DIST_TOKEN on every node")
        );
    }

    #[test]
    fn bad_options_are_named() {
        let cases: [(&[&str], &str); 5] = [
            (&["--nproc-per-node", "0", "--", "x"], "--nproc-per-node"),
            (&["--nnodes", "0", "--", "x"], "--nnodes"),
            (
                &["--nnodes", "2", "--node-rank", "2", "--", "x"],
                "--node-rank 2",
            ),
            (
                &["--nnodes", "2", "--master-port", "0", "--", "x"],
                "--master-port 0",
            ),
            (&[], "no command"),
        ];
        for (cli, named) in cases {
            let err = Job::from_args(args(cli), Some("t".into())).unwrap_err();
            assert!(err.to_string().contains(named), "{cli:?}: {err}");
            assert_eq!(err.exit_code(), 2);
        }
    }

    #[test]
    fn the_restart_count_reaches_every_rank_and_port_zero_is_picked_again() {
        let job = Job::from_args(args(&["--standalone", "--", "x"]), None).unwrap();
        assert_eq!((job.nnodes, job.master_addr.as_str()), (1, "127.0.0.1"));
        assert_eq!(env_of(&job, 0, RESTART_VAR), "0");
        let next = job.restarted().unwrap();
        assert_eq!(env_of(&next, 0, RESTART_VAR), "1");
        assert_eq!(next.requested_port, 0);
        assert_ne!(next.master_port, 0);
        assert_eq!(
            next.token, job.token,
            "the job keeps its token across restarts"
        );
        let fixed = Job::from_args(args(&["--master-port", "29999", "--", "x"]), None).unwrap();
        assert_eq!(fixed.restarted().unwrap().master_port, 29999);
    }

    #[test]
    fn standalone_with_the_options_it_sets_is_refused() {
        for option in ["--nnodes", "--master-port", "--master-addr", "--node-rank"] {
            let cli = ["burn-dist-run", "--standalone", option, "1", "--", "x"];
            let err = Args::try_parse_from(cli).expect_err("accepted");
            assert!(err.to_string().contains("cannot be used with"), "{err}");
        }
    }

    #[test]
    fn a_filtered_rank_that_does_not_exist_is_named() {
        let cli = [
            "--nproc-per-node",
            "2",
            "--local-ranks-filter",
            "0,2",
            "--",
            "x",
        ];
        let err = Job::from_args(args(&cli), None).unwrap_err();
        assert!(
            matches!(
                err,
                LaunchError::FilteredRankOutOfRange { local_rank: 2, .. }
            ),
            "{err}"
        );
        assert!(
            err.to_string()
                .starts_with("--local-ranks-filter: local rank 2")
        );
        let job = Job::from_args(args(&["--local-ranks-filter", "0", "--", "x"]), None).unwrap();
        assert!(job.shows(0));
        let all = Job::from_args(args(&["--nproc-per-node", "2", "--", "x"]), None).unwrap();
        assert!(all.shows(1));
    }

    #[test]
    fn elastic_node_ranges_are_checked_naming_the_flag() {
        let elastic = ["--nnodes", "2:3", "--master-port", "29400", "--", "x"];
        let job = Job::from_args(args(&elastic), Some("t".into())).unwrap();
        let range = job.elastic.as_ref().map(|e| (e.min, e.max));
        assert_eq!(range, Some((2, 3)), "on loopback: every node on this host");
        let err = Job::from_args(args(&elastic), None).unwrap_err();
        assert!(
            matches!(err, LaunchError::MissingToken { nnodes: 3 }),
            "{err}"
        );
        let cases: [(&[&str], &str); 5] = [
            (&["--nnodes", "3:2"], "--nnodes 3:2: MIN is above MAX"),
            (&["--nnodes", "0:2"], "--nnodes 0:2: MIN must be at least 1"),
            (&["--nnodes", "two"], "--nnodes two: not a number"),
            (
                &["--nnodes", "1:2", "--node-rank", "1"],
                "--node-rank cannot be used",
            ),
            (
                &["--nnodes", "1:2", "--master-port", "0"],
                "--master-port 0",
            ),
        ];
        for (cli, named) in cases {
            let cli = [cli, &["--", "x"]].concat();
            let err = Job::from_args(args(&cli), Some("t".into())).unwrap_err();
            assert!(err.to_string().starts_with(named), "{cli:?}: {err}");
            assert_eq!(err.exit_code(), 2);
        }
    }

    #[test]
    fn port_zero_becomes_a_real_port() {
        let job = Job::from_args(args(&["--master-port", "0", "--", "x"]), None).unwrap();
        assert_ne!(job.master_port, 0);
    }

    #[test]
    fn several_nodes_with_a_loopback_master_are_refused_naming_the_flag() {
        for addr in [
            "127.0.0.1",
            "127.0.1.1",
            "::1",
            "localhost",
            "LocalHost.",
            "node.localhost",
        ] {
            let cli = ["--master-addr", addr, "--nnodes", "2", "--", "x"];
            let err = Job::from_args(args(&cli), Some("t".into())).unwrap_err();
            assert!(
                matches!(&err, LaunchError::LoopbackMasterMultiNode { nnodes: 2, .. }),
                "{addr}: {err}"
            );
            assert!(
                err.to_string()
                    .starts_with(&format!("--master-addr {addr} is a loopback"))
            );
            assert_eq!(err.exit_code(), 2);
        }
        // One node on loopback is the default and stays fine.
        Job::from_args(args(&["--nproc-per-node", "2", "--", "x"]), None).unwrap();
    }

    #[test]
    fn too_many_ranks_are_refused_naming_the_flags() {
        let cli = [
            "--master-addr",
            REMOTE_MASTER,
            "--nnodes",
            "1000",
            "--nproc-per-node",
            "100",
        ];
        let cli = [cli.as_slice(), &["--", "x"]].concat();
        let err = Job::from_args(args(&cli), Some("t".into())).unwrap_err();
        assert!(
            matches!(err, LaunchError::WorldTooLarge { world: 100_000, .. }),
            "{err}"
        );
        assert!(
            err.to_string()
                .contains("--nnodes 1000 × --nproc-per-node 100"),
            "{err}"
        );
    }
}
