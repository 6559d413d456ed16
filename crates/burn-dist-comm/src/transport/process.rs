//! The transport between processes. Each pair of ranks shares these links:
//! - a data link per lane, read and written directly from and into the collective's buffers: a
//!   TCP connection, or for two ranks on one host a pair of shared-memory rings (`shm`). Each
//!   lane is a transport of its own, run by its own communicator worker;
//! - one TCP control connection for all lanes, watched by one thread per peer, that carries
//!   aborts and goodbyes, and a rank's questions "where are you?" after a long wait and their
//!   answers (`divergence`).
//!
//! The control connection is what makes failures loud and fast: when a peer dies, the kernel
//! closes its sockets, every rank's watchdog sees it at once (not only the ranks that happen
//! to be reading from the dead peer), records who died, and shuts this rank's data links so
//! that whatever send or receive is blocked returns and reports that root cause.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use super::link::{DataLink, Link};
use super::{Abort, Arenas, Rx, Transport, Tx, check_header, recv_into_scratch};
use crate::divergence::{Peers, Progress, RankState};
use crate::wire::{HEADER_LEN, Header};
use crate::{CommError, OpDesc, Result};

const CONTROL_ABORT: u8 = 1;
const CONTROL_GOODBYE: u8 = 2;
/// "Where are you?", with the question's number (`Peers::states`).
const CONTROL_QUESTION: u8 = 3;
/// The answer: the question's number, then the rank's `RankState`.
const CONTROL_ANSWER: u8 = 4;
/// Frames longer than this are cut (an abort's reason is a one-line message; an answer is
/// bounded below it).
const MAX_REASON: usize = 4096;

/// The links to one peer: one data link per lane, and the control connection.
pub(crate) struct PeerLink {
    pub data: Vec<DataLink>,
    pub control: TcpStream,
}

/// One lane of a rank's links to its peers. The lanes of a rank share the control connections
/// and the failure: an abort on one shuts every lane's data links.
pub(crate) struct ProcessTransport {
    rank: usize,
    world: usize,
    tx: ProcessTx,
    rx: ProcessRx,
    shared: Arc<Shared>,
    /// The control watchers, held by lane 0, which closes last and says goodbye for all.
    watchdogs: Vec<JoinHandle<()>>,
    lane: usize,
    /// Every rank's collective buffers, where all peers share this host's memory.
    arenas: Option<Arc<Arenas>>,
}

struct ProcessTx {
    data: Vec<Option<DataLink>>,
    shared: Arc<Shared>,
}

struct ProcessRx {
    data: Vec<Option<DataLink>>,
    shared: Arc<Shared>,
}

/// What the watchdogs and both sides share: the failure, and handles to wake blocked I/O.
struct Shared {
    rank: usize,
    timeout: Duration,
    failure: OnceLock<CommError>,
    /// Every lane's data links, to wake them all on a failure.
    data: Vec<DataLink>,
    control: Vec<Option<Mutex<TcpStream>>>,
    departed: Vec<AtomicBool>,
    closing: AtomicBool,
    /// Signalled when `failure` is set, for `io_error`'s grace wait.
    failed: (Mutex<()>, Condvar),
    /// What this rank has issued and waits for, which peers ask about.
    progress: Arc<Progress>,
    /// This rank's latest question to its peers and their answers, signalled as they come.
    answers: (Mutex<Answers>, Condvar),
    /// One question at a time.
    asking: Mutex<()>,
}

/// The answers to question number `question`, by peer.
struct Answers {
    question: u64,
    states: Vec<Option<RankState>>,
}

/// How long a rank that saw a peer's connection close waits for that peer's abort (or the
/// dead rank's name) to arrive on the control connection before blaming the peer itself. A
/// rank that aborts sends its reason on control first, then closes its data sockets; the two
/// race on the receiving side.
const ABORT_GRACE: Duration = Duration::from_millis(500);

impl ProcessTransport {
    /// Wraps established links, one transport per lane; `links[rank]` must be `None` and every
    /// other entry must have `lanes` data links; `arenas[lane]`: that lane's view of the
    /// arenas, if any.
    pub(crate) fn lanes(
        rank: usize,
        links: Vec<Option<PeerLink>>,
        lanes: usize,
        timeout: Duration,
        grace: Duration,
        arenas: Vec<Option<Arc<Arenas>>>,
    ) -> io::Result<Vec<Self>> {
        let world = links.len();
        for link in links.iter().flatten() {
            for data in &link.data {
                data.configure(timeout)?;
            }
            link.control.set_nodelay(true)?;
            link.control.set_read_timeout(None)?;
            link.control
                .set_write_timeout(Some(Duration::from_secs(5)))?;
        }
        let mut every_data = Vec::new();
        for link in links.iter().flatten() {
            for data in &link.data {
                every_data.push(data.try_clone()?);
            }
        }
        let shared = Arc::new(Shared {
            rank,
            timeout,
            failure: OnceLock::new(),
            data: every_data,
            control: clone_each(&links, |l| l.control.try_clone())?
                .into_iter()
                .map(|c| c.map(Mutex::new))
                .collect(),
            departed: (0..world).map(|_| AtomicBool::new(false)).collect(),
            closing: AtomicBool::new(false),
            failed: (Mutex::new(()), Condvar::new()),
            progress: Progress::new(grace),
            answers: (
                Mutex::new(Answers {
                    question: 0,
                    states: vec![None; world],
                }),
                Condvar::new(),
            ),
            asking: Mutex::new(()),
        });
        let mut transports = Vec::with_capacity(lanes);
        for lane in 0..lanes {
            let data = || clone_each(&links, |l| l.data[lane].try_clone());
            transports.push(ProcessTransport {
                rank,
                world,
                tx: ProcessTx {
                    data: data()?,
                    shared: shared.clone(),
                },
                rx: ProcessRx {
                    data: data()?,
                    shared: shared.clone(),
                },
                shared: shared.clone(),
                watchdogs: Vec::new(),
                lane,
                arenas: arenas.get(lane).cloned().flatten(),
            });
        }
        for (peer, link) in links.into_iter().enumerate() {
            if let Some(link) = link {
                let shared = shared.clone();
                let watchdog = std::thread::Builder::new()
                    .name(format!("burn-dist-watch-{rank}-{peer}"))
                    .spawn(move || watch(peer, link.control, &shared))?;
                transports[0].watchdogs.push(watchdog);
            }
        }
        Ok(transports)
    }
}

/// One more handle to some part of every peer's links.
fn clone_each<T>(
    links: &[Option<PeerLink>],
    clone: impl Fn(&PeerLink) -> io::Result<T>,
) -> io::Result<Vec<Option<T>>> {
    links
        .iter()
        .map(|l| l.as_ref().map(&clone).transpose())
        .collect()
}

/// Reads `peer`'s control connection until it closes, turning aborts and unexpected closes
/// into this rank's failure.
fn watch(peer: usize, mut control: TcpStream, shared: &Shared) {
    loop {
        let mut kind = [0u8; 1];
        let mut len = [0u8; 4];
        let frame = control
            .read_exact(&mut kind)
            .and_then(|()| control.read_exact(&mut len));
        if frame.is_err() {
            let expected = shared.closing.load(Ordering::SeqCst)
                || shared.departed[peer].load(Ordering::SeqCst);
            if !expected {
                shared.abort(CommError::PeerLost { peer });
            }
            return;
        }
        let len = (u32::from_le_bytes(len) as usize).min(MAX_REASON);
        let mut reason = vec![0u8; len];
        if control.read_exact(&mut reason).is_err() {
            reason.clear();
        }
        match kind[0] {
            CONTROL_QUESTION => shared.answer(peer, &reason),
            CONTROL_ANSWER => shared.take_answer(peer, &reason),
            CONTROL_ABORT => {
                let reason = String::from_utf8_lossy(&reason).into_owned();
                shared.abort(CommError::Aborted { by: peer, reason });
            }
            CONTROL_GOODBYE => shared.departed[peer].store(true, Ordering::SeqCst),
            other => {
                let reason = format!("unknown control frame kind {other} from rank {peer}");
                shared.abort(CommError::Aborted { by: peer, reason });
            }
        }
    }
}

/// A control frame: its kind, its length, then `payload` (cut to [`MAX_REASON`] bytes).
fn control_frame(kind: u8, payload: &[u8]) -> Vec<u8> {
    let payload = &payload[..payload.len().min(MAX_REASON)];
    let mut frame = vec![kind];
    frame.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    frame.extend_from_slice(payload);
    frame
}

impl Shared {
    fn send_control(&self, kind: u8, reason: &str) {
        let frame = control_frame(kind, reason.as_bytes());
        for control in self.control.iter().flatten() {
            if let Ok(mut stream) = control.lock() {
                _ = stream.write_all(&frame);
            }
        }
    }

    fn send_control_to(&self, peer: usize, frame: &[u8]) {
        if let Some(control) = &self.control[peer]
            && let Ok(mut stream) = control.lock()
        {
            _ = stream.write_all(frame);
        }
    }

    /// `peer` asked where this rank stands (`question`: its number): the answer goes back.
    fn answer(&self, peer: usize, question: &[u8]) {
        let mut payload = question.to_vec();
        payload.extend_from_slice(&self.progress.state().encode());
        self.send_control_to(peer, &control_frame(CONTROL_ANSWER, &payload));
    }

    /// `peer`'s answer to a question; kept if it answers the latest.
    fn take_answer(&self, peer: usize, answer: &[u8]) {
        let Some((number, state)) = answer.split_at_checked(8) else {
            return;
        };
        let number = u64::from_le_bytes(number.try_into().expect("8 bytes"));
        let (lock, signal) = &self.answers;
        let mut answers = lock.lock().unwrap_or_else(|e| e.into_inner());
        if answers.question == number {
            answers.states[peer] = RankState::decode(state);
            signal.notify_all();
        }
    }

    /// The error to report for an I/O failure with `peer`: the recorded root cause if the group
    /// has failed (our own shutdown of the sockets is what woke us), else what `err` means.
    fn io_error(&self, peer: usize, op: &OpDesc, err: io::Error) -> CommError {
        let closed = matches!(
            err.kind(),
            io::ErrorKind::UnexpectedEof
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::BrokenPipe
        );
        if closed {
            self.wait_for_failure(ABORT_GRACE);
        }
        if let Some(failure) = self.failure.get() {
            return failure.clone();
        }
        match err.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => CommError::Timeout {
                peer,
                op: op.clone(),
                timeout: self.timeout,
            },
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe => CommError::PeerClosed {
                peer,
                op: op.clone(),
            },
            _ => CommError::io(format!("rank {peer}, {op}"), err),
        }
    }
}

impl Shared {
    /// Waits up to `grace` for some thread (a watchdog) to record the group's failure.
    fn wait_for_failure(&self, grace: Duration) {
        let (lock, signal) = &self.failed;
        let guard = lock.lock().unwrap_or_else(|e| e.into_inner());
        let _unused = signal
            .wait_timeout_while(guard, grace, |_| self.failure.get().is_none())
            .unwrap_or_else(|e| e.into_inner());
    }
}

impl Abort for Shared {
    fn abort(&self, error: CommError) -> CommError {
        let mut first = false;
        let cause = self.failure.get_or_init(|| {
            first = true;
            error
        });
        if first {
            let (lock, signal) = &self.failed;
            drop(lock.lock().unwrap_or_else(|e| e.into_inner()));
            signal.notify_all();
            tracing::error!(rank = self.rank, "aborting the group: {cause}");
            if !matches!(cause, CommError::Aborted { .. }) {
                self.send_control(CONTROL_ABORT, &cause.to_string());
            }
            for link in &self.data {
                link.shutdown();
            }
        }
        cause.clone()
    }

    fn failure(&self) -> Option<CommError> {
        self.failure.get().cloned()
    }
}

impl Peers for Shared {
    fn own(&self) -> &Arc<Progress> {
        &self.progress
    }

    /// Asks every peer over its control connection and waits up to `patience` for all answers.
    fn states(&self, patience: Duration) -> Vec<Option<RankState>> {
        let _asking = self.asking.lock().unwrap_or_else(|e| e.into_inner());
        let (lock, signal) = &self.answers;
        let question = {
            let mut answers = lock.lock().unwrap_or_else(|e| e.into_inner());
            answers.question += 1;
            answers.states.iter_mut().for_each(|s| *s = None);
            answers.question
        };
        let frame = control_frame(CONTROL_QUESTION, &question.to_le_bytes());
        for peer in (0..self.control.len()).filter(|&p| p != self.rank) {
            self.send_control_to(peer, &frame);
        }
        let answers = lock.lock().unwrap_or_else(|e| e.into_inner());
        let everyone = |answers: &mut Answers| {
            (0..answers.states.len()).all(|p| p == self.rank || answers.states[p].is_some())
        };
        let (mut answers, _) = signal
            .wait_timeout_while(answers, patience, |answers| !everyone(answers))
            .unwrap_or_else(|e| e.into_inner());
        let mut states = std::mem::take(&mut answers.states);
        answers.states = vec![None; states.len()];
        states[self.rank] = Some(self.progress.state());
        states
    }
}

impl Tx for ProcessTx {
    fn send(&self, peer: usize, op: &OpDesc, payload: &[u8]) -> Result<()> {
        let link = self.data[peer].as_ref().expect("no link to self");
        let header = Header::for_op(op).with_len(payload.len()).encode();
        link.write_all(&header)
            .and_then(|()| link.write_all(payload))
            .and_then(|()| link.end_message(HEADER_LEN + payload.len()))
            .map_err(|e| self.shared.io_error(peer, op, e))
    }
}

impl ProcessRx {
    fn link(&self, peer: usize) -> &DataLink {
        self.data[peer].as_ref().expect("no link to self")
    }

    /// Reads `peer`'s next header and checks that it starts the message of `op` with `len`
    /// bytes that this rank expects.
    fn read_header(&self, peer: usize, op: &OpDesc, len: usize) -> Result<()> {
        let mut header = [0u8; HEADER_LEN];
        self.link(peer)
            .read_exact(&mut header)
            .map_err(|e| self.shared.io_error(peer, op, e))?;
        let got = Header::decode(&header).map_err(|got| CommError::Mismatch {
            peer,
            op: op.clone(),
            expected: Header::for_op(op).with_len(len).to_string(),
            got,
            got_tag: 0,
        })?;
        check_header(peer, op, got, len)
    }

    /// Reads what follows the payload of `peer`'s message of `len` bytes.
    fn skip_message_end(&self, peer: usize, op: &OpDesc, len: usize) -> Result<()> {
        self.link(peer)
            .skip_message_end(HEADER_LEN + len)
            .map_err(|e| self.shared.io_error(peer, op, e))
    }
}

/// The most bytes of each peer's message that one `visit` of a side-by-side receive from the
/// rings waits for: small enough that visiting starts while the writers still write.
#[cfg(target_os = "linux")]
const SIDE_BY_SIDE_RUN: usize = 64 << 10;

impl Rx for ProcessRx {
    fn recv(&mut self, peer: usize, op: &OpDesc, out: &mut [u8]) -> Result<()> {
        self.read_header(peer, op, out.len())?;
        self.link(peer)
            .read_exact(out)
            .map_err(|e| self.shared.io_error(peer, op, e))?;
        self.skip_message_end(peer, op, out.len())
    }

    /// From shared-memory rings, the bytes are visited where the peers wrote them: no copy.
    #[cfg(target_os = "linux")]
    fn recv_side_by_side(
        &mut self,
        peers: &[usize],
        op: &OpDesc,
        len: usize,
        align: usize,
        scratch: &mut [u8],
        visit: &mut dyn FnMut(usize, &[&[u8]]),
    ) -> Result<()> {
        if peers.is_empty() {
            return Ok(());
        }
        let in_rings = peers
            .iter()
            .all(|&peer| self.link(peer).inbound_ring().is_some());
        if !in_rings {
            return recv_into_scratch(self, peers, op, len, scratch, visit);
        }
        for &peer in peers {
            self.read_header(peer, op, len)?;
        }
        let mut at = 0;
        while at < len {
            // Each message starts aligned in its ring and every ring's end is aligned too, so
            // every peer has at least `want` bytes or a multiple of `align` in one run.
            let want = (len - at).min(SIDE_BY_SIDE_RUN);
            let mut held = Vec::with_capacity(peers.len());
            for &peer in peers {
                let ring = self.link(peer).inbound_ring().expect("checked above");
                held.push(
                    ring.peek(want)
                        .map_err(|e| self.shared.io_error(peer, op, e))?,
                );
            }
            let run = held.iter().map(|h| h.bytes().len()).min().unwrap_or(0);
            let n = run.min(len - at) / align * align;
            if n == 0 {
                // Only a peer that broke the rings' alignment gets here.
                let reason = format!(
                    "{op}: the rings from ranks {peers:?} hold less than one element of {align} \
                     bytes in a run"
                );
                return Err(CommError::io(
                    reason,
                    std::io::ErrorKind::InvalidData.into(),
                ));
            }
            let parts: Vec<&[u8]> = held.iter().map(|h| &h.bytes()[..n]).collect();
            visit(at, &parts);
            held.into_iter().for_each(|h| h.release(n));
            at += n;
        }
        for &peer in peers {
            self.skip_message_end(peer, op, len)?;
        }
        Ok(())
    }
}

impl Transport for ProcessTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn parts(&mut self) -> (&dyn Tx, &mut dyn Rx, &dyn Abort) {
        (&self.tx, &mut self.rx, &*self.shared)
    }

    fn arenas(&self) -> Option<Arc<Arenas>> {
        self.arenas.clone()
    }

    fn peers(&self) -> Arc<dyn Peers> {
        self.shared.clone()
    }

    fn links(&self) -> Vec<Option<Link>> {
        self.tx
            .data
            .iter()
            .map(|l| l.as_ref().map(DataLink::kind))
            .collect()
    }

    /// Lane 0 says goodbye for the rank; the other lanes, closed before it, leave the links to it.
    fn close(&mut self) {
        if self.lane != 0 {
            return;
        }
        self.shared.closing.store(true, Ordering::SeqCst);
        self.shared.send_control(CONTROL_GOODBYE, "");
        for control in self.shared.control.iter().flatten() {
            if let Ok(stream) = control.lock() {
                _ = stream.shutdown(Shutdown::Both);
            }
        }
        for watchdog in self.watchdogs.drain(..) {
            _ = watchdog.join();
        }
    }
}
