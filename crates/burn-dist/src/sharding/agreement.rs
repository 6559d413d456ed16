//! How the ranks agree on the gather schedules at the optimizer step: which phases recorded a
//! new order ([`new_schedules`], compared by [`check_new_schedules`]), then rank 0's order of
//! each, shared and checked against every rank's own before any becomes a plan
//! ([`adopt_schedules`]).

use burn_dist_comm::{Communicator, HostBuffer, HostCommunicator};

use super::gathers::Gathers;
use super::schedule::{BACKWARD_END, Phase};
use super::shards::ShardedParamInfo;
use crate::error::{DistError, Result};

/// Which phases (bit [`Phase`] `Train` = 1, `Eval` = 2) have a new order to agree on.
pub(super) fn new_schedules(gathers: &Gathers) -> u8 {
    Phase::ALL
        .into_iter()
        .filter(|&phase| gathers.has_candidate(phase))
        .map(|phase| 1 << phase.slot())
        .sum()
}

/// Checks every rank's [`new_schedules`] (index = rank) against rank 0's: a rank that differs
/// is [`DistError::NewSchedules`] on every rank alike.
pub(super) fn check_new_schedules(every_rank: &[u8]) -> Result<()> {
    let rank0 = every_rank.first().copied().unwrap_or(0);
    for (rank, &bits) in every_rank.iter().enumerate() {
        let differ = bits ^ rank0;
        if let Some(phase) = Phase::ALL
            .into_iter()
            .find(|phase| differ & (1 << phase.slot()) != 0)
        {
            return Err(DistError::NewSchedules {
                rank,
                phase,
                here: bits & (1 << phase.slot()) != 0,
            });
        }
    }
    Ok(())
}

/// Rank 0's recorded order of each phase that has one is shared, every rank checks its own
/// against it (the ends of backward passes included), and once every rank has, they become the
/// phases' plans. A rank whose order differs fails with [`DistError::Schedule`] and aborts the
/// group, so that every other rank fails here too, naming it, instead of gathering ahead what
/// this rank will not.
pub(super) fn adopt_schedules(
    comm: &HostCommunicator,
    gathers: &Gathers,
    params: &[ShardedParamInfo],
) -> Result<()> {
    let mut agreed = Vec::new();
    for (phase, order) in Phase::ALL.into_iter().zip(gathers.take_candidates()) {
        let Some(order) = order else { continue };
        // The digests agreed, so every rank should hold the same sequence; rank 0's length
        // goes first all the same, so that a rank whose sequence differs still takes part in
        // the broadcast and names the difference instead of failing inside it.
        let length = (order.len() as u64).to_le_bytes().to_vec();
        let length = comm.broadcast(HostBuffer::U8(length), 0).wait()?;
        let length = u64::from_le_bytes(length.as_bytes().try_into().expect("8 bytes"));
        let mut bytes: Vec<u8> = order
            .iter()
            .flat_map(|&i| encode_entry(i).to_le_bytes())
            .collect();
        bytes.resize(4 * length as usize, 0);
        let shared = comm.broadcast(HostBuffer::U8(bytes), 0).wait()?;
        let rank0: Vec<usize> = shared
            .as_bytes()
            .chunks_exact(4)
            .map(|b| decode_entry(u32::from_le_bytes(b.try_into().expect("4 bytes"))))
            .collect();
        if let Some(position) =
            (0..order.len().max(rank0.len())).find(|&p| order.get(p) != rank0.get(p))
        {
            let name = |i: Option<&usize>| match i {
                None => "nothing".to_string(),
                Some(&BACKWARD_END) => "the end of a backward pass".to_string(),
                Some(&i) => format!("`{}`", params[i].name),
            };
            let error = DistError::Schedule {
                rank: comm.rank(),
                phase,
                position,
                here: name(order.get(position)),
                rank0: name(rank0.get(position)),
            };
            comm.abort(error.to_string());
            return Err(error);
        }
        agreed.push((phase, order));
    }
    if agreed.is_empty() {
        return Ok(());
    }
    // Every rank has checked its sequences: a rank that found a difference aborted the group,
    // and the others learn it here rather than at their next gather.
    comm.barrier().wait()?;
    for (phase, order) in agreed {
        gathers.adopt(phase, order);
    }
    Ok(())
}

/// A sequence entry on the wire: a parameter index, or `u32::MAX` for [`BACKWARD_END`].
fn encode_entry(entry: usize) -> u32 {
    if entry == BACKWARD_END {
        u32::MAX
    } else {
        u32::try_from(entry).expect("fewer than 2^32 - 1 parameters")
    }
}

fn decode_entry(wire: u32) -> usize {
    if wire == u32::MAX {
        BACKWARD_END
    } else {
        wire as usize
    }
}
