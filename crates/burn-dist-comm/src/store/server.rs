//! The TCP key-value store that rank 0 hosts for the rendezvous, like torchrun's TCPStore.
//!
//! It binds only the address it is given and answers only connections whose first frame, a
//! hello of at most [`MAX_HELLO`] bytes that arrives whole within the handshake timeout,
//! presents the job token and a rank of the job that has not joined yet. Until then a
//! connection waits at a [`Gate`] that holds only a few more than the job's ranks, so a flood of
//! silent or trickling connections cannot lock the job out or exhaust rank 0's descriptors.
//! Each connection is served on its own thread. `Get` waits server-side (on a condition
//! variable) until the key is set or the requested wait runs out.
//!
//! A rank that joins twice before the whole job has joined means two processes were given the
//! same rank: the job cannot form, so from then on every request of every connection is
//! answered with [`Message::DuplicateRank`]. Once every rank has joined, a second hello for a
//! rank is a stray process and only that connection is refused.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::codec::{FrameError, MAX_HELLO, Message, encode_frame, read_frame};
use super::tokens_match;
use crate::gate::{AcceptBackoff, Gate, SPARE_PENDING, Ticket};
use crate::{CommConfig, CommError, MAX_TIMEOUT, Result};

/// What the store holds, under one lock.
#[derive(Default)]
struct Book {
    values: HashMap<String, Vec<u8>>,
    /// The ranks that have joined, with the address each joined from.
    joined: BTreeMap<u64, String>,
    /// A [`Message::DuplicateRank`] seen while the job was forming: the answer to everything.
    failure: Option<Message>,
    /// Handles to the joined connections, to end their reads when the store closes.
    connections: Vec<TcpStream>,
    /// Threads serving a joined connection: the store waits for them when it closes, so that
    /// every answer already decided (a duplicate rank, above all) reaches its rank.
    serving: usize,
    /// Set when the store is dropped: waits end, and no one joins any more.
    closing: bool,
}

struct State {
    world: usize,
    book: Mutex<Book>,
    /// Signalled whenever a value is set, a rank joins or the job fails.
    changed: Condvar,
}

/// What every connection thread needs.
struct Shared {
    state: State,
    token: Vec<u8>,
    max_frame: usize,
    handshake_timeout: Duration,
}

/// A running store. Dropping it stops accepting connections, answers every request still
/// waiting, and waits for those answers to be sent.
pub struct StoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    acceptor: Option<JoinHandle<()>>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreServer")
            .field("addr", &self.addr)
            .field("world", &self.shared.state.world)
            .finish_non_exhaustive()
    }
}

impl StoreServer {
    /// Binds `addr` (port 0 picks a free port) for a job of `world` ranks, and serves until
    /// dropped.
    pub fn bind(addr: SocketAddr, token: &str, world: usize, config: &CommConfig) -> Result<Self> {
        let listener = TcpListener::bind(addr).map_err(|e| {
            let hint = if e.kind() == std::io::ErrorKind::AddrInUse {
                " (is another job or a stale process using it? pick another MASTER_PORT, or \
                 `burn-dist-run --master-port 0` to let the launcher pick a free one; under \
                 torchrun, set BURN_DIST_STORE_PORT)"
            } else {
                ""
            };
            CommError::Store {
                addr: addr.to_string(),
                reason: format!("cannot bind: {e}{hint}"),
            }
        })?;
        let addr = listener
            .local_addr()
            .map_err(|e| CommError::io("store local_addr", e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let shared = Arc::new(Shared {
            state: State {
                world,
                book: Mutex::default(),
                changed: Condvar::new(),
            },
            token: token.as_bytes().to_vec(),
            max_frame: config.max_store_frame,
            handshake_timeout: config.handshake_timeout,
        });
        // Every rank may connect at once; a few more may wait, never many.
        let gate = Gate::new(world + SPARE_PENDING, config.handshake_timeout);
        let (stop_flag, serving) = (stop.clone(), shared.clone());
        let acceptor = std::thread::Builder::new()
            .name("burn-dist-store".into())
            .spawn(move || accept_loop(listener, &stop_flag, &serving, &gate))
            .map_err(|e| CommError::io("spawning the store thread", e))?;
        tracing::debug!(%addr, world, "store listening");
        Ok(StoreServer {
            addr,
            stop,
            acceptor: Some(acceptor),
            shared,
        })
    }

    /// The address the store listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the blocking accept so that it sees the flag.
        _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(acceptor) = self.acceptor.take() {
            _ = acceptor.join();
        }
        self.shared.state.close(self.shared.handshake_timeout);
    }
}

fn accept_loop(listener: TcpListener, stop: &AtomicBool, shared: &Arc<Shared>, gate: &Arc<Gate>) {
    let mut backoff = AcceptBackoff::default();
    loop {
        let accepted = listener.accept();
        if stop.load(Ordering::SeqCst) {
            gate.close_all();
            return;
        }
        let stream = match accepted {
            Ok((stream, _)) => {
                backoff.succeeded();
                stream
            }
            Err(e) => {
                backoff.failed("store", &e);
                continue;
            }
        };
        let Some(ticket) = gate.admit(&stream) else {
            continue;
        };
        let shared = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("burn-dist-store-conn".into())
            .spawn(move || serve(stream, ticket, &shared));
        if spawned.is_err() {
            tracing::warn!("store: could not spawn a connection thread");
        }
    }
}

fn reply(mut stream: &TcpStream, message: Message) -> bool {
    stream.write_all(&encode_frame(&message)).is_ok()
}

/// Serves one connection: its hello, then its requests until the peer closes it or breaks the
/// protocol.
fn serve(stream: TcpStream, ticket: Ticket, shared: &Shared) {
    let peer = stream
        .peer_addr()
        .map_or_else(|_| "?".into(), |a| a.to_string());
    _ = stream.set_nodelay(true);
    _ = stream.set_write_timeout(Some(shared.handshake_timeout));
    let hello = read_frame(&mut ticket.reader(&stream), MAX_HELLO);
    if !ticket.release() {
        // Evicted by newer connections while it had still not said hello.
        return;
    }
    // Once the token is right, the store waits for this thread when it closes.
    let (answer, _serving) = match hello {
        Ok(Message::Hello {
            token: presented,
            rank,
        }) if tokens_match(&presented, &shared.token) => {
            let (answer, serving) = shared.state.join(rank, &peer, &stream);
            (answer, Some(serving))
        }
        Ok(Message::Hello { rank, .. }) => {
            tracing::warn!(%peer, rank, "store: rejected a peer with a wrong job token");
            let reason = "wrong job token: BURN_DIST_TOKEN must be the same on every rank".into();
            (Message::Error { reason }, None)
        }
        Ok(other) => {
            let reason = format!("expected a hello first, got {other:?}");
            (Message::Error { reason }, None)
        }
        Err(e) => {
            tracing::warn!(%peer, "store: bad first frame: {e}");
            let reason = e.to_string();
            (Message::Error { reason }, None)
        }
    };
    let joined = answer == Message::Ok;
    if !reply(&stream, answer) || !joined {
        return;
    }
    // Joined peers may stay idle for long stretches; they close the connection when done.
    _ = stream.set_read_timeout(None);
    _ = stream.set_write_timeout(None);
    loop {
        let request = match read_frame(&mut &stream, shared.max_frame) {
            Ok(request) => request,
            Err(FrameError::Io(_)) => return,
            Err(e) => {
                reply(
                    &stream,
                    Message::Error {
                        reason: e.to_string(),
                    },
                );
                return;
            }
        };
        if !reply(&stream, handle(&shared.state, request)) {
            return;
        }
    }
}

impl State {
    fn lock(&self) -> MutexGuard<'_, Book> {
        self.book.lock().expect("store state poisoned")
    }

    /// Admits `rank`, joining from `from` on `stream`, once: the answer to its hello, and the
    /// count of this thread among those the store waits for when it closes.
    fn join(&self, rank: u64, from: &str, stream: &TcpStream) -> (Message, Serving<'_>) {
        let mut book = self.lock();
        book.serving += 1;
        let serving = Serving(self);
        let answer = self.admit(&mut book, rank, from, stream);
        (answer, serving)
    }

    fn admit(&self, book: &mut Book, rank: u64, from: &str, stream: &TcpStream) -> Message {
        if rank >= self.world as u64 {
            return Message::Error {
                reason: format!("rank {rank} is not below WORLD_SIZE={}", self.world),
            };
        }
        if let Some(first) = book.joined.get(&rank) {
            let duplicate = Message::DuplicateRank {
                rank,
                first: first.clone(),
                second: from.into(),
            };
            tracing::error!(rank, first, second = from, "store: a rank joined twice");
            if book.joined.len() < self.world && book.failure.is_none() {
                book.failure = Some(duplicate.clone());
                self.changed.notify_all();
            }
            return duplicate;
        }
        if let Some(failure) = &book.failure {
            return failure.clone();
        }
        if book.closing {
            return Message::Error {
                reason: "the store is closing: rank 0 is leaving the job".into(),
            };
        }
        let Ok(handle) = stream.try_clone() else {
            return Message::Error {
                reason: "the store is out of file descriptors".into(),
            };
        };
        book.joined.insert(rank, from.into());
        book.connections.push(handle);
        self.changed.notify_all();
        tracing::debug!(from, rank, "store: rank joined");
        Message::Ok
    }

    /// Closes the store: every wait ends, every joined connection's next read finds the end,
    /// and this returns once each serving thread has sent its last answer. If the job failed to
    /// form, the ranks first get up to `linger` to ask and hear why (they leave once told).
    fn close(&self, linger: Duration) {
        let mut book = self.lock();
        book.closing = true;
        self.changed.notify_all();
        if book.failure.is_some() {
            let deadline = Instant::now() + linger;
            while book.serving > 0 {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                book = self
                    .changed
                    .wait_timeout(book, left)
                    .expect("store poisoned")
                    .0;
            }
        }
        for connection in &book.connections {
            _ = connection.shutdown(Shutdown::Read);
        }
        while book.serving > 0 {
            book = self.changed.wait(book).expect("store poisoned");
        }
    }

    /// Waits on `book` until `done` has an answer, the job fails or `wait_ms` runs out (then
    /// `timed_out` answers).
    fn wait<'a>(
        &self,
        mut book: MutexGuard<'a, Book>,
        wait_ms: u64,
        done: impl Fn(&Book) -> Option<Message>,
        timed_out: impl FnOnce(&Book) -> Message,
    ) -> Message {
        // A peer may ask for any wait; past MAX_TIMEOUT the deadline could overflow.
        let deadline = Instant::now() + Duration::from_millis(wait_ms).min(MAX_TIMEOUT);
        loop {
            if let Some(failure) = &book.failure {
                return failure.clone();
            }
            if book.closing {
                return Message::Error {
                    reason: "the store closed while this rank waited: rank 0 has left the job"
                        .into(),
                };
            }
            if let Some(answer) = done(&book) {
                return answer;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return timed_out(&book);
            }
            book = self
                .changed
                .wait_timeout(book, left)
                .expect("store poisoned")
                .0;
        }
    }
}

/// Counts a thread serving a joined connection while it lives (see [`State::close`]).
struct Serving<'a>(&'a State);

impl Drop for Serving<'_> {
    fn drop(&mut self) {
        let mut book = self.0.book.lock().unwrap_or_else(|e| e.into_inner());
        book.serving -= 1;
        self.0.changed.notify_all();
    }
}

fn handle(state: &State, request: Message) -> Message {
    let mut book = state.lock();
    if let Some(failure) = &book.failure {
        return failure.clone();
    }
    match request {
        Message::Set { key, value } => {
            book.values.insert(key, value);
            state.changed.notify_all();
            Message::Ok
        }
        Message::Get { key, wait_ms } => state.wait(
            book,
            wait_ms,
            |book| {
                let value = book.values.get(&key)?.clone();
                Some(Message::Value { value })
            },
            |_| Message::NotFound,
        ),
        Message::WaitJoined { wait_ms } => state.wait(
            book,
            wait_ms,
            |book| (book.joined.len() == state.world).then_some(Message::Ok),
            |book| {
                let missing: Vec<String> = (0..state.world as u64)
                    .filter(|rank| !book.joined.contains_key(rank))
                    .map(|rank| rank.to_string())
                    .collect();
                let ranks = match missing.len() {
                    1 => "rank",
                    _ => "ranks",
                };
                Message::Error {
                    reason: format!(
                        "{ranks} {} did not join within {} s",
                        missing.join(", "),
                        Duration::from_millis(wait_ms).as_secs_f32()
                    ),
                }
            },
        ),
        Message::Add { key, delta } => {
            let current = book
                .values
                .get(&key)
                .and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok());
            let value = current.map_or(0, i64::from_le_bytes).wrapping_add(delta);
            book.values.insert(key, value.to_le_bytes().to_vec());
            state.changed.notify_all();
            Message::Counter { value }
        }
        other => Message::Error {
            reason: format!("not a request: {other:?}"),
        },
    }
}
