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
//! it succeeded or failed (only a rank killed *during* the set-up can leave its files behind).
//! A pair uses shared memory only if both rings of it opened; otherwise (two containers with
//! separate `/dev/shm`, a full `/dev/shm`, shared memory turned off on either rank) it keeps its
//! TCP data connection. Both ranks of a pair read the same four facts, so they always agree.

mod ring;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

pub(crate) use ring::Ring;

use crate::store::StoreClient;
use crate::{CommConfig, Result};

/// Data bytes of each ring: two of them per pair and rank. Large enough that a write rarely
/// waits for the reader, small enough to stay in a shared last-level cache.
const RING_BYTES: usize = 1 << 20;
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

/// What two ranks must share to map the same file: the running kernel (its boot id) and the
/// `/dev/shm` mount (its device and inode). `None` where there is no `/dev/shm`.
fn host_identity() -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let dir = std::fs::metadata(SHM_DIR).ok().filter(|m| m.is_dir())?;
    Some(format!("{}/{}:{}", boot.trim(), dir.dev(), dir.ino()))
}

/// A fresh path for the ring from `writer` to `reader`, unique across jobs and retries.
fn ring_path(writer: usize, reader: usize) -> PathBuf {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let name = format!(
        "burn-dist-{}-{nanos:x}-{writer}-to-{reader}",
        std::process::id()
    );
    Path::new(SHM_DIR).join(name)
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
