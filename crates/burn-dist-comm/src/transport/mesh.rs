//! Builds the TCP mesh: every rank listens on the interface that reaches the store, publishes
//! its address there, connects to every lower rank and accepts every higher one: per pair, one
//! control connection and one data connection per lane (see [`CommConfig::gather_lane`]). Each connection opens with a hello that carries the
//! job token; a connection with a wrong token or an impossible rank is refused and does not
//! count, so a stray process cannot take a rank's place. Connections wait for their hello at a
//! [`Gate`], each read on its own thread within one deadline, so silent or trickling intruders
//! neither delay the peers that connect after them nor hold many descriptors.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::link::DataLink;
use super::process::{PeerLink, ProcessTransport};
use crate::env::{GATHER_LANE_VAR, MAX_TOKEN_BYTES};
use crate::gate::{AcceptBackoff, BeforeDeadline, Gate, SPARE_PENDING, Ticket};
use crate::store::{StoreClient, tokens_match};
use crate::{CommConfig, CommError, Result};

const MAGIC: &[u8; 4] = b"BDM1";
const DATA: u8 = 0;
const CONTROL: u8 = 1;
const ACCEPTED: u8 = 0;
const REFUSED: u8 = 1;
/// How often the accepting rank looks for new connections while it waits for hellos.
const ACCEPT_POLL: Duration = Duration::from_millis(2);

fn addr_key(rank: usize) -> String {
    format!("burn-dist/mesh/addr/{rank}")
}

/// The connection kind of data lane `lane`: lanes after the first follow `CONTROL`.
fn data_kind(lane: usize) -> u8 {
    match lane {
        0 => DATA,
        l => CONTROL + l as u8,
    }
}

/// The connection kinds of a pair with `lanes` data lanes: control, then each lane's data.
fn kinds(lanes: usize) -> impl Iterator<Item = u8> {
    std::iter::once(CONTROL).chain((0..lanes).map(data_kind))
}

/// Connects `rank` of `world` to every peer, using `store` to find them: one transport per
/// lane.
pub(crate) fn connect(
    rank: usize,
    world: usize,
    store: &StoreClient,
    token: &str,
    config: &CommConfig,
) -> Result<Vec<ProcessTransport>> {
    let listener = listen(rank, store)?;
    link(&listener, rank, world, store, token, config)
}

/// Listens on the interface that reaches the store and publishes the address there.
fn listen(rank: usize, store: &StoreClient) -> Result<TcpListener> {
    let ip = store.local_ip();
    let listener =
        TcpListener::bind((ip, 0)).map_err(|e| CommError::io(format!("listening on {ip}"), e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| CommError::io("mesh local_addr", e))?;
    store.set(&addr_key(rank), addr.to_string().as_bytes())?;
    Ok(listener)
}

/// Dials every lower rank, accepts every higher one on `listener`, and links same-host peers
/// through shared memory where both sides can (each lane its own rings).
fn link(
    listener: &TcpListener,
    rank: usize,
    world: usize,
    store: &StoreClient,
    token: &str,
    config: &CommConfig,
) -> Result<Vec<ProcessTransport>> {
    let lanes = config.lanes();
    let mut links: Vec<Option<PeerLink>> = (0..world).map(|_| None).collect();
    for (peer, link) in links.iter_mut().enumerate().take(rank) {
        let peer_addr = peer_address(store, peer)?;
        let control = dial(peer_addr, peer, rank, world, token, CONTROL, config)?;
        let data = (0..lanes)
            .map(|lane| dial(peer_addr, peer, rank, world, token, data_kind(lane), config))
            .map(|stream| stream.map(DataLink::Tcp))
            .collect::<Result<_>>()?;
        *link = Some(PeerLink { data, control });
    }
    accept_higher(listener, rank, world, token, config, &mut links)?;
    #[cfg(target_os = "linux")]
    let arenas = {
        for lane in 0..lanes {
            // Every rank sets up the same lanes in the same order, so each call meets its peers'.
            for (peer, shm) in super::shm::link_same_host_peers(rank, world, store, config)?
                .into_iter()
                .enumerate()
            {
                if let (Some(shm), Some(link)) = (shm, &mut links[peer]) {
                    link.data[lane] = DataLink::SharedMemory(shm);
                }
            }
        }
        let linked: Vec<bool> = links
            .iter()
            .map(|link| {
                link.as_ref().is_some_and(|link| {
                    link.data
                        .iter()
                        .all(|data| data.kind() == super::Link::SharedMemory)
                })
            })
            .collect();
        super::shm::share_arenas(rank, world, store, &linked, lanes)?
    };
    #[cfg(not(target_os = "linux"))]
    let arenas = Vec::new();
    ProcessTransport::lanes(
        rank,
        links,
        lanes,
        config.timeout,
        config.divergence_grace,
        arenas,
    )
    .map_err(|e| CommError::io("setting up peer links", e))
}

fn peer_address(store: &StoreClient, peer: usize) -> Result<SocketAddr> {
    let value = store.get(&addr_key(peer)).map_err(|e| match e {
        CommError::Store { addr, reason } => CommError::Store {
            addr,
            reason: format!("rank {peer} did not join the rendezvous: {reason}"),
        },
        other => other,
    })?;
    String::from_utf8_lossy(&value)
        .parse()
        .map_err(|_| CommError::Handshake {
            from: format!("rank {peer}"),
            reason: format!(
                "published an unparsable address {:?}",
                String::from_utf8_lossy(&value)
            ),
        })
}

/// Opens one connection to `peer` and presents this rank.
fn dial(
    addr: SocketAddr,
    peer: usize,
    rank: usize,
    world: usize,
    token: &str,
    kind: u8,
    config: &CommConfig,
) -> Result<TcpStream> {
    let fail = |e: io::Error| CommError::io(format!("connecting to rank {peer} at {addr}"), e);
    let deadline = Instant::now() + config.handshake_timeout;
    let stream = TcpStream::connect_timeout(&addr, config.handshake_timeout).map_err(fail)?;
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&(rank as u32).to_le_bytes());
    hello.extend_from_slice(&(world as u32).to_le_bytes());
    hello.push(kind);
    hello.push(config.lanes() as u8);
    hello.extend_from_slice(&(token.len() as u16).to_le_bytes());
    hello.extend_from_slice(token.as_bytes());
    (&stream).write_all(&hello).map_err(fail)?;
    let mut answer = BeforeDeadline::new(&stream, deadline);
    let mut status = [0u8; 3];
    answer.read_exact(&mut status).map_err(fail)?;
    if status[0] == ACCEPTED {
        return Ok(stream);
    }
    let mut reason = vec![0u8; u16::from_le_bytes([status[1], status[2]]) as usize];
    answer.read_exact(&mut reason).map_err(fail)?;
    Err(CommError::Handshake {
        from: format!("rank {peer} at {addr}"),
        reason: format!(
            "it refused rank {rank}: {}",
            String::from_utf8_lossy(&reason)
        ),
    })
}

/// Closes every connection still waiting at the gate, however the accepting loop ends.
struct CloseOnDrop<'a>(&'a Gate);

impl Drop for CloseOnDrop<'_> {
    fn drop(&mut self) {
        self.0.close_all();
    }
}

/// A connection's verified hello: who is on the other end and which link it is.
struct Hello {
    peer: usize,
    kind: u8,
    stream: TcpStream,
}

/// Accepts the data and control connections of every rank above `rank`, refusing impostors,
/// until all are in or the join timeout runs out. Each hello is read on its own thread, so a
/// connection that never finishes its hello holds up nobody.
fn accept_higher(
    listener: &TcpListener,
    rank: usize,
    world: usize,
    token: &str,
    config: &CommConfig,
    links: &mut [Option<PeerLink>],
) -> Result<()> {
    let lanes = config.lanes();
    let per_peer = kinds(lanes).count();
    let mut pending: Vec<Vec<Option<TcpStream>>> = (0..world)
        .map(|_| (0..per_peer).map(|_| None).collect())
        .collect();
    let expected = per_peer * (world - 1 - rank);
    let mut missing = expected;
    let deadline = Instant::now() + config.join_timeout;
    listener
        .set_nonblocking(true)
        .map_err(|e| CommError::io("mesh listener", e))?;
    // Every higher rank may connect at once; a few more may wait, never many.
    let gate = Gate::new(expected + SPARE_PENDING, config.handshake_timeout);
    let (judged, verdicts) = mpsc::channel();
    let mut backoff = AcceptBackoff::default();
    std::thread::scope(|scope| {
        // Whatever still waits for its hello when this ends is not needed: end those threads'
        // reads, which the scope waits for.
        let _close = CloseOnDrop(&gate);
        while missing > 0 {
            match listener.accept() {
                Ok((stream, from)) => {
                    backoff.succeeded();
                    if let Some(ticket) = gate.admit(&stream) {
                        let judged = judged.clone();
                        scope.spawn(move || {
                            let verdict = read_hello(stream, &ticket, rank, world, lanes, token);
                            // An evicted connection is already shut down: drop it unanswered.
                            if ticket.release() {
                                _ = judged.send((from, verdict.and_then(welcome)));
                            }
                        });
                    }
                    continue;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => backoff.failed("mesh", &e),
            }
            while let Ok((from, verdict)) = verdicts.recv_timeout(ACCEPT_POLL) {
                match verdict {
                    Ok(Hello { peer, kind, stream }) if pending[peer][kind as usize].is_none() => {
                        pending[peer][kind as usize] = Some(stream);
                        missing -= 1;
                    }
                    Ok(Hello { peer, .. }) => {
                        tracing::warn!(rank, %from, peer, "refused a duplicate connection")
                    }
                    Err(reason) => tracing::warn!(rank, %from, "refused a connection: {reason}"),
                }
            }
            if missing > 0 && Instant::now() >= deadline {
                let absent: Vec<String> = (rank + 1..world)
                    .filter(|&q| pending[q].iter().any(Option::is_none))
                    .map(|q| q.to_string())
                    .collect();
                return Err(CommError::Handshake {
                    from: format!("ranks {}", absent.join(", ")),
                    reason: format!(
                        "they did not connect to rank {rank} within {} s",
                        config.join_timeout.as_secs_f32()
                    ),
                });
            }
        }
        Ok(())
    })?;
    for (peer, mut streams) in pending.into_iter().enumerate().skip(rank + 1) {
        let mut take = |kind: u8| streams[kind as usize].take().expect("all links in");
        let control = take(CONTROL);
        let data = (0..lanes)
            .map(|lane| DataLink::Tcp(take(data_kind(lane))))
            .collect();
        links[peer] = Some(PeerLink { data, control });
    }
    Ok(())
}

/// Tells a peer whose hello passed that its connection counts.
fn welcome(hello: Hello) -> std::result::Result<Hello, String> {
    (&hello.stream)
        .write_all(&[ACCEPTED, 0, 0])
        .map_err(|e| e.to_string())?;
    Ok(hello)
}

/// Reads and checks a peer's hello within its ticket's deadline; answers a refusal (see
/// [`welcome`] for the other answer).
fn read_hello(
    stream: TcpStream,
    ticket: &Ticket,
    rank: usize,
    world: usize,
    lanes: usize,
    token: &str,
) -> std::result::Result<Hello, String> {
    let io = |e: io::Error| e.to_string();
    stream.set_nonblocking(false).map_err(io)?;
    let mut hello = ticket.reader(&stream);
    let mut head = [0u8; 16];
    hello.read_exact(&mut head).map_err(io)?;
    let u32_at =
        |i: usize| u32::from_le_bytes(head[i..i + 4].try_into().expect("4 bytes")) as usize;
    let (peer, peer_world, kind, peer_lanes) = (u32_at(4), u32_at(8), head[12], head[13]);
    let token_len = u16::from_le_bytes([head[14], head[15]]) as usize;
    let verdict = if &head[..4] != MAGIC {
        Err("not a burn-dist peer".to_string())
    } else if token_len > MAX_TOKEN_BYTES {
        Err(format!("token of {token_len} bytes is too long"))
    } else {
        let mut presented = vec![0u8; token_len];
        hello.read_exact(&mut presented).map_err(io)?;
        if !tokens_match(&presented, token.as_bytes()) {
            Err("wrong job token: BURN_DIST_TOKEN must be the same on every rank".into())
        } else if peer_world != world {
            Err(format!(
                "it says WORLD_SIZE={peer_world}, this rank has {world}"
            ))
        } else if peer_lanes as usize != lanes {
            Err(format!(
                "it opens {peer_lanes} data lane(s), this rank {lanes}: {GATHER_LANE_VAR} must be \
                 the same on every rank"
            ))
        } else if peer <= rank || peer >= world || !kinds(lanes).any(|k| k == kind) {
            Err(format!(
                "rank {peer} (kind {kind}) should not connect to rank {rank}"
            ))
        } else {
            Ok(())
        }
    };
    match verdict {
        Ok(()) => Ok(Hello { peer, kind, stream }),
        Err(reason) => {
            let mut reply = vec![REFUSED];
            reply.extend_from_slice(&(reason.len() as u16).to_le_bytes());
            reply.extend_from_slice(reason.as_bytes());
            _ = (&stream).write_all(&reply);
            Err(reason)
        }
    }
}

#[cfg(test)]
#[path = "mesh_tests.rs"]
mod tests;
