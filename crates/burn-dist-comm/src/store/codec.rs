//! The store's wire format: a little-endian u32 length, then a message of that many bytes.
//!
//! A message is a tag byte followed by fields: strings and byte strings as a u32 length plus
//! the bytes, integers as 8 little-endian bytes. The decoder checks every length against what
//! is left before it slices or allocates, rejects unknown tags and trailing bytes, and never
//! panics on any input (fuzzed: see docs/testing.md). Encoding is canonical:
//! `encode(decode(b)?) == b`.

use std::io::{self, Read};

/// One request or response on a store connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// First frame of every connection: the job token and the joining rank.
    Hello { token: Vec<u8>, rank: u64 },
    /// Sets `key` to `value`, waking every waiter on it.
    Set { key: String, value: Vec<u8> },
    /// Returns the value of `key`, waiting up to `wait_ms` for it to be set.
    Get { key: String, wait_ms: u64 },
    /// Adds `delta` to the counter `key` (missing = 0) and returns the new value.
    Add { key: String, delta: i64 },
    /// Waits up to `wait_ms` until every rank of the job has joined the store; answered with
    /// `Ok`, `DuplicateRank`, or an `Error` naming the ranks still missing.
    WaitJoined { wait_ms: u64 },
    /// Success without a value.
    Ok,
    /// A value that was asked for.
    Value { value: Vec<u8> },
    /// A counter's new value.
    Counter { value: i64 },
    /// `Get` found no value in time.
    NotFound,
    /// The request was refused; the text says why.
    Error { reason: String },
    /// Two connections presented the same rank, first from `first` and again from `second`:
    /// the answer to the second, and, while the job is still forming, to every request after.
    DuplicateRank {
        rank: u64,
        first: String,
        second: String,
    },
}

/// The largest hello the store reads: tag, token length, a token of up to
/// [`MAX_TOKEN_BYTES`](crate::env::MAX_TOKEN_BYTES) and the rank. Anything longer is refused
/// before the token is checked.
pub const MAX_HELLO: usize = 1 + 4 + crate::env::MAX_TOKEN_BYTES + 8;

/// Why a frame could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("empty message")]
    Empty,
    #[error("unknown message tag {0}")]
    UnknownTag(u8),
    #[error("message ends inside a field ({needed} more bytes needed, {left} left)")]
    Truncated { needed: usize, left: usize },
    #[error("{0} unexpected bytes after the message")]
    Trailing(usize),
    #[error("a key or reason is not UTF-8")]
    NotUtf8,
}

const HELLO: u8 = 1;
const SET: u8 = 2;
const GET: u8 = 3;
const ADD: u8 = 4;
const OK: u8 = 10;
const VALUE: u8 = 11;
const COUNTER: u8 = 12;
const NOT_FOUND: u8 = 13;
const ERROR: u8 = 14;
const WAIT_JOINED: u8 = 5;
const DUPLICATE_RANK: u8 = 15;

/// Encodes `message` as a frame body (without the length prefix).
pub fn encode(message: &Message) -> Vec<u8> {
    let mut out = Vec::new();
    let bytes = |out: &mut Vec<u8>, b: &[u8]| {
        out.extend_from_slice(&(b.len() as u32).to_le_bytes());
        out.extend_from_slice(b);
    };
    match message {
        Message::Hello { token, rank } => {
            out.push(HELLO);
            bytes(&mut out, token);
            out.extend_from_slice(&rank.to_le_bytes());
        }
        Message::Set { key, value } => {
            out.push(SET);
            bytes(&mut out, key.as_bytes());
            bytes(&mut out, value);
        }
        Message::Get { key, wait_ms } => {
            out.push(GET);
            bytes(&mut out, key.as_bytes());
            out.extend_from_slice(&wait_ms.to_le_bytes());
        }
        Message::Add { key, delta } => {
            out.push(ADD);
            bytes(&mut out, key.as_bytes());
            out.extend_from_slice(&delta.to_le_bytes());
        }
        Message::WaitJoined { wait_ms } => {
            out.push(WAIT_JOINED);
            out.extend_from_slice(&wait_ms.to_le_bytes());
        }
        Message::Ok => out.push(OK),
        Message::Value { value } => {
            out.push(VALUE);
            bytes(&mut out, value);
        }
        Message::Counter { value } => {
            out.push(COUNTER);
            out.extend_from_slice(&value.to_le_bytes());
        }
        Message::NotFound => out.push(NOT_FOUND),
        Message::Error { reason } => {
            out.push(ERROR);
            bytes(&mut out, reason.as_bytes());
        }
        Message::DuplicateRank {
            rank,
            first,
            second,
        } => {
            out.push(DUPLICATE_RANK);
            out.extend_from_slice(&rank.to_le_bytes());
            bytes(&mut out, first.as_bytes());
            bytes(&mut out, second.as_bytes());
        }
    }
    out
}

/// Encodes `message` as a whole frame: length prefix and body.
pub fn encode_frame(message: &Message) -> Vec<u8> {
    let body = encode(message);
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(&body);
    frame
}

/// Decodes a frame body.
pub fn decode(body: &[u8]) -> Result<Message, DecodeError> {
    let (&tag, rest) = body.split_first().ok_or(DecodeError::Empty)?;
    let mut r = Fields(rest);
    let message = match tag {
        HELLO => Message::Hello {
            token: r.bytes()?.to_vec(),
            rank: r.u64()?,
        },
        SET => Message::Set {
            key: r.string()?,
            value: r.bytes()?.to_vec(),
        },
        GET => Message::Get {
            key: r.string()?,
            wait_ms: r.u64()?,
        },
        ADD => Message::Add {
            key: r.string()?,
            delta: r.u64()? as i64,
        },
        WAIT_JOINED => Message::WaitJoined { wait_ms: r.u64()? },
        OK => Message::Ok,
        VALUE => Message::Value {
            value: r.bytes()?.to_vec(),
        },
        COUNTER => Message::Counter {
            value: r.u64()? as i64,
        },
        NOT_FOUND => Message::NotFound,
        ERROR => Message::Error {
            reason: r.string()?,
        },
        DUPLICATE_RANK => Message::DuplicateRank {
            rank: r.u64()?,
            first: r.string()?,
            second: r.string()?,
        },
        other => return Err(DecodeError::UnknownTag(other)),
    };
    match r.0.len() {
        0 => Ok(message),
        n => Err(DecodeError::Trailing(n)),
    }
}

/// Why a frame could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge { len: usize, max: usize },
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// Reads one frame, refusing one longer than `max` bytes before allocating for it.
pub fn read_frame(reader: &mut impl Read, max: usize) -> Result<Message, FrameError> {
    let mut len = [0u8; 4];
    reader.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    let mut body = vec![0u8; len];
    reader.read_exact(&mut body)?;
    Ok(decode(&body)?)
}

/// A cursor over the fields of a message.
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.0.len() < n {
            return Err(DecodeError::Truncated {
                needed: n,
                left: self.0.len(),
            });
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    fn bytes(&mut self) -> Result<&'a [u8], DecodeError> {
        let len = self.u32()? as usize;
        self.take(len)
    }

    fn string(&mut self) -> Result<String, DecodeError> {
        String::from_utf8(self.bytes()?.to_vec()).map_err(|_| DecodeError::NotUtf8)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn any_message() -> impl Strategy<Value = Message> {
        let bytes = proptest::collection::vec(any::<u8>(), 0..64);
        prop_oneof![
            (bytes.clone(), any::<u64>()).prop_map(|(token, rank)| Message::Hello { token, rank }),
            (".{0,16}", bytes.clone()).prop_map(|(key, value)| Message::Set { key, value }),
            (".{0,16}", any::<u64>()).prop_map(|(key, wait_ms)| Message::Get { key, wait_ms }),
            (".{0,16}", any::<i64>()).prop_map(|(key, delta)| Message::Add { key, delta }),
            any::<u64>().prop_map(|wait_ms| Message::WaitJoined { wait_ms }),
            Just(Message::Ok),
            bytes.prop_map(|value| Message::Value { value }),
            any::<i64>().prop_map(|value| Message::Counter { value }),
            Just(Message::NotFound),
            ".{0,32}".prop_map(|reason| Message::Error { reason }),
            (any::<u64>(), ".{0,24}", ".{0,24}").prop_map(|(rank, first, second)| {
                Message::DuplicateRank {
                    rank,
                    first,
                    second,
                }
            }),
        ]
    }

    proptest! {
        #[test]
        fn every_message_round_trips(message in any_message()) {
            let frame = encode_frame(&message);
            let decoded = read_frame(&mut frame.as_slice(), 1 << 20).unwrap();
            prop_assert_eq!(decoded, message);
        }

        #[test]
        fn arbitrary_bytes_never_panic_and_decode_canonically(body in proptest::collection::vec(any::<u8>(), 0..80)) {
            if let Ok(message) = decode(&body) {
                prop_assert_eq!(encode(&message), body);
            }
        }
    }

    #[test]
    fn oversized_frame_is_refused_before_allocation() {
        let frame = u32::MAX.to_le_bytes();
        let err = read_frame(&mut frame.as_slice(), 1024).unwrap_err();
        assert!(
            err.to_string().contains("exceeds the limit of 1024 bytes"),
            "{err}"
        );
    }

    #[test]
    fn field_length_beyond_the_message_is_truncation() {
        let mut body = vec![SET];
        body.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(decode(&body), Err(DecodeError::Truncated { .. })));
    }
}
