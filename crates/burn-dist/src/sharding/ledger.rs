//! What one rank's uses of its sharded parameters cost and which they were: the counters of
//! [`ShardStats`], the bytes of gathered parameters live right now, the digest of the step's
//! sequence of uses that every rank must agree on, and the first gather that failed.
//!
//! It only counts: it never gathers, and nothing in it is communicated (the step's agreement
//! compares what [`UseLedger::end_step`] returns).

use std::sync::{Mutex, MutexGuard};

use burn_dist_comm::CommError;

use super::frame::Use;
use super::schedule::Phase;

/// What sharding costs and holds on one rank (counted, not estimated).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShardStats {
    /// Bytes of the pieces this rank holds, in the parameters' dtype.
    pub shard_bytes: usize,
    /// Gathers made for ops since the start, and their bytes (whole parameters).
    pub gathers: u64,
    pub gathered_bytes: u64,
    /// Bytes of gathered parameters held right now by running ops.
    pub live_bytes: usize,
    /// The most `live_bytes` held at once since the current step began.
    pub peak_live_bytes: usize,
    /// The same for the last finished step (`ParamShards::end_step`).
    pub last_step_peak_bytes: usize,
    /// Parameters materialized outside any op (read to the host, met in a gradient hook):
    /// zero in a training loop.
    pub reads: u64,
    /// Uses (gathers and reads) since the current step began, hashed into the step's digest.
    pub uses: u64,
    /// Gathers issued ahead of their use by the schedule (each of one unit of adjacent
    /// parameters), since the start.
    pub prefetched: u64,
    /// Uses the schedule did not expect (each makes its round gather on demand and be recorded
    /// again), since the start.
    pub off_schedule: u64,
    /// Schedules agreed and adopted, since the start (one per phase at the first step).
    pub schedules: u64,
    /// Time ops waited for gathers to arrive, since the start, in nanoseconds.
    pub wait_nanos: u64,
    /// Host gathers written into a buffer an earlier gather of the same size left, instead of
    /// fresh memory, since the start (the pool holds at most the previous step's peak of
    /// gathered bytes).
    pub reused_buffers: u64,
    /// Bytes of such buffers pooled, free for the next gathers, right now.
    pub pooled_bytes: usize,
    /// Uses served by the tensor that an earlier use of the same round made of the same
    /// parameter and kept, with no gather (a tied embedding's first use in forward, kept for
    /// the LM head at its end, and the head's first use in backward), since the start.
    pub served_again: u64,
    /// Host gathers that read the peers' pieces straight out of their shared buffers (every
    /// rank on this host, linked through shared memory), since the start; the others went
    /// through the links.
    pub gathered_in_place: u64,
    /// Bytes gathered that no use took, since the start: parameters a unit carries between
    /// those its uses need (a bias between two weights backward needs), and gathers ahead that
    /// a use off the schedule dropped. Gathers moved these on top of `gathered_bytes`.
    pub unused_bytes: u64,
}

/// How a use was served, as the step's digest counts it.
#[derive(Clone, Copy)]
pub(super) enum Served {
    /// Gathered for an op.
    Op = 0,
    /// Gathered outside any op (a read).
    Read = 1,
    /// Served by the tensor an earlier use kept, with no gather.
    Kept = 2,
}

impl From<Use> for Served {
    fn from(counted: Use) -> Self {
        match counted {
            Use::Op => Served::Op,
            Use::Read => Served::Read,
        }
    }
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// One rank's counts of its uses (see the module docs).
pub(super) struct UseLedger {
    state: Mutex<Entries>,
}

struct Entries {
    stats: ShardStats,
    /// FNV-1a over this step's sequence of entries.
    digest: u64,
    /// The first failed gather (its parameter and the cause), returned by later calls that
    /// can return errors.
    failure: Option<(usize, CommError)>,
}

impl UseLedger {
    pub(super) fn new(shard_bytes: usize) -> Self {
        UseLedger {
            state: Mutex::new(Entries {
                stats: ShardStats {
                    shard_bytes,
                    ..ShardStats::default()
                },
                digest: FNV_OFFSET,
                failure: None,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Entries> {
        // Counters only: a panic while one was held leaves nothing half-written that matters.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The counters as they are now (the gathers' own counters are added by `ParamShards`).
    pub(super) fn stats(&self) -> ShardStats {
        self.lock().stats
    }

    /// One more entry of the step's sequence (a parameter index, or the end of a backward).
    pub(super) fn hash_entry(&self, entry: usize) {
        let mut state = self.lock();
        state.digest = (state.digest ^ entry as u64).wrapping_mul(FNV_PRIME);
    }

    /// One more use of the step's sequence: parameter `index`, with how it was served and its
    /// phase, so that ranks that used the same parameters in another phase, or one as a read
    /// where another's op gathered it, differ.
    fn hash_use(&self, index: usize, served: Served, phase: Phase) {
        self.hash_entry(index);
        self.hash_entry(2 * served as usize + phase.slot());
    }

    /// A use of parameter `index` (`bytes` whole) that gathered it, for an op (its bytes live
    /// from now on) or as a read.
    pub(super) fn count(&self, index: usize, bytes: usize, counted: Use, phase: Phase) {
        self.hash_use(index, counted.into(), phase);
        let mut state = self.lock();
        let stats = &mut state.stats;
        stats.uses += 1;
        match counted {
            Use::Op => {
                stats.gathers += 1;
                stats.gathered_bytes += bytes as u64;
                hold(stats, bytes);
            }
            Use::Read => stats.reads += 1,
        }
    }

    /// A use served by the tensor an earlier use kept: one more use of the step's sequence,
    /// and no gather (its bytes are live already).
    pub(super) fn count_again(&self, index: usize, phase: Phase) {
        self.hash_use(index, Served::Kept, phase);
        let mut state = self.lock();
        state.stats.uses += 1;
        state.stats.served_again += 1;
    }

    /// `bytes` of gathered parameters more are held (gathered ahead, or by an op).
    pub(super) fn hold(&self, bytes: usize) {
        hold(&mut self.lock().stats, bytes);
    }

    /// `bytes` of gathered parameters are no longer held: the op that held them returned, or
    /// what was gathered ahead was taken or dropped.
    pub(super) fn release(&self, bytes: usize) {
        let mut state = self.lock();
        state.stats.live_bytes = state.stats.live_bytes.saturating_sub(bytes);
    }

    /// `bytes` gathered that no use will take are released.
    pub(super) fn release_unused(&self, bytes: usize) {
        let mut state = self.lock();
        state.stats.live_bytes = state.stats.live_bytes.saturating_sub(bytes);
        state.stats.unused_bytes += bytes as u64;
    }

    pub(super) fn waited(&self, nanos: u64) {
        self.lock().stats.wait_nanos += nanos;
    }

    pub(super) fn prefetched(&self) {
        self.lock().stats.prefetched += 1;
    }

    pub(super) fn adopted_schedule(&self) {
        self.lock().stats.schedules += 1;
    }

    /// Records the first failed gather of this rank (later ones are its consequences).
    pub(super) fn fail(&self, index: usize, source: CommError) {
        self.lock().failure.get_or_insert((index, source));
    }

    pub(super) fn failure(&self) -> Option<(usize, CommError)> {
        self.lock().failure.clone()
    }

    /// Ends the step's count: the digest of its sequence and its number of uses; the next
    /// step starts again (its peak from what is live now, the ended one's peak kept as
    /// `last_step_peak_bytes`).
    pub(super) fn end_step(&self) -> (u64, u64) {
        let mut state = self.lock();
        let ended = (state.digest, state.stats.uses);
        state.digest = FNV_OFFSET;
        let stats = &mut state.stats;
        stats.uses = 0;
        stats.last_step_peak_bytes = stats.peak_live_bytes;
        stats.peak_live_bytes = stats.live_bytes;
        ended
    }
}

fn hold(stats: &mut ShardStats, bytes: usize) {
    stats.live_bytes += bytes;
    stats.peak_live_bytes = stats.peak_live_bytes.max(stats.live_bytes);
}
