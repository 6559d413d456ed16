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
    /// Connects to the store at `addr` and presents `token` as `rank`. Retries, up to
    /// `config.join_timeout`, while nothing listens yet (rank 0 may start last) and while the
    /// connection is dropped before the store answers (a flood of other connections may have
    /// pushed it out of the store's gate). A refusal is final, and so is a store that stops
    /// listening after it was reached: rank 0 has failed.
    pub fn connect(
        addr: SocketAddr,
        token: &str,
        rank: usize,
        config: &CommConfig,
    ) -> Result<Self> {
        let deadline = Instant::now() + config.join_timeout;
        let mut backoff = Duration::from_millis(10);
        // Why the store last dropped this rank's connection, once it has.
        let mut dropped: Option<String> = None;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let (failure, detail) =
                match TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1))) {
                    Ok(stream) => match Self::present(stream, addr, token, rank, config)? {
                        Ok(client) => return Ok(client),
                        Err(e) => (
                            "dropped every connection before answering",
                            dropped.insert(e).clone(),
                        ),
                    },
                    Err(e) if dropped.is_some() => {
                        let reason = format!(
                            "dropped rank {rank}'s connection before answering ({}), then \
                             stopped listening ({e}): did rank 0 fail?",
                            dropped.unwrap_or_default()
                        );
                        return Err(store_error(addr, reason));
                    }
                    Err(e) => ("not reachable", e.to_string()),
                };
            if Instant::now() + backoff >= deadline {
                return Err(store_error(
                    addr,
                    format!(
                        "{failure} within {} s ({detail}): is rank 0 running, and are \
                         MASTER_ADDR and MASTER_PORT the same on every rank?",
                        config.join_timeout.as_secs_f32()
                    ),
                ));
            }
            tracing::debug!(%addr, "store {failure} ({detail}); retrying");
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_millis(500));
        }
    }

    /// Sends the hello on a fresh connection. The inner `Err` is a connection lost before any
    /// answer, worth retrying; the outer one a refusal.
    fn present(
        stream: TcpStream,
        addr: SocketAddr,
        token: &str,
        rank: usize,
        config: &CommConfig,
    ) -> Result<std::result::Result<Self, String>> {
        let local_ip = match stream.set_nodelay(true).and_then(|()| stream.local_addr()) {
            Ok(local) => local.ip(),
            Err(e) => return Ok(Err(e.to_string())),
        };
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
        match client.exchange(hello, Duration::ZERO) {
            Err(FrameError::Io(e)) => Ok(Err(e.to_string())),
            Err(e) => Err(store_error(addr, format!("bad reply: {e}"))),
            Ok(Message::Ok) => Ok(Ok(client)),
            Ok(other) => Err(client.refused(format!("refused to let rank {rank} join"), other)),
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

    /// Waits until every rank of the job has joined the store, up to the configured timeout.
    /// Fails with [`CommError::DuplicateRank`] if a rank joined twice meanwhile, and names the
    /// ranks still missing when the time runs out.
    pub fn wait_for_every_rank(&self) -> Result<()> {
        let wait = Message::WaitJoined {
            wait_ms: self.wait_ms(),
        };
        match self.request(wait, self.timeout)? {
            Message::Ok => Ok(()),
            other => Err(self.refused("waiting for every rank to join".into(), other)),
        }
    }

    /// Sets `key` to `value`, waking every rank waiting for it.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let set = Message::Set {
            key: key.into(),
            value: value.to_vec(),
        };
        match self.request(set, Duration::ZERO)? {
            Message::Ok => Ok(()),
            other => Err(self.refused(format!("set {key:?}"), other)),
        }
    }

    /// The value of `key`, waiting for it up to the configured timeout.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        let get = Message::Get {
            key: key.into(),
            wait_ms: self.wait_ms(),
        };
        match self.request(get, self.timeout)? {
            Message::Value { value } => Ok(value),
            Message::NotFound => Err(store_error(
                self.addr,
                format!(
                    "key {key:?} was not set within {} s",
                    self.timeout.as_secs_f32()
                ),
            )),
            other => Err(self.refused(format!("get {key:?}"), other)),
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
            other => Err(self.refused(format!("add {key:?}"), other)),
        }
    }

    /// The configured timeout as the store's wait field.
    fn wait_ms(&self) -> u64 {
        self.timeout.as_millis().min(u64::MAX as u128) as u64
    }

    fn request(&self, message: Message, server_wait: Duration) -> Result<Message> {
        self.exchange(message, server_wait).map_err(|e| match e {
            FrameError::Io(e) if closed(&e) => store_error(self.addr, STORE_CLOSED.into()),
            e => store_error(self.addr, format!("connection lost or bad reply: {e}")),
        })
    }

    /// Sends `message` and reads the reply, allowing `server_wait` for the store to answer.
    fn exchange(&self, message: Message, server_wait: Duration) -> Result<Message, FrameError> {
        let mut stream = self.stream.lock().expect("store client poisoned");
        stream.set_read_timeout(Some(server_wait.saturating_add(REPLY_SLACK)))?;
        stream.write_all(&encode_frame(&message))?;
        read_frame(&mut *stream, self.max_frame)
    }

    /// The error for an answer other than the one `doing` expected.
    fn refused(&self, doing: String, answer: Message) -> CommError {
        match answer {
            Message::DuplicateRank {
                rank,
                first,
                second,
            } => CommError::DuplicateRank {
                rank: rank as usize,
                first,
                second,
            },
            Message::Error { reason } => store_error(self.addr, format!("{doing}: {reason}")),
            other => store_error(self.addr, format!("{doing}: unexpected reply {other:?}")),
        }
    }
}

fn store_error(addr: SocketAddr, reason: String) -> CommError {
    CommError::Store {
        addr: addr.to_string(),
        reason,
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
