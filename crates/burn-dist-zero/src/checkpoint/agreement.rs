//! The collectives of a save or a load that keep every rank's outcome the same.

use burn_dist_comm::{Communicator, HostBuffer, HostCommunicator};

use super::error::{CheckpointError, Result};

/// Every rank's `mine` (the same length on every rank), by rank.
pub(super) fn gather_u64s(comm: &HostCommunicator, mine: &[u64]) -> Result<Vec<Vec<u64>>> {
    let bytes: Vec<u8> = mine.iter().flat_map(|x| x.to_le_bytes()).collect();
    let len = bytes.len();
    let all = comm
        .all_gather(HostBuffer::U8(bytes), len * comm.world_size())
        .wait()?;
    Ok(all
        .as_bytes()
        .chunks_exact(len)
        .map(|rank| {
            rank.chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect()
        })
        .collect())
}

/// Every rank's outcome of a local part of a collective: `Ok` everywhere, or every rank fails
/// (a failing rank with its own error, the others naming the first failing rank and its
/// message). Always runs the same collectives on every rank, so a failure never hangs a peer.
pub(super) fn agree<T>(comm: &HostCommunicator, local: Result<T>) -> Result<T> {
    let world = comm.world_size();
    let message = match &local {
        Ok(_) => Vec::new(),
        Err(e) => e.to_string().into_bytes(),
    };
    let lengths: Vec<usize> = gather_u64s(comm, &[message.len() as u64])?
        .iter()
        .map(|rank| rank[0] as usize)
        .collect();
    let longest = lengths.iter().copied().max().unwrap_or(0);
    if longest == 0 {
        return local;
    }
    let mut padded = message;
    padded.resize(longest, 0);
    let all = comm
        .all_gather(HostBuffer::U8(padded), longest * world)
        .wait()?;
    // This rank's own error, or the first failing rank's.
    local?;
    let rank = lengths
        .iter()
        .position(|&l| l > 0)
        .expect("some rank failed");
    let bytes = &all.as_bytes()[rank * longest..rank * longest + lengths[rank]];
    Err(CheckpointError::Rank {
        rank,
        message: String::from_utf8_lossy(bytes).into_owned(),
    })
}
