//! A rank's peak memory as the host pays for it: its proportional set size (PSS), sampled at
//! the step's high points.
//!
//! Resident memory (VmRSS, and its high-water mark VmHWM) counts every page a process maps in
//! full. At ZeRO stage 3 a rank maps its peers' gather buffers (shared memory under
//! `/dev/shm`), and the kernel counts each page in every rank that read it, though the host
//! holds it once: on a 19 M-parameter GPT at 4 ranks stage 3's VmHWM was the higher (395
//! against 349 MiB) while its private memory was the lower (145 against 220 MiB, issue 45).
//! PSS (`/proc/self/smaps_rollup`) counts a private page in full and a shared page divided by
//! the number of mappings of it, so the ranks' figures add up to what the host holds, and
//! DDP's and stage 2's, which share little, stay close to their VmHWM.
//!
//! The kernel keeps no high-water mark of PSS, and a reading walks the page tables (about
//! 15 µs per MiB resident, 17 ms at 1.1 GiB), too slow to repeat every millisecond. A thread
//! reads the resident size instead (`/proc/self/statm`, microseconds) every millisecond, and
//! reads PSS at the step's high points: whenever resident memory is within [`band`] of the
//! highest it has been and has risen by a quarter of that since the last reading of the step.
//! Steps alike then take a handful of readings each, near their top, whatever phase of the
//! step (backward, the optimizer's all-gather) the top is in. Between two readings resident
//! memory rises by less than a quarter of the band, and the shared pages' share moves with it,
//! so a peak is missed by about that much at most; a faster transient than the 1 ms poll is
//! missed. The figure is the most PSS read, at the end of each step too.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often the resident size is read.
const POLL: Duration = Duration::from_millis(1);

/// PSS is read while resident memory is within this many bytes of the highest it has been
/// (`highest`): a sixteenth of it, and at least 32 MiB.
pub fn band(highest: u64) -> u64 {
    (highest / 16).max(32 << 20)
}

/// Whether to read PSS now: resident memory is `resident` bytes, the highest so far
/// `highest`, and the step's last reading was at `read_at` resident bytes (0 for none).
pub fn reads_now(resident: u64, highest: u64, read_at: u64) -> bool {
    let band = band(highest);
    resident + band >= highest && resident >= read_at + band / 4
}

/// Samples this process's PSS at the step's high points, on a thread of its own.
pub struct PssSampler {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

struct Shared {
    stop: AtomicBool,
    /// Steps begun: each is read afresh from the bottom of the band.
    steps: AtomicU64,
    /// The most PSS read so far, bytes.
    peak: AtomicU64,
    /// Readings of PSS so far.
    readings: AtomicU64,
}

impl PssSampler {
    /// Starts sampling; `None` where procfs lacks `statm` or `smaps_rollup` (not Linux).
    pub fn start() -> Option<PssSampler> {
        let first = pss_bytes()?;
        resident_bytes()?;
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            steps: AtomicU64::new(0),
            peak: AtomicU64::new(first),
            readings: AtomicU64::new(1),
        });
        let sampling = shared.clone();
        let thread = std::thread::Builder::new()
            .name("gpt-pretrain-pss".into())
            .spawn(move || sample(&sampling))
            .ok()?;
        Some(PssSampler {
            shared,
            thread: Some(thread),
        })
    }

    /// A step begins: its high points are read again, even below the last step's readings.
    pub fn next_step(&self) {
        self.shared.steps.fetch_add(1, Ordering::Relaxed);
    }

    /// The most PSS read so far, in bytes, with a reading taken now.
    pub fn peak(&self) -> u64 {
        self.read();
        self.shared.peak.load(Ordering::Relaxed)
    }

    /// Readings of PSS taken so far.
    pub fn readings(&self) -> u64 {
        self.shared.readings.load(Ordering::Relaxed)
    }

    fn read(&self) {
        if let Some(pss) = pss_bytes() {
            self.shared.peak.fetch_max(pss, Ordering::Relaxed);
            self.shared.readings.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Drop for PssSampler {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The sampler's loop: resident memory every [`POLL`], PSS when [`reads_now`] says so, but
/// never more than half the time (a reading waits for twice the last one's time after it).
fn sample(shared: &Shared) {
    let (mut highest, mut read_at, mut step) = (0, 0, 0);
    let mut next_reading = Instant::now();
    while !shared.stop.load(Ordering::Relaxed) {
        let now_step = shared.steps.load(Ordering::Relaxed);
        if now_step != step {
            (step, read_at) = (now_step, 0);
        }
        if let Some(resident) = resident_bytes() {
            highest = highest.max(resident);
            if reads_now(resident, highest, read_at) && Instant::now() >= next_reading {
                let started = Instant::now();
                if let Some(pss) = pss_bytes() {
                    shared.peak.fetch_max(pss, Ordering::Relaxed);
                    shared.readings.fetch_add(1, Ordering::Relaxed);
                }
                next_reading = Instant::now() + 2 * started.elapsed();
                read_at = resident;
            }
        }
        std::thread::sleep(POLL);
    }
}

/// This process's resident memory (`/proc/self/statm`'s second field, in pages), bytes.
fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * page_size())
}

/// This process's proportional set size (`Pss:` of `/proc/self/smaps_rollup`), bytes.
pub fn pss_bytes() -> Option<u64> {
    let rollup = std::fs::read_to_string("/proc/self/smaps_rollup").ok()?;
    let kib: u64 = rollup
        .lines()
        .find_map(|line| line.strip_prefix("Pss:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib << 10)
}

fn page_size() -> u64 {
    // SAFETY: sysconf reads a constant of the system and touches no memory.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(size).unwrap_or(4096)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// Runs `test` (this module's test of that name) alone in a child process of the test
    /// binary, and fails if it fails there. Each of these tests measures the whole process,
    /// and the other tests of the crate run on threads beside it: their allocations and
    /// frees moved the PSS a test compared by more than its margin.
    fn alone_in_a_process(test: &str, body: impl FnOnce()) {
        const CHILD: &str = "GPT_PRETRAIN_MEMORY_TEST_ALONE";
        if std::env::var_os(CHILD).is_some() {
            return body();
        }
        let output =
            burn_dist_models::processes::this_test_again(&format!("memory::tests::{test}"))
                .env(CHILD, "1")
                .output()
                .expect("the test binary runs again");
        let text = String::from_utf8_lossy(&output.stdout).into_owned()
            + &String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success(),
            "{test} alone in a process:\n{text}"
        );
        assert!(
            text.contains("1 passed"),
            "{test} did not run alone:\n{text}"
        );
    }

    #[test]
    fn pss_is_read_near_the_top_each_time_memory_rose_by_a_quarter_band() {
        let highest = 300 * MIB;
        assert_eq!(band(highest), 32 * MIB);
        assert_eq!(
            band(1600 * MIB),
            100 * MIB,
            "a sixteenth of a large process"
        );
        assert!(!reads_now(260 * MIB, highest, 0), "below the band");
        assert!(
            reads_now(270 * MIB, highest, 0),
            "the step's first reading in the band"
        );
        assert!(
            !reads_now(277 * MIB, highest, 270 * MIB),
            "7 MiB higher: not yet"
        );
        assert!(
            reads_now(278 * MIB, highest, 270 * MIB),
            "a quarter band higher"
        );
        assert!(reads_now(310 * MIB, 310 * MIB, 300 * MIB), "a new high");
        // A step whose top is lower than an earlier one's: sampled if within the band.
        assert!(reads_now(280 * MIB, highest, 0));
    }

    /// A page mapped twice counts twice in resident memory and once in PSS: the sampler's
    /// peak grows by a shared buffer's size however many mappings it has, as the host's memory
    /// does, while VmRSS grows by every mapping of it.
    #[test]
    fn a_shared_page_mapped_twice_counts_once_in_the_peak() {
        alone_in_a_process("a_shared_page_mapped_twice_counts_once_in_the_peak", || {
            let sampler = PssSampler::start().expect("Linux has smaps_rollup");
            let before = sampler.peak();
            let bytes = 64 << 20;
            let file = tempfile::tempfile_in("/dev/shm").expect("a file in /dev/shm");
            file.set_len(bytes as u64).unwrap();
            // SAFETY: two shared mappings of a file that only this test uses.
            let (mut first, second) = unsafe {
                (
                    memmap2::MmapMut::map_mut(&file).unwrap(),
                    memmap2::Mmap::map(&file).unwrap(),
                )
            };
            first.fill(7);
            let resident_before = resident_bytes().unwrap();
            let read: u64 = second.iter().step_by(4096).map(|&b| u64::from(b)).sum();
            assert_eq!(read, 7 * (bytes as u64 / 4096));
            let resident = resident_bytes().unwrap() - resident_before;
            assert!(
                resident >= bytes as u64,
                "the second mapping's pages count again: {resident}"
            );
            let grown = sampler.peak() - before;
            let mib = |b: u64| b as f64 / MIB as f64;
            assert!(
                (60 * MIB..=80 * MIB).contains(&grown),
                "the peak grew by {:.1} MiB for a 64 MiB buffer mapped twice",
                mib(grown)
            );
            assert!(sampler.readings() >= 3);
            drop((first, second));
        });
    }

    /// The thread reads PSS at the high points between two of the caller's readings: memory
    /// allocated and dropped again within the step is in the peak, within the quarter band
    /// by which readings may trail a rise.
    #[test]
    fn a_transient_high_within_the_step_is_in_the_peak() {
        alone_in_a_process("a_transient_high_within_the_step_is_in_the_peak", || {
            let sampler = PssSampler::start().expect("Linux has smaps_rollup");
            sampler.next_step();
            let before = pss_bytes().unwrap();
            let bytes = 96 << 20;
            let held = vec![1u8; bytes];
            let want = before + bytes as u64 - band(resident_bytes().unwrap()) / 4 - 4 * MIB;
            // Held until the thread's own readings (not the caller's: `peak` takes one) have
            // seen it, at most 30 s on a loaded machine.
            let deadline = Instant::now() + Duration::from_secs(30);
            while sampler.shared.peak.load(Ordering::Relaxed) < want {
                assert!(
                    Instant::now() < deadline,
                    "the sampler's readings stayed {} bytes under {want}",
                    want - sampler.shared.peak.load(Ordering::Relaxed)
                );
                std::thread::yield_now();
            }
            drop(std::hint::black_box(held));
            assert!(sampler.peak() >= want);
        });
    }
}
