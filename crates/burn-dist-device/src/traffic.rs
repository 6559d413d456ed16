//! Bytes that cross between host and device: what the device path promises to keep small.

use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes moved between host and device so far, as a snapshot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Device to host (reads).
    pub to_host: u64,
    /// Host to device (uploads).
    pub to_device: u64,
}

impl Traffic {
    /// Both directions together.
    pub fn total(self) -> u64 {
        self.to_host + self.to_device
    }

    /// What moved between `earlier` and `self`.
    pub fn since(self, earlier: Traffic) -> Traffic {
        Traffic {
            to_host: self.to_host - earlier.to_host,
            to_device: self.to_device - earlier.to_device,
        }
    }
}

impl std::ops::Add for Traffic {
    type Output = Traffic;

    fn add(self, other: Traffic) -> Traffic {
        Traffic {
            to_host: self.to_host + other.to_host,
            to_device: self.to_device + other.to_device,
        }
    }
}

/// A shared counter of [`Traffic`]: the collectives record what they stage, and their users
/// (the reducer, ZeroAdam) record their own reads of scalars in the same counter.
#[derive(Debug, Default)]
pub struct TrafficCounter {
    to_host: AtomicU64,
    to_device: AtomicU64,
    calls: AtomicU64,
}

impl TrafficCounter {
    /// `bytes` read from the device.
    pub fn to_host(&self, bytes: usize) {
        self.to_host.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// `bytes` written to the device.
    pub fn to_device(&self, bytes: usize) {
        self.to_device.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// One collective issued on device memory (one NCCL group, or one staged host collective).
    pub fn call(&self) {
        self.calls.fetch_add(1, Ordering::Relaxed);
    }

    /// Collectives issued so far: how many groups (NCCL) or host collectives (staged) the
    /// device path made, whatever they moved.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// The totals so far.
    pub fn get(&self) -> Traffic {
        Traffic {
            to_host: self.to_host.load(Ordering::Relaxed),
            to_device: self.to_device.load(Ordering::Relaxed),
        }
    }
}
