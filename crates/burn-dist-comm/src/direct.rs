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
//! - all-reduce: each rank folds its chunk as in the reduce-scatter and writes the result, tile
//!   by tile while it is in cache, into its own buffer and into the same place of every
//!   peer's; then a barrier. One pass over memory and one barrier fewer than a reduce-scatter
//!   followed by an all-gather.
//!
//! The one rule: no byte is written by one rank while another rank reads or writes it. In the
//! reduce-scatter and the all-reduce, chunk `c` of every buffer is touched by rank `c` alone;
//! in the all-gather, a rank writes only the chunks of its own buffer that are not its own,
//! and the peers read only its own. Peers write into a rank's buffer only in the all-reduce,
//! and it reads what they wrote only after the closing barrier. A rank borrows for writing
//! only the bytes of its buffer that it alone touches in the phase (`SharedBuffer::range_mut`),
//! never a slice over bytes a peer reads or writes meanwhile.
//!
//! Only the main lane maps the peers' arenas writable; on the gather lane they are read-only
//! (`transport::shm::arena::Access`), so an all-reduce there goes through the links, as does
//! every collective where a rank's buffer is on the heap or a peer on another host: every rank
//! then runs the ring algorithms of [`crate::algorithms`] on its buffer, with the same results.

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
    in_place_or_links(
        t,
        op,
        buf,
        counts,
        Spread::No,
        |direct, buf| direct.fold_own(buf, reduce, Spread::No),
        |t, buf| scatter_through_links(t, op, buf, reduce, counts, scratch),
    )
}

/// Fills every rank's chunk of `buf` with its owner's; this rank's chunk must hold its own.
pub(crate) fn all_gather(
    t: &mut dyn Transport,
    op: &OpDesc,
    buf: &mut SharedBuffer,
    counts: &[usize],
) -> Result<Path> {
    in_place_or_links(
        t,
        op,
        buf,
        counts,
        Spread::No,
        |direct, buf| direct.copy_peers(buf),
        |t, buf| gather_through_links(t, op, buf, counts),
    )
}

/// Reduces all of `buf` over all ranks, in place. Read in place, each rank folds its chunk and
/// writes the result into every buffer, its own and its peers', in one pass: no second phase
/// copies the peers' chunks, and one barrier ends it. Through the links, the reduce-scatter
/// then the all-gather.
pub(crate) fn all_reduce(
    t: &mut dyn Transport,
    op: &OpDesc,
    buf: &mut SharedBuffer,
    reduce: ReduceOp,
    counts: &[usize],
    scratch: &mut Scratch,
) -> Result<Path> {
    in_place_or_links(
        t,
        op,
        buf,
        counts,
        Spread::ToPeers,
        |direct, buf| direct.fold_own(buf, reduce, Spread::ToPeers),
        |t, buf| {
            scatter_through_links(t, op, buf, reduce, counts, scratch)?;
            gather_through_links(t, op, buf, counts)
        },
    )
}

/// Every in-place collective's protocol: locate the buffers; if all are shared (and, for a
/// collective that writes into the peers' buffers, `spread`, this lane may write them),
/// `in_place` then a barrier (nobody reads a buffer before its peers' writes are done, or
/// reuses one a peer still reads), else `links` on every rank.
fn in_place_or_links(
    t: &mut dyn Transport,
    op: &OpDesc,
    buf: &mut SharedBuffer,
    counts: &[usize],
    spread: Spread,
    in_place: impl FnOnce(&Direct, &mut SharedBuffer) -> Result<()>,
    links: impl FnOnce(&mut dyn Transport, &mut SharedBuffer) -> Result<()>,
) -> Result<Path> {
    match Direct::locate(t, op, buf, counts, spread)? {
        Some(direct) => {
            in_place(&direct, buf)?;
            barrier_small(t, op)?;
            Ok(Path::Direct)
        }
        None => {
            links(t, buf)?;
            Ok(Path::Links)
        }
    }
}

fn scatter_through_links(
    t: &mut dyn Transport,
    op: &OpDesc,
    buf: &mut SharedBuffer,
    reduce: ReduceOp,
    counts: &[usize],
    scratch: &mut Scratch,
) -> Result<()> {
    let dtype = buf.dtype();
    reduce_scatter_in_place(t, op, buf.as_bytes_mut(), dtype, reduce, counts, scratch)
}

fn gather_through_links(
    t: &mut dyn Transport,
    op: &OpDesc,
    buf: &mut SharedBuffer,
    counts: &[usize],
) -> Result<()> {
    let elem = buf.dtype().size();
    all_gather_counts_in_place(t, op, buf.as_bytes_mut(), counts, elem)
}

/// Whether a rank's folded chunk is also written into its peers' buffers.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Spread {
    No,
    ToPeers,
}

/// Bytes folded at a time when the result is spread: small enough that the folded tile is
/// still in the core's cache when it is copied to the peers (one more read of memory saved
/// per byte and peer), large enough that the per-tile work is noise.
const SPREAD_TILE: usize = 64 << 10;

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
    /// every rank's buffer is in its arena and, where the collective writes into the peers'
    /// buffers (`spread`), every rank's lane maps them writable (only the main lane does);
    /// every rank gets the same answers, so every rank takes the same path. Also the
    /// collective's start: a rank announces its buffer only once the collective holds it.
    fn locate(
        t: &mut dyn Transport,
        op: &'op OpDesc,
        buf: &SharedBuffer,
        counts: &[usize],
        spread: Spread,
    ) -> Result<Option<Direct<'op>>> {
        let (rank, world) = (t.rank(), t.world());
        let arenas = t.arenas();
        let mine = Location {
            offset: arenas
                .as_deref()
                .filter(|arenas| spread == Spread::No || arenas.writes_peers())
                .and_then(|arenas| arenas.offset_of(buf))
                .map_or(NOT_SHARED, |offset| offset as u64),
            bytes: buf.byte_len() as u64,
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
            .ok_or_else(|| self.outside(q, range))
    }

    /// The error for bytes `range` of rank `q`'s buffer that its arena does not hold.
    fn outside(&self, q: usize, range: Range<usize>) -> CommError {
        let reason = format!(
            "rank {q}'s buffer at offset {} does not hold bytes {range:?} in its shared-memory \
             arena",
            self.offsets[q]
        );
        CommError::invalid(self.op.to_string(), reason)
    }

    /// Bytes `range` of every peer's buffer (an empty slice for this rank's), to fold.
    fn peers_at(&self, range: Range<usize>) -> Result<Vec<&[u8]>> {
        (0..self.chunks.len())
            .map(|q| match q == self.rank {
                true => Ok(&[][..]),
                false => self.peer(q, range.clone()),
            })
            .collect()
    }

    /// Folds this rank's chunk of every rank's buffer, in rank order, into its own; with
    /// [`Spread::ToPeers`], also into the same place of every peer's buffer, tile by tile.
    ///
    /// Only this rank's chunk of its buffer is borrowed for writing: meanwhile peer `q` reads
    /// chunk `q` of it (reduce-scatter) or writes it (all-reduce). The peers' bytes read are
    /// their copies of this rank's chunk, which no one but this rank writes; in the all-reduce
    /// each tile's slices of them are dropped before this rank writes the result there.
    fn fold_own(&self, buf: &mut SharedBuffer, reduce: ReduceOp, spread: Spread) -> Result<()> {
        let own = self.chunks[self.rank].clone();
        let dtype = buf.dtype();
        let folded = buf.range_mut(own.clone());
        if spread == Spread::No {
            let others = self.peers_at(own)?;
            fold_in_rank_order(dtype, reduce, self.rank, folded, &others);
            return Ok(());
        }
        // Every element size divides the tile, so no tile splits an element.
        for start in (0..folded.len()).step_by(SPREAD_TILE) {
            let tile = start..(start + SPREAD_TILE).min(folded.len());
            let at = own.start + tile.start..own.start + tile.end;
            let out = &mut folded[tile];
            fold_in_rank_order(dtype, reduce, self.rank, out, &self.peers_at(at.clone())?);
            for q in (0..self.chunks.len()).filter(|&q| q != self.rank) {
                self.write_peer(q, at.start, out)?;
            }
        }
        Ok(())
    }

    /// Writes `data` into rank `q`'s buffer at byte `at`.
    fn write_peer(&self, q: usize, at: usize, data: &[u8]) -> Result<()> {
        let arena = self.arenas.peers[q].as_ref();
        let offset = self.offsets[q].checked_add(at);
        offset
            .zip(arena)
            .and_then(|(offset, arena)| arena.write(offset, data))
            .ok_or_else(|| self.outside(q, at..at + data.len()))
    }

    /// Copies every peer's chunk out of its buffer into the same place of this one. Each chunk
    /// of this buffer is borrowed for writing alone, never this rank's own, which the peers
    /// read meanwhile; the peers' chunks read are written by no one during an all-gather.
    fn copy_peers(&self, buf: &mut SharedBuffer) -> Result<()> {
        for (q, chunk) in self.chunks.iter().enumerate() {
            if q != self.rank {
                buf.range_mut(chunk.clone())
                    .copy_from_slice(self.peer(q, chunk.clone())?);
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
