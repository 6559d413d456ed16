//! Settings shared by the store, the rendezvous and the collectives.

use std::time::Duration;

/// How long any blocking wait may last before it fails with an error naming the peer.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10 * 60);

/// The longest timeout accepted from the environment (30 days). Every deadline is an `Instant`
/// plus a timeout (plus a little slack), and this keeps that sum far from overflowing.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(30 * 24 * 3600);

/// How long a new connection to the store or to a rank's mesh listener has to present its
/// hello, all of its bytes together.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a collective waits before it asks its peers where they stand (see
/// [`CommConfig::divergence_grace`]).
pub const DEFAULT_DIVERGENCE_GRACE: Duration = Duration::from_secs(1);

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
    /// Bound on one connection's hello, to the store or to a rank's mesh listener, from accept
    /// to the last byte: a peer that sends nothing, or one byte at a time, is dropped after it.
    pub handshake_timeout: Duration,
    /// Whether ranks on one host carry their data through shared memory (Linux `/dev/shm`)
    /// instead of loopback TCP. A pair uses it only if both ranks allow it; the environment
    /// variable `BURN_DIST_SHM=0` turns it off for [`init`](crate::init).
    pub shared_memory: bool,
    /// Whether the group gets a second lane for parameter gathers
    /// ([`HostCommunicator::gather_lane`](crate::HostCommunicator::gather_lane)): its own links
    /// to every peer and its own worker thread, so that a gather never queues behind a large
    /// reduction. It costs one more connection (or pair of rings) per peer and one thread. It
    /// must be the same on every rank; the environment variable `BURN_DIST_GATHER_LANE=0`
    /// turns it off for [`init`](crate::init).
    pub gather_lane: bool,
    /// How long a caller waits for a collective before it asks every peer, over the control
    /// connection, how far it has issued on each lane and what it waits for. Ranks that wait
    /// for each other on different lanes (each in a collective another has not issued, which
    /// no header can show) are then found, twice a grace apart, and the group is aborted with
    /// [`CommError::Diverged`](crate::CommError::Diverged) naming what each waits in, instead
    /// of waiting out [`Self::timeout`]. Waits shorter than this send nothing.
    pub divergence_grace: Duration,
}

impl Default for CommConfig {
    fn default() -> Self {
        Self {
            timeout: DEFAULT_TIMEOUT,
            join_timeout: DEFAULT_TIMEOUT,
            max_store_frame: 16 << 20,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            shared_memory: true,
            gather_lane: true,
            divergence_grace: DEFAULT_DIVERGENCE_GRACE,
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

    /// The same settings with the gather lane on or off (see [`Self::gather_lane`]).
    pub fn with_gather_lane(mut self, on: bool) -> Self {
        self.gather_lane = on;
        self
    }

    /// The same settings with another [`Self::divergence_grace`].
    pub fn with_divergence_grace(mut self, grace: Duration) -> Self {
        self.divergence_grace = grace;
        self
    }

    /// Data lanes of a group with these settings: the main one, and the gather lane if on.
    pub(crate) fn lanes(&self) -> usize {
        1 + usize::from(self.gather_lane)
    }

    /// The same settings with another bound on each connection's hello.
    pub fn with_handshake_timeout(mut self, timeout: Duration) -> Self {
        self.handshake_timeout = timeout;
        self
    }

    /// The same settings with another timeout for joining only.
    pub fn with_join_timeout(mut self, timeout: Duration) -> Self {
        self.join_timeout = timeout;
        self
    }
}
