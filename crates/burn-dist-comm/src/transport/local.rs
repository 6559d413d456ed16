//! In-process transport: N ranks as threads of one process, linked by channels. The test twin
//! of the TCP transport, with the same headers, checks and failure reporting.
//!
//! Each rank has one inbox per lane for everything sent to it there. Messages from a peer that
//! is not being read yet wait in a per-peer queue; an abort from any rank reaches every inbox
//! of every lane at once, whatever peer the receiver is waiting on.

use std::collections::VecDeque;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use super::{Abort, Link, Rx, Transport, Tx, check_header};
use crate::divergence::{Peers, Progress, RankState};
use crate::wire::Header;
use crate::{CommError, OpDesc, Result};

enum Envelope {
    Data {
        from: usize,
        header: Header,
        payload: Vec<u8>,
    },
    Abort {
        from: usize,
        reason: String,
    },
    Goodbye {
        from: usize,
    },
}

pub(crate) struct LocalTransport {
    tx: LocalTx,
    rx: LocalRx,
    /// Shared by the rank's lanes: a failure on one is a failure of all.
    abort: Arc<LocalAbort>,
}

struct LocalTx {
    rank: usize,
    inboxes: Vec<Sender<Envelope>>,
}

struct LocalRx {
    inbox: Receiver<Envelope>,
    pending: Vec<VecDeque<(Header, Vec<u8>)>>,
    departed: Vec<bool>,
    timeout: Duration,
}

struct LocalAbort {
    rank: usize,
    /// Every inbox of every rank, all lanes.
    inboxes: Vec<Sender<Envelope>>,
    failure: OnceLock<CommError>,
    /// Every rank's progress (index = rank), read directly when a wait asks where the ranks
    /// stand: they share this process.
    progress: Arc<[Arc<Progress>]>,
}

/// One lane's inbox of every rank: the senders, and the receivers (index = rank).
type LaneChannels = (Vec<Sender<Envelope>>, Vec<Receiver<Envelope>>);

/// The transports of a group of `world` ranks with `lanes` independent lanes each:
/// `group[rank][lane]`. A wait past `grace` checks for ranks waiting on different lanes.
pub(crate) fn local_group(
    world: usize,
    lanes: usize,
    timeout: Duration,
    grace: Duration,
) -> Vec<Vec<LocalTransport>> {
    let progress: Arc<[Arc<Progress>]> = (0..world).map(|_| Progress::new(grace)).collect();
    let mut lane_channels: Vec<LaneChannels> = (0..lanes)
        .map(|_| (0..world).map(|_| channel()).unzip())
        .collect();
    let every_inbox: Vec<Sender<Envelope>> = lane_channels
        .iter()
        .flat_map(|(senders, _)| senders.iter().cloned())
        .collect();
    // Handed out rank by rank, in order.
    let mut receivers: Vec<std::vec::IntoIter<Receiver<Envelope>>> = lane_channels
        .iter_mut()
        .map(|(_, receivers)| std::mem::take(receivers).into_iter())
        .collect();
    (0..world)
        .map(|rank| {
            let abort = Arc::new(LocalAbort {
                rank,
                inboxes: every_inbox.clone(),
                failure: OnceLock::new(),
                progress: progress.clone(),
            });
            lane_channels
                .iter()
                .zip(&mut receivers)
                .map(|((senders, _), lane_receivers)| LocalTransport {
                    tx: LocalTx {
                        rank,
                        inboxes: senders.clone(),
                    },
                    rx: LocalRx {
                        inbox: lane_receivers.next().expect("one inbox per rank"),
                        pending: (0..world).map(|_| VecDeque::new()).collect(),
                        departed: vec![false; world],
                        timeout,
                    },
                    abort: abort.clone(),
                })
                .collect()
        })
        .collect()
}

impl Tx for LocalTx {
    fn send(&self, peer: usize, op: &OpDesc, payload: &[u8]) -> Result<()> {
        let header = Header::for_op(op).with_len(payload.len());
        let envelope = Envelope::Data {
            from: self.rank,
            header,
            payload: payload.to_vec(),
        };
        self.inboxes[peer]
            .send(envelope)
            .map_err(|_| CommError::PeerClosed {
                peer,
                op: op.clone(),
            })
    }
}

impl Rx for LocalRx {
    fn recv(&mut self, peer: usize, op: &OpDesc, out: &mut [u8]) -> Result<()> {
        let deadline = Instant::now() + self.timeout;
        loop {
            if let Some((header, payload)) = self.pending[peer].pop_front() {
                check_header(peer, op, header, out.len())?;
                out.copy_from_slice(&payload);
                return Ok(());
            }
            if self.departed[peer] {
                return Err(CommError::PeerClosed {
                    peer,
                    op: op.clone(),
                });
            }
            let wait = deadline.saturating_duration_since(Instant::now());
            match self.inbox.recv_timeout(wait) {
                Ok(Envelope::Data {
                    from,
                    header,
                    payload,
                }) => self.pending[from].push_back((header, payload)),
                Ok(Envelope::Abort { from, reason }) => {
                    return Err(CommError::Aborted { by: from, reason });
                }
                Ok(Envelope::Goodbye { from }) => self.departed[from] = true,
                Err(RecvTimeoutError::Timeout) => {
                    return Err(CommError::Timeout {
                        peer,
                        op: op.clone(),
                        timeout: self.timeout,
                    });
                }
                // Unreachable while this rank holds a sender to its own inbox; kept total.
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(CommError::PeerClosed {
                        peer,
                        op: op.clone(),
                    });
                }
            }
        }
    }
}

impl Abort for LocalAbort {
    fn abort(&self, error: CommError) -> CommError {
        let mut first = false;
        let cause = self.failure.get_or_init(|| {
            first = true;
            error
        });
        // An abort received from a peer has reached every rank already; only a failure seen
        // here first is announced. Our own inbox gets it too, to wake our receiver.
        if first && !matches!(cause, CommError::Aborted { .. }) {
            for inbox in &self.inboxes {
                let reason = cause.to_string();
                _ = inbox.send(Envelope::Abort {
                    from: self.rank,
                    reason,
                });
            }
        }
        cause.clone()
    }

    fn failure(&self) -> Option<CommError> {
        self.failure.get().cloned()
    }
}

impl Peers for LocalAbort {
    fn own(&self) -> &Arc<Progress> {
        &self.progress[self.rank]
    }

    fn states(&self, _patience: Duration) -> Vec<Option<RankState>> {
        self.progress.iter().map(|p| Some(p.state())).collect()
    }
}

impl Transport for LocalTransport {
    fn rank(&self) -> usize {
        self.tx.rank
    }

    fn world(&self) -> usize {
        self.tx.inboxes.len()
    }

    fn links(&self) -> Vec<Option<Link>> {
        let rank = self.rank();
        (0..self.world())
            .map(|peer| (peer != rank).then_some(Link::InProcess))
            .collect()
    }

    fn parts(&mut self) -> (&dyn Tx, &mut dyn Rx, &dyn Abort) {
        (&self.tx, &mut self.rx, &*self.abort)
    }

    fn peers(&self) -> Arc<dyn Peers> {
        self.abort.clone()
    }

    fn close(&mut self) {
        for (peer, inbox) in self.tx.inboxes.iter().enumerate() {
            if peer != self.tx.rank {
                _ = inbox.send(Envelope::Goodbye { from: self.tx.rank });
            }
        }
    }
}
