//! A connection to the TCP store.

use std::io::Write;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::codec::{FrameError, Message, encode_frame, read_frame};
use crate::{CommConfig, CommError, Result};

/// Slack on top of a server-side wait, so the socket timeout fires only if the server is gone.
const REPLY_SLACK: Duration = Duration::from_secs(10);

/// A joined connection to the store. Requests are serialized; the client is `Sync`.
#[derive(Debug)]
pub struct StoreClient {
    addr: SocketAddr,
    local_ip: IpAddr,
    stream: Mutex<TcpStream>,
    timeout: Duration,
    max_frame: usize,
}

impl StoreClient {
    /// Connects to the store at `addr` and presents `token`. Retries while nothing listens
    /// yet (rank 0 may start last), up to `config.timeout`.
    pub fn connect(
        addr: SocketAddr,
        token: &str,
        rank: usize,
        config: &CommConfig,
    ) -> Result<Self> {
        let deadline = Instant::now() + config.join_timeout;
        let mut backoff = Duration::from_millis(10);
        let stream = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1))) {
                Ok(stream) => break stream,
                Err(e) if Instant::now() + backoff < deadline => {
                    tracing::debug!(%addr, "store not reachable yet: {e}");
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_millis(500));
                }
                Err(e) => {
                    return Err(store_error(
                        addr,
                        format!(
                            "not reachable within {} s ({e}): is rank 0 running, and are \
                             MASTER_ADDR and MASTER_PORT the same on every rank?",
                            config.join_timeout.as_secs_f32()
                        ),
                    ));
                }
            }
        };
        stream
            .set_nodelay(true)
            .map_err(|e| CommError::io("store set_nodelay", e))?;
        let local_ip = stream
            .local_addr()
            .map_err(|e| CommError::io("store local_addr", e))?
            .ip();
        let client = StoreClient {
            addr,
            local_ip,
            stream: Mutex::new(stream),
            timeout: config.join_timeout,
            max_frame: config.max_store_frame,
        };
        let hello = Message::Hello {
            token: token.as_bytes().to_vec(),
            rank: rank as u64,
        };
        match client.request(hello, Duration::ZERO)? {
            Message::Ok => Ok(client),
            other => Err(store_error(
                addr,
                format!("refused to let rank {rank} join: {}", reason(other)),
            )),
        }
    }

    /// The address of this machine's interface that reaches the store: the one to advertise
    /// to peers.
    pub fn local_ip(&self) -> IpAddr {
        self.local_ip
    }

    /// The address of the store.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let set = Message::Set {
            key: key.into(),
            value: value.to_vec(),
        };
        match self.request(set, Duration::ZERO)? {
            Message::Ok => Ok(()),
            other => Err(store_error(
                self.addr,
                format!("set {key:?}: {}", reason(other)),
            )),
        }
    }

    /// The value of `key`, waiting for it up to the configured timeout.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        let wait_ms = self.timeout.as_millis().min(u64::MAX as u128) as u64;
        match self.request(
            Message::Get {
                key: key.into(),
                wait_ms,
            },
            self.timeout,
        )? {
            Message::Value { value } => Ok(value),
            Message::NotFound => Err(store_error(
                self.addr,
                format!(
                    "key {key:?} was not set within {} s",
                    self.timeout.as_secs_f32()
                ),
            )),
            other => Err(store_error(
                self.addr,
                format!("get {key:?}: {}", reason(other)),
            )),
        }
    }

    /// Adds `delta` to the counter `key` and returns its new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        match self.request(
            Message::Add {
                key: key.into(),
                delta,
            },
            Duration::ZERO,
        )? {
            Message::Counter { value } => Ok(value),
            other => Err(store_error(
                self.addr,
                format!("add {key:?}: {}", reason(other)),
            )),
        }
    }

    fn request(&self, message: Message, server_wait: Duration) -> Result<Message> {
        let mut stream = self.stream.lock().expect("store client poisoned");
        let io = |e| store_error(self.addr, format!("connection lost: {e}"));
        stream
            .set_read_timeout(Some(server_wait + REPLY_SLACK))
            .map_err(io)?;
        stream.write_all(&encode_frame(&message)).map_err(io)?;
        read_frame(&mut *stream, self.max_frame).map_err(|e| match e {
            FrameError::Io(e) if closed(&e) => store_error(self.addr, STORE_CLOSED.into()),
            e => store_error(self.addr, format!("bad reply: {e}")),
        })
    }
}

/// The store lives in rank 0's process: a connection it closes means rank 0 has exited, most
/// often because another rank failed first. Say so, rather than "failed to fill whole buffer".
const STORE_CLOSED: &str = "closed the connection: rank 0, whose process serves the store, has \
     exited (its own error, or the launcher's summary, says which rank failed first)";

/// Whether a read failed because the peer closed or reset the connection.
fn closed(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
    matches!(
        e.kind(),
        UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe
    )
}

fn reason(message: Message) -> String {
    match message {
        Message::Error { reason } => reason,
        other => format!("unexpected reply {other:?}"),
    }
}

fn store_error(addr: SocketAddr, reason: String) -> CommError {
    CommError::Store {
        addr: addr.to_string(),
        reason,
    }
}
