//! Each rank's collective buffers in shared memory, which its peers on the host read directly.
//!
//! Through the rings every byte of a collective is copied into a ring and out again, on the
//! cores the ranks share; at 2 ranks that reaches about a third of what the copies themselves
//! would allow (docs/perf/host-all-reduce.md, "the ceiling"). A buffer that lives in an arena
//! instead, a file under `/dev/shm` that every peer maps, is read by the peers where it lies: a
//! peer folds or copies straight out of it, with no ring in between, and in an all-reduce
//! writes its reduced chunk straight into it.
//!
//! Peers map it read-write for that last write only; which bytes of a buffer each rank may
//! touch in a collective, and when, is `crate::direct`'s rule. The file is sparse: its size is the address space, not memory. Memory is
//! reserved for each buffer when it is allocated (`fallocate`), so a full `/dev/shm` is a
//! failed allocation (the caller falls back to the heap) rather than a SIGBUS, and it is
//! returned to the system when the buffer is freed (a punched hole; the range may then hold a
//! later buffer). No peer reads a freed buffer: an in-place collective's last barrier comes
//! before its buffer goes back, and one that fails never gives its buffer back.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use memmap2::{MmapOptions, MmapRaw};

/// Buffers start at page boundaries, so that freeing one (a punched hole) never touches a
/// neighbour's bytes, and every element type is aligned.
const PAGE: usize = 4096;

/// The arena's address space when `/dev/shm`'s size cannot be read: enough for any host
/// buffer, and only address space until buffers use it.
const DEFAULT_CAPACITY: usize = 64 << 30;

/// This rank's arena: it allocates buffers in it and writes them; its peers read them.
pub(crate) struct Arena {
    file: File,
    map: MmapRaw,
    /// Free ranges, offset → length, coalesced. Their memory is not reserved.
    free: Mutex<BTreeMap<usize, usize>>,
    /// Whether a refused allocation has been reported (once: a job whose `/dev/shm` is too
    /// small would otherwise say so at every gather).
    refusal_told: AtomicBool,
}

impl Arena {
    /// Creates the arena's file at `path` (it must not exist; only this user may open it) with
    /// `capacity` bytes of address space, none of it reserved yet.
    pub(crate) fn create(path: &Path, capacity: usize) -> io::Result<Arena> {
        let capacity = capacity / PAGE * PAGE;
        if capacity == 0 {
            let why = "an arena needs at least one page".to_string();
            return Err(io::Error::new(io::ErrorKind::InvalidInput, why));
        }
        let file = super::create_private(path)?;
        let sized_and_mapped = || {
            file.set_len(capacity as u64)?;
            MmapOptions::new().map_raw(&file)
        };
        let map = sized_and_mapped().inspect_err(|_| _ = std::fs::remove_file(path))?;
        Ok(Arena {
            file,
            map,
            free: Mutex::new(BTreeMap::from([(0, capacity)])),
            refusal_told: AtomicBool::new(false),
        })
    }

    /// The address space `/dev/shm` (at `dir`) can back: its size, so that no allocation that
    /// could succeed is refused for want of address space.
    pub(crate) fn capacity_for(dir: &Path) -> usize {
        use std::os::unix::ffi::OsStrExt;
        let Ok(path) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
            return DEFAULT_CAPACITY;
        };
        let mut stats = std::mem::MaybeUninit::<libc::statvfs>::uninit();
        // SAFETY: `path` is a valid C string and `stats` is written by the call before it is read.
        if unsafe { libc::statvfs(path.as_ptr(), stats.as_mut_ptr()) } != 0 {
            return DEFAULT_CAPACITY;
        }
        // SAFETY: statvfs succeeded, so it filled `stats`.
        let stats = unsafe { stats.assume_init() };
        let size = (stats.f_blocks as u128) * (stats.f_frsize as u128);
        usize::try_from(size).unwrap_or(DEFAULT_CAPACITY).max(PAGE)
    }

    /// A zeroed region of at least `bytes` bytes (a whole number of pages), its memory
    /// reserved; `None` when the arena has no free range that large or the system refuses the
    /// memory (a full `/dev/shm`, a memory limit).
    pub(crate) fn alloc(self: &Arc<Self>, bytes: usize) -> Option<Region> {
        let size = bytes.max(1).next_multiple_of(PAGE);
        let Some(offset) = self.take_range(size) else {
            self.refused(size, "the arena's address space is in use");
            return None;
        };
        // SAFETY: a plain system call on the arena's own file descriptor.
        let reserved = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                0,
                offset as libc::off_t,
                size as libc::off_t,
            )
        };
        if reserved != 0 {
            let why = io::Error::last_os_error();
            // Whatever part the failed call reserved goes back too.
            self.release(offset, size);
            self.refused(size, &why.to_string());
            return None;
        }
        Some(Region {
            arena: self.clone(),
            offset,
            size,
        })
    }

    /// The first free range of `size` bytes, taken off the free list.
    fn take_range(&self, size: usize) -> Option<usize> {
        let mut free = self.free.lock().expect("arena free list");
        let (&offset, &len) = free.iter().find(|&(_, &len)| len >= size)?;
        free.remove(&offset);
        if len > size {
            free.insert(offset + size, len - size);
        }
        Some(offset)
    }

    /// Says, once per arena, that a buffer did not fit and why.
    fn refused(&self, size: usize, why: &str) {
        if !self.refusal_told.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "no room in /dev/shm for a {size}-byte shared buffer ({why}): it and any other \
                 that does not fit go on the heap, and their collectives through the rings \
                 (slower, same results); a container needs a larger --shm-size"
            );
        }
    }

    /// Returns `size` bytes at `offset` to the system and to the free list.
    fn release(&self, offset: usize, size: usize) {
        // SAFETY: a plain system call on the arena's own file descriptor; the range is a
        // region nobody holds any more.
        unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset as libc::off_t,
                size as libc::off_t,
            )
        };
        self.give_back(offset, size);
    }

    /// Puts a range back on the free list, merged with free neighbours.
    fn give_back(&self, mut offset: usize, mut size: usize) {
        let mut free = self.free.lock().expect("arena free list");
        if let Some((&before, &len)) = free.range(..offset).next_back()
            && before + len == offset
        {
            free.remove(&before);
            offset = before;
            size += len;
        }
        if let Some(len) = free.remove(&(offset + size)) {
            size += len;
        }
        free.insert(offset, size);
    }
}

/// A buffer in this rank's arena; its memory goes back to the system when it drops.
pub(crate) struct Region {
    arena: Arc<Arena>,
    offset: usize,
    size: usize,
}

impl Region {
    /// Where the region starts in its arena: what a peer needs to find it.
    pub(crate) fn offset(&self) -> usize {
        self.offset
    }

    /// Its length in bytes: whole pages.
    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// Whether this region lies in `arena`.
    pub(crate) fn is_in(&self, arena: &Arc<Arena>) -> bool {
        Arc::ptr_eq(&self.arena, arena)
    }

    /// The region's first `len` bytes (`len` at most its size).
    pub(crate) fn bytes(&self, len: usize) -> &[u8] {
        assert!(
            len <= self.size,
            "{len} bytes past a {}-byte region",
            self.size
        );
        // SAFETY: the region lies inside the mapping, which lives as long as `self.arena`;
        // `&self` excludes this rank's writes through `bytes_mut`, and peers write only during
        // an all-reduce, which holds the buffer itself (no `&self` exists meanwhile).
        unsafe { std::slice::from_raw_parts(self.arena.map.as_ptr().add(self.offset), len) }
    }

    /// The region's first `len` bytes, for writing.
    pub(crate) fn bytes_mut(&mut self, len: usize) -> &mut [u8] {
        assert!(
            len <= self.size,
            "{len} bytes past a {}-byte region",
            self.size
        );
        // SAFETY: as in `bytes`; `&mut self` makes this the only reference in this process.
        // Peers touch the bytes only during a collective that holds the buffer, and never the
        // bytes this rank writes meanwhile (`crate::direct`'s rule).
        unsafe { std::slice::from_raw_parts_mut(self.arena.map.as_mut_ptr().add(self.offset), len) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        self.arena.release(self.offset, self.size);
    }
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Region({} bytes at {})", self.size, self.offset)
    }
}

/// A peer's arena, mapped read-write: this rank reads the peer's buffers in every in-place
/// collective, and writes its reduced chunk into them in an all-reduce.
pub(crate) struct PeerArena {
    map: MmapRaw,
}

impl PeerArena {
    /// Maps the arena another rank created at `path`.
    pub(crate) fn open(path: &Path) -> io::Result<PeerArena> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let map = MmapOptions::new().map_raw(&file)?;
        Ok(PeerArena { map })
    }

    /// `len` bytes at `offset`, or `None` if that range is not in the arena (a peer's offset
    /// that cannot be right must not make this rank read outside its mapping).
    ///
    /// The bytes are the peer's: the collective protocol guarantees that nobody writes them
    /// while they are read.
    pub(crate) fn bytes(&self, offset: usize, len: usize) -> Option<&[u8]> {
        self.holds(offset, len).then(|| {
            // SAFETY: the range lies inside the mapping, which lives as long as `self`.
            unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(offset), len) }
        })
    }

    /// Copies `data` into the peer's arena at `offset`; `None` (and nothing written) if that
    /// range is not in the arena.
    ///
    /// The protocol guarantees that nobody else reads or writes those bytes meanwhile, and the
    /// peer reads them only after a barrier that follows this write.
    pub(crate) fn write(&self, offset: usize, data: &[u8]) -> Option<()> {
        self.holds(offset, data.len()).then(|| {
            // SAFETY: the range lies inside the writable mapping, which lives as long as
            // `self`; `data` is never a slice of this mapping (the caller's own buffer or
            // another peer's), so the two do not overlap.
            unsafe {
                let at = self.map.as_mut_ptr().add(offset);
                std::ptr::copy_nonoverlapping(data.as_ptr(), at, data.len());
            }
        })
    }

    /// Whether `len` bytes at `offset` lie in the mapping.
    fn holds(&self, offset: usize, len: usize) -> bool {
        offset
            .checked_add(len)
            .is_some_and(|end| end <= self.map.len())
    }
}

/// This rank's arena and every peer's, all mapped: what a direct collective needs.
pub(crate) struct Arenas {
    pub own: Arc<Arena>,
    /// `peers[q]`: rank `q`'s arena (`None` for this rank).
    pub peers: Vec<Option<PeerArena>>,
}

impl Arenas {
    /// Where `buf` starts in this rank's arena; `None` when it lies elsewhere (the heap, or
    /// another group's arena), where no peer can read it.
    pub(crate) fn offset_of(&self, buf: &crate::SharedBuffer) -> Option<usize> {
        buf.region()
            .filter(|region| region.is_in(&self.own))
            .map(Region::offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arena(capacity: usize) -> (tempfile::TempDir, Arc<Arena>) {
        let dir = tempfile::tempdir().unwrap();
        let arena = Arena::create(&dir.path().join("arena"), capacity).unwrap();
        (dir, Arc::new(arena))
    }

    #[test]
    fn regions_are_disjoint_zeroed_pages_seen_by_a_reader_and_reused_once_freed() {
        let (dir, arena) = arena(16 * PAGE);
        let reader = PeerArena::open(&dir.path().join("arena")).unwrap();
        let mut a = arena.alloc(10).unwrap();
        let mut b = arena.alloc(PAGE + 1).unwrap();
        assert_eq!((a.offset(), b.offset()), (0, PAGE));
        a.bytes_mut(10).fill(1);
        b.bytes_mut(PAGE + 1).fill(2);
        assert_eq!(reader.bytes(0, 10).unwrap(), &[1; 10]);
        assert!(
            reader
                .bytes(PAGE, PAGE + 1)
                .unwrap()
                .iter()
                .all(|&x| x == 2)
        );
        drop(a);
        // The freed page reads as zeros to the peer, and is handed out again, zeroed.
        assert!(reader.bytes(0, PAGE).unwrap().iter().all(|&x| x == 0));
        let c = arena.alloc(PAGE).unwrap();
        assert_eq!(c.offset(), 0);
        assert!(c.bytes(PAGE).iter().all(|&x| x == 0));
        drop((b, c));
        // Everything coalesced back into one range: the whole arena fits again.
        assert!(arena.alloc(16 * PAGE).is_some());
    }

    /// The memory behind the address space is what runs out first on a real mount: a buffer
    /// larger than `/dev/shm` is refused by the system at once (tmpfs checks a request against
    /// its size before reserving anything), and smaller ones still fit.
    #[test]
    fn a_buffer_larger_than_dev_shm_is_refused_and_leaves_the_arena_usable() {
        let mount = Path::new("/dev/shm");
        let size = Arena::capacity_for(mount);
        let dir = tempfile::tempdir_in(mount).unwrap();
        let arena = Arc::new(Arena::create(&dir.path().join("arena"), 2 * size).unwrap());
        assert!(arena.alloc(size + PAGE).is_none());
        let small = arena.alloc(PAGE).expect("a page still fits");
        assert_eq!(
            small.offset(),
            0,
            "the refused range went back to the free list"
        );
    }

    #[test]
    fn an_arena_without_room_refuses_and_a_reader_refuses_ranges_past_its_end() {
        let (dir, arena) = arena(4 * PAGE);
        let held = arena.alloc(3 * PAGE).unwrap();
        assert!(arena.alloc(2 * PAGE).is_none());
        assert!(arena.alloc(PAGE).is_some());
        drop(held);
        let reader = PeerArena::open(&dir.path().join("arena")).unwrap();
        assert!(reader.bytes(3 * PAGE, PAGE).is_some());
        assert!(reader.bytes(3 * PAGE, PAGE + 1).is_none());
        assert!(reader.bytes(usize::MAX, 2).is_none());
    }
}
