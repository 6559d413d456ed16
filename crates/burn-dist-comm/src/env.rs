//! Where this process sits in the job: read from torchrun-style variables (what `burn-dist-run`
//! sets) or, failing that, from Slurm's.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use crate::{CommError, MAX_TIMEOUT, Result};

/// Variable holding the job token that every peer must present.
pub const TOKEN_VAR: &str = "BURN_DIST_TOKEN";
/// Optional variable overriding the timeout of every blocking wait, in seconds.
pub const TIMEOUT_VAR: &str = "BURN_DIST_TIMEOUT_SECS";
/// Optional variable: `0` keeps same-host ranks on loopback TCP instead of shared memory.
pub const SHM_VAR: &str = "BURN_DIST_SHM";
/// Optional variable: `0` gives the group no second lane for parameter gathers (see
/// [`CommConfig::gather_lane`](crate::CommConfig::gather_lane)). Must be the same on every rank.
pub const GATHER_LANE_VAR: &str = "BURN_DIST_GATHER_LANE";
/// Port used under Slurm when MASTER_PORT is not set: this base plus the job id modulo 10000,
/// so that two jobs sharing a node do not collide.
pub const SLURM_PORT_BASE: u16 = 20000;
/// The longest job token accepted: hellos stay small, so that the store and the mesh can read
/// them whole before they know who is talking.
pub const MAX_TOKEN_BYTES: usize = 1024;
/// The most ranks a job may have. Every rank keeps three TCP connections to every other, so far
/// below this the file-descriptor limit of a real machine is reached; above it, a mistyped
/// WORLD_SIZE would only allocate per-rank tables before failing.
pub const MAX_WORLD_SIZE: usize = 1 << 16;

/// Optional variable: the port of burn-dist's store under torchrun's agent store (see
/// [`store_port`]). Must be the same for every rank.
pub const STORE_PORT_VAR: &str = "BURN_DIST_STORE_PORT";
/// Set by torchrun (`True`) when its agent serves its own store on MASTER_PORT, so that rank 0
/// cannot bind it.
pub const AGENT_STORE_VAR: &str = "TORCHELASTIC_USE_AGENT_STORE";
/// Which start of the job this is: 0 for the first, 1 after the first restart, ... Set by
/// `burn-dist-run --max-restarts`.
pub const RESTART_VAR: &str = "BURN_DIST_RESTART_COUNT";
/// torchrun's name for [`RESTART_VAR`], read when that one is not set.
pub const TORCHRUN_RESTART_VAR: &str = "TORCHELASTIC_RESTART_COUNT";

/// The variables a place in the job was read from, to name them in errors.
struct Names {
    rank: &'static str,
    world_size: &'static str,
    local_rank: &'static str,
    local_world_size: &'static str,
}

const TORCHRUN_NAMES: Names = Names {
    rank: "RANK",
    world_size: "WORLD_SIZE",
    local_rank: "LOCAL_RANK",
    local_world_size: "LOCAL_WORLD_SIZE",
};

const SLURM_NAMES: Names = Names {
    rank: "SLURM_PROCID",
    world_size: "SLURM_NTASKS",
    local_rank: "SLURM_LOCALID",
    local_world_size: "SLURM_NTASKS_PER_NODE",
};

/// This process's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankInfo {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    /// Host name or address of rank 0, which hosts the store.
    pub master_addr: String,
    /// The port of burn-dist's store on `master_addr`: MASTER_PORT, or beside it under
    /// torchrun's agent store (see [`store_port`]).
    pub master_port: u16,
    /// Which start of the job this is (0: the first; see [`restart_count`]).
    pub restart_count: usize,
    /// Shared secret of the job; empty when none was set.
    pub token: String,
    /// Timeout override from the environment, if any.
    pub timeout: Option<Duration>,
    /// Shared-memory override from the environment ([`SHM_VAR`]), if any.
    pub shared_memory: Option<bool>,
    /// Gather-lane override from the environment ([`GATHER_LANE_VAR`]), if any.
    pub gather_lane: Option<bool>,
}

impl RankInfo {
    /// Reads the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// Reads variables through `get`, so that tests need not touch the process environment.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let (info, names) = if get("RANK").is_some() {
            let info = RankInfo {
                rank: number(&get, "RANK")?,
                world_size: number(&get, "WORLD_SIZE")?,
                local_rank: optional_number(&get, "LOCAL_RANK")?.unwrap_or(0),
                local_world_size: optional_number(&get, "LOCAL_WORLD_SIZE")?.unwrap_or(1),
                master_addr: required(&get, "MASTER_ADDR")?,
                master_port: store_port(&get)?,
                restart_count: 0,
                token: String::new(),
                timeout: None,
                shared_memory: None,
                gather_lane: None,
            };
            (info, TORCHRUN_NAMES)
        } else if get("SLURM_PROCID").is_some() {
            (from_slurm(&get)?, SLURM_NAMES)
        } else {
            return Err(CommError::Env {
                var: "RANK".into(),
                problem: "not set, and this is not a Slurm job (no SLURM_PROCID): launch with \
                          `burn-dist-run`, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
                    .into(),
            });
        };
        let token = get(TOKEN_VAR).unwrap_or_default();
        let timeout = optional_number(&get, TIMEOUT_VAR)?
            .map(timeout_of)
            .transpose()?;
        let shared_memory = switch(&get, SHM_VAR, "loopback TCP", "shared memory")?;
        let gather_lane = switch(&get, GATHER_LANE_VAR, "one lane", "a gather lane")?;
        RankInfo {
            token,
            timeout,
            shared_memory,
            gather_lane,
            restart_count: restart_count_from(&get)?,
            ..info
        }
        .validated(&names)
    }

    fn validated(self, names: &Names) -> Result<Self> {
        let bad = |var: &str, problem: String| {
            Err(CommError::Env {
                var: var.into(),
                problem,
            })
        };
        let Names {
            rank,
            world_size,
            local_rank,
            local_world_size,
        } = names;
        if self.world_size == 0 {
            return bad(world_size, "must be at least 1".into());
        }
        if self.world_size > MAX_WORLD_SIZE {
            let problem = format!(
                "{} is more than {MAX_WORLD_SIZE}, the most ranks a job can have (each rank \
                 keeps two connections to every other)",
                self.world_size
            );
            return bad(world_size, problem);
        }
        if self.rank >= self.world_size {
            return bad(
                rank,
                format!(
                    "{} is not below {world_size}={}",
                    self.rank, self.world_size
                ),
            );
        }
        if self.local_world_size == 0 || self.local_world_size > self.world_size {
            let problem = format!(
                "{} must be in 1..={world_size}={}",
                self.local_world_size, self.world_size
            );
            return bad(local_world_size, problem);
        }
        if self.local_rank >= self.local_world_size {
            let problem = format!(
                "{} is not below {local_world_size}={}",
                self.local_rank, self.local_world_size
            );
            return bad(local_rank, problem);
        }
        if self.master_addr.is_empty() {
            return bad("MASTER_ADDR", "is empty".into());
        }
        if self.token.len() > MAX_TOKEN_BYTES {
            let problem = format!(
                "is {} bytes long, more than the {MAX_TOKEN_BYTES} a job token may have",
                self.token.len()
            );
            return bad(TOKEN_VAR, problem);
        }
        Ok(self)
    }
}

fn from_slurm(get: &impl Fn(&str) -> Option<String>) -> Result<RankInfo> {
    let world_size = number(get, "SLURM_NTASKS")?;
    let local_world_size = match get("SLURM_NTASKS_PER_NODE") {
        Some(_) => number(get, "SLURM_NTASKS_PER_NODE")?,
        None => first_count(&get("SLURM_TASKS_PER_NODE").unwrap_or_else(|| "1".into())),
    };
    let master_addr = match get("MASTER_ADDR") {
        Some(addr) => addr,
        None => {
            let list = required(get, "SLURM_JOB_NODELIST")?;
            first_host(&list).ok_or_else(|| CommError::Env {
                var: "SLURM_JOB_NODELIST".into(),
                problem: format!("cannot read a host name from {list:?}"),
            })?
        }
    };
    let master_port = match port(get)? {
        Some(port) => port,
        None => {
            SLURM_PORT_BASE + (optional_number(get, "SLURM_JOB_ID")?.unwrap_or(0) % 10000) as u16
        }
    };
    Ok(RankInfo {
        rank: number(get, "SLURM_PROCID")?,
        world_size,
        local_rank: optional_number(get, "SLURM_LOCALID")?.unwrap_or(0),
        local_world_size,
        master_addr,
        master_port,
        restart_count: 0,
        token: String::new(),
        timeout: None,
        shared_memory: None,
        gather_lane: None,
    })
}

/// An optional on/off variable: `0` means `off`, `1` means `on`, anything else is refused.
fn switch(
    get: &impl Fn(&str) -> Option<String>,
    var: &str,
    off: &str,
    on: &str,
) -> Result<Option<bool>> {
    match get(var).as_deref().map(str::trim) {
        None => Ok(None),
        Some("1") => Ok(Some(true)),
        Some("0") => Ok(Some(false)),
        Some(other) => Err(CommError::Env {
            var: var.into(),
            problem: format!("{other:?} is neither 0 ({off}) nor 1 ({on})"),
        }),
    }
}

/// The port of burn-dist's store, read from torchrun-style variables.
///
/// Under torchrun's elastic agent ([`AGENT_STORE_VAR`] is `True`, torch 2.x's default) the
/// agent of the node that holds rank 0 already serves its own store on MASTER_PORT, on the same
/// host as rank 0. burn-dist's store then rendezvouses beside it, on MASTER_PORT + 1, which
/// every rank of every node computes alike; [`STORE_PORT_VAR`] chooses another one where that
/// is taken. Otherwise (burn-dist-run, Slurm, torchrun with the agent store turned off, which
/// hands out a free port) rank 0 binds MASTER_PORT itself. See docs/decisions.md.
fn store_port(get: &impl Fn(&str) -> Option<String>) -> Result<u16> {
    if let Some(port) = port_var(get, STORE_PORT_VAR)? {
        return Ok(port);
    }
    let master = port(get)?.ok_or_else(|| missing("MASTER_PORT"))?;
    if get(AGENT_STORE_VAR).is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
        return master.checked_add(1).ok_or_else(|| CommError::Env {
            var: "MASTER_PORT".into(),
            problem: format!(
                "{master} is torchrun's agent store ({AGENT_STORE_VAR}=True) and burn-dist's \
                 store goes on the next port, which does not exist: set {STORE_PORT_VAR}"
            ),
        });
    }
    Ok(master)
}

/// Which start of the job this process belongs to: [`RESTART_VAR`] (burn-dist-run), else
/// [`TORCHRUN_RESTART_VAR`] (torchrun), else 0.
pub fn restart_count() -> Result<usize> {
    restart_count_from(&|name| std::env::var(name).ok())
}

fn restart_count_from(get: &impl Fn(&str) -> Option<String>) -> Result<usize> {
    match optional_number(get, RESTART_VAR)? {
        Some(count) => Ok(count),
        None => Ok(optional_number(get, TORCHRUN_RESTART_VAR)?.unwrap_or(0)),
    }
}

/// The address of the store: `host` (a name or an IP address) resolved, with `port`.
pub fn resolve_master(host: &str, port: u16) -> Result<SocketAddr> {
    let unresolvable = |problem: String| CommError::Env {
        var: "MASTER_ADDR".into(),
        problem,
    };
    let mut addrs = (host, port)
        .to_socket_addrs()
        .map_err(|e| unresolvable(format!("cannot resolve {host:?}: {e}")))?;
    addrs
        .next()
        .ok_or_else(|| unresolvable(format!("{host:?} resolves to no address")))
}

/// A timeout of `secs` seconds from [`TIMEOUT_VAR`], refused where no wait could work: 0 fails
/// every wait at once, and beyond [`MAX_TIMEOUT`] a deadline would overflow `Instant`.
fn timeout_of(secs: usize) -> Result<Duration> {
    let bad = |problem: String| CommError::Env {
        var: TIMEOUT_VAR.into(),
        problem,
    };
    let most = MAX_TIMEOUT.as_secs();
    match secs as u64 {
        0 => Err(bad(
            "0 would fail every wait at once: give the seconds a wait may last, at least 1".into(),
        )),
        secs if secs > most => Err(bad(format!(
            "{secs} s is longer than the {most} s (30 days) a wait may last"
        ))),
        secs => Ok(Duration::from_secs(secs)),
    }
}

/// The first host of a Slurm node list such as `gpu[07-09,12],login1` (here `gpu07`).
pub fn first_host(nodelist: &str) -> Option<String> {
    let nodelist = nodelist.trim();
    let bracket = nodelist.find('[');
    let comma = nodelist.find(',');
    match (bracket, comma) {
        (Some(b), c) if c.is_none_or(|c| b < c) => {
            let prefix = &nodelist[..b];
            let inside = &nodelist[b + 1..nodelist[b..].find(']')? + b];
            let first = inside.split(',').next()?.split('-').next()?;
            (!first.is_empty()).then(|| format!("{prefix}{first}"))
        }
        (_, Some(c)) => Some(nodelist[..c].to_string()).filter(|h| !h.is_empty()),
        (_, None) => Some(nodelist.to_string()).filter(|h| !h.is_empty()),
    }
}

/// The first count of a Slurm task list such as `2(x3),1` (here 2).
fn first_count(tasks_per_node: &str) -> usize {
    tasks_per_node
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1)
}

fn missing(var: &str) -> CommError {
    CommError::Env {
        var: var.into(),
        problem: "is not set".into(),
    }
}

fn required(get: &impl Fn(&str) -> Option<String>, var: &str) -> Result<String> {
    get(var).ok_or_else(|| missing(var))
}

fn optional_number(get: &impl Fn(&str) -> Option<String>, var: &str) -> Result<Option<usize>> {
    get(var)
        .map(|value| {
            value.trim().parse().map_err(|_| CommError::Env {
                var: var.into(),
                problem: format!("{value:?} is not a non-negative integer"),
            })
        })
        .transpose()
}

fn number(get: &impl Fn(&str) -> Option<String>, var: &str) -> Result<usize> {
    optional_number(get, var)?.ok_or_else(|| missing(var))
}

fn port(get: &impl Fn(&str) -> Option<String>) -> Result<Option<u16>> {
    port_var(get, "MASTER_PORT")
}

fn port_var(get: &impl Fn(&str) -> Option<String>, var: &str) -> Result<Option<u16>> {
    match optional_number(get, var)? {
        None => Ok(None),
        Some(p) if (1..=65535).contains(&p) => Ok(Some(p as u16)),
        Some(p) => Err(CommError::Env {
            var: var.into(),
            problem: format!("{p} is not a port in 1..=65535"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn read(vars: &[(&str, &str)]) -> Result<RankInfo> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        RankInfo::from_vars(|name| map.get(name).cloned())
    }

    const TORCHRUN: [(&str, &str); 6] = [
        ("RANK", "3"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "10.1.2.3"),
        ("MASTER_PORT", "29500"),
    ];

    #[test]
    fn torchrun_variables_are_read() {
        let info = read(&TORCHRUN).unwrap();
        assert_eq!(
            (
                info.rank,
                info.world_size,
                info.local_rank,
                info.local_world_size
            ),
            (3, 4, 1, 2)
        );
        assert_eq!(
            (info.master_addr.as_str(), info.master_port),
            ("10.1.2.3", 29500)
        );
    }

    /// torchrun's agent holds MASTER_PORT: the store goes beside it, unless told where.
    #[test]
    fn under_torchruns_agent_store_the_store_port_is_the_next_one() {
        assert_eq!(read(&TORCHRUN).unwrap().master_port, 29500);
        let agent = [TORCHRUN.as_slice(), &[(AGENT_STORE_VAR, "True")]].concat();
        assert_eq!(read(&agent).unwrap().master_port, 29501);
        let off = [TORCHRUN.as_slice(), &[(AGENT_STORE_VAR, "False")]].concat();
        assert_eq!(read(&off).unwrap().master_port, 29500);
        let chosen = [agent.as_slice(), &[(STORE_PORT_VAR, "31000")]].concat();
        assert_eq!(read(&chosen).unwrap().master_port, 31000);
        let mut last = agent.clone();
        last[5] = ("MASTER_PORT", "65535");
        let err = read(&last).unwrap_err().to_string();
        assert!(
            err.starts_with("MASTER_PORT: 65535") && err.contains(STORE_PORT_VAR),
            "{err}"
        );
    }

    #[test]
    fn restart_count_is_read_from_either_launcher() {
        assert_eq!(read(&TORCHRUN).unwrap().restart_count, 0);
        let torchrun = [TORCHRUN.as_slice(), &[(TORCHRUN_RESTART_VAR, "2")]].concat();
        assert_eq!(read(&torchrun).unwrap().restart_count, 2);
        let both = [torchrun.as_slice(), &[(RESTART_VAR, "3")]].concat();
        assert_eq!(read(&both).unwrap().restart_count, 3);
        let bad = [TORCHRUN.as_slice(), &[(RESTART_VAR, "x")]].concat();
        assert!(read(&bad).unwrap_err().to_string().starts_with(RESTART_VAR));
    }

    #[test]
    fn shared_memory_switch_is_read_and_checked() {
        assert_eq!(read(&TORCHRUN).unwrap().shared_memory, None);
        let with = |value| read(&[TORCHRUN.as_slice(), &[(SHM_VAR, value)]].concat());
        assert_eq!(with("0").unwrap().shared_memory, Some(false));
        assert_eq!(with("1").unwrap().shared_memory, Some(true));
        let err = with("yes").unwrap_err().to_string();
        assert!(err.contains(SHM_VAR) && err.contains("\"yes\""), "{err}");
    }

    #[test]
    fn gather_lane_switch_is_read_and_checked() {
        assert_eq!(read(&TORCHRUN).unwrap().gather_lane, None);
        let with = |value| read(&[TORCHRUN.as_slice(), &[(GATHER_LANE_VAR, value)]].concat());
        assert_eq!(with("0").unwrap().gather_lane, Some(false));
        assert_eq!(with("1").unwrap().gather_lane, Some(true));
        let err = with("2").unwrap_err().to_string();
        assert!(
            err.contains(GATHER_LANE_VAR) && err.contains("one lane"),
            "{err}"
        );
    }

    #[test]
    fn rank_not_below_world_size_is_named() {
        let mut vars = TORCHRUN.to_vec();
        vars[0] = ("RANK", "4");
        let err = read(&vars).unwrap_err().to_string();
        assert_eq!(err, "RANK: 4 is not below WORLD_SIZE=4");
    }

    #[test]
    fn missing_master_addr_is_named() {
        let vars: Vec<_> = TORCHRUN
            .iter()
            .copied()
            .filter(|(k, _)| *k != "MASTER_ADDR")
            .collect();
        assert_eq!(
            read(&vars).unwrap_err().to_string(),
            "MASTER_ADDR: is not set"
        );
    }

    #[test]
    fn malformed_number_is_named() {
        let mut vars = TORCHRUN.to_vec();
        vars[1] = ("WORLD_SIZE", "four");
        let err = read(&vars).unwrap_err().to_string();
        assert_eq!(err, "WORLD_SIZE: \"four\" is not a non-negative integer");
    }

    #[test]
    fn nothing_set_explains_how_to_launch() {
        let err = read(&[]).unwrap_err().to_string();
        assert!(err.contains("burn-dist-run"), "{err}");
    }

    #[test]
    fn slurm_variables_are_the_fallback() {
        let info = read(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_TASKS_PER_NODE", "4(x2)"),
            ("SLURM_JOB_NODELIST", "gpu[07-08]"),
            ("SLURM_JOB_ID", "123456"),
        ])
        .unwrap();
        assert_eq!(
            (
                info.rank,
                info.world_size,
                info.local_rank,
                info.local_world_size
            ),
            (5, 8, 1, 4)
        );
        assert_eq!(info.master_addr, "gpu07");
        assert_eq!(info.master_port, SLURM_PORT_BASE + 3456);
    }

    #[test]
    fn first_host_of_slurm_node_lists() {
        assert_eq!(first_host("node01").as_deref(), Some("node01"));
        assert_eq!(first_host("a,b").as_deref(), Some("a"));
        assert_eq!(first_host("gpu[07-09,12],login1").as_deref(), Some("gpu07"));
        assert_eq!(first_host("login1,gpu[07-09]").as_deref(), Some("login1"));
        assert_eq!(first_host("n[3]").as_deref(), Some("n3"));
        assert_eq!(first_host(""), None);
        assert_eq!(first_host("n[").as_deref(), None);
    }

    #[test]
    fn timeout_of_zero_is_refused_naming_the_variable() {
        let err = read(&[TORCHRUN.as_slice(), &[(TIMEOUT_VAR, "0")]].concat()).unwrap_err();
        assert!(
            matches!(&err, CommError::Env { var, .. } if var == TIMEOUT_VAR),
            "{err}"
        );
        assert!(err.to_string().contains("at least 1"), "{err}");
    }

    #[test]
    fn timeout_too_large_for_an_instant_is_refused_naming_the_variable() {
        let huge = u64::MAX.to_string();
        let err = read(&[TORCHRUN.as_slice(), &[(TIMEOUT_VAR, huge.as_str())]].concat())
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with(TIMEOUT_VAR) && err.contains("longer than the 2592000 s"),
            "{err}"
        );
        let most = MAX_TIMEOUT.as_secs().to_string();
        let info = read(&[TORCHRUN.as_slice(), &[(TIMEOUT_VAR, most.as_str())]].concat());
        assert_eq!(info.unwrap().timeout, Some(MAX_TIMEOUT));
    }

    #[test]
    fn huge_world_size_is_refused_naming_the_variable() {
        let mut vars = TORCHRUN.to_vec();
        vars[1] = ("WORLD_SIZE", "4000000000");
        let err = read(&vars).unwrap_err().to_string();
        assert!(
            err.starts_with("WORLD_SIZE: 4000000000 is more than 65536"),
            "{err}"
        );
        let slurm = read(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "100000"),
            ("SLURM_JOB_NODELIST", "gpu07"),
        ]);
        let err = slurm.unwrap_err().to_string();
        assert!(err.starts_with("SLURM_NTASKS: 100000 is more"), "{err}");
    }

    #[test]
    fn token_longer_than_a_hello_allows_is_refused() {
        let long = "t".repeat(MAX_TOKEN_BYTES + 1);
        let err = read(&[TORCHRUN.as_slice(), &[(TOKEN_VAR, long.as_str())]].concat())
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with(TOKEN_VAR) && err.contains("1025 bytes"),
            "{err}"
        );
    }
}
