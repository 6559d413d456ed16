//! Shared-memory data links between ranks on one host (Linux).
//!
//! Over loopback TCP every byte crosses the kernel twice and an all-reduce reaches about a tenth
//! of memcpy (docs/perf/host-all-reduce.md). Ranks that share a host therefore carry their data
//! through a pair of [`Ring`]s in `/dev/shm` instead; the TCP control connection stays, so a
//! dead peer is still noticed at once and aborts still reach everyone.
//!
//! Setting up a pair goes through the store and needs no extra connection: each rank publishes
//! its host identity, creates one ring to every peer with the same identity, publishes the
//! ring's path, opens the peers' rings to itself and says whether that worked; then each
//! creator unlinks its files, so nothing is left in `/dev/shm` once the set-up is over, whether
//! it succeeded or failed. Only a rank killed *during* the set-up can leave its files behind;
//! the next set-up on the host removes those ([`sweep_stale_rings`]: files named after a pid
//! that no longer exists).
//! A pair uses shared memory only if both rings of it opened; otherwise (two containers with
//! separate `/dev/shm`, a full `/dev/shm`, shared memory turned off on either rank) it keeps its
//! TCP data connection. Both ranks of a pair read the same four facts, so they always agree.

pub(crate) mod arena;
mod ring;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

pub(crate) use arena::{Access, Arena, Arenas, PeerArena, Region};
pub(crate) use ring::{ALIGN as RING_ALIGN, Ring};

use crate::store::StoreClient;
use crate::{CommConfig, CommError, Result, SharedFileProblem};

/// Data bytes of each ring: two of them per pair and rank. Large enough that a write rarely
/// waits for the reader, small enough to stay in a shared last-level cache.
pub(crate) const RING_BYTES: usize = 1 << 20;
const _: () = assert!(RING_BYTES.is_multiple_of(RING_ALIGN));
const SHM_DIR: &str = "/dev/shm";
const OPENED: &[u8] = b"opened";

/// Both directions between this rank and one peer.
#[derive(Clone)]
pub(crate) struct ShmLink {
    /// This rank writes, the peer reads.
    pub outbound: Arc<Ring>,
    /// The peer writes, this rank reads.
    pub inbound: Arc<Ring>,
}

/// The store keys of one set-up. They carry the set-up's generation (how many times this rank
/// has connected through this store, the same count on every rank of a group), so that a
/// second group on the same store never reads the first one's values.
struct Keys {
    generation: i64,
}

impl Keys {
    fn new(rank: usize, store: &StoreClient) -> Result<Keys> {
        let generation = store.add(&format!("burn-dist/shm/connects/{rank}"), 1)?;
        Ok(Keys { generation })
    }

    fn host(&self, rank: usize) -> String {
        format!("burn-dist/shm/{}/host/{rank}", self.generation)
    }

    fn ring(&self, writer: usize, reader: usize) -> String {
        format!("burn-dist/shm/{}/ring/{writer}/{reader}", self.generation)
    }

    fn opened(&self, writer: usize, reader: usize) -> String {
        format!("burn-dist/shm/{}/opened/{writer}/{reader}", self.generation)
    }

    fn arena(&self, owner: usize) -> String {
        format!("burn-dist/shm/{}/arena/{owner}", self.generation)
    }

    fn arena_opened(&self, owner: usize, reader: usize) -> String {
        format!(
            "burn-dist/shm/{}/arena-opened/{owner}/{reader}",
            self.generation
        )
    }
}

/// The rings this rank created, by reader. Whatever is still here when it drops (an error
/// before every peer confirmed) has its file unlinked, so no way out of the set-up leaves a
/// file in `/dev/shm`.
struct Created(Vec<Option<(PathBuf, Ring)>>);

impl Created {
    /// The ring to `peer`, its file unlinked: from now on only the two mappings hold it.
    fn take(&mut self, peer: usize) -> Option<Ring> {
        self.0[peer].take().map(|(path, ring)| {
            _ = std::fs::remove_file(&path);
            ring
        })
    }
}

impl Drop for Created {
    fn drop(&mut self) {
        for (path, _) in self.0.iter().flatten() {
            _ = std::fs::remove_file(path);
        }
    }
}

/// Creates the file at `path` for this process alone: it must not exist (`O_EXCL`), and only
/// this user may open it.
pub(crate) fn create_private(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
}

/// Opens a file that a peer made with [`create_private`], for reading and, with `write`, for
/// writing, and refuses anything else: a file that is not regular (a symbolic link is not
/// followed, and a FIFO does not block the open), that belongs to another user, or that anyone
/// but its owner may open. The checks read the opened descriptor, so the file checked is the
/// file that is mapped.
pub(crate) fn open_private(path: &Path, write: bool) -> Result<std::fs::File> {
    // SAFETY: geteuid(2) cannot fail and touches no memory.
    open_owned_by(path, write, unsafe { libc::geteuid() })
}

/// [`open_private`] for files that `owner` must own.
fn open_owned_by(path: &Path, write: bool, owner: u32) -> Result<std::fs::File> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
    let refused = |problem| CommError::SharedFileRefused {
        path: path.to_path_buf(),
        problem,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => refused(SharedFileProblem::NotRegular("a symbolic link")),
            _ => CommError::io(format!("opening {}", path.display()), e),
        })?;
    let meta = file
        .metadata()
        .map_err(|e| CommError::io(format!("reading the status of {}", path.display()), e))?;
    let kind = meta.file_type();
    let problem = if !kind.is_file() {
        let what = match () {
            _ if kind.is_dir() => "a directory",
            _ if kind.is_fifo() => "a FIFO",
            _ if kind.is_socket() => "a socket",
            _ if kind.is_block_device() || kind.is_char_device() => "a device",
            _ => "not a file",
        };
        Some(SharedFileProblem::NotRegular(what))
    } else if meta.uid() != owner {
        Some(SharedFileProblem::Owner {
            owner: meta.uid(),
            expected: owner,
        })
    } else if meta.mode() & 0o7777 != 0o600 {
        Some(SharedFileProblem::Mode {
            mode: meta.mode() & 0o7777,
        })
    } else {
        None
    };
    match problem {
        Some(problem) => Err(refused(problem)),
        None => Ok(file),
    }
}

/// What two ranks must share to map the same file: the running kernel (its boot id) and the
/// `/dev/shm` mount (its device and inode). `None` where there is no `/dev/shm`.
fn host_identity() -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let dir = std::fs::metadata(SHM_DIR).ok().filter(|m| m.is_dir())?;
    Some(format!("{}/{}:{}", boot.trim(), dir.dev(), dir.ino()))
}

/// The start of every ring file's name; the creator's pid follows it.
const RING_PREFIX: &str = "burn-dist-";

/// A fresh path for the ring from `writer` to `reader`, unique across jobs and retries.
fn ring_path(writer: usize, reader: usize) -> PathBuf {
    shm_path(&format!("{writer}-to-{reader}"))
}

/// A fresh path for a file of this process under `/dev/shm`, ending in `what`. The creator's
/// pid and pid namespace come first, so that [`sweep_stale_rings`] can tell whose file it is.
fn shm_path(what: &str) -> PathBuf {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let name = format!(
        "{RING_PREFIX}{}-{:x}-{nanos:x}-{what}",
        std::process::id(),
        pid_namespace().unwrap_or(0)
    );
    Path::new(SHM_DIR).join(name)
}

/// This process's pid namespace (the inode of `/proc/self/ns/pid`). Containers that share a
/// `/dev/shm` may each have their own: a pid seen in a file name is only meaningful in the
/// namespace that wrote it.
fn pid_namespace() -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").ok().map(|m| m.ino())
}

/// Unlinks the ring files in `dir` that a dead process of this user and pid namespace created:
/// a rank killed during the set-up (between creating its rings and the peers' confirmation)
/// cannot unlink them itself, so the next job on the host does. Files of live processes
/// (another job's set-up in progress), of other users or pid namespaces, and any other file are
/// left alone. Returns how many files it removed.
pub(crate) fn sweep_stale_rings(dir: &Path) -> usize {
    use std::os::unix::fs::MetadataExt;
    let (Ok(entries), Some(namespace)) = (std::fs::read_dir(dir), pid_namespace()) else {
        return 0;
    };
    // SAFETY: getuid(2) cannot fail and touches no memory.
    let me = unsafe { libc::getuid() };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(RING_PREFIX))
            .and_then(|rest| {
                let mut fields = rest.split('-');
                let pid = fields.next()?.parse::<libc::pid_t>().ok()?;
                let ns = u64::from_str_radix(fields.next()?, 16).ok()?;
                (pid > 0 && ns == namespace).then_some(pid)
            })
        else {
            continue;
        };
        let owned = entry.metadata().is_ok_and(|m| m.is_file() && m.uid() == me);
        if owned && !process_exists(pid) && std::fs::remove_file(entry.path()).is_ok() {
            tracing::info!(
                "removed {}, a shared-memory ring left by pid {pid}, which has exited",
                entry.path().display()
            );
            removed += 1;
        }
    }
    removed
}

/// Whether a process with this pid exists (a zombie counts: its parent has not reaped it yet,
/// and it may still be a rank whose launcher is about to).
fn process_exists(pid: libc::pid_t) -> bool {
    // SAFETY: kill(2) with signal 0 sends nothing; it only checks that the pid exists.
    let found = unsafe { libc::kill(pid, 0) } == 0;
    found || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Links this rank to every peer on the same host through shared memory, where both sides can;
/// `links[peer]` is `None` for the others (and for this rank). With `config.shared_memory` off,
/// this rank still takes part in the exchange but offers no peer a link.
pub(crate) fn link_same_host_peers(
    rank: usize,
    world: usize,
    store: &StoreClient,
    config: &CommConfig,
) -> Result<Vec<Option<ShmLink>>> {
    let keys = Keys::new(rank, store)?;
    let identity = config.shared_memory.then(host_identity).flatten();
    if identity.is_some() {
        sweep_stale_rings(Path::new(SHM_DIR));
    }
    store.set(
        &keys.host(rank),
        identity.as_deref().unwrap_or("").as_bytes(),
    )?;
    let mut same_host = vec![false; world];
    if let Some(identity) = &identity {
        for (peer, same) in same_host.iter_mut().enumerate() {
            *same = peer != rank && store.get(&keys.host(peer))? == identity.as_bytes();
        }
    }
    let peers = || (0..world).filter(|&peer| same_host[peer]);

    // Rings this rank writes: created and published before any wait, so no rank waits on another.
    let mut outbound = Created((0..world).map(|_| None).collect());
    for peer in peers() {
        let path = ring_path(rank, peer);
        match Ring::create(&path, rank, peer, RING_BYTES, config.timeout) {
            Ok(ring) => outbound.0[peer] = Some((path, ring)),
            Err(e) => tracing::warn!(
                rank,
                peer,
                "cannot create a shared-memory ring at {}, using TCP: {e}",
                path.display()
            ),
        }
        let published = outbound.0[peer].as_ref().map_or(Path::new(""), |(p, _)| p);
        store.set(
            &keys.ring(rank, peer),
            published.as_os_str().as_encoded_bytes(),
        )?;
    }

    // Rings this rank reads, and whether each opened.
    let mut inbound: Vec<Option<Ring>> = (0..world).map(|_| None).collect();
    for peer in peers() {
        let path = String::from_utf8_lossy(&store.get(&keys.ring(peer, rank))?).into_owned();
        let verdict = if path.is_empty() {
            b"not created".to_vec()
        } else {
            match Ring::open(Path::new(&path), peer, rank, config.timeout) {
                Ok(ring) => {
                    inbound[peer] = Some(ring);
                    OPENED.to_vec()
                }
                Err(e) => format!("rank {rank} cannot open {path}: {e}").into_bytes(),
            }
        };
        store.set(&keys.opened(peer, rank), &verdict)?;
    }

    let mut links: Vec<Option<ShmLink>> = (0..world).map(|_| None).collect();
    for peer in peers() {
        let verdict = store.get(&keys.opened(rank, peer))?;
        match (outbound.take(peer), inbound[peer].take()) {
            (Some(out), Some(inb)) if verdict == OPENED => {
                links[peer] = Some(ShmLink {
                    outbound: Arc::new(out),
                    inbound: Arc::new(inb),
                });
            }
            _ => tracing::warn!(
                rank,
                peer,
                "no shared memory with rank {peer} on this host, using TCP ({})",
                String::from_utf8_lossy(&verdict)
            ),
        }
    }
    Ok(links)
}

/// A file under `/dev/shm` removed when this drops.
struct Unlinked(PathBuf);

impl Drop for Unlinked {
    fn drop(&mut self) {
        _ = std::fs::remove_file(&self.0);
    }
}

/// Gives this rank an arena that every peer maps, and maps every peer's, when all of `linked`
/// (every peer but this rank) reach this rank through shared memory: then collectives on
/// buffers in the arenas read the peers' buffers where they lie. One [`Arenas`] per lane, all
/// with the same arena of this rank: the main lane (lane 0) maps the peers' arenas read-write,
/// since its in-place all-reduce writes each rank's reduced chunk into every peer's buffer; the
/// other lanes (the gather lane) map them read-only, from a descriptor opened read-only, so
/// that nothing on them can write a peer's bytes ([`Access::for_lane`]). `None` for every lane
/// otherwise, or when any arena cannot be created or mapped; every rank takes part in the
/// exchange either way. Like the rings, the file is unlinked once every peer has opened it (or
/// failed to).
pub(crate) fn share_arenas(
    rank: usize,
    world: usize,
    store: &StoreClient,
    linked: &[bool],
    lanes: usize,
) -> Result<Vec<Option<Arc<Arenas>>>> {
    let keys = Keys::new(rank, store)?;
    let peers = || (0..world).filter(|&q| q != rank && linked[q]);
    let every_peer_linked = world > 1 && peers().count() == world - 1;
    // The file goes when this returns, however it returns: the peers have mapped it by then,
    // or will not.
    let created = every_peer_linked
        .then(|| {
            let path = shm_path(&format!("arena-{rank}"));
            Arena::create(&path, Arena::capacity_for(Path::new(SHM_DIR)))
                .inspect_err(|e| {
                    tracing::warn!(
                        rank,
                        "cannot create a shared-memory arena at {}, collectives go through the \
                         rings: {e}",
                        path.display()
                    )
                })
                .ok()
                .map(|arena| (Unlinked(path), arena))
        })
        .flatten();
    let published = created.as_ref().map_or(Path::new(""), |(p, _)| &p.0);
    store.set(&keys.arena(rank), published.as_os_str().as_encoded_bytes())?;

    // `mapped[lane][peer]`.
    let mut mapped: Vec<Vec<Option<PeerArena>>> = (0..lanes)
        .map(|_| (0..world).map(|_| None).collect())
        .collect();
    for peer in peers() {
        let path = String::from_utf8_lossy(&store.get(&keys.arena(peer))?).into_owned();
        let verdict = if path.is_empty() {
            b"not created".to_vec()
        } else {
            let opened = (0..lanes)
                .map(|lane| PeerArena::open(Path::new(&path), Access::for_lane(lane)))
                .collect::<Result<Vec<_>>>();
            match opened {
                Ok(arenas) => {
                    for (lane, arena) in arenas.into_iter().enumerate() {
                        mapped[lane][peer] = Some(arena);
                    }
                    OPENED.to_vec()
                }
                Err(e) => format!("rank {rank} cannot map {path}: {e}").into_bytes(),
            }
        };
        store.set(&keys.arena_opened(peer, rank), &verdict)?;
    }
    for peer in peers() {
        let verdict = store.get(&keys.arena_opened(rank, peer))?;
        if created.is_some() && verdict != OPENED {
            tracing::warn!(
                rank,
                peer,
                "rank {peer} cannot read this rank's arena, collectives go through the rings ({})",
                String::from_utf8_lossy(&verdict)
            );
        }
    }
    let none = || (0..lanes).map(|_| None).collect();
    let Some((_unlinked, own)) = created else {
        return Ok(none());
    };
    if !peers().all(|q| mapped[0][q].is_some()) {
        return Ok(none());
    }
    let own = Arc::new(own);
    Ok(mapped
        .into_iter()
        .map(|peers| {
            Some(Arc::new(Arenas {
                own: own.clone(),
                peers,
            }))
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Link;

    /// The pid of a process that has exited and been reaped.
    fn dead_pid() -> u32 {
        let mut child = std::process::Command::new("true")
            .spawn()
            .expect("spawn true");
        child.wait().expect("wait for true");
        child.id()
    }

    fn ring_file(dir: &Path, pid: u32, namespace: u64) -> PathBuf {
        let path = dir.join(format!("{RING_PREFIX}{pid}-{namespace:x}-1f2e-0-to-1"));
        std::fs::write(&path, b"ring").unwrap();
        path
    }

    #[test]
    fn sweep_removes_only_rings_of_exited_processes_of_this_pid_namespace() {
        let dir = tempfile::tempdir().unwrap();
        let namespace = pid_namespace().expect("/proc/self/ns/pid");
        let dead = ring_file(dir.path(), dead_pid(), namespace);
        let alive = ring_file(dir.path(), std::process::id(), namespace);
        let other_namespace = ring_file(dir.path(), dead_pid(), namespace ^ 1);
        let unrelated = dir.path().join("burn-dist-notapid-0-to-1");
        std::fs::write(&unrelated, b"x").unwrap();

        assert_eq!(sweep_stale_rings(dir.path()), 1);
        assert!(!dead.exists(), "the exited process's ring must be removed");
        assert!(
            alive.exists(),
            "a live process's ring (a set-up in progress) must stay"
        );
        assert!(
            other_namespace.exists(),
            "another pid namespace's pid means nothing here"
        );
        assert!(unrelated.exists());
    }

    /// The set-up itself sweeps: a ring left in `/dev/shm` by a rank killed during an earlier
    /// job's set-up is gone once the next group on this host has linked.
    #[test]
    fn linking_a_group_sweeps_rings_left_by_exited_processes() {
        let namespace = pid_namespace().expect("/proc/self/ns/pid");
        let stale = ring_file(Path::new(SHM_DIR), dead_pid(), namespace);
        let _group = crate::testing::linked_group(2, &CommConfig::default(), Link::SharedMemory);
        let left = stale.exists();
        _ = std::fs::remove_file(&stale);
        assert!(!left, "{} was not swept by the set-up", stale.display());
    }

    /// In a group over shared memory, the main lane maps each peer's arena writable (its
    /// all-reduce writes into it) and the gather lane read-only; both lanes allocate in the
    /// same arena of their own rank.
    #[test]
    fn the_gather_lane_maps_the_peers_arenas_read_only_and_the_main_lane_writable() {
        let (_store, comms) = crate::testing::linked_group(
            3,
            &CommConfig::default().with_gather_lane(true),
            Link::SharedMemory,
        );
        let permissions = |arenas: &Arenas, peer: usize| {
            let view = arenas.peers[peer]
                .as_ref()
                .expect("every peer's arena mapped");
            arena::tests::permissions_at(view.span().start)
        };
        for (rank, comm) in comms.iter().enumerate() {
            let main = comm.arenas().expect("the main lane's arenas");
            let gather = comm
                .gather_lane()
                .arenas()
                .expect("the gather lane's arenas");
            assert!(
                Arc::ptr_eq(&main.own, &gather.own),
                "rank {rank}: one arena"
            );
            assert!(main.writes_peers() && !gather.writes_peers());
            for peer in (0..3).filter(|&q| q != rank) {
                assert_eq!(permissions(main, peer), "rw-s", "rank {rank}, peer {peer}");
                assert_eq!(
                    permissions(gather, peer),
                    "r--s",
                    "rank {rank}, peer {peer}"
                );
            }
        }
    }

    #[test]
    fn ring_paths_name_their_creator() {
        let path = ring_path(2, 3);
        let name = path.file_name().unwrap().to_str().unwrap();
        let prefix = format!(
            "{RING_PREFIX}{}-{:x}-",
            std::process::id(),
            pid_namespace().unwrap()
        );
        assert!(
            name.starts_with(&prefix),
            "{name} does not start with {prefix}"
        );
        assert!(name.ends_with("-2-to-3"), "{name}");
    }
}
