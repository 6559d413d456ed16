//! Point-to-point links between the ranks of a group, and the one exchange pattern every
//! collective is built from.
//!
//! A transport moves framed byte messages between ranks: in-process channels for unit tests
//! (`local`) or, between processes (`process`), TCP sockets and, for ranks on one host,
//! shared-memory rings (`shm`). The collectives in `algorithms` know nothing about which one
//! they run on.

pub(crate) mod link;
pub(crate) mod local;
pub(crate) mod mesh;
pub(crate) mod process;
#[cfg(target_os = "linux")]
pub(crate) mod shm;

pub use link::Link;
#[cfg(target_os = "linux")]
pub(crate) use shm::{Arenas, Region};
/// Arenas exist only on Linux: elsewhere no transport has any, and none can be made.
#[cfg(not(target_os = "linux"))]
pub(crate) struct Arenas {
    pub peers: Vec<Option<NoArena>>,
    _none: std::convert::Infallible,
}

/// A peer's arena where there are none.
#[cfg(not(target_os = "linux"))]
pub(crate) struct NoArena;

#[cfg(not(target_os = "linux"))]
impl Arenas {
    pub(crate) fn offset_of(&self, _buf: &crate::SharedBuffer) -> Option<usize> {
        match self._none {}
    }

    pub(crate) fn writes_peers(&self) -> bool {
        match self._none {}
    }
}

#[cfg(not(target_os = "linux"))]
impl NoArena {
    pub(crate) fn bytes(&self, _offset: usize, _len: usize) -> Option<&[u8]> {
        None
    }

    pub(crate) fn write(&self, _offset: usize, _data: &[u8]) -> Option<()> {
        None
    }
}

use crate::divergence::Peers;
use crate::wire::Header;
use crate::{CommError, OpDesc, Result};

/// The sending side of a transport. Shared with a helper thread while the receiving side runs.
pub(crate) trait Tx: Sync {
    /// Sends one message of collective `op` to `peer`.
    fn send(&self, peer: usize, op: &OpDesc, payload: &[u8]) -> Result<()>;
}

/// The receiving side of a transport.
pub(crate) trait Rx {
    /// Receives `peer`'s next message into `out`. It must belong to the same collective `op`
    /// (kind, sequence number, dtype) and have `out.len()` bytes, otherwise this fails with
    /// `CommError::Mismatch` (see [`check_header`]).
    fn recv(&mut self, peer: usize, op: &OpDesc, out: &mut [u8]) -> Result<()>;

    /// Receives the next message of each of `peers`, all of `len` bytes, and shows them to
    /// `visit` side by side: each call `visit(at, parts)` gets bytes `at..at + n` of every
    /// peer's message (`parts[i]` is `peers[i]`'s, all of one length `n`, a multiple of
    /// `align`), and the calls cover the messages in order. A link that can lends the bytes where
    /// they arrived; otherwise they are received into `scratch` (at least `peers.len() × len`
    /// bytes) first and visited in one call. With no peers nothing is visited. The same checks
    /// and errors as [`Rx::recv`].
    fn recv_side_by_side(
        &mut self,
        peers: &[usize],
        op: &OpDesc,
        len: usize,
        _align: usize,
        scratch: &mut [u8],
        visit: &mut dyn FnMut(usize, &[&[u8]]),
    ) -> Result<()> {
        recv_into_scratch(self, peers, op, len, scratch, visit)
    }
}

/// [`Rx::recv_side_by_side`] for links that cannot lend their bytes: each message is received
/// into its slot of `scratch`, then all are visited at once.
pub(crate) fn recv_into_scratch<R: Rx + ?Sized>(
    rx: &mut R,
    peers: &[usize],
    op: &OpDesc,
    len: usize,
    scratch: &mut [u8],
    visit: &mut dyn FnMut(usize, &[&[u8]]),
) -> Result<()> {
    if peers.is_empty() {
        return Ok(());
    }
    let mut parts: Vec<&[u8]> = Vec::with_capacity(peers.len());
    let mut rest = &mut scratch[..peers.len() * len];
    for &peer in peers {
        let (slot, tail) = std::mem::take(&mut rest).split_at_mut(len);
        rx.recv(peer, op, slot)?;
        parts.push(slot);
        rest = tail;
    }
    visit(0, &parts);
    Ok(())
}

/// Failure handling shared by both sides of a transport.
pub(crate) trait Abort: Sync {
    /// Records `error` as the group's failure unless one is recorded already, tells the peers,
    /// and wakes every send and receive still blocked on this rank. Returns the first failure,
    /// which is the root cause to report.
    fn abort(&self, error: CommError) -> CommError;
    /// The recorded failure, if any.
    fn failure(&self) -> Option<CommError>;
}

/// A rank's links to every other rank of its group.
pub(crate) trait Transport: Send {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Both sides at once, so one thread can send while another receives.
    fn parts(&mut self) -> (&dyn Tx, &mut dyn Rx, &dyn Abort);
    /// How the data reaches each peer (`None` for this rank).
    fn links(&self) -> Vec<Option<Link>>;
    /// This rank's arena and every peer's, where every peer shares this host's memory (see
    /// `shm::arena`): collectives on buffers in them read the peers' buffers in place.
    fn arenas(&self) -> Option<std::sync::Arc<Arenas>> {
        None
    }
    /// What the rank's lanes share to check, while a caller waits long, that the group has not
    /// diverged across lanes (see `divergence`).
    fn peers(&self) -> std::sync::Arc<dyn Peers>;
    /// Aborts the group with `error` (see [`Abort::abort`]).
    fn abort(&mut self, error: CommError) -> CommError {
        self.parts().2.abort(error)
    }
    /// Orderly shutdown: tells the peers this rank is leaving, so that they do not take it for
    /// a crash unless they still need it.
    fn close(&mut self);
}

/// Sends every `(peer, bytes)` of `sends` in order while receiving every `(peer, buffer)` of
/// `recvs` in order. See [`exchange_with`].
pub(crate) fn exchange(
    transport: &mut dyn Transport,
    op: &OpDesc,
    sends: &[(usize, &[u8])],
    recvs: &mut [(usize, &mut [u8])],
) -> Result<()> {
    let inline = recvs.is_empty();
    exchange_sending(transport, op, sends, recvs, inline)
}

/// Messages [`exchange_small`] may send on the calling thread.
pub(crate) const SMALL_MESSAGE_BYTES: usize = 4096;

/// [`exchange`] for messages of at most [`SMALL_MESSAGE_BYTES`] (the barriers and buffer
/// locations of the in-place collectives), sent on this thread before anything is received:
/// a helper thread would cost more than the message. No link (a ring of [`shm::RING_BYTES`],
/// a socket's buffer) is too full to take one for good: a rank finishes a collective only once
/// it has received all of its messages, so when both ranks of a link are in the same
/// collective the link holds nothing older, and a peer still in an earlier one is receiving.
///
/// Only for links that report a vanished peer after a grace for its abort notice (processes,
/// see `process::ABORT_GRACE`): sent first, a message to a rank that aborted and left would
/// otherwise report the closed link rather than the rank's reason, which the in-process
/// channels deliver only to a receive.
pub(crate) fn exchange_small(
    transport: &mut dyn Transport,
    op: &OpDesc,
    sends: &[(usize, &[u8])],
    recvs: &mut [(usize, &mut [u8])],
) -> Result<()> {
    debug_assert!(sends.iter().all(|(_, s)| s.len() <= SMALL_MESSAGE_BYTES));
    exchange_sending(transport, op, sends, recvs, true)
}

fn exchange_sending(
    transport: &mut dyn Transport,
    op: &OpDesc,
    sends: &[(usize, &[u8])],
    recvs: &mut [(usize, &mut [u8])],
    inline: bool,
) -> Result<()> {
    exchange_with(transport, op, sends, inline, |rx| {
        for (peer, out) in recvs.iter_mut() {
            rx.recv(*peer, op, out)?;
        }
        Ok(())
    })
}

/// Sends every `(peer, bytes)` of `sends` in order while `receive` takes the messages it
/// expects from the receiving side. Sending runs on a helper thread so that two ranks that
/// send to each other at once cannot block each other on full socket buffers or rings; with
/// `inline` (nothing to receive, or nothing to send) both run on this thread, sends first.
///
/// On any failure the group is aborted and the root cause is returned.
pub(crate) fn exchange_with(
    transport: &mut dyn Transport,
    op: &OpDesc,
    sends: &[(usize, &[u8])],
    inline: bool,
    receive: impl FnOnce(&mut dyn Rx) -> Result<()>,
) -> Result<()> {
    let (tx, rx, abort) = transport.parts();
    if let Some(failure) = abort.failure() {
        return Err(failure);
    }
    let send_all = || -> Result<()> {
        for (peer, payload) in sends {
            tx.send(*peer, op, payload)
                .inspect_err(|e| _ = abort.abort(e.clone()))?;
        }
        Ok(())
    };
    let recv_all = || receive(rx).inspect_err(|e| _ = abort.abort(e.clone()));
    let (sent, received) = if inline || sends.is_empty() {
        (send_all(), recv_all())
    } else {
        std::thread::scope(|scope| {
            let sender = scope.spawn(send_all);
            let received = recv_all();
            (sender.join().expect("sender thread panicked"), received)
        })
    };
    match (sent, received) {
        (Ok(()), Ok(())) => Ok(()),
        (Err(e), _) | (_, Err(e)) => Err(abort.abort(e)),
    }
}

/// Peers in the pairwise-exchange order: at step `s`, send to `rank + s` and receive from
/// `rank - s` (mod world). Every step is a permutation of the ranks, so no link carries two
/// messages at once and each rank sends and receives exactly once per step.
pub(crate) fn send_order(rank: usize, world: usize) -> impl Iterator<Item = usize> {
    (1..world).map(move |s| (rank + s) % world)
}

/// See [`send_order`].
pub(crate) fn recv_order(rank: usize, world: usize) -> impl Iterator<Item = usize> {
    (1..world).map(move |s| (rank + world - s) % world)
}

/// Checks that a message `got` from `peer` is the one this rank expects next: the same
/// collective as `op`, carrying `len` bytes.
pub(crate) fn check_header(peer: usize, op: &OpDesc, got: Header, len: usize) -> Result<()> {
    let expect = Header::for_op(op).with_len(len);
    if got == expect {
        Ok(())
    } else {
        Err(CommError::Mismatch {
            peer,
            op: op.clone(),
            expected: format!("{expect}{}", op.label_of(op.tag)),
            got: format!("{got}{}", op.label_of(got.tag)),
            got_tag: got.tag,
        })
    }
}
