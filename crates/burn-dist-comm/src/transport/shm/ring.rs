//! A one-way byte stream between two processes of one host: a ring buffer in a file under
//! `/dev/shm`, mapped by both. It stands in for a TCP data connection (`write_all` and
//! `read_exact` with the same error kinds), but each byte is copied once into the ring and once
//! out of it (or not at all, when the reader uses it where it lies: `peek`), with no kernel
//! copy in between and, for a ring the size of a cache, no trip to main memory.
//!
//! The writer owns `written`, the reader owns `read`; bytes in `read..written` are the reader's,
//! the rest of the ring is the writer's. A side that finds nothing to do spins briefly, then
//! sleeps on a futex in the shared page until the other side moves or the ring is closed.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64};
use std::time::{Duration, Instant};

use memmap2::MmapRaw;

const MAGIC: u64 = u64::from_le_bytes(*b"BDSHMRG1");
/// The control block's page; the data follows it.
const CONTROL_BYTES: usize = 4096;
/// A write or read moves at most this fraction of the ring before it tells the other side, so
/// that the reader copies one piece out while the writer copies the next one in.
const PIECES: usize = 4;
/// The smallest ring: each move must be able to carry at least one byte.
const MIN_CAPACITY: usize = PIECES;
/// A ring's capacity is a multiple of this, so that a stream whose messages start at multiples
/// of it (the transport pads them) never has an element split by the ring's end, and bytes
/// lent in place are aligned for every element type.
pub(crate) const ALIGN: usize = 8;
/// Checks of the other side's position before sleeping: enough to catch a peer that is about to
/// move without a system call, few enough not to steal a core from it.
const SPINS: u32 = 16;

/// One cache line, so that the two sides' counters never share one.
#[repr(C, align(64))]
struct Line<T>(T);

/// A futex word the other side bumps whenever it moves, and how many sleep on it.
struct Signal {
    seq: AtomicU32,
    sleepers: AtomicU32,
}

/// The first page of the file. A new file is all zeros, which is a valid state of every field.
#[repr(C)]
struct Control {
    magic: Line<AtomicU64>,
    capacity: Line<AtomicU64>,
    /// `writer << 32 | reader`: the ranks this ring links, checked by the side that opens it.
    ends: Line<AtomicU64>,
    closed: Line<AtomicU32>,
    written: Line<AtomicU64>,
    read: Line<AtomicU64>,
    /// Bumped by the writer: data arrived.
    data: Line<Signal>,
    /// Bumped by the reader: space freed.
    space: Line<Signal>,
}

const _: () = assert!(std::mem::size_of::<Control>() <= CONTROL_BYTES);

/// One mapped ring. Either side may hold it; only the writer calls `write_all` and only the
/// reader `read_exact` and `peek`.
pub(crate) struct Ring {
    map: MmapRaw,
    capacity: usize,
    /// Longest wait for the other side before an operation fails with `TimedOut`.
    timeout: Duration,
    /// This process's reader has bytes lent out (a live [`Held`]): a second lend could release
    /// bytes the first still shows to the writer.
    lent: AtomicBool,
}

impl Ring {
    /// Creates the ring file at `path` (it must not exist; only this user may open it) for bytes
    /// from rank `writer` to rank `reader`, with `capacity` data bytes. The file's memory is
    /// reserved here, so a full `/dev/shm` is an error now rather than a SIGBUS later.
    pub(crate) fn create(
        path: &Path,
        writer: usize,
        reader: usize,
        capacity: usize,
        timeout: Duration,
    ) -> io::Result<Ring> {
        if capacity < MIN_CAPACITY {
            let why = format!("a ring needs at least {MIN_CAPACITY} bytes, not {capacity}");
            return Err(io::Error::new(io::ErrorKind::InvalidInput, why));
        }
        if !capacity.is_multiple_of(ALIGN) {
            let why = format!("a ring's capacity must be a multiple of {ALIGN}, not {capacity}");
            return Err(io::Error::new(io::ErrorKind::InvalidInput, why));
        }
        let file = super::create_private(path)?;
        let reserve_and_map = || {
            let len = (CONTROL_BYTES + capacity) as libc::off_t;
            // SAFETY: a plain system call on a file descriptor this function owns.
            let reserved = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) };
            if reserved != 0 {
                return Err(io::Error::from_raw_os_error(reserved));
            }
            Ring::map(&file, capacity, timeout)
        };
        let ring = reserve_and_map().inspect_err(|_| _ = std::fs::remove_file(path))?;
        let control = ring.control();
        control.capacity.0.store(capacity as u64, SeqCst);
        control.ends.0.store(ends(writer, reader), SeqCst);
        control.magic.0.store(MAGIC, SeqCst);
        Ok(ring)
    }

    /// Opens the ring another rank created at `path`, checking that it is a ring from `writer`
    /// to `reader`, in a file of this user that only this user may open
    /// ([`super::open_private`]).
    pub(crate) fn open(
        path: &Path,
        writer: usize,
        reader: usize,
        timeout: Duration,
    ) -> io::Result<Ring> {
        let file = super::open_private(path, true).map_err(io::Error::other)?;
        let len = file.metadata()?.len() as usize;
        let invalid = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
        if len < CONTROL_BYTES + MIN_CAPACITY {
            return Err(invalid(format!("{len} bytes is too short for a ring")));
        }
        if !(len - CONTROL_BYTES).is_multiple_of(ALIGN) {
            let capacity = len - CONTROL_BYTES;
            return Err(invalid(format!(
                "its capacity {capacity} is not a multiple of {ALIGN}"
            )));
        }
        let ring = Ring::map(&file, len - CONTROL_BYTES, timeout)?;
        let control = ring.control();
        if control.magic.0.load(SeqCst) != MAGIC {
            return Err(invalid("not a burn-dist ring (bad magic)".into()));
        }
        if control.capacity.0.load(SeqCst) != ring.capacity as u64 {
            return Err(invalid("its capacity does not match its size".into()));
        }
        if control.ends.0.load(SeqCst) != ends(writer, reader) {
            return Err(invalid(format!(
                "it does not link rank {writer} to rank {reader}"
            )));
        }
        Ok(ring)
    }

    fn map(file: &File, capacity: usize, timeout: Duration) -> io::Result<Ring> {
        let map = MmapRaw::map_raw(file)?;
        Ok(Ring {
            map,
            capacity,
            timeout,
            lent: AtomicBool::new(false),
        })
    }

    fn control(&self) -> &Control {
        // SAFETY: the mapping is page-aligned, at least CONTROL_BYTES long and lives as long as
        // `self`; every field is an atomic, for which any bit pattern (the file starts zeroed)
        // is valid and which both processes access only atomically.
        unsafe { &*self.map.as_mut_ptr().cast::<Control>() }
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: the data follows the control page inside the mapping.
        unsafe { self.map.as_mut_ptr().add(CONTROL_BYTES) }
    }

    /// Writes all of `bytes`, waiting for space as needed. Fails with `BrokenPipe` once the ring
    /// is closed, `TimedOut` when the reader frees nothing for the whole timeout.
    pub(crate) fn write_all(&self, mut bytes: &[u8]) -> io::Result<()> {
        let control = self.control();
        while !bytes.is_empty() {
            let used =
                || (control.written.0.load(SeqCst)).wrapping_sub(control.read.0.load(SeqCst));
            self.wait(&control.space.0, || used() < self.capacity as u64)?;
            let at = control.written.0.load(SeqCst);
            // Saturating: positions a broken peer corrupted must not wrap into a huge count.
            let free = self.capacity.saturating_sub(used() as usize);
            let n = free.min(bytes.len()).min(self.capacity / PIECES);
            let start = (at % self.capacity as u64) as usize;
            let first = n.min(self.capacity - start);
            // SAFETY: `start..start + first` and `0..n - first` lie in the ring and in the free
            // part the reader does not touch until `written` moves past them below.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.data().add(start), first);
                std::ptr::copy_nonoverlapping(bytes[first..].as_ptr(), self.data(), n - first);
            }
            control.written.0.store(at + n as u64, SeqCst);
            wake(&control.data.0);
            bytes = &bytes[n..];
        }
        Ok(())
    }

    /// Fills `out`, waiting for data as needed; the same errors as [`Ring::write_all`].
    pub(crate) fn read_exact(&self, mut out: &mut [u8]) -> io::Result<()> {
        while !out.is_empty() {
            let held = self.peek(1)?;
            let n = held
                .bytes()
                .len()
                .min(out.len())
                .min(self.capacity / PIECES);
            out[..n].copy_from_slice(&held.bytes()[..n]);
            held.release(n);
            out = &mut std::mem::take(&mut out)[n..];
        }
        Ok(())
    }

    /// Waits until the ring holds at least `min` bytes in one run from the read position (or
    /// every byte up to the end of the ring, when that comes first) and shows the whole run
    /// where it lies, without copying it. Nothing is consumed until [`Held::release`]; the
    /// same errors as [`Ring::read_exact`].
    pub(crate) fn peek(&self, min: usize) -> io::Result<Held<'_>> {
        let control = self.control();
        let at = control.read.0.load(SeqCst);
        let start = (at % self.capacity as u64) as usize;
        let to_end = self.capacity - start;
        // Saturating and capped: positions a broken peer corrupted must not reach past the ring.
        let run = || {
            let held = control.written.0.load(SeqCst).wrapping_sub(at);
            (held.min(self.capacity as u64) as usize).min(to_end)
        };
        let want = min.clamp(1, to_end);
        assert!(
            !self.lent.swap(true, SeqCst),
            "a ring lends one run at a time: release the last one first"
        );
        let lent = Lent(&self.lent);
        self.wait(&control.data.0, || run() >= want)?;
        // SAFETY: `start..start + run()` lies in the ring and in the part the writer filled; the
        // writer does not touch it until `read` moves past it, which only `Held::release` does,
        // and no other `Held` of this ring is alive to move it (`lent`).
        let bytes = unsafe { std::slice::from_raw_parts(self.data().add(start), run()) };
        Ok(Held {
            ring: self,
            at,
            bytes,
            _lent: lent,
        })
    }

    /// Closes the ring for both sides: whatever waits on it, here or in the other process,
    /// returns `BrokenPipe`.
    pub(crate) fn close(&self) {
        let control = self.control();
        control.closed.0.store(1, SeqCst);
        wake(&control.data.0);
        wake(&control.space.0);
    }

    fn closed(&self) -> bool {
        self.control().closed.0.load(SeqCst) != 0
    }

    /// Waits until `ready()` or the ring closes or the other side stays still for the timeout.
    /// What is ready is done even on a closed ring, so that a reader gets everything written
    /// before the writer closed (as from a TCP connection before its end of stream).
    ///
    /// No wake-up is lost: a sleeper counts itself in `sleepers` before reading `seq` and
    /// checking `ready` once more; the other side moves, then bumps `seq`, then reads
    /// `sleepers` (all sequentially consistent). Either the other side sees the sleeper and
    /// wakes it, or the sleeper's last check sees the move, or the futex sees `seq` changed.
    fn wait(&self, signal: &Signal, ready: impl Fn() -> bool) -> io::Result<()> {
        // A timeout too large to add is no deadline at all.
        let deadline = Instant::now().checked_add(self.timeout);
        let mut spins = 0;
        loop {
            if ready() {
                return Ok(());
            }
            if self.closed() {
                // The other side moves before it closes: the close seen, a last look sees
                // its last move (a move between the first look and the close is not lost).
                return if ready() {
                    Ok(())
                } else {
                    Err(io::ErrorKind::BrokenPipe.into())
                };
            }
            if spins < SPINS {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            let left = deadline.map_or(Duration::MAX, |d| {
                d.saturating_duration_since(Instant::now())
            });
            if left.is_zero() {
                return Err(io::ErrorKind::TimedOut.into());
            }
            signal.sleepers.fetch_add(1, SeqCst);
            let seen = signal.seq.load(SeqCst);
            if !ready() && !self.closed() {
                futex_wait(&signal.seq, seen, left);
            }
            signal.sleepers.fetch_sub(1, SeqCst);
        }
    }
}

/// Bytes the writer put in the ring that the reader has not released, seen where they lie.
/// Dropped without [`Held::release`], it releases nothing: the next `peek` shows them again.
#[must_use = "bytes peeked at stay in the ring until they are released"]
pub(crate) struct Held<'a> {
    ring: &'a Ring,
    at: u64,
    bytes: &'a [u8],
    _lent: Lent<'a>,
}

/// Clears a ring's `lent` flag when its `Held` goes, released or not.
struct Lent<'a>(&'a AtomicBool);

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        self.0.store(false, SeqCst);
    }
}

impl Held<'_> {
    pub(crate) fn bytes(&self) -> &[u8] {
        self.bytes
    }

    /// Hands the first `n` bytes back to the writer: they are read.
    pub(crate) fn release(self, n: usize) {
        assert!(n <= self.bytes.len(), "released more than the ring held");
        let control = self.ring.control();
        control.read.0.store(self.at + n as u64, SeqCst);
        wake(&control.space.0);
    }
}

/// A side that lets go of its ring closes it, as a process closes its socket: the other side
/// fails at once instead of waiting out its timeout.
impl Drop for Ring {
    fn drop(&mut self) {
        self.close();
    }
}

fn ends(writer: usize, reader: usize) -> u64 {
    ((writer as u64) << 32) | reader as u64
}

/// Tells the other side that this one moved.
fn wake(signal: &Signal) {
    signal.seq.fetch_add(1, SeqCst);
    if signal.sleepers.load(SeqCst) > 0 {
        // SAFETY: FUTEX_WAKE on a valid, aligned u32 in a shared mapping; no memory is written.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                signal.seq.as_ptr(),
                libc::FUTEX_WAKE,
                i32::MAX,
            );
        }
    }
}

/// Sleeps until `word` is woken, no longer holds `seen`, or `timeout` passes. Not the private
/// futex: the other process waits and wakes on the same word.
fn futex_wait(word: &AtomicU32, seen: u32, timeout: Duration) {
    let timeout = libc::timespec {
        tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT reads the aligned u32 `word` and the timespec, both valid for the call.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            seen,
            &timeout as *const libc::timespec,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir();
        dir.join(format!("burn-dist-ring-{}-{name}", std::process::id()))
    }

    /// A writer and a reader, each with its own mapping of one file, as two processes have.
    fn pair(name: &str, capacity: usize, timeout: Duration) -> (Ring, Ring) {
        let path = path(name);
        let writer = Ring::create(&path, 3, 5, capacity, timeout).expect("create");
        let reader = Ring::open(&path, 3, 5, timeout).expect("open");
        std::fs::remove_file(&path).expect("unlink");
        (writer, reader)
    }

    #[test]
    fn carries_a_stream_through_a_small_ring_in_order() {
        // 1 MiB through 4 KiB: the positions wrap hundreds of times, and messages of odd sizes
        // straddle the end of the ring.
        let (writer, reader) = pair("stream", 4096, Duration::from_secs(30));
        let data: Vec<u8> = (0..1 << 20).map(|i: u32| (i * 7 + i / 251) as u8).collect();
        let sizes = [1usize, 4095, 4096, 4097, 3, 100_000];
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let mut rest = &data[..];
                for size in sizes.iter().cycle() {
                    let (now, later) = rest.split_at((*size).min(rest.len()));
                    writer.write_all(now).expect("write");
                    rest = later;
                    if rest.is_empty() {
                        break;
                    }
                }
            });
            let mut got = vec![0u8; data.len()];
            let mut rest = &mut got[..];
            for size in sizes.iter().rev().cycle() {
                let take = (*size).min(rest.len());
                let (now, later) = std::mem::take(&mut rest).split_at_mut(take);
                reader.read_exact(now).expect("read");
                rest = later;
                if rest.is_empty() {
                    break;
                }
            }
            assert!(got == data, "the stream arrived altered");
        });
    }

    #[test]
    fn peek_lends_the_run_up_to_the_rings_end_and_release_hands_it_back() {
        let (writer, reader) = pair("peek", 4096, Duration::from_secs(30));
        let data: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
        writer.write_all(&data[..3000]).expect("write");
        reader.read_exact(&mut [0u8; 3000]).expect("read");
        writer
            .write_all(&data[3000..])
            .expect("write across the end");
        // 2000 bytes are held, 1096 of them before the ring's end: a wish for more stops there.
        let held = reader.peek(2000).expect("peek");
        assert_eq!(held.bytes(), &data[3000..4096]);
        held.release(96);
        let held = reader.peek(1).expect("peek after a partial release");
        assert_eq!(
            held.bytes(),
            &data[3096..4096],
            "a release moves by what it says"
        );
        held.release(1000);
        let held = reader.peek(904).expect("peek past the end");
        assert_eq!(held.bytes(), &data[4096..]);
        held.release(904);
        // All of it read: the writer has the whole ring again.
        writer
            .write_all(&[7u8; 4096])
            .expect("a full ring's worth fits");
    }

    #[test]
    #[should_panic(expected = "one run at a time")]
    fn a_second_peek_while_the_first_is_held_is_refused() {
        let (writer, reader) = pair("peek-twice", 4096, Duration::from_secs(30));
        writer.write_all(&[1u8; 100]).expect("write");
        let _first = reader.peek(1).expect("peek");
        let _second = reader.peek(1);
    }

    #[test]
    fn a_reader_with_nothing_to_read_times_out() {
        let (_writer, reader) = pair("timeout", 4096, Duration::from_millis(50));
        let err = reader.read_exact(&mut [0u8; 1]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    }

    #[test]
    fn closing_from_either_side_fails_both_after_what_was_written() {
        let (writer, reader) = pair("close", 4096, Duration::from_secs(30));
        writer.write_all(b"last words").expect("write");
        std::thread::scope(|scope| {
            // Blocked or not yet blocked when the close lands: either way it must return, and
            // only after the bytes written before the close.
            let blocked = scope.spawn(|| {
                let mut last = [0u8; 10];
                reader
                    .read_exact(&mut last)
                    .expect("bytes written before the close");
                assert_eq!(&last, b"last words");
                reader.read_exact(&mut [0u8; 8])
            });
            drop(writer);
            assert_eq!(
                blocked.join().unwrap().unwrap_err().kind(),
                io::ErrorKind::BrokenPipe
            );
        });
        let (writer, reader) = pair("close-reader", 4096, Duration::from_secs(30));
        drop(reader);
        let more_than_fits = [0u8; 8192];
        let err = writer.write_all(&more_than_fits).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::BrokenPipe);
    }

    #[test]
    fn opening_checks_what_the_file_is() {
        let path = path("check");
        let timeout = Duration::from_secs(1);
        let _ring = Ring::create(&path, 1, 2, 4096, timeout).expect("create");
        let wrong_ends = Ring::open(&path, 2, 1, timeout)
            .err()
            .expect("wrong direction");
        assert!(
            wrong_ends.to_string().contains("rank 2 to rank 1"),
            "{wrong_ends}"
        );
        assert!(
            Ring::create(&path, 1, 2, 4096, timeout).is_err(),
            "create must not reuse"
        );
        let tiny = Ring::create(&path.with_extension("tiny"), 1, 2, 3, timeout).err();
        let tiny = tiny.expect("a 3-byte ring must be refused").to_string();
        assert!(tiny.contains("at least 4 bytes"), "{tiny}");
        let odd = Ring::create(&path.with_extension("odd"), 1, 2, 4100, timeout).err();
        let odd = odd
            .expect("a ring of 4100 bytes must be refused")
            .to_string();
        assert!(odd.contains("multiple of 8"), "{odd}");
        std::fs::write(&path, vec![0u8; CONTROL_BYTES + 4100]).expect("overwrite");
        let odd = Ring::open(&path, 1, 2, timeout)
            .err()
            .expect("an odd capacity");
        assert!(odd.to_string().contains("multiple of 8"), "{odd}");
        std::fs::write(&path, vec![7u8; 8192]).expect("overwrite");
        let garbage = Ring::open(&path, 1, 2, timeout).err().expect("garbage");
        assert!(garbage.to_string().contains("bad magic"), "{garbage}");
        std::fs::remove_file(&path).expect("unlink");
    }
}
