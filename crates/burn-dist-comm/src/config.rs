//! Settings shared by the store, the rendezvous and the collectives.

use std::time::Duration;

/// How long any blocking wait may last before it fails with an error naming the peer.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10 * 60);

/// Settings of a communicator and its rendezvous.
#[derive(Debug, Clone)]
pub struct CommConfig {
    /// Bound on every blocking wait of a collective: a message from a peer, a barrier.
    pub timeout: Duration,
    /// Bound on joining: reaching the store, waiting for every rank to publish its address,
    /// connecting the mesh, and every later store get.
    pub join_timeout: Duration,
    /// Largest frame the TCP store accepts; larger ones are refused before any allocation.
    pub max_store_frame: usize,
    /// Whether ranks on one host carry their data through shared memory (Linux `/dev/shm`)
    /// instead of loopback TCP. A pair uses it only if both ranks allow it; the environment
    /// variable `BURN_DIST_SHM=0` turns it off for [`init`](crate::init).
    pub shared_memory: bool,
}

impl Default for CommConfig {
    fn default() -> Self {
        Self {
            timeout: DEFAULT_TIMEOUT,
            join_timeout: DEFAULT_TIMEOUT,
            max_store_frame: 16 << 20,
            shared_memory: true,
        }
    }
}

impl CommConfig {
    /// The same settings with another timeout for collectives and for joining.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self.join_timeout = timeout;
        self
    }

    /// The same settings with shared memory between same-host ranks allowed or not.
    pub fn with_shared_memory(mut self, allowed: bool) -> Self {
        self.shared_memory = allowed;
        self
    }

    /// The same settings with another timeout for joining only.
    pub fn with_join_timeout(mut self, timeout: Duration) -> Self {
        self.join_timeout = timeout;
        self
    }
}
