//! Ranks that wait for each other on different lanes.
//!
//! Headers catch ranks that issue different collectives on one lane: the first message that
//! differs fails both. Across lanes there is no such message. At ZeRO stage 3 a rank that reads
//! a weight alone waits in a gather on the gather lane while its peer waits in the step's
//! agreement on the main lane: each waits for a message the other will never send on that
//! lane, and only the collective timeout (10 minutes by default) would end it.
//!
//! So a wait that lasts past [`CommConfig::divergence_grace`](crate::CommConfig) asks every
//! rank where it stands ([`Peers::states`]): how many collectives it has issued on each lane,
//! and which of them it has been waiting for past its own grace. Ranks that all wait, each for
//! a collective that another of them has not issued, can never go on, since a rank whose
//! caller waits issues nothing (its collectives are issued by the thread that waits for
//! them): [`crossed_waits`] finds the largest such set. When two rounds of answers, a grace
//! apart, find the same set with no rank having moved, the waiting rank aborts the group with
//! [`CommError::Diverged`], which names what every rank of the set waits in and who has not
//! issued it, so every rank fails within a few seconds naming both sides.
//!
//! Nothing is sent while waits end within the grace: collectives cost what they did.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use crate::transport::Abort;
use crate::{CommError, DType, Lane, OpDesc, OpKind, ReduceOp, Result};

/// Lanes a rank can have, in [`Lane::index`] order.
const LANES: [Lane; 2] = [Lane::Main, Lane::Gather];

/// The most waits a rank reports, and the longest description of each: an answer must fit one
/// control frame.
const MAX_REPORTED_WAITS: usize = 4;
const MAX_DESCRIPTION: usize = 600;

/// What one rank has issued on each lane, and what it has waited for past its grace. Shared by
/// the rank's lanes; read by its peers' questions.
pub(crate) struct Progress {
    grace: Duration,
    issued: [AtomicU64; 2],
    waits: Mutex<Vec<Waiting>>,
    /// What the tags stand for (`HostCommunicator::label_tags`), to describe a gather.
    labels: RwLock<Option<Arc<[String]>>>,
}

impl Progress {
    pub(crate) fn new(grace: Duration) -> Arc<Self> {
        Arc::new(Progress {
            grace,
            issued: Default::default(),
            waits: Mutex::new(Vec::new()),
            labels: RwLock::new(None),
        })
    }

    /// One more collective on `lane`: its sequence number there.
    pub(crate) fn issue(&self, lane: Lane) -> u64 {
        self.issued[lane.index()].fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn issued(&self, lane: Lane) -> u64 {
        self.issued[lane.index()].load(Ordering::Relaxed)
    }

    pub(crate) fn set_labels(&self, labels: Arc<[String]>) {
        *self.labels.write().unwrap_or_else(|e| e.into_inner()) = Some(labels);
    }

    fn labels(&self) -> Option<Arc<[String]>> {
        self.labels
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn waits(&self) -> MutexGuard<'_, Vec<Waiting>> {
        // Plain data: a panic while it was held leaves nothing half-written.
        self.waits.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// This rank as its peers see it.
    pub(crate) fn state(&self) -> RankState {
        RankState {
            issued: LANES.map(|lane| self.issued(lane)),
            waits: self.waits().clone(),
        }
    }
}

/// A collective a rank's caller has waited for past its grace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Waiting {
    pub lane: Lane,
    pub seq: u64,
    /// As the waiting rank describes it: `all_gather #7 on the gather lane tag 5 (u8, 1.2 KiB)
    /// (`layers.2.weight`)`.
    pub what: String,
}

/// One rank's answer to "where are you?".
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RankState {
    /// Collectives issued on each lane ([`Lane::index`]).
    pub issued: [u64; 2],
    pub waits: Vec<Waiting>,
}

impl RankState {
    /// Little endian: issued per lane, the count of waits, then per wait its lane, sequence
    /// number and description (length first). At most a few hundred bytes.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for issued in self.issued {
            out.extend_from_slice(&issued.to_le_bytes());
        }
        let waits = &self.waits[..self.waits.len().min(MAX_REPORTED_WAITS)];
        out.push(waits.len() as u8);
        for wait in waits {
            out.push(wait.lane.index() as u8);
            out.extend_from_slice(&wait.seq.to_le_bytes());
            let mut end = wait.what.len().min(MAX_DESCRIPTION);
            while !wait.what.is_char_boundary(end) {
                end -= 1;
            }
            out.extend_from_slice(&(end as u16).to_le_bytes());
            out.extend_from_slice(&wait.what.as_bytes()[..end]);
        }
        out
    }

    /// `None` for bytes that are not an encoded state.
    pub(crate) fn decode(bytes: &[u8]) -> Option<RankState> {
        let mut bytes = Reader(bytes);
        let issued = [bytes.u64()?, bytes.u64()?];
        let count = bytes.take(1)?[0];
        let mut waits = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let lane = *LANES.get(bytes.take(1)?[0] as usize)?;
            let seq = bytes.u64()?;
            let len = u16::from_le_bytes(bytes.take(2)?.try_into().expect("2 bytes"));
            let what = String::from_utf8(bytes.take(len as usize)?.to_vec()).ok()?;
            waits.push(Waiting { lane, seq, what });
        }
        Some(RankState { issued, waits })
    }
}

/// Reads an encoded [`RankState`] front to back.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, tail) = self.0.split_at_checked(n)?;
        self.0 = tail;
        Some(head)
    }

    fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }
}

/// What a rank's lanes can ask of the group, behind the transport (in-process ranks read each
/// other's [`Progress`]; processes ask over the control connections).
/// Aborting is the transport's [`Abort`]: the group's first failure.
pub(crate) trait Peers: Abort + Send + Sync {
    /// This rank's progress.
    fn own(&self) -> &Arc<Progress>;
    /// Every rank's state, index = rank (this one's included); `None` for a peer that did not
    /// answer within `patience`.
    fn states(&self, patience: Duration) -> Vec<Option<RankState>>;
}

/// Ranks that wait for each other on different lanes: each waits in `waits[i]` (an index into
/// its state's waits), which `blockers[i]` (ranks of the set) have not issued.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Crossed {
    pub ranks: Vec<usize>,
    pub waits: Vec<usize>,
    pub blockers: Vec<Vec<usize>>,
}

/// The largest set of ranks that all wait, each for a collective that some other rank of the
/// set has not issued (so none of them can go on), or `None`. Starts from every rank that
/// waits and drops, until none is left to drop, the ranks whose every wait has been issued by
/// every other rank of the set: they may yet go on, or a rank outside the set (not waiting)
/// may yet issue what they wait for. Within one lane no such set exists (a rank waiting for
/// #s there has issued #s, and a peer that has not waits for an earlier one, issued by all),
/// so a set found spans lanes.
pub(crate) fn crossed_waits(states: &[RankState]) -> Option<Crossed> {
    let blockers = |rank: usize, wait: &Waiting, set: &[usize]| -> Vec<usize> {
        set.iter()
            .copied()
            .filter(|&other| other != rank && states[other].issued[wait.lane.index()] <= wait.seq)
            .collect()
    };
    let mut set: Vec<usize> = (0..states.len())
        .filter(|&rank| !states[rank].waits.is_empty())
        .collect();
    loop {
        let held: Vec<usize> = set
            .iter()
            .copied()
            .filter(|&rank| {
                states[rank]
                    .waits
                    .iter()
                    .any(|wait| !blockers(rank, wait, &set).is_empty())
            })
            .collect();
        if held.len() == set.len() {
            break;
        }
        set = held;
    }
    if set.is_empty() {
        return None;
    }
    let mut crossed = Crossed {
        ranks: set.clone(),
        waits: Vec::new(),
        blockers: Vec::new(),
    };
    for &rank in &set {
        let (index, by) = states[rank]
            .waits
            .iter()
            .enumerate()
            .map(|(i, wait)| (i, blockers(rank, wait, &set)))
            .find(|(_, by)| !by.is_empty())
            .expect("every rank of the set is held");
        crossed.waits.push(index);
        crossed.blockers.push(by);
    }
    Some(crossed)
}

/// The message of [`CommError::Diverged`] for `crossed`: what each rank waits in and who has
/// not issued it.
pub(crate) fn describe(crossed: &Crossed, states: &[RankState]) -> String {
    let parts: Vec<String> = crossed
        .ranks
        .iter()
        .zip(&crossed.waits)
        .zip(&crossed.blockers)
        .map(|((&rank, &wait), by)| {
            let wait = &states[rank].waits[wait];
            let lane = wait.lane.index();
            let not_issued: Vec<String> = by
                .iter()
                .map(|&q| format!("rank {q} (issued {} there)", states[q].issued[lane]))
                .collect();
            format!(
                "rank {rank} waits in {}, which {} has not issued",
                wait.what,
                not_issued.join(" and ")
            )
        })
        .collect();
    parts.join("; ")
}

/// Rounds of answers with the same ranks in the same places: no rank moved between them.
fn same_places(a: &[RankState], b: &[RankState]) -> bool {
    let places = |s: &RankState| {
        let waits: Vec<(Lane, u64)> = s.waits.iter().map(|w| (w.lane, w.seq)).collect();
        (s.issued, waits)
    };
    a.len() == b.len() && a.iter().zip(b).all(|(a, b)| places(a) == places(b))
}

/// A collective as its caller issued it: enough to describe it to peers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Issued {
    pub kind: OpKind,
    pub tag: u32,
    pub buf: Option<(DType, usize)>,
    pub reduce: Option<ReduceOp>,
}

impl Issued {
    pub(crate) fn new(kind: OpKind) -> Self {
        Issued {
            kind,
            tag: 0,
            buf: None,
            reduce: None,
        }
    }

    pub(crate) fn of(kind: OpKind, dtype: DType, bytes: usize) -> Self {
        Issued {
            buf: Some((dtype, bytes)),
            ..Issued::new(kind)
        }
    }

    pub(crate) fn tagged(self, tag: u32) -> Self {
        Issued { tag, ..self }
    }

    pub(crate) fn reducing(self, reduce: ReduceOp) -> Self {
        Issued {
            reduce: Some(reduce),
            ..self
        }
    }
}

/// What a [`Pending`](crate::Pending) of the host communicator needs to check, while it
/// waits, that the group has not diverged across lanes.
pub(crate) struct Watch {
    pub peers: Arc<dyn Peers>,
    pub lane: Lane,
    pub seq: u64,
    pub issued: Issued,
}

/// Takes a [`Waiting`] back out of its rank's [`Progress`] when the wait ends.
struct Registered<'a> {
    progress: &'a Progress,
    lane: Lane,
    seq: u64,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        self.progress
            .waits()
            .retain(|w| (w.lane, w.seq) != (self.lane, self.seq));
    }
}

impl Watch {
    fn description(&self, progress: &Progress) -> String {
        let (dtype, bytes) = self.issued.buf.unzip();
        let op = OpDesc {
            kind: self.issued.kind,
            seq: self.seq,
            lane: self.lane,
            tag: self.issued.tag,
            tag_labels: progress.labels(),
            dtype,
            reduce: self.issued.reduce,
            bytes: bytes.unwrap_or(0),
        };
        let lane = match self.lane {
            Lane::Main => " on the main lane",
            Lane::Gather => "",
        };
        format!("{op}{}{lane}", op.label_of(op.tag))
    }

    /// Waits for the result on `rx`; past the grace, checks the group as the module docs say,
    /// and aborts it when it has diverged across lanes. Bounded like every wait: the worker
    /// sending on `rx` fails at the collective timeout.
    pub(crate) fn wait<T>(self, rx: &Receiver<Result<T>>, rank: usize) -> Result<T> {
        let progress = self.peers.own().clone();
        let grace = progress.grace;
        let shut_down = || CommError::ShutDown { rank };
        let next = |rx: &Receiver<Result<T>>| match rx.recv_timeout(grace) {
            Ok(result) => Some(result),
            Err(RecvTimeoutError::Disconnected) => Some(Err(shut_down())),
            Err(RecvTimeoutError::Timeout) => None,
        };
        if let Some(result) = next(rx) {
            return result;
        }
        progress.waits().push(Waiting {
            lane: self.lane,
            seq: self.seq,
            what: self.description(&progress),
        });
        let _registered = Registered {
            progress: &progress,
            lane: self.lane,
            seq: self.seq,
        };
        let mut before: Option<Vec<RankState>> = None;
        loop {
            let states: Option<Vec<RankState>> = self.peers.states(grace).into_iter().collect();
            let found = states
                .as_ref()
                .and_then(|states| crossed_waits(states).map(|c| (c, states)));
            match (found, &before) {
                (Some((crossed, now)), Some(earlier))
                    if same_places(now, earlier)
                        && crossed_waits(earlier).as_ref() == Some(&crossed) =>
                {
                    let detail = describe(&crossed, now);
                    tracing::error!(rank, "{detail}");
                    self.peers.abort(CommError::Diverged { detail });
                    return rx.recv().unwrap_or_else(|_| Err(shut_down()));
                }
                (Some(_), _) => before = states,
                (None, _) => before = None,
            }
            if let Some(result) = next(rx) {
                return result;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waits(lane: Lane, seq: u64, what: &str) -> Vec<Waiting> {
        vec![Waiting {
            lane,
            seq,
            what: what.to_string(),
        }]
    }

    #[test]
    fn ranks_waiting_on_different_lanes_for_what_the_other_has_not_issued_are_crossed() {
        // Rank 0 reads a weight (gather #7) after its last main-lane collective #2; rank 1
        // waits in the step's agreement (main #3) after gather #6.
        let states = [
            RankState {
                issued: [3, 8],
                waits: waits(Lane::Gather, 7, "all_gather #7 on the gather lane"),
            },
            RankState {
                issued: [4, 7],
                waits: waits(Lane::Main, 3, "all_gather #3 on the main lane"),
            },
        ];
        let crossed = crossed_waits(&states).expect("crossed");
        assert_eq!(crossed.ranks, [0, 1]);
        assert_eq!(crossed.blockers, [vec![1], vec![0]]);
        let message = describe(&crossed, &states);
        assert_eq!(
            message,
            "rank 0 waits in all_gather #7 on the gather lane, which rank 1 (issued 7 there) \
             has not issued; rank 1 waits in all_gather #3 on the main lane, which rank 0 \
             (issued 3 there) has not issued"
        );
    }

    #[test]
    fn a_rank_that_is_not_waiting_or_has_issued_what_others_wait_for_crosses_nothing() {
        // Rank 1 computes (no wait): rank 0 may yet be served.
        let computing = [
            RankState {
                issued: [3, 8],
                waits: waits(Lane::Gather, 7, "g"),
            },
            RankState {
                issued: [4, 7],
                waits: Vec::new(),
            },
        ];
        assert_eq!(crossed_waits(&computing), None);
        // Both wait on one lane: the later waiter is served once the earlier one is.
        let one_lane = [
            RankState {
                issued: [3, 8],
                waits: waits(Lane::Gather, 7, "g"),
            },
            RankState {
                issued: [3, 6],
                waits: waits(Lane::Gather, 5, "g"),
            },
        ];
        assert_eq!(crossed_waits(&one_lane), None);
        // Three ranks: 0 and 1 crossed, 2 waits in what both have issued and is no part of it.
        let three = [
            RankState {
                issued: [3, 8],
                waits: waits(Lane::Gather, 7, "g"),
            },
            RankState {
                issued: [4, 7],
                waits: waits(Lane::Main, 3, "m"),
            },
            RankState {
                issued: [3, 7],
                waits: waits(Lane::Main, 2, "m"),
            },
        ];
        assert_eq!(crossed_waits(&three).unwrap().ranks, [0, 1]);
    }

    #[test]
    fn a_state_survives_its_encoding() {
        let state = RankState {
            issued: [3, u64::MAX],
            waits: vec![
                Waiting {
                    lane: Lane::Gather,
                    seq: 7,
                    what: "all_gather #7 (`layers.2.weight`)".into(),
                },
                Waiting {
                    lane: Lane::Main,
                    seq: 2,
                    what: "é".repeat(400),
                },
            ],
        };
        let decoded = RankState::decode(&state.encode()).unwrap();
        assert_eq!(decoded.issued, state.issued);
        assert_eq!(decoded.waits[0], state.waits[0]);
        // Cut at a character boundary within the bound.
        assert_eq!(decoded.waits[1].what, "é".repeat(300));
        assert!(RankState::decode(&state.encode()[..20]).is_none());
    }
}
