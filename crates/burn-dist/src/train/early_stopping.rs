//! Early stopping decided by rank 0, for every rank.

use std::sync::Arc;

use burn_dist_comm::{Communicator, HostBuffer, HostCommunicator};
use burn_train::EarlyStoppingStrategy;
use burn_train::metric::store::EventStoreClient;

use crate::Ddp;

/// An early-stopping strategy whose decision every rank takes from rank 0: rank 0 holds the
/// validation metrics (the other ranks log none), and a rank that stopped alone would leave
/// the others waiting in their next collective. One byte is broadcast per epoch.
#[derive(Clone)]
pub struct AgreedEarlyStopping<S> {
    inner: S,
    comm: Arc<HostCommunicator>,
}

impl<S> AgreedEarlyStopping<S> {
    pub fn new(ddp: &Ddp, inner: S) -> Self {
        AgreedEarlyStopping {
            inner,
            comm: ddp.comm(),
        }
    }
}

impl<S: EarlyStoppingStrategy> EarlyStoppingStrategy for AgreedEarlyStopping<S> {
    fn should_stop(&mut self, epoch: usize, store: &EventStoreClient) -> bool {
        let mine = self.inner.should_stop(epoch, store);
        let decision = self
            .comm
            .broadcast(HostBuffer::U8(vec![u8::from(mine)]), 0)
            .wait()
            .unwrap_or_else(|error| {
                panic!(
                    "rank {}: agreeing on early stopping after epoch {epoch}: {error}",
                    self.comm.rank()
                )
            });
        decision.as_bytes()[0] != 0
    }
}
