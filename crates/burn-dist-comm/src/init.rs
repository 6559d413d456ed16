//! Joining a job: read the environment, meet at the store, connect the mesh.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;

use crate::communicator::HostCommunicator;
use crate::env::{RankInfo, TOKEN_VAR};
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
    Group::join(info, &config)
}

impl Group {
    /// Joins the job `info` describes: rank 0 hosts the store at MASTER_ADDR:MASTER_PORT,
    /// every rank connects to it, and the ranks connect to each other.
    pub fn join(info: RankInfo, config: &CommConfig) -> Result<Group> {
        if info.token.is_empty() {
            tracing::warn!("{TOKEN_VAR} is not set: any process that reaches the store may join");
        }
        let addr = resolve(&info.master_addr, info.master_port)?;
        let server = match info.rank {
            0 => Some(StoreServer::bind(addr, &info.token, config)?),
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
/// shared memory for peers on the same host (see [`CommConfig::shared_memory`]).
pub fn connect(
    rank: usize,
    world: usize,
    store: &StoreClient,
    token: &str,
    config: &CommConfig,
) -> Result<HostCommunicator> {
    let transport = mesh::connect(rank, world, store, token, config)?;
    HostCommunicator::new(Box::new(transport))
}

fn resolve(host: &str, port: u16) -> Result<SocketAddr> {
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
