//! Joining a job: read the environment, meet at the store, connect the mesh.

use std::sync::Arc;

use crate::communicator::HostCommunicator;
use crate::env::{RankInfo, TOKEN_VAR, resolve_master};
use crate::store::{StoreClient, StoreServer};
use crate::transport::mesh;
use crate::{CommConfig, CommError, Result};

/// This process's membership of a job: who it is, the store, and the host communicator.
pub struct Group {
    pub info: RankInfo,
    /// Shared, so that a reducer and the user's own collectives can use it at once.
    pub comm: Arc<HostCommunicator>,
    pub store: StoreClient,
    /// The store itself, on rank 0; it must outlive the other ranks' use of it.
    _server: Option<StoreServer>,
}

/// Joins the job described by the environment (see [`RankInfo::from_env`]).
pub fn init(config: CommConfig) -> Result<Group> {
    let info = RankInfo::from_env()?;
    let config = match info.timeout {
        Some(timeout) => config.with_timeout(timeout),
        None => config,
    };
    let config = match info.shared_memory {
        Some(allowed) => config.with_shared_memory(allowed),
        None => config,
    };
    let config = match info.gather_lane {
        Some(on) => config.with_gather_lane(on),
        None => config,
    };
    Group::join(info, &config)
}

impl Group {
    /// Joins the job `info` describes: rank 0 hosts the store at MASTER_ADDR:MASTER_PORT,
    /// every rank connects to it, and the ranks connect to each other.
    pub fn join(info: RankInfo, config: &CommConfig) -> Result<Group> {
        let addr = resolve_master(&info.master_addr, info.master_port)?;
        if info.token.is_empty() {
            // Off loopback the store and every mesh listener face the network: a job token is
            // the only thing that keeps strangers out.
            if !addr.ip().is_loopback() {
                return Err(CommError::TokenRequired {
                    addr: addr.to_string(),
                });
            }
            tracing::warn!("{TOKEN_VAR} is not set: any process on this host may join the job");
        }
        let server = match info.rank {
            0 => Some(StoreServer::bind(
                addr,
                &info.token,
                info.world_size,
                config,
            )?),
            _ => None,
        };
        let store = StoreClient::connect(addr, &info.token, info.rank, config)?;
        let comm = connect(info.rank, info.world_size, &store, &info.token, config)?;
        tracing::info!(
            rank = info.rank,
            world = info.world_size,
            links = ?comm.links(),
            "joined the group"
        );
        Ok(Group {
            info,
            comm: Arc::new(comm),
            store,
            _server: server,
        })
    }
}

/// Connects `rank` of `world` to its peers, finding them through `store`: over TCP, or through
/// shared memory for peers on the same host (see [`CommConfig::shared_memory`]). Waits first
/// until every rank has joined the store, so that a rank given to two processes fails every
/// rank here, naming it ([`CommError::DuplicateRank`]), before any link is made.
pub fn connect(
    rank: usize,
    world: usize,
    store: &StoreClient,
    token: &str,
    config: &CommConfig,
) -> Result<HostCommunicator> {
    store.wait_for_every_rank()?;
    let lanes = mesh::connect(rank, world, store, token, config)?;
    let comm = HostCommunicator::new(lanes)?;
    // Rank 0 hosts the store, and a peer may still read its last set-up keys from it (a
    // shared-memory verdict) after rank 0 has read all of its own: a rank 0 that returned and
    // exited at once (a job that only joins, or a rank 0 that fails right after) would close
    // the store under it. So every other rank says when it is done with the store, and rank 0
    // returns only then. (Not a barrier on `comm`: that would be every job's collective #0.)
    if rank == 0 {
        for peer in 1..world {
            store.get(&connected_key(peer))?;
        }
    } else {
        store.set(&connected_key(rank), b"")?;
    }
    Ok(comm)
}

/// The store key by which `rank` says it has finished connecting.
fn connected_key(rank: usize) -> String {
    format!("burn-dist/connected/{rank}")
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;
    use std::time::Duration;

    use super::*;
    use crate::Communicator;

    fn rank0_of_one(master_addr: &str, master_port: u16, token: &str) -> RankInfo {
        RankInfo {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: master_addr.into(),
            master_port,
            restart_count: 0,
            token: token.into(),
            timeout: None,
            shared_memory: None,
            gather_lane: None,
        }
    }

    /// Refused before anything is bound or sent: 192.0.2.1 (TEST-NET-1) is never contacted.
    #[test]
    fn empty_token_off_loopback_is_refused() {
        let config = CommConfig::default();
        let err = Group::join(rank0_of_one("192.0.2.1", 29500, ""), &config)
            .err()
            .expect("joined without a token off loopback");
        assert!(
            matches!(&err, CommError::TokenRequired { addr } if addr == "192.0.2.1:29500"),
            "{err}"
        );
        assert!(err.to_string().contains("export BURN_DIST_TOKEN="), "{err}");
    }

    #[test]
    fn empty_token_on_loopback_still_joins() {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let config = CommConfig::default().with_timeout(Duration::from_secs(30));
        let group = Group::join(rank0_of_one("127.0.0.1", port, ""), &config).unwrap();
        assert_eq!(group.comm.world_size(), 1);
    }
}
