//! The collectives, built from pairwise exchanges.
//!
//! Reduce-scatter sends each chunk straight to the rank that owns it and the owner folds the
//! contributions in rank order; all-gather sends each rank's chunk to every peer. Both move
//! (world−1)/world of the buffer in and out of every rank, like a ring, but unlike a ring the
//! summation order of an element never depends on which chunk it falls in.

use std::ops::Range;

use crate::reduce::{chunk_range, fold_in_rank_order};
use crate::transport::{
    Transport, exchange, exchange_small, exchange_with, recv_order, send_order,
};
use crate::{DType, HostBuffer, OpDesc, ReduceOp, Result};

/// Reusable receive space, kept between collectives so that large ones do not fault in fresh
/// pages every time. Backed by u64 so that every slot is aligned for any element type.
#[derive(Default)]
pub(crate) struct Scratch(Vec<u64>);

impl Scratch {
    fn bytes(&mut self, len: usize) -> &mut [u8] {
        let words = len.div_ceil(8);
        if self.0.len() < words {
            self.0.resize(words, 0);
        }
        &mut bytemuck::cast_slice_mut(&mut self.0)[..len]
    }
}

/// Byte range of rank `index`'s chunk in a buffer of `len` elements of `elem` bytes.
fn chunk_bytes(len: usize, world: usize, index: usize, elem: usize) -> Range<usize> {
    let r = chunk_range(len, world, index);
    r.start * elem..r.end * elem
}

/// The element counts of every rank's [`chunk_range`] of `len` elements.
pub(crate) fn even_counts(len: usize, world: usize) -> Vec<usize> {
    (0..world)
        .map(|q| chunk_range(len, world, q).len())
        .collect()
}

/// Byte ranges of consecutive chunks of `counts[q]` elements each.
pub(crate) fn count_bytes(counts: &[usize], elem: usize) -> Vec<Range<usize>> {
    let mut start = 0;
    counts
        .iter()
        .map(|&n| {
            let range = start..start + n * elem;
            start = range.end;
            range
        })
        .collect()
}

/// Splits `bytes` into consecutive disjoint pieces of the given sizes.
fn split_by_sizes(mut bytes: &mut [u8], sizes: impl Iterator<Item = usize>) -> Vec<&mut [u8]> {
    sizes
        .map(|size| {
            let (piece, rest) = std::mem::take(&mut bytes).split_at_mut(size);
            bytes = rest;
            piece
        })
        .collect()
}

/// Splits `bytes` into the disjoint chunks of every rank.
fn split_chunks(bytes: &mut [u8], world: usize, elem: usize) -> Vec<&mut [u8]> {
    let len = bytes.len() / elem;
    split_by_sizes(
        bytes,
        (0..world).map(|q| chunk_range(len, world, q).len() * elem),
    )
}

/// Bytes of a chunk that travel as one message of a reduce-scatter: a multiple of every element
/// size, small enough that the receive slots stay in cache while they are folded.
const PIECE_BYTES: usize = 256 << 10;

// A ring holds two pieces' messages (header, piece, padding): folding out of the rings cannot
// block (see `reduce_scatter_in_place`).
#[cfg(target_os = "linux")]
const _: () = assert!(
    crate::transport::shm::RING_BYTES
        >= 2 * (PIECE_BYTES + crate::wire::HEADER_LEN + crate::transport::shm::RING_ALIGN)
);

/// Byte range of piece `p` of a chunk of `len` bytes (empty past its end).
fn piece(len: usize, p: usize) -> Range<usize> {
    let start = (p * PIECE_BYTES).min(len);
    start..(start + PIECE_BYTES).min(len)
}

/// Leaves this rank's chunk of `data` (rank `q` owns the `counts[q]` elements after those of
/// the ranks before it) reduced over all ranks; the other chunks are unchanged.
///
/// Chunks travel in pieces, piece-major: at step (piece `p`, offset `s`) this rank sends piece
/// `p` of rank `rank + s`'s chunk while rank `rank - s` sends it piece `p` of its own. Received
/// one peer at a time into slots the size of one piece (TCP, channels), every send meets its
/// receive whatever the link buffers. Folded straight out of the shared-memory rings, a piece
/// waits for every peer's copy at once, which cannot block: a ring holds two pieces' messages,
/// so a peer past piece `p` has left its piece `p` in the ring and one not yet there has room
/// to write it (asserted beside `PIECE_BYTES`).
pub(crate) fn reduce_scatter_in_place(
    t: &mut dyn Transport,
    op: &OpDesc,
    data: &mut [u8],
    dtype: DType,
    reduce: ReduceOp,
    counts: &[usize],
    scratch: &mut Scratch,
) -> Result<()> {
    let (rank, world, elem) = (t.rank(), t.world(), dtype.size());
    let chunks = count_bytes(counts, elem);
    let mut parts = split_by_sizes(data, chunks.iter().map(Range::len));
    let own = std::mem::take(&mut parts[rank]);
    let pieces = chunks
        .iter()
        .map(|c| c.len().div_ceil(PIECE_BYTES))
        .max()
        .unwrap_or(0);
    let sends: Vec<(usize, &[u8])> = (0..pieces)
        .flat_map(|p| send_order(rank, world).map(move |q| (q, p)))
        .map(|(q, p)| (q, &parts[q][piece(parts[q].len(), p)]))
        .collect();
    let peers: Vec<usize> = recv_order(rank, world).collect();
    let staging = scratch.bytes(own.len().min(PIECE_BYTES) * peers.len());
    exchange_with(t, op, &sends, false, |rx| {
        for p in 0..pieces {
            let range = piece(own.len(), p);
            let len = range.len();
            let own = &mut own[range];
            let mut fold = |at: usize, parts: &[&[u8]]| {
                let n = parts.first().map_or(0, |part| part.len());
                let mut others: Vec<&[u8]> = vec![&[]; world];
                for (&q, part) in peers.iter().zip(parts) {
                    others[q] = part;
                }
                fold_in_rank_order(dtype, reduce, rank, &mut own[at..at + n], &others);
            };
            rx.recv_side_by_side(&peers, op, len, elem, staging, &mut fold)?;
        }
        Ok(())
    })
}

/// Fills every chunk of `data` with its owner's chunk; this rank's chunk is sent as it is.
pub(crate) fn all_gather_in_place(
    t: &mut dyn Transport,
    op: &OpDesc,
    data: &mut [u8],
    elem: usize,
) -> Result<()> {
    let world = t.world();
    let chunks = split_chunks(data, world, elem);
    gather_chunks(t, op, chunks)
}

/// Fills every rank's chunk (one per rank, in rank order) with its owner's; this rank's is sent
/// as it is.
fn gather_chunks(t: &mut dyn Transport, op: &OpDesc, mut chunks: Vec<&mut [u8]>) -> Result<()> {
    let (rank, world) = (t.rank(), t.world());
    let own: &[u8] = &*std::mem::take(&mut chunks[rank]);
    let sends: Vec<(usize, &[u8])> = send_order(rank, world).map(|q| (q, own)).collect();
    let mut recvs: Vec<(usize, &mut [u8])> = recv_order(rank, world)
        .map(|q| (q, std::mem::take(&mut chunks[q])))
        .collect();
    exchange(t, op, &sends, &mut recvs)
}

pub(crate) fn all_reduce(
    t: &mut dyn Transport,
    op: &OpDesc,
    buf: &mut HostBuffer,
    reduce: ReduceOp,
    scratch: &mut Scratch,
) -> Result<()> {
    let dtype = buf.dtype();
    let counts = even_counts(buf.len(), t.world());
    reduce_scatter_in_place(t, op, buf.as_bytes_mut(), dtype, reduce, &counts, scratch)?;
    all_gather_in_place(t, op, buf.as_bytes_mut(), dtype.size())
}

/// Returns this rank's chunk (`counts[rank]` elements after those of the ranks before it) of
/// the reduction of `buf` over all ranks.
pub(crate) fn reduce_scatter(
    t: &mut dyn Transport,
    op: &OpDesc,
    mut buf: HostBuffer,
    reduce: ReduceOp,
    counts: &[usize],
    scratch: &mut Scratch,
) -> Result<HostBuffer> {
    let dtype = buf.dtype();
    reduce_scatter_in_place(t, op, buf.as_bytes_mut(), dtype, reduce, counts, scratch)?;
    let start: usize = counts[..t.rank()].iter().sum();
    Ok(buf.slice(start..start + counts[t.rank()]))
}

/// Concatenates every rank's chunk, in rank order, into a buffer of `total_len` elements.
pub(crate) fn all_gather(
    t: &mut dyn Transport,
    op: &OpDesc,
    shard: &HostBuffer,
    total_len: usize,
) -> Result<HostBuffer> {
    let dtype = shard.dtype();
    let mut full = HostBuffer::for_result(dtype, total_len);
    let own = chunk_bytes(total_len, t.world(), t.rank(), dtype.size());
    full.as_bytes_mut()[own].copy_from_slice(shard.as_bytes());
    all_gather_in_place(t, op, full.as_bytes_mut(), dtype.size())?;
    Ok(full)
}

/// Concatenates every rank's chunk of `counts[q]` elements, in rank order, into `full` (as
/// many elements as `counts` sums to, of the shard's dtype).
pub(crate) fn all_gather_counts(
    t: &mut dyn Transport,
    op: &OpDesc,
    shard: &HostBuffer,
    counts: &[usize],
    mut full: HostBuffer,
) -> Result<HostBuffer> {
    let dtype = shard.dtype();
    let own = count_bytes(counts, dtype.size())[t.rank()].clone();
    full.as_bytes_mut()[own].copy_from_slice(shard.as_bytes());
    all_gather_counts_in_place(t, op, full.as_bytes_mut(), counts, dtype.size())?;
    Ok(full)
}

/// Fills every rank's chunk of `data` (rank `q`'s holds the `counts[q]` elements of `elem`
/// bytes after those of the ranks before it) with its owner's; this rank's is sent as it is.
pub(crate) fn all_gather_counts_in_place(
    t: &mut dyn Transport,
    op: &OpDesc,
    data: &mut [u8],
    counts: &[usize],
    elem: usize,
) -> Result<()> {
    let ranges = count_bytes(counts, elem);
    gather_chunks(t, op, split_by_sizes(data, ranges.iter().map(Range::len)))
}

/// Root scatters the chunks, then everyone all-gathers: the root sends the buffer once instead
/// of once per peer.
pub(crate) fn broadcast(
    t: &mut dyn Transport,
    op: &OpDesc,
    buf: &mut HostBuffer,
    root: usize,
) -> Result<()> {
    let (rank, world, elem) = (t.rank(), t.world(), buf.dtype().size());
    let data = buf.as_bytes_mut();
    let len = data.len() / elem;
    if rank == root {
        let sends: Vec<(usize, &[u8])> = send_order(root, world)
            .map(|q| (q, &data[chunk_bytes(len, world, q, elem)]))
            .collect();
        exchange(t, op, &sends, &mut [])?;
    } else {
        let own = &mut data[chunk_bytes(len, world, rank, elem)];
        exchange(t, op, &[], &mut [(root, own)])?;
    }
    all_gather_in_place(t, op, data, elem)
}

/// Every rank sends an empty message to every other rank and waits for theirs.
pub(crate) fn barrier(t: &mut dyn Transport, op: &OpDesc) -> Result<()> {
    empty_messages(t, op, exchange)
}

/// [`barrier`] through [`exchange_small`]: for the in-place collectives' barriers, on process
/// links only (see there).
pub(crate) fn barrier_small(t: &mut dyn Transport, op: &OpDesc) -> Result<()> {
    empty_messages(t, op, exchange_small)
}

type Exchange =
    fn(&mut dyn Transport, &OpDesc, &[(usize, &[u8])], &mut [(usize, &mut [u8])]) -> Result<()>;

fn empty_messages(t: &mut dyn Transport, op: &OpDesc, exchange: Exchange) -> Result<()> {
    let (rank, world) = (t.rank(), t.world());
    let sends: Vec<(usize, &[u8])> = send_order(rank, world).map(|q| (q, &[][..])).collect();
    let mut recvs: Vec<(usize, &mut [u8])> =
        recv_order(rank, world).map(|q| (q, &mut [][..])).collect();
    exchange(t, op, &sends, &mut recvs)
}
