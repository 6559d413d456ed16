//! The one error type of burn-dist-zero.

#[derive(Debug, thiserror::Error)]
pub enum ZeroError {
    #[error(transparent)]
    Comm(#[from] burn_dist_comm::CommError),
    #[error(transparent)]
    Dist(#[from] burn_dist::DistError),
    /// Boxed: a checkpoint error can itself carry a `ZeroError`.
    #[error(transparent)]
    Checkpoint(Box<crate::checkpoint::CheckpointError>),
    /// A collective on device memory failed (feature `device`).
    #[cfg(feature = "device")]
    #[error(transparent)]
    Device(#[from] burn_dist_device::DeviceError),
    /// `ZeroAdamConfig::host_threads` could not give a thread pool.
    #[error("ZeroAdamConfig::host_threads = Some({threads}): no thread pool ({reason})")]
    HostThreads { threads: usize, reason: String },
    /// An optimizer record (`ZeroAdamRecord`) of another model: other parameter counts.
    #[error(
        "the ZeroAdam record is of another model: it has {got} parameters with {got_elements} \
         elements, this model {expected} with {expected_elements}"
    )]
    RecordMismatch {
        expected: usize,
        expected_elements: usize,
        got: usize,
        got_elements: usize,
    },
    #[error("{0}")]
    Usage(String),
}

pub type Result<T, E = ZeroError> = std::result::Result<T, E>;
