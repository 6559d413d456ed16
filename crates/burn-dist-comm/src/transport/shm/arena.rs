//! Each rank's collective buffers in shared memory, which its peers on the host read directly.
//!
//! Through the rings every byte of a collective is copied into a ring and out again, on the
//! cores the ranks share; at 2 ranks that reaches about a third of what the copies themselves
//! would allow (docs/perf/host-all-reduce.md, "the ceiling"). A buffer that lives in an arena
//! instead, a file under `/dev/shm` that every peer maps, is read by the peers where it lies: a
//! peer folds or copies straight out of it, with no ring in between, and in an all-reduce
//! writes its reduced chunk straight into it.
//!
//! Peers map it read-write on the main lane only, for that last write; on the gather lane
//! (every other lane) they map it read-only, from a descriptor opened read-only ([`Access`]).
//! Which bytes of a buffer each rank may touch in a collective, and when, is `crate::direct`'s
//! rule. A peer opens the file only if it is what [`Arena::create`] makes: a regular file of
//! this user with mode 0600 (`super::open_private`).
//!
//! The file is sparse: its size is the address space, not memory. Memory is
//! reserved for each buffer when it is allocated (`fallocate`), so a full `/dev/shm` is a
//! failed allocation (the caller falls back to the heap) rather than a SIGBUS, and it is
//! returned to the system when the buffer is freed (a punched hole; the range may then hold a
//! later buffer). No peer reads a freed buffer: an in-place collective's last barrier comes
//! before its buffer goes back, and one that fails never gives its buffer back.

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
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
    /// Bytes of the regions alive (their memory reserved), and the most at once since the
    /// arena was made.
    held: AtomicUsize,
    peak: AtomicUsize,
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
            held: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
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
        let held = self.held.fetch_add(size, Ordering::Relaxed) + size;
        self.peak.fetch_max(held, Ordering::Relaxed);
        Some(Region {
            arena: self.clone(),
            offset,
            size,
        })
    }

    /// Bytes of the regions alive now, and the most alive at once since the arena was made.
    pub(crate) fn usage(&self) -> (usize, usize) {
        (
            self.held.load(Ordering::Relaxed),
            self.peak.load(Ordering::Relaxed),
        )
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
        // `&self` excludes this rank's writes through `bytes_mut` and `range_mut`, and peers
        // write only during an in-place all-reduce, which holds the buffer itself by value (no
        // `&self` exists meanwhile).
        unsafe { std::slice::from_raw_parts(self.arena.map.as_ptr().add(self.offset), len) }
    }

    /// The region's first `len` bytes, for writing, while no collective holds it: the peers
    /// touch a buffer only during a collective on it.
    pub(crate) fn bytes_mut(&mut self, len: usize) -> &mut [u8] {
        self.range_mut(0..len)
    }

    /// Bytes `range` of the region, for writing, and no byte outside it. An in-place
    /// collective writes one part of its buffer while peers read or write the others (a
    /// rank's own chunk in a reduce-scatter, every chunk but its own in an all-gather): a
    /// `&mut` over the whole buffer would claim bytes that another process touches meanwhile.
    pub(crate) fn range_mut(&mut self, range: std::ops::Range<usize>) -> &mut [u8] {
        assert!(
            range.start <= range.end && range.end <= self.size,
            "bytes {range:?} of a {}-byte region",
            self.size
        );
        // SAFETY: `range` lies inside the region (asserted), so inside the mapping, which is
        // writable and lives as long as `self.arena`. `&mut self` makes this the only reference
        // to the region in this process. What the peers do with these bytes meanwhile is the
        // caller's argument: outside a collective they touch none of the buffer; inside one,
        // `crate::direct` asks only for bytes that no peer reads or writes until its closing
        // barrier, after which the slice is gone.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.arena.map.as_mut_ptr().add(self.offset + range.start),
                range.len(),
            )
        }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        self.arena.held.fetch_sub(self.size, Ordering::Relaxed);
        self.arena.release(self.offset, self.size);
    }
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Region({} bytes at {})", self.size, self.offset)
    }
}

/// What a lane may do with a peer's arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    /// Read the peer's buffers: every in-place collective but the all-reduce.
    Read,
    /// Also write this rank's reduced chunk into them: the in-place all-reduce.
    ReadWrite,
}

impl Access {
    /// The main lane (0) may all-reduce in place; the other lanes (the gather lane) only read,
    /// and their all-reduces go through the links.
    pub(crate) fn for_lane(lane: usize) -> Access {
        match lane {
            0 => Access::ReadWrite,
            _ => Access::Read,
        }
    }
}

/// A peer's arena, mapped into this process. Read-only unless [`Access::ReadWrite`]: then the
/// descriptor it was mapped from was opened read-only too, so the pages cannot be made
/// writable (`mprotect` refuses) and a stray write faults instead of changing a peer's bytes.
pub(crate) struct PeerArena {
    map: MmapRaw,
    access: Access,
}

impl PeerArena {
    /// Maps the arena another rank created at `path`, after checking that it is what an
    /// [`Arena`] creates ([`super::open_private`]): a regular file of this user that no one else
    /// may open.
    pub(crate) fn open(path: &Path, access: Access) -> crate::Result<PeerArena> {
        let file = super::open_private(path, access == Access::ReadWrite)?;
        let mapping = match access {
            Access::Read => MmapOptions::new().map_raw_read_only(&file),
            Access::ReadWrite => MmapOptions::new().map_raw(&file),
        };
        let map =
            mapping.map_err(|e| crate::CommError::io(format!("mapping {}", path.display()), e))?;
        Ok(PeerArena { map, access })
    }

    /// Whether this rank may write into the peer's buffers through this mapping.
    pub(crate) fn writable(&self) -> bool {
        self.access == Access::ReadWrite
    }

    /// `len` bytes at `offset`, or `None` if that range is not in the arena (a peer's offset
    /// that cannot be right must not make this rank read outside its mapping).
    ///
    /// The bytes are the peer's: the collective protocol guarantees that nobody writes them
    /// while the returned slice lives.
    pub(crate) fn bytes(&self, offset: usize, len: usize) -> Option<&[u8]> {
        self.holds(offset, len).then(|| {
            // SAFETY: the range lies inside the mapping, which lives as long as `self`, and the
            // protocol leaves it unwritten while the slice lives (`crate::direct`'s rule).
            unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(offset), len) }
        })
    }

    /// Copies `data` into the peer's arena at `offset`; `None` (and nothing written) if that
    /// range is not in the arena or the mapping is read-only.
    ///
    /// The protocol guarantees that nobody else reads or writes those bytes meanwhile, and the
    /// peer reads them only after a barrier that follows this write.
    pub(crate) fn write(&self, offset: usize, data: &[u8]) -> Option<()> {
        (self.writable() && self.holds(offset, data.len())).then(|| {
            // SAFETY: the range lies inside the mapping, which is writable and lives as long
            // as `self`; no reference to those bytes exists in this process (slices of a peer's
            // arena are made by `bytes` only, over ranges that nobody writes while they live);
            // `data` is never a slice of this mapping (the caller's own buffer or another
            // peer's), so the two do not overlap.
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

    /// Where the mapping lies in this process's address space.
    #[cfg(test)]
    pub(crate) fn span(&self) -> std::ops::Range<usize> {
        let start = self.map.as_ptr() as usize;
        start..start + self.map.len()
    }
}

/// This rank's arena and every peer's, all mapped: what a direct collective needs.
pub(crate) struct Arenas {
    pub own: Arc<Arena>,
    /// `peers[q]`: rank `q`'s arena (`None` for this rank).
    pub peers: Vec<Option<PeerArena>>,
}

impl Arenas {
    /// Whether this lane may write into every peer's buffers (its in-place all-reduce).
    pub(crate) fn writes_peers(&self) -> bool {
        self.peers.iter().flatten().all(PeerArena::writable)
    }

    /// Where `buf` starts in this rank's arena; `None` when it lies elsewhere (the heap, or
    /// another group's arena), where no peer can read it.
    pub(crate) fn offset_of(&self, buf: &crate::SharedBuffer) -> Option<usize> {
        buf.region()
            .filter(|region| region.is_in(&self.own))
            .map(Region::offset)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn arena(capacity: usize) -> (tempfile::TempDir, Arc<Arena>) {
        let dir = tempfile::tempdir().unwrap();
        let arena = Arena::create(&dir.path().join("arena"), capacity).unwrap();
        (dir, Arc::new(arena))
    }

    #[test]
    fn regions_are_disjoint_zeroed_pages_seen_by_a_reader_and_reused_once_freed() {
        let (dir, arena) = arena(16 * PAGE);
        let reader = PeerArena::open(&dir.path().join("arena"), Access::Read).unwrap();
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
        assert_eq!(
            arena.usage(),
            (3 * PAGE, 3 * PAGE),
            "b's two pages and c's one"
        );
        drop((b, c));
        assert_eq!(arena.usage(), (0, 3 * PAGE));
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
        let reader = PeerArena::open(&dir.path().join("arena"), Access::Read).unwrap();
        assert!(reader.bytes(3 * PAGE, PAGE).is_some());
        assert!(reader.bytes(3 * PAGE, PAGE + 1).is_none());
        assert!(reader.bytes(usize::MAX, 2).is_none());
    }

    /// The permissions `/proc/self/maps` gives the mapping that starts at `start`
    /// (`r--s`, `rw-s`, ...).
    pub(crate) fn permissions_at(start: usize) -> String {
        let maps = std::fs::read_to_string("/proc/self/maps").expect("/proc/self/maps");
        maps.lines()
            .find_map(|line| {
                let (range, rest) = line.split_once(' ')?;
                let from = usize::from_str_radix(range.split_once('-')?.0, 16).ok()?;
                (from == start).then(|| rest[..4].to_string())
            })
            .unwrap_or_else(|| panic!("no mapping starts at {start:#x}"))
    }

    /// How a forked child that writes one byte at `at` ends: `Some(signal)` if a signal killed
    /// it, `None` if the write went through. The child only writes and exits (both allowed
    /// after a fork in a process with threads), and leaves no core dump.
    fn child_writing_at(at: *mut u8) -> Option<i32> {
        // SAFETY: the child calls only async-signal-safe functions (setrlimit, a store to
        // memory, _exit) before it ends; the parent only waits for it.
        unsafe {
            let pid = libc::fork();
            assert!(pid >= 0, "fork: {}", io::Error::last_os_error());
            if pid == 0 {
                let no_core = libc::rlimit {
                    rlim_cur: 0,
                    rlim_max: 0,
                };
                libc::setrlimit(libc::RLIMIT_CORE, &no_core);
                at.write_volatile(0x5a);
                libc::_exit(0);
            }
            let mut status = 0;
            assert_eq!(libc::waitpid(pid, &mut status, 0), pid);
            libc::WIFSIGNALED(status).then(|| libc::WTERMSIG(status))
        }
    }

    #[test]
    fn a_read_only_peer_mapping_faults_on_a_write_and_cannot_be_made_writable() {
        let (dir, arena) = arena(4 * PAGE);
        let mut region = arena.alloc(PAGE).unwrap();
        region.bytes_mut(PAGE).fill(7);
        let path = dir.path().join("arena");

        let reader = PeerArena::open(&path, Access::Read).unwrap();
        let span = reader.span();
        assert_eq!(permissions_at(span.start), "r--s");
        assert!(!reader.writable());
        assert!(
            reader.write(0, &[1]).is_none(),
            "a read-only view writes nothing"
        );
        // Mapped from a read-only descriptor: the pages cannot be made writable either.
        // SAFETY: mprotect on a whole page of a mapping this test owns; it is refused.
        let made_writable = unsafe {
            libc::mprotect(
                span.start as *mut libc::c_void,
                PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
            )
        };
        assert_eq!(made_writable, -1);
        assert_eq!(
            io::Error::last_os_error().raw_os_error(),
            Some(libc::EACCES)
        );
        assert_eq!(permissions_at(span.start), "r--s");
        assert_eq!(child_writing_at(span.start as *mut u8), Some(libc::SIGSEGV));
        assert_eq!(
            region.bytes(PAGE),
            &[7; PAGE][..],
            "the owner's bytes are intact"
        );

        // The control: the main lane's view is writable, and the same write goes through.
        let writer = PeerArena::open(&path, Access::ReadWrite).unwrap();
        assert_eq!(permissions_at(writer.span().start), "rw-s");
        assert_eq!(child_writing_at(writer.span().start as *mut u8), None);
        assert_eq!(region.bytes(1), &[0x5a]);
        assert_eq!(writer.write(1, &[9]), Some(()));
        assert_eq!(region.bytes(2), &[0x5a, 9]);
    }

    #[test]
    fn a_peer_refuses_an_arena_file_of_another_owner_mode_or_type_naming_it() {
        use std::os::unix::fs::PermissionsExt;
        let refusal = |result: crate::Result<PeerArena>| match result {
            Err(crate::CommError::SharedFileRefused { path, problem }) => (path, problem),
            Err(other) => panic!("another error: {other}"),
            Ok(_) => panic!("mapped"),
        };
        let (dir, _arena) = arena(4 * PAGE);
        let path = dir.path().join("arena");
        assert!(
            PeerArena::open(&path, Access::Read).is_ok(),
            "what create makes"
        );

        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let (named, problem) = refusal(PeerArena::open(&path, Access::Read));
        assert_eq!(named, path);
        assert_eq!(problem, crate::SharedFileProblem::Mode { mode: 0o644 });
        let message = crate::CommError::SharedFileRefused {
            path: named,
            problem,
        }
        .to_string();
        assert!(
            message.contains(&path.display().to_string()) && message.contains("0644"),
            "{message}"
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();

        // SAFETY: geteuid(2) cannot fail and touches no memory.
        let me = unsafe { libc::geteuid() };
        let other = me.wrapping_add(1);
        let owned_by_other = super::super::open_owned_by(&path, false, other)
            .map(|_| ())
            .unwrap_err();
        assert!(
            matches!(
                &owned_by_other,
                crate::CommError::SharedFileRefused {
                    path: p,
                    problem: crate::SharedFileProblem::Owner { owner, expected },
                } if *p == path && *owner == me && *expected == other
            ),
            "{owned_by_other}"
        );

        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        let (named, problem) = refusal(PeerArena::open(&link, Access::Read));
        assert_eq!(
            (named, problem),
            (
                link,
                crate::SharedFileProblem::NotRegular("a symbolic link")
            )
        );

        // A FIFO would block a plain read-only open until a writer came: refused at once.
        let fifo = dir.path().join("fifo");
        let c_fifo = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid C string; mkfifo creates a file in this test's directory.
        assert_eq!(unsafe { libc::mkfifo(c_fifo.as_ptr(), 0o600) }, 0);
        let (named, problem) = refusal(PeerArena::open(&fifo, Access::Read));
        assert_eq!(
            (named, problem),
            (fifo, crate::SharedFileProblem::NotRegular("a FIFO"))
        );
        let (_, problem) = refusal(PeerArena::open(dir.path(), Access::Read));
        assert_eq!(problem, crate::SharedFileProblem::NotRegular("a directory"));
    }
}
