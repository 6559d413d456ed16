//! The rendezvous store: a small TCP key-value service hosted by rank 0.

mod client;
pub mod codec;
mod server;

pub use client::StoreClient;
pub use server::StoreServer;

/// Connections the store (and each rank's mesh listener) lets wait for their hello beyond
/// those the job itself opens at once; a newer one pushes out the longest waiter.
pub use crate::gate::SPARE_PENDING;

/// Compares job tokens in time independent of where they differ (also for the launcher's
/// elastic rendezvous).
pub fn tokens_match(presented: &[u8], expected: &[u8]) -> bool {
    presented.len() == expected.len()
        && presented
            .iter()
            .zip(expected)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}
