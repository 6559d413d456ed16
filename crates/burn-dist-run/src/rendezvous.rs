//! The elastic rendezvous (`--nnodes MIN:MAX`): before every start of the job, the launchers
//! meet at `--master-addr:--master-port`, and the one that could bind that address numbers
//! them. A round closes as soon as MAX nodes have joined, or `--rdzv-last-call-secs` after the
//! MIN-th joined; a node that joins later waits for the next round (the next restart).
//!
//! One line each way, on a connection per join:
//! - join: `burn-dist-rdzv 1 <token, hex> <nproc per node> <store port> <host: 0|1>`
//! - answer: `node <node rank> of <nodes> store <ip> <port>`, or `refused <reason>`.
//!
//! The hosting launcher's node is node 0 when it takes part, so the job's store lives where
//! the rendezvous does; the others follow in the order they joined. The store of the round is
//! node 0's, at the address the rendezvous saw it connect from, on the free port it sent.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use burn_dist_comm::store::tokens_match;

use crate::error::LaunchError;

const MAGIC: &str = "burn-dist-rdzv 1";
/// How long a connection gets to send its join line, so a silent one cannot hold a thread.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest join line accepted: the token is at most 1024 bytes, 2048 in hex.
const MAX_LINE: u64 = 4096;

/// The numbers of one round, as this node's launcher receives them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    pub node_rank: u32,
    pub nnodes: u32,
    /// Where rank 0 (on node 0) hosts the job's store this round.
    pub master_addr: String,
    pub master_port: u16,
}

/// What the hosting launcher needs to run rounds.
#[derive(Debug, Clone)]
pub struct Rounds {
    pub min: u32,
    pub max: u32,
    pub nproc_per_node: u32,
    pub last_call: Duration,
    pub token: Vec<u8>,
}

struct Joiner {
    stream: TcpStream,
    ip: IpAddr,
    store_port: u16,
    host: bool,
}

#[derive(Default)]
struct Waiting {
    joiners: Vec<Joiner>,
    /// When the MIN-th node joined the current round.
    quorum_since: Option<Instant>,
}

/// Binds the rendezvous address if this launcher is the first on it, and serves rounds on
/// threads that live as long as the launcher. Returns whether this launcher hosts.
pub fn host_if_first(addr: SocketAddr, rounds: Rounds) -> Result<bool, LaunchError> {
    let listener = match TcpListener::bind(addr) {
        Ok(listener) => listener,
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => return Ok(false),
        Err(e) if e.kind() == std::io::ErrorKind::AddrNotAvailable => return Ok(false),
        Err(source) => {
            return Err(LaunchError::Rendezvous {
                addr: addr.to_string(),
                problem: format!("cannot bind: {source}"),
            });
        }
    };
    let waiting = Arc::new((Mutex::new(Waiting::default()), Condvar::new()));
    let rounds = Arc::new(rounds);
    {
        let (waiting, rounds) = (waiting.clone(), rounds.clone());
        thread::spawn(move || close_rounds(&waiting, &rounds));
    }
    thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let (waiting, rounds) = (waiting.clone(), rounds.clone());
            // A thread per join, so that a slow hello cannot delay the others.
            thread::spawn(move || admit(stream, &waiting, &rounds));
        }
    });
    Ok(true)
}

/// Reads a join line; adds a valid joiner to the round, answers an invalid one with why.
fn admit(mut stream: TcpStream, waiting: &(Mutex<Waiting>, Condvar), rounds: &Rounds) {
    let Ok(peer) = stream.peer_addr() else { return };
    let _ = stream.set_read_timeout(Some(HELLO_TIMEOUT));
    let mut line = String::new();
    let read = BufReader::new(&stream).take(MAX_LINE).read_line(&mut line);
    if read.is_err() {
        return;
    }
    let joiner = match parse_join(line.trim_end(), rounds) {
        Ok((store_port, host)) => Joiner {
            stream,
            ip: peer.ip(),
            store_port,
            host,
        },
        Err(reason) => {
            let _ = writeln!(stream, "refused {reason}");
            return;
        }
    };
    let (lock, wake) = waiting;
    let mut state = lock.lock().unwrap_or_else(|e| e.into_inner());
    state.joiners.push(joiner);
    if state.joiners.len() == rounds.min as usize && state.quorum_since.is_none() {
        state.quorum_since = Some(Instant::now());
    }
    wake.notify_all();
}

fn parse_join(line: &str, rounds: &Rounds) -> Result<(u16, bool), String> {
    let rest = line
        .strip_prefix(MAGIC)
        .ok_or("not a burn-dist-run rendezvous join (another program, or another version)")?;
    let words: Vec<&str> = rest.split_whitespace().collect();
    let [token, nproc, port, host] = words[..] else {
        return Err("malformed join".into());
    };
    if !tokens_match(&from_hex(token).unwrap_or_default(), &rounds.token) {
        return Err("wrong job token: export the same BURN_DIST_TOKEN on every node".into());
    }
    if nproc != rounds.nproc_per_node.to_string() {
        return Err(format!(
            "--nproc-per-node {nproc} differs from the hosting node's {}: every node of an \
             elastic job runs the same number of ranks",
            rounds.nproc_per_node
        ));
    }
    let port = port.parse().map_err(|_| "malformed store port")?;
    Ok((port, host == "1"))
}

/// Closes a round whenever MAX nodes wait, or MIN have waited for the last call.
fn close_rounds(waiting: &(Mutex<Waiting>, Condvar), rounds: &Rounds) {
    let (lock, wake) = waiting;
    let mut state = lock.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        // A launcher that died while it waited must not be counted into the round.
        state.joiners.retain(|j| connected(&j.stream));
        if state.joiners.len() < rounds.min as usize {
            state.quorum_since = None;
        }
        let full = state.joiners.len() >= rounds.max as usize;
        let called = state
            .quorum_since
            .is_some_and(|since| since.elapsed() >= rounds.last_call);
        if full || called {
            let take = state.joiners.len().min(rounds.max as usize);
            let round: Vec<Joiner> = state.joiners.drain(..take).collect();
            state.quorum_since = (state.joiners.len() >= rounds.min as usize).then(Instant::now);
            answer(round);
            continue;
        }
        state = match state.quorum_since {
            Some(since) => {
                let left = rounds.last_call.saturating_sub(since.elapsed());
                wake.wait_timeout(state, left)
                    .unwrap_or_else(|e| e.into_inner())
                    .0
            }
            None => wake.wait(state).unwrap_or_else(|e| e.into_inner()),
        };
    }
}

/// Whether the joiner is still there: its launcher sends nothing after the join line, so end
/// of file (or an error) on its connection means it has gone.
fn connected(stream: &TcpStream) -> bool {
    let mut byte = [0u8; 1];
    let _ = stream.set_nonblocking(true);
    let alive = match stream.peek(&mut byte) {
        Ok(0) => false,
        Ok(_) => true,
        Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
    };
    let _ = stream.set_nonblocking(false);
    alive
}

/// Numbers the nodes of a closed round (the host's first) and tells each its place.
fn answer(mut round: Vec<Joiner>) {
    // Stable: the other nodes keep the order they joined in.
    round.sort_by_key(|j| !j.host);
    let (ip, port) = (round[0].ip, round[0].store_port);
    let nnodes = round.len();
    for (node_rank, joiner) in round.iter_mut().enumerate() {
        let _ = writeln!(
            joiner.stream,
            "node {node_rank} of {nnodes} store {ip} {port}"
        );
    }
}

/// Joins the next round at `addr` and waits (up to `timeout`) for this node's place. A free
/// port for the job's store is picked on the address this node reaches the rendezvous from, in
/// case it becomes node 0.
pub fn join(
    addr: SocketAddr,
    token: &[u8],
    nproc_per_node: u32,
    host: bool,
    timeout: Duration,
) -> Result<Assignment, LaunchError> {
    let fail = |problem: String| LaunchError::Rendezvous {
        addr: addr.to_string(),
        problem,
    };
    let deadline = Instant::now() + timeout;
    // The hosting launcher may not be up yet: try again until the deadline.
    let mut stream = loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
            Ok(stream) => break stream,
            Err(e) if Instant::now() >= deadline => {
                return Err(fail(format!("not reachable within {timeout:?}: {e}")));
            }
            Err(_) => thread::sleep(Duration::from_millis(200)),
        }
    };
    let local = stream
        .local_addr()
        .map_err(|e| fail(format!("local address: {e}")))?;
    let store_port = TcpListener::bind((local.ip(), 0))
        .and_then(|l| l.local_addr())
        .map_err(|e| fail(format!("cannot pick a port for the store: {e}")))?
        .port();
    let join_line = format!(
        "{MAGIC} {} {nproc_per_node} {store_port} {}\n",
        to_hex(token),
        u8::from(host)
    );
    stream
        .write_all(join_line.as_bytes())
        .map_err(|e| fail(format!("sending the join: {e}")))?;
    let left = deadline.saturating_duration_since(Instant::now());
    let _ = stream.set_read_timeout(Some(left.max(Duration::from_millis(1))));
    let mut answer = String::new();
    BufReader::new(&stream)
        .take(MAX_LINE)
        .read_line(&mut answer)
        .map_err(|e| fail(format!("no round closed within {timeout:?}: {e}")))?;
    parse_answer(answer.trim_end()).map_err(fail)
}

fn parse_answer(line: &str) -> Result<Assignment, String> {
    if let Some(reason) = line.strip_prefix("refused ") {
        return Err(format!("refused this node: {reason}"));
    }
    let words: Vec<&str> = line.split_whitespace().collect();
    let parsed = match words[..] {
        ["node", rank, "of", nodes, "store", ip, port] => (|| {
            Some(Assignment {
                node_rank: rank.parse().ok()?,
                nnodes: nodes.parse().ok()?,
                master_addr: ip.parse::<IpAddr>().ok()?.to_string(),
                master_port: port.parse().ok()?,
            })
        })(),
        _ => None,
    };
    parsed.ok_or_else(|| {
        if line.is_empty() {
            "closed the connection without an answer (did the hosting launcher exit?)".into()
        } else {
            format!("unexpected answer {line:?}")
        }
    })
}

fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn from_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rounds(min: u32, max: u32, last_call_ms: u64) -> Rounds {
        Rounds {
            min,
            max,
            nproc_per_node: 1,
            last_call: Duration::from_millis(last_call_ms),
            token: b"job".to_vec(),
        }
    }

    fn free_addr() -> SocketAddr {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
    }

    fn join_on(addr: SocketAddr, host: bool) -> thread::JoinHandle<Assignment> {
        thread::spawn(move || join(addr, b"job", 1, host, Duration::from_secs(30)).unwrap())
    }

    #[test]
    fn a_full_round_closes_at_once_with_the_host_first() {
        let addr = free_addr();
        assert!(host_if_first(addr, rounds(2, 3, 60_000)).unwrap());
        assert!(!host_if_first(addr, rounds(2, 3, 60_000)).unwrap(), "taken");
        let others: Vec<_> = (0..2).map(|_| join_on(addr, false)).collect();
        let host = join_on(addr, true).join().unwrap();
        assert_eq!((host.node_rank, host.nnodes), (0, 3));
        let mut ranks: Vec<u32> = others
            .into_iter()
            .map(|j| j.join().unwrap().node_rank)
            .collect();
        ranks.sort();
        assert_eq!(ranks, [1, 2]);
        assert_eq!(host.master_addr, "127.0.0.1");
    }

    /// MIN nodes and no more: the round closes after the last call, without the missing one.
    #[test]
    fn a_round_of_min_nodes_closes_after_the_last_call() {
        let addr = free_addr();
        host_if_first(addr, rounds(2, 3, 200)).unwrap();
        let (a, b) = (join_on(addr, true), join_on(addr, false));
        let (a, b) = (a.join().unwrap(), b.join().unwrap());
        assert_eq!((a.nnodes, b.nnodes), (2, 2));
        assert_eq!(a.master_port, b.master_port);
    }

    /// A node that joined and then died is left out of the round.
    #[test]
    fn a_joiner_that_left_is_not_counted() {
        let addr = free_addr();
        host_if_first(addr, rounds(2, 3, 300)).unwrap();
        let mut gone = TcpStream::connect(addr).unwrap();
        writeln!(gone, "{MAGIC} {} 1 1 0", to_hex(b"job")).unwrap();
        drop(gone);
        let (a, b) = (join_on(addr, true), join_on(addr, false));
        assert_eq!((a.join().unwrap().nnodes, b.join().unwrap().nnodes), (2, 2));
    }

    /// A node that comes once a round is full (a node back after a loss) is not squeezed into
    /// it: it waits and is numbered in the next round, with the next node to come.
    #[test]
    fn a_late_node_joins_the_next_round() {
        let addr = free_addr();
        host_if_first(addr, rounds(2, 2, 60_000)).unwrap();
        let first: Vec<_> = [true, false].map(|host| join_on(addr, host)).into();
        let first: Vec<Assignment> = first.into_iter().map(|j| j.join().unwrap()).collect();
        assert!(first.iter().all(|a| a.nnodes == 2));
        let late = join_on(addr, false);
        let next = join_on(addr, true).join().unwrap();
        let late = late.join().unwrap();
        assert_eq!((next.node_rank, late.node_rank, late.nnodes), (0, 1, 2));
    }

    #[test]
    fn a_wrong_token_is_refused_naming_it() {
        let addr = free_addr();
        host_if_first(addr, rounds(1, 1, 0)).unwrap();
        let err = join(addr, b"other", 1, false, Duration::from_secs(30)).unwrap_err();
        assert!(err.to_string().contains("wrong job token"), "{err}");
    }

    #[test]
    fn hex_round_trips() {
        assert_eq!(from_hex(&to_hex(b"\x00tok\xff")).unwrap(), b"\x00tok\xff");
        assert_eq!(from_hex("abc"), None);
    }
}
