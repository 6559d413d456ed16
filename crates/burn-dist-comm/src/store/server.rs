//! The TCP key-value store that rank 0 hosts for the rendezvous, like torchrun's TCPStore.
//!
//! It binds only the address it is given, answers only connections that present the job token
//! in their first frame, refuses frames over the size limit, and serves each connection on its
//! own thread. `Get` waits server-side (on a condition variable) until the key is set or the
//! requested wait runs out.

use std::collections::HashMap;
use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::codec::{Message, encode_frame, read_frame};
use super::tokens_match;
use crate::{CommConfig, CommError, Result};

/// How long a new connection has to present its hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once; more are refused, so a flood cannot exhaust threads.
const MAX_CONNECTIONS: usize = 1024;

#[derive(Default)]
struct State {
    values: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

/// A running store. Dropping it stops accepting connections.
#[derive(Debug)]
pub struct StoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    acceptor: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Binds `addr` (port 0 picks a free port) and serves until dropped.
    pub fn bind(addr: SocketAddr, token: &str, config: &CommConfig) -> Result<Self> {
        let listener = TcpListener::bind(addr).map_err(|e| {
            let hint = if e.kind() == std::io::ErrorKind::AddrInUse {
                " (is another job or a stale process using it? pick another MASTER_PORT, or \
                 `burn-dist-run --master-port 0` to let the launcher pick a free one)"
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
        let state = Arc::new(State::default());
        let token = token.as_bytes().to_vec();
        let max_frame = config.max_store_frame;
        let stop_flag = stop.clone();
        let acceptor = std::thread::Builder::new()
            .name("burn-dist-store".into())
            .spawn(move || accept_loop(listener, &stop_flag, &state, &token, max_frame))
            .map_err(|e| CommError::io("spawning the store thread", e))?;
        tracing::debug!(%addr, "store listening");
        Ok(StoreServer {
            addr,
            stop,
            acceptor: Some(acceptor),
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
    }
}

fn accept_loop(
    listener: TcpListener,
    stop: &AtomicBool,
    state: &Arc<State>,
    token: &[u8],
    max_frame: usize,
) {
    let live = Arc::new(AtomicUsize::new(0));
    for stream in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(mut stream) = stream else { continue };
        if live.load(Ordering::SeqCst) >= MAX_CONNECTIONS {
            let reason = format!("the store serves at most {MAX_CONNECTIONS} connections");
            _ = stream.write_all(&encode_frame(&Message::Error { reason }));
            continue;
        }
        live.fetch_add(1, Ordering::SeqCst);
        let (state, token, live) = (state.clone(), token.to_vec(), live.clone());
        let spawned = std::thread::Builder::new()
            .name("burn-dist-store-conn".into())
            .spawn(move || {
                serve(stream, &state, &token, max_frame);
                live.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            tracing::warn!("store: could not spawn a connection thread");
        }
    }
}

/// Serves one connection until the peer closes it or breaks the protocol.
fn serve(mut stream: TcpStream, state: &State, token: &[u8], max_frame: usize) {
    let peer = stream
        .peer_addr()
        .map_or_else(|_| "?".into(), |a| a.to_string());
    _ = stream.set_nodelay(true);
    _ = stream.set_read_timeout(Some(HELLO_TIMEOUT));
    let reply = |stream: &mut TcpStream, message: Message| {
        stream.write_all(&encode_frame(&message)).is_ok()
    };
    match read_frame(&mut stream, max_frame) {
        Ok(Message::Hello {
            token: presented,
            rank,
        }) if tokens_match(&presented, token) => {
            tracing::debug!(%peer, rank, "store: rank joined");
            if !reply(&mut stream, Message::Ok) {
                return;
            }
        }
        Ok(Message::Hello { rank, .. }) => {
            tracing::warn!(%peer, rank, "store: rejected a peer with a wrong job token");
            let reason = "wrong job token: BURN_DIST_TOKEN must be the same on every rank".into();
            reply(&mut stream, Message::Error { reason });
            return;
        }
        Ok(other) => {
            let reason = format!("expected a hello first, got {other:?}");
            reply(&mut stream, Message::Error { reason });
            return;
        }
        Err(e) => {
            tracing::warn!(%peer, "store: bad first frame: {e}");
            reply(
                &mut stream,
                Message::Error {
                    reason: e.to_string(),
                },
            );
            return;
        }
    }
    // Joined peers may stay idle for long stretches; they close the connection when done.
    _ = stream.set_read_timeout(None);
    loop {
        let request = match read_frame(&mut stream, max_frame) {
            Ok(request) => request,
            Err(super::codec::FrameError::Io(_)) => return,
            Err(e) => {
                reply(
                    &mut stream,
                    Message::Error {
                        reason: e.to_string(),
                    },
                );
                return;
            }
        };
        let response = handle(state, request);
        if !reply(&mut stream, response) {
            return;
        }
    }
}

fn handle(state: &State, request: Message) -> Message {
    let mut values = state.values.lock().expect("store state poisoned");
    match request {
        Message::Set { key, value } => {
            values.insert(key, value);
            state.changed.notify_all();
            Message::Ok
        }
        Message::Get { key, wait_ms } => {
            let deadline = Instant::now() + Duration::from_millis(wait_ms);
            loop {
                if let Some(value) = values.get(&key) {
                    return Message::Value {
                        value: value.clone(),
                    };
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Message::NotFound;
                }
                values = state
                    .changed
                    .wait_timeout(values, left)
                    .expect("store poisoned")
                    .0;
            }
        }
        Message::Add { key, delta } => {
            let current = values
                .get(&key)
                .and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok());
            let value = current.map_or(0, i64::from_le_bytes).wrapping_add(delta);
            values.insert(key, value.to_le_bytes().to_vec());
            state.changed.notify_all();
            Message::Counter { value }
        }
        other => Message::Error {
            reason: format!("not a request: {other:?}"),
        },
    }
}
