//! The door of every socket that listens for the job: the store's, and each rank's mesh
//! listener. Anyone who reaches the port can connect, so what a connection may cost before it
//! has shown the job token is bounded here, once for both:
//!
//! - at most `cap` connections wait to present their hello at once; a new one evicts the one
//!   that has waited longest (a real peer sends its hello as soon as it connects, so the oldest
//!   waiter is the likeliest intruder, and a flood cannot lock the job out);
//! - each hello must arrive whole before one deadline, however its bytes are spread out, so a
//!   peer that trickles one byte at a time is dropped like a silent one;
//! - a failing `accept` (out of file descriptors, say) is retried after a growing pause
//!   instead of in a busy loop.

use std::collections::VecDeque;
use std::io::{self, Read};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Connections allowed to wait for their hello beyond those the job opens at once: room for a
/// port scan or a health check, while a flood holds only a few dozen descriptors.
pub const SPARE_PENDING: usize = 32;

/// The connections of one listener that have not presented a valid hello yet.
pub(crate) struct Gate {
    /// Oldest first: (ticket id, a handle to shut the connection down on eviction).
    pending: Mutex<VecDeque<(u64, TcpStream)>>,
    cap: usize,
    timeout: Duration,
    next_id: AtomicU64,
}

impl Gate {
    /// A gate letting `cap` (at least 1) connections wait at once, each for at most `timeout`.
    pub(crate) fn new(cap: usize, timeout: Duration) -> Arc<Gate> {
        Arc::new(Gate {
            pending: Mutex::new(VecDeque::new()),
            cap: cap.max(1),
            timeout,
            next_id: AtomicU64::new(0),
        })
    }

    /// Lets `stream` wait for its hello, evicting the longest waiter if the gate is full. `None`
    /// if the connection cannot be tracked (no file descriptor left to clone it): drop it.
    pub(crate) fn admit(self: &Arc<Self>, stream: &TcpStream) -> Option<Ticket> {
        let handle = stream.try_clone().ok()?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut pending = self.lock();
        while pending.len() >= self.cap {
            if let Some((_, oldest)) = pending.pop_front() {
                // Wakes the thread blocked reading its hello; it then drops the connection.
                _ = oldest.shutdown(Shutdown::Both);
            }
        }
        pending.push_back((id, handle));
        Some(Ticket {
            gate: self.clone(),
            id,
            deadline: Instant::now() + self.timeout,
        })
    }

    /// Shuts every waiting connection down, so that the threads reading their hellos end.
    pub(crate) fn close_all(&self) {
        for (_, stream) in self.lock().drain(..) {
            _ = stream.shutdown(Shutdown::Both);
        }
    }

    /// How many connections wait for their hello now.
    #[cfg(test)]
    pub(crate) fn waiting(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<(u64, TcpStream)>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Removes ticket `id`; false if it was evicted before.
    fn remove(&self, id: u64) -> bool {
        let mut pending = self.lock();
        match pending.iter().position(|(i, _)| *i == id) {
            Some(at) => {
                pending.remove(at);
                true
            }
            None => false,
        }
    }
}

/// One admitted connection's place at the gate. Dropping it frees the place.
pub(crate) struct Ticket {
    gate: Arc<Gate>,
    id: u64,
    deadline: Instant,
}

impl Ticket {
    /// `stream` as a reader that fails with `TimedOut` once this connection's hello deadline
    /// has passed, however many reads it takes.
    pub(crate) fn reader<'a>(&self, stream: &'a TcpStream) -> BeforeDeadline<'a> {
        BeforeDeadline::new(stream, self.deadline)
    }

    /// Leaves the gate once the hello has been judged. False if the connection was evicted
    /// meanwhile (and so shut down): it must not be used.
    pub(crate) fn release(self) -> bool {
        let kept = self.gate.remove(self.id);
        std::mem::forget(self);
        kept
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.gate.remove(self.id);
    }
}

/// Reads from a stream until one deadline for all reads together (see [`Ticket::reader`]).
pub(crate) struct BeforeDeadline<'a> {
    stream: &'a TcpStream,
    deadline: Instant,
}

impl<'a> BeforeDeadline<'a> {
    /// Reads `stream` until `deadline`.
    pub(crate) fn new(stream: &'a TcpStream, deadline: Instant) -> Self {
        BeforeDeadline { stream, deadline }
    }
}

impl Read for BeforeDeadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the hello did not arrive in time",
            ));
        }
        self.stream.set_read_timeout(Some(left))?;
        (&mut &*self.stream).read(buf)
    }
}

/// Pauses between failed `accept` calls: 10 ms, doubling up to 1 s, back to 10 ms after a
/// success. A listener whose process is out of file descriptors stays readable, so retrying
/// at once would spin a core without helping anyone.
pub(crate) struct AcceptBackoff {
    next: Duration,
}

impl Default for AcceptBackoff {
    fn default() -> Self {
        AcceptBackoff { next: Self::FIRST }
    }
}

impl AcceptBackoff {
    const FIRST: Duration = Duration::from_millis(10);
    const MOST: Duration = Duration::from_secs(1);

    pub(crate) fn succeeded(&mut self) {
        self.next = Self::FIRST;
    }

    /// Logs `err` and waits before the next `accept`.
    pub(crate) fn failed(&mut self, what: &str, err: &io::Error) {
        tracing::warn!("{what}: accept failed ({err}); retrying in {:?}", self.next);
        std::thread::sleep(self.next);
        self.next = (self.next * 2).min(Self::MOST);
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    /// A connected pair on loopback: (client end, server end).
    fn pair(listener: &TcpListener) -> (TcpStream, TcpStream) {
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        (client, listener.accept().unwrap().0)
    }

    #[test]
    fn a_full_gate_evicts_the_longest_waiter() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let gate = Gate::new(2, Duration::from_secs(60));
        let (mut oldest, served_oldest) = pair(&listener);
        let (_c2, s2) = pair(&listener);
        let (_c3, s3) = pair(&listener);
        let first = gate.admit(&served_oldest).unwrap();
        let _second = gate.admit(&s2).unwrap();
        let _third = gate.admit(&s3).unwrap();
        assert_eq!(gate.waiting(), 2);
        // The evicted connection is shut down: its client reads end of file.
        oldest
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        assert_eq!(oldest.read(&mut [0u8; 1]).unwrap(), 0);
        assert!(
            !first.release(),
            "an evicted ticket must not be released as kept"
        );
    }

    #[test]
    fn one_deadline_bounds_all_reads_together() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let (mut client, server) = pair(&listener);
        let started = Instant::now();
        let mut reader = BeforeDeadline::new(&server, started + Duration::from_millis(200));
        let mut got = 0;
        // The client trickles a byte before each read, so no single read waits long; the
        // deadline still ends the hello.
        let err = loop {
            std::io::Write::write_all(&mut client, b"x").unwrap();
            match reader.read(&mut [0u8; 1]) {
                Ok(n) => got += n,
                Err(e) => break e,
            }
            if started.elapsed() > Duration::from_secs(10) {
                panic!("still reading after 10 s");
            }
        };
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        assert!(got > 0);
        assert!(started.elapsed() >= Duration::from_millis(200));
    }
}
