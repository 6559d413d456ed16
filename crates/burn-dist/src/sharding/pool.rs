//! Stage 3's host gathers reuse their buffers, and their parameters become tensors without a
//! copy.
//!
//! Every step gathers the same units of parameters, so a unit's buffer, once its parameters'
//! tensors are dropped, goes back to a pool and a later gather writes into it: the smallest
//! free buffer that holds it, if that is at most twice its size ([`SLACK`]; forward's units
//! and backward's differ in size, so an exact size would rarely match).
//! Without it each gather mapped fresh memory (page faults on every step), and freed gathers
//! between longer-lived activations fragmented glibc's heap (docs/perf/zero3.md, "The allocator
//! decides the step time"). The buffers are the communicator's shared buffers
//! (`HostCommunicator::shared_buffer`): where the ranks share a host, the peers read each
//! rank's pieces straight out of its buffer.
//!
//! What it pools is bounded, since stage 3 is chosen for memory:
//! - free buffers and units alive together never hold more than the units alive held at once
//!   in a step;
//! - free buffers hold at most the largest buffer the pool has lent, one unit's worth: a
//!   finished unit's buffer is taken again by the next gather issued ahead, so one is what the
//!   window cycles through; a buffer given back past that bound replaces the older free ones;
//! - results of 32 MiB or more (the tied embedding, which would be held through the whole
//!   step) are not pooled.
//!
//! The free buffers lie in shared memory that the rank holds beside its private memory at
//! every moment of the step, its highest included (the activations at the turn to backward).
//! With only the first and third bounds, on a 19 M-parameter GPT at 4 ranks (units of 24 MiB,
//! the whole model gathered in three) the pool held 80 MiB between steps, and the ranks' peak
//! PSS (private memory plus each rank's share of shared pages) was 280-300 MiB with it against
//! 229-258 MiB with no pool at all (issue 45). At the GPT-2 124M shape the first bound pooled
//! 20 MiB, within the second: the peak per rank unchanged (1049 against 1038 MiB VmHWM) and the
//! step 0.86×; pooling up to the whole gathered peak, tied embedding included, was about 5 %
//! faster, within the VM's spread between runs, for 250 MiB more (docs/perf/zero3.md, "Gathers
//! into pooled buffers").
//!
//! The parameters of a unit share its buffer: each is a [`Bytes`] whose allocation controller
//! ([`PartOfUnit`]) points at its own disjoint range. `TensorData::from_bytes_vec`, by contrast,
//! copies any `Vec<u8>` whole (a byte vector is aligned to 1, and `Bytes` wants 16).

use std::collections::BTreeMap;
use std::mem::MaybeUninit;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use burn_dist_comm::{HUGE_PAGE_RESULT_BYTES, SharedBuffer};
use burn_std::bytes::{AllocationController, AllocationProperty, Bytes};

/// The alignment `Bytes` asks of an allocation (cubecl-common's `MAX_ALIGN`, `u128`'s).
const BYTES_ALIGN: usize = std::mem::align_of::<u128>();

/// A free buffer serves a gather of at least 1/`SLACK` of its capacity.
const SLACK: usize = 2;

/// Buffers of finished gathers, by capacity, for the next gathers that fit them.
#[derive(Debug, Default)]
pub(crate) struct GatherPool {
    free: Mutex<Free>,
}

#[derive(Debug, Default)]
struct Free {
    by_capacity: BTreeMap<usize, Vec<SharedBuffer>>,
    /// Bytes of the buffers in `by_capacity`.
    bytes: usize,
    /// Bytes of the gathered units alive (their tensors not all dropped yet) of a size the
    /// pool takes back.
    out: usize,
    /// The most `out` reached since the last `end_step`.
    peak_out: usize,
    /// What units alive and free buffers may hold together: the most that units alive held
    /// at once in a step (`GatherPool::end_step`).
    cap: usize,
    /// The largest buffer lent of a size the pool takes back: what the free buffers may hold.
    largest: usize,
    reused: u64,
}

impl Free {
    /// Frees one pooled buffer (the smallest).
    fn evict_one(&mut self) {
        let mut first = self
            .by_capacity
            .first_entry()
            .expect("a pooled buffer to free");
        let capacity = *first.key();
        first.get_mut().pop();
        if first.get().is_empty() {
            first.remove();
        }
        self.bytes -= capacity;
    }
}

impl GatherPool {
    /// A pooled buffer of `len` bytes from an earlier gather, if one is free that holds them
    /// within [`SLACK`] (its contents are the old gather's: the next gather overwrites its
    /// `len` bytes).
    pub(crate) fn take(&self, len: usize) -> Option<SharedBuffer> {
        let mut free = self.lock();
        let most = len.checked_mul(SLACK)?;
        let (&capacity, _) = free.by_capacity.range(len.max(1)..=most).next()?;
        let same_size = free.by_capacity.get_mut(&capacity).expect("just found");
        let mut buffer = same_size.pop().expect("no empty lists are left in the map");
        if same_size.is_empty() {
            free.by_capacity.remove(&capacity);
        }
        free.bytes -= capacity;
        free.reused += 1;
        assert!(
            buffer.set_len(len),
            "a buffer of {capacity} bytes holds {len}"
        );
        Some(buffer)
    }

    /// A step ended: from now on a finished gather's buffer is pooled only while the units
    /// alive and the free buffers hold together at most what the units alive held at once in a
    /// step (so pooling buffers adds no more than the gathers themselves once held).
    pub(crate) fn end_step(&self) {
        let mut free = self.lock();
        free.cap = free.cap.max(free.peak_out);
        free.peak_out = free.out;
    }

    /// Gathers that wrote into a pooled buffer instead of a fresh one, since the start.
    pub(crate) fn reused(&self) -> u64 {
        self.lock().reused
    }

    /// Bytes of free buffers pooled right now.
    pub(crate) fn free_bytes(&self) -> usize {
        self.lock().bytes
    }

    /// A unit whose buffer holds `len` bytes is alive.
    fn lend(&self, len: usize) {
        if Self::pools(len) {
            let mut free = self.lock();
            free.out += len;
            free.peak_out = free.peak_out.max(free.out);
            free.largest = free.largest.max(len);
        }
    }

    /// Whether buffers of `len` bytes are pooled. Not empty ones, and not results of
    /// [`HUGE_PAGE_RESULT_BYTES`] or more: pooling one (the tied embedding's 147 MiB at GPT-2
    /// small) would hold it through the whole step.
    fn pools(len: usize) -> bool {
        len > 0 && len < HUGE_PAGE_RESULT_BYTES
    }

    /// A unit's tensors are all dropped: its buffer is pooled for the next gather of its size,
    /// or freed.
    fn give_back(&self, buffer: SharedBuffer) {
        let mut free = self.lock();
        let len = buffer.capacity();
        if !Self::pools(len) {
            return;
        }
        free.out -= len;
        if free.out + len > free.cap || len > free.largest {
            return;
        }
        // The newest buffer stays: the next gather ahead is most likely of its size.
        while free.out + free.bytes + len > free.cap || free.bytes + len > free.largest {
            free.evict_one();
        }
        free.bytes += len;
        free.by_capacity.entry(len).or_default().push(buffer);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Free> {
        // Nothing panics while holding it; a poisoned pool is still consistent.
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The buffer of one unit's gather, shared by its parameters' tensors ([`PartOfUnit`]); back
/// to the pool when the last is dropped.
struct UnitBuffer {
    /// Taken only on drop, so nothing else holds a reference into it while the parts write
    /// their ranges through `start`.
    buffer: Option<SharedBuffer>,
    /// Where the buffer's bytes start.
    start: NonNull<u8>,
    len: usize,
    pool: Arc<GatherPool>,
}

// SAFETY: `UnitBuffer` owns its buffer; the parts touch disjoint ranges of it through `start`.
unsafe impl Send for UnitBuffer {}
unsafe impl Sync for UnitBuffer {}

impl Drop for UnitBuffer {
    fn drop(&mut self) {
        if let Some(buffer) = self.buffer.take() {
            self.pool.give_back(buffer);
        }
    }
}

/// Splits a gather's result (u8) into one [`Bytes`] per range of `ranges` (consecutive,
/// covering the buffer or less), none of them copied; the buffer returns to `pool` when all are
/// dropped.
pub(crate) fn split(
    mut buffer: SharedBuffer,
    ranges: &[Range<usize>],
    pool: &Arc<GatherPool>,
) -> Vec<Bytes> {
    let len = buffer.as_bytes().len();
    pool.lend(buffer.capacity());
    let start = NonNull::new(buffer.as_bytes_mut().as_mut_ptr()).expect("a slice is not null");
    let unit = Arc::new(UnitBuffer {
        buffer: Some(buffer),
        start,
        len,
        pool: pool.clone(),
    });
    ranges
        .iter()
        .map(|range| {
            assert!(range.end <= unit.len, "a part past its unit's end");
            let part = PartOfUnit {
                unit: unit.clone(),
                range: range.clone(),
            };
            // SAFETY: the whole range is initialized (the gather wrote it, or an earlier one
            // did, and the buffer's length covers it).
            unsafe { Bytes::from_controller(Box::new(part), range.len()) }
        })
        .collect()
}

/// One parameter's bytes inside its unit's buffer.
struct PartOfUnit {
    unit: Arc<UnitBuffer>,
    range: Range<usize>,
}

impl PartOfUnit {
    fn start(&self) -> *mut u8 {
        // SAFETY: `range` lies within the unit's buffer (checked in `split`).
        unsafe { self.unit.start.as_ptr().add(self.range.start) }
    }
}

impl AllocationController for PartOfUnit {
    fn alloc_align(&self) -> usize {
        // The alignment the range starts at: `Bytes` copies into a fresh allocation only a
        // part that is less aligned than it asks (a parameter after one of an odd size).
        let address = self.start() as usize;
        (1usize << address.trailing_zeros()).min(BYTES_ALIGN)
    }

    fn property(&self) -> AllocationProperty {
        AllocationProperty::Other
    }

    unsafe fn memory_mut(&mut self) -> &mut [MaybeUninit<u8>] {
        // SAFETY: no other part covers this range, and `&mut self` is its only access.
        unsafe { std::slice::from_raw_parts_mut(self.start().cast(), self.range.len()) }
    }

    fn memory(&self) -> &[MaybeUninit<u8>] {
        // SAFETY: as above, shared.
        unsafe { std::slice::from_raw_parts(self.start().cast(), self.range.len()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A buffer holding `bytes`.
    fn shared(bytes: &[u8]) -> SharedBuffer {
        let mut buffer = SharedBuffer::on_heap(burn_dist_comm::DType::U8, bytes.len());
        buffer.as_bytes_mut().copy_from_slice(bytes);
        buffer
    }

    /// A unit of one part: all of `buffer`.
    fn whole_of(buffer: SharedBuffer, pool: &Arc<GatherPool>) -> Vec<Bytes> {
        let len = buffer.len();
        split(buffer, std::slice::from_ref(&(0..len)), pool)
    }

    /// A unit of one part: all of a buffer of `len` zeros.
    fn whole(len: usize, pool: &Arc<GatherPool>) -> Vec<Bytes> {
        whole_of(shared(&vec![0; len]), pool)
    }

    /// A pool whose units alive and free buffers may hold `cap` bytes, and its free buffers
    /// as much.
    fn pool(cap: usize) -> Arc<GatherPool> {
        let pool = Arc::new(GatherPool::default());
        pool.lock().cap = cap;
        pool.lock().largest = cap;
        pool
    }

    #[test]
    fn parts_read_their_ranges_and_the_buffer_returns_when_the_last_is_dropped() {
        let pool = pool(1 << 20);
        let buffer = shared(&(0..48).collect::<Vec<u8>>());
        let address = buffer.as_bytes().as_ptr();
        let mut parts = split(buffer, &[0..16, 16..20, 20..48], &pool);
        assert_eq!(&parts[1][..], &[16, 17, 18, 19]);
        assert_eq!(parts[2][0], 20);
        parts[0][3] = 99;
        assert_eq!(parts[0][3], 99, "a part writes its own range");
        assert_eq!(parts[1][0], 16, "and no other");
        let last = parts.pop().unwrap();
        drop(parts);
        assert_eq!(pool.free_bytes(), 0, "a part is still alive");
        drop(last);
        assert_eq!(pool.free_bytes(), 48);
        let again = pool
            .take(48)
            .expect("pooled for the next gather of 48 bytes");
        assert_eq!(
            again.as_bytes().as_ptr(),
            address,
            "the same memory, not a copy"
        );
        assert_eq!(again.as_bytes()[3], 99);
        assert_eq!(pool.reused(), 1);
        assert!(pool.take(48).is_none());
    }

    #[test]
    fn units_alive_and_free_buffers_stay_within_the_cap() {
        // Sizes in whole 8-byte words: a heap buffer's capacity is its length.
        let pool = pool(100);
        drop(whole(56, &pool));
        drop(whole(56, &pool));
        assert_eq!(
            pool.free_bytes(),
            56,
            "a second 56 bytes would pass 100: the newer replaces the first"
        );
        assert!(pool.take(57).is_none(), "too small for 57 bytes");
        assert!(pool.take(24).is_none(), "more than twice 24 bytes");
        let alive = whole_of(pool.take(40).expect("56 bytes hold 40"), &pool);
        assert_eq!(alive[0].len(), 40, "the gather's length, not the buffer's");
        drop(whole(48, &pool));
        assert_eq!(pool.free_bytes(), 0, "56 alive and 48 more would pass 100");
        drop(alive);
        assert_eq!(pool.free_bytes(), 56, "its whole capacity is back");
    }

    #[test]
    fn a_gather_takes_the_smallest_free_buffer_that_holds_it() {
        let pool = pool(1000);
        drop(whole(64, &pool));
        drop(whole(32, &pool));
        drop(whole(40, &pool));
        assert_eq!(pool.take(30).unwrap().capacity(), 32);
        assert_eq!(pool.take(33).unwrap().capacity(), 40);
        assert_eq!(pool.take(32).unwrap().capacity(), 64);
        assert_eq!((pool.free_bytes(), pool.reused()), (0, 3));
    }

    #[test]
    fn the_cap_is_the_most_units_held_alive_in_a_step_and_huge_results_are_not_pooled() {
        let pool = Arc::new(GatherPool::default());
        // Only the cap bounds here (the free buffers' own bound has its test).
        pool.lock().largest = usize::MAX;
        drop(whole(40, &pool));
        assert_eq!(
            pool.free_bytes(),
            0,
            "nothing is pooled before a step has ended"
        );
        let first = whole(32, &pool);
        let second = whole(24, &pool);
        drop((first, second));
        pool.end_step();
        // The step held 56 bytes at once at most: the 40 alone, or 32 and 24 together.
        drop(whole(32, &pool));
        drop(whole(24, &pool));
        assert_eq!(pool.free_bytes(), 56);
        drop(whole(16, &pool));
        assert_eq!(
            pool.free_bytes(),
            48,
            "72 bytes would pass what the step held: the 16 took the 24's place"
        );

        pool.lock().cap = 2 * HUGE_PAGE_RESULT_BYTES;
        drop(whole(HUGE_PAGE_RESULT_BYTES, &pool));
        assert_eq!(pool.free_bytes(), 48, "a huge result is not held");
        assert_eq!(pool.lock().out, 0);
    }

    /// The free buffers hold at most one buffer's worth of the largest lent, so that the pool
    /// holds little shared memory through the step's highest moment; the buffer given back
    /// last is the one pooled.
    #[test]
    fn free_buffers_hold_at_most_the_largest_buffer_lent_and_the_newest_stays() {
        let pool = Arc::new(GatherPool::default());
        pool.lock().cap = 1000;
        drop(whole(40, &pool));
        assert_eq!(pool.free_bytes(), 40);
        drop(whole(32, &pool));
        assert_eq!(pool.free_bytes(), 32, "72 bytes would pass 40: the 40 went");
        assert!(pool.take(33).is_none(), "the 40-byte buffer is gone");
        drop(whole(24, &pool));
        drop(whole(16, &pool));
        assert_eq!(
            pool.free_bytes(),
            40,
            "the 32 made room for the 24, and the 16 fits"
        );
        assert_eq!(pool.take(24).unwrap().capacity(), 24);
        assert_eq!(pool.take(16).unwrap().capacity(), 16);
        drop(whole(48, &pool));
        assert_eq!(pool.free_bytes(), 48, "the largest lent is 48 bytes now");
    }

    #[test]
    fn a_part_reports_the_alignment_it_starts_at_and_clones_by_copying() {
        let pool = pool(0);
        let parts = split(shared(&[7; 64]), &[0..3, 3..64], &pool);
        // glibc aligns the heap buffer's 64 bytes to at least 16.
        assert_eq!(parts[0].align(), BYTES_ALIGN);
        assert_eq!(parts[1].align(), 1, "3 bytes past a 16-aligned start");
        let copy = parts[1].clone();
        assert_eq!(&copy[..], &parts[1][..]);
        assert_ne!(copy.as_ptr(), parts[1].as_ptr());
    }
}
