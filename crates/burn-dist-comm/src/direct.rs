//! The collectives on [`SharedBuffer`]s, in place.
//!
//! Each starts with every rank telling every peer where its buffer lies in its arena. When
//! every rank's buffer is in its arena (and so every peer's can be read), the collective reads
//! the peers' buffers where they lie:
//! - reduce-scatter: each rank folds its chunk out of every rank's buffer, in rank order
//!   ([`fold_in_rank_order`], as the ring algorithms do, so the results are bitwise theirs),
//!   into its own buffer; then a barrier, so that nobody frees or rewrites a buffer a peer
//!   still reads;
//! - all-gather: each rank copies every peer's chunk out of the peer's buffer, then a barrier;
//! - all-reduce: the reduce-scatter, a barrier, then the all-gather.
//!
//! Rank `r` writes only its own buffer, and while peers read its chunk `q` it writes only its
//! chunk `r` (reduce-scatter) or the chunks it copies in (all-gather), never the bytes they
//! read. Otherwise (a rank's buffer on the heap, or a peer on another host) every rank runs
//! the ring algorithms of [`crate::algorithms`] on its buffer, with the same results.

use std::ops::Range;
use std::sync::Arc;

use crate::algorithms::{
    Scratch, all_gather_counts_in_place, barrier_small, count_bytes, reduce_scatter_in_place,
};
use crate::reduce::fold_in_rank_order;
use crate::transport::{Arenas, Transport, exchange, exchange_small, recv_order, send_order};
use crate::{CommError, OpDesc, ReduceOp, Result, SharedBuffer};

/// How a collective reached the peers' data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Path {
    /// Read out of the peers' buffers in shared memory.
    Direct,
    /// Through the links (rings, sockets or channels).
    Links,
}

/// The offset a rank announces when its buffer cannot be read in place.
const NOT_SHARED: u64 = u64::MAX;

/// Leaves this rank's chunk of `buf` (the `counts[rank]` elements after those of the ranks
/// before it) reduced over all ranks; the other chunks keep this rank's input.
pub(crate) fn reduce_scatter(
    t: &mut dyn Transport,
    op: &OpDesc,
    buf: &mut SharedBuffer,
    reduce: ReduceOp,
    counts: &[usize],
    scratch: &mut Scratch,
) -> Result<Path> {
    let direct = scatter(t, op, buf, reduce, counts, scratch)?;
    Ok(if direct.is_some() {
        Path::Direct
    } else {
        Path::Links
    })
}

/// Fills every rank's chunk of `buf` with its owner's; this rank's chunk must hold its own.
pub(crate) fn all_gather(
    t: &mut dyn Transport,
    op: &OpDesc,
    buf: &mut SharedBuffer,
    counts: &[usize],
) -> Result<Path> {
    let located = Direct::locate(t, op, buf, counts)?;
    gather(t, op, buf, counts, located)
}

/// Reduces all of `buf` over all ranks, in place: the reduce-scatter, then the all-gather of
/// the reduced chunks on the same path.
pub(crate) fn all_reduce(
    t: &mut dyn Transport,
    op: &OpDesc,
    buf: &mut SharedBuffer,
    reduce: ReduceOp,
    counts: &[usize],
    scratch: &mut Scratch,
) -> Result<Path> {
    let located = scatter(t, op, buf, reduce, counts, scratch)?;
    gather(t, op, buf, counts, located)
}

/// The reduce-scatter: in place when every buffer is shared (then returns their locations,
/// after a barrier), else through the links.
fn scatter<'op>(
    t: &mut dyn Transport,
    op: &'op OpDesc,
    buf: &mut SharedBuffer,
    reduce: ReduceOp,
    counts: &[usize],
    scratch: &mut Scratch,
) -> Result<Option<Direct<'op>>> {
    let dtype = buf.dtype();
    let located = Direct::locate(t, op, buf, counts)?;
    match &located {
        Some(direct) => {
            direct.fold_own(buf, reduce)?;
            barrier_small(t, op)?;
        }
        None => {
            let data = buf.as_bytes_mut();
            reduce_scatter_in_place(t, op, data, dtype, reduce, counts, scratch)?;
        }
    }
    Ok(located)
}

/// The all-gather, once the buffers are located: in place (then a barrier) or through the
/// links.
fn gather(
    t: &mut dyn Transport,
    op: &OpDesc,
    buf: &mut SharedBuffer,
    counts: &[usize],
    located: Option<Direct>,
) -> Result<Path> {
    match located {
        Some(direct) => {
            direct.copy_peers(buf)?;
            barrier_small(t, op)?;
            Ok(Path::Direct)
        }
        None => {
            let elem = buf.dtype().size();
            all_gather_counts_in_place(t, op, buf.as_bytes_mut(), counts, elem)?;
            Ok(Path::Links)
        }
    }
}

/// Every rank's buffer, readable in place.
struct Direct<'op> {
    op: &'op OpDesc,
    rank: usize,
    arenas: Arc<Arenas>,
    /// Where each rank's buffer starts in its arena.
    offsets: Vec<usize>,
    /// Each rank's chunk, in bytes.
    chunks: Vec<Range<usize>>,
}

impl<'op> Direct<'op> {
    /// Tells every peer where this rank's buffer lies and learns where theirs do. `None` unless
    /// every rank's buffer is in its arena; every rank gets the same answers, so every rank
    /// takes the same path. Also the collective's start: a rank announces its buffer only once
    /// the collective holds it.
    fn locate(
        t: &mut dyn Transport,
        op: &'op OpDesc,
        buf: &SharedBuffer,
        counts: &[usize],
    ) -> Result<Option<Direct<'op>>> {
        let (rank, world) = (t.rank(), t.world());
        let arenas = t.arenas();
        let mine = Location {
            offset: arenas
                .as_deref()
                .and_then(|arenas| arenas.offset_of(buf))
                .map_or(NOT_SHARED, |offset| offset as u64),
            bytes: buf.as_bytes().len() as u64,
            counts: digest(counts),
        };
        let sent = mine.encode();
        let sends: Vec<(usize, &[u8])> = send_order(rank, world).map(|q| (q, &sent[..])).collect();
        let mut theirs = vec![[0u8; Location::BYTES]; world];
        let mut slots: Vec<Option<&mut [u8]>> =
            theirs.iter_mut().map(|s| Some(&mut s[..])).collect();
        let mut recvs: Vec<(usize, &mut [u8])> = recv_order(rank, world)
            .map(|q| (q, slots[q].take().expect("one slot per peer")))
            .collect();
        // Only process links have arenas, and only they may send small messages first.
        match arenas {
            Some(_) => exchange_small(t, op, &sends, &mut recvs),
            None => exchange(t, op, &sends, &mut recvs),
        }?;
        let mut offsets = Vec::with_capacity(world);
        for (q, bytes) in theirs.iter().enumerate() {
            let theirs = if q == rank {
                mine
            } else {
                Location::decode(bytes)
            };
            if (theirs.bytes, theirs.counts) != (mine.bytes, mine.counts) {
                return Err(CommError::Mismatch {
                    peer: q,
                    op: op.clone(),
                    expected: mine.shape(),
                    got: theirs.shape(),
                    got_tag: op.tag,
                });
            }
            offsets.push(theirs.offset);
        }
        let (Some(arenas), false) = (arenas, world == 1 || offsets.contains(&NOT_SHARED)) else {
            return Ok(None);
        };
        Ok(Some(Direct {
            op,
            rank,
            arenas,
            offsets: offsets.into_iter().map(|o| o as usize).collect(),
            chunks: count_bytes(counts, buf.dtype().size()),
        }))
    }

    /// Bytes `range` of rank `q`'s buffer, in its arena.
    fn peer(&self, q: usize, range: Range<usize>) -> Result<&[u8]> {
        let at = self.offsets[q].checked_add(range.start);
        let arena = self.arenas.peers[q].as_ref();
        at.zip(arena)
            .and_then(|(at, arena)| arena.bytes(at, range.len()))
            .ok_or_else(|| {
                let reason = format!(
                    "rank {q}'s buffer at offset {} does not hold bytes {range:?} in its \
                     shared-memory arena",
                    self.offsets[q]
                );
                CommError::invalid(self.op.to_string(), reason)
            })
    }

    /// Folds this rank's chunk of every rank's buffer, in rank order, into its own.
    fn fold_own(&self, buf: &mut SharedBuffer, reduce: ReduceOp) -> Result<()> {
        let own = self.chunks[self.rank].clone();
        let others = (0..self.chunks.len())
            .map(|q| match q == self.rank {
                true => Ok(&[][..]),
                false => self.peer(q, own.clone()),
            })
            .collect::<Result<Vec<&[u8]>>>()?;
        let dtype = buf.dtype();
        fold_in_rank_order(
            dtype,
            reduce,
            self.rank,
            &mut buf.as_bytes_mut()[own],
            &others,
        );
        Ok(())
    }

    /// Copies every peer's chunk out of its buffer into the same place of this one.
    fn copy_peers(&self, buf: &mut SharedBuffer) -> Result<()> {
        let data = buf.as_bytes_mut();
        for (q, chunk) in self.chunks.iter().enumerate() {
            if q != self.rank {
                data[chunk.clone()].copy_from_slice(self.peer(q, chunk.clone())?);
            }
        }
        Ok(())
    }
}

/// What a rank tells its peers at the start of an in-place collective: where its buffer lies,
/// and its shape, which must be theirs (read in place, a buffer of another length or split
/// would be read wrong rather than fail).
#[derive(Clone, Copy)]
struct Location {
    offset: u64,
    bytes: u64,
    /// [`digest`] of the counts.
    counts: u64,
}

impl Location {
    const BYTES: usize = 24;

    fn encode(&self) -> [u8; Self::BYTES] {
        let mut out = [0; Self::BYTES];
        for (slot, value) in out
            .chunks_exact_mut(8)
            .zip([self.offset, self.bytes, self.counts])
        {
            slot.copy_from_slice(&value.to_le_bytes());
        }
        out
    }

    fn decode(bytes: &[u8; Self::BYTES]) -> Location {
        let word = |i: usize| u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap());
        Location {
            offset: word(0),
            bytes: word(1),
            counts: word(2),
        }
    }

    /// The shape, for a mismatch's message.
    fn shape(&self) -> String {
        format!(
            "a buffer of {} bytes (chunks digest {:016x})",
            self.bytes, self.counts
        )
    }
}

/// FNV-1a over the counts: ranks that split a buffer differently differ here.
fn digest(counts: &[usize]) -> u64 {
    counts
        .iter()
        .flat_map(|&c| (c as u64).to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
}
