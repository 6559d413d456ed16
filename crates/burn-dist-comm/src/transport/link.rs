//! The data link to one peer process: a TCP connection, or a pair of shared-memory rings when
//! the peer is on the same host. Both report failures as the same `io::Error` kinds, so the
//! transport maps them to one set of errors.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::Duration;

#[cfg(target_os = "linux")]
use super::shm::{RING_ALIGN, Ring, ShmLink};
#[cfg(target_os = "linux")]
use crate::wire::HEADER_LEN;

// On a ring every message (header and payload) starts at a multiple of the ring's alignment,
// so that a payload read where it lies in the ring is aligned for every element type.
#[cfg(target_os = "linux")]
const _: () = assert!(HEADER_LEN.is_multiple_of(RING_ALIGN));

/// How the data of one pair of ranks travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    /// Channels between threads of one process.
    InProcess,
    /// A TCP connection.
    Tcp,
    /// Rings in shared memory (ranks on one host).
    SharedMemory,
}

impl std::fmt::Display for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Link::InProcess => "in-process",
            Link::Tcp => "tcp",
            Link::SharedMemory => "shm",
        })
    }
}

pub(crate) enum DataLink {
    Tcp(TcpStream),
    #[cfg(target_os = "linux")]
    SharedMemory(ShmLink),
}

impl DataLink {
    /// Sets what a TCP link needs for collectives: no Nagle delay, and `timeout` on every read
    /// and write. A ring carries its timeout from creation.
    pub(crate) fn configure(&self, timeout: Duration) -> io::Result<()> {
        match self {
            DataLink::Tcp(stream) => {
                stream.set_nodelay(true)?;
                stream.set_read_timeout(Some(timeout))?;
                stream.set_write_timeout(Some(timeout))
            }
            #[cfg(target_os = "linux")]
            DataLink::SharedMemory(_) => Ok(()),
        }
    }

    pub(crate) fn kind(&self) -> Link {
        match self {
            DataLink::Tcp(_) => Link::Tcp,
            #[cfg(target_os = "linux")]
            DataLink::SharedMemory(_) => Link::SharedMemory,
        }
    }

    /// Another handle to the same link, for the other side of the transport.
    pub(crate) fn try_clone(&self) -> io::Result<DataLink> {
        Ok(match self {
            DataLink::Tcp(stream) => DataLink::Tcp(stream.try_clone()?),
            #[cfg(target_os = "linux")]
            DataLink::SharedMemory(link) => DataLink::SharedMemory(link.clone()),
        })
    }

    pub(crate) fn write_all(&self, bytes: &[u8]) -> io::Result<()> {
        match self {
            DataLink::Tcp(stream) => (&mut &*stream).write_all(bytes),
            #[cfg(target_os = "linux")]
            DataLink::SharedMemory(link) => link.outbound.write_all(bytes),
        }
    }

    pub(crate) fn read_exact(&self, out: &mut [u8]) -> io::Result<()> {
        match self {
            DataLink::Tcp(stream) => (&mut &*stream).read_exact(out),
            #[cfg(target_os = "linux")]
            DataLink::SharedMemory(link) => link.inbound.read_exact(out),
        }
    }

    /// Ends a message of `len` bytes (header included): on a ring, with the zero bytes that bring
    /// the next message to a multiple of `RING_ALIGN`.
    pub(crate) fn end_message(&self, len: usize) -> io::Result<()> {
        match self {
            DataLink::Tcp(_) => Ok(()),
            #[cfg(target_os = "linux")]
            DataLink::SharedMemory(link) => link.outbound.write_all(&[0; RING_ALIGN][..pad(len)]),
        }
    }

    /// Skips what [`DataLink::end_message`] added after a message of `len` bytes.
    pub(crate) fn skip_message_end(&self, len: usize) -> io::Result<()> {
        match self {
            DataLink::Tcp(_) => Ok(()),
            #[cfg(target_os = "linux")]
            DataLink::SharedMemory(link) => {
                link.inbound.read_exact(&mut [0; RING_ALIGN][..pad(len)])
            }
        }
    }

    /// The ring this link reads from, whose bytes can be used where they lie.
    #[cfg(target_os = "linux")]
    pub(crate) fn inbound_ring(&self) -> Option<&Ring> {
        match self {
            DataLink::Tcp(_) => None,
            DataLink::SharedMemory(link) => Some(&link.inbound),
        }
    }

    /// Wakes every blocked read and write on the link, on both ends, for good.
    pub(crate) fn shutdown(&self) {
        match self {
            DataLink::Tcp(stream) => _ = stream.shutdown(Shutdown::Both),
            #[cfg(target_os = "linux")]
            DataLink::SharedMemory(link) => {
                link.outbound.close();
                link.inbound.close();
            }
        }
    }
}

/// Zero bytes that round `len` up to a multiple of `RING_ALIGN`.
#[cfg(target_os = "linux")]
fn pad(len: usize) -> usize {
    len.next_multiple_of(RING_ALIGN) - len
}
