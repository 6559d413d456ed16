//! The one error type of burn-dist.

use burn_dist_comm::CommError;

#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// A collective failed: a peer died, timed out or disagreed.
    #[error(transparent)]
    Comm(#[from] CommError),

    /// A collective on device memory failed (bad slice, unsupported dtype, a peer's failure).
    #[cfg(feature = "device")]
    #[error(transparent)]
    Device(#[from] burn_dist_device::DeviceError),

    /// The ranks were given different models.
    #[error("the ranks have different models: {0}")]
    ModelMismatch(String),

    /// A gradient hook saw a parameter that `Ddp::prepare` did not register.
    #[error(
        "a marked parameter ({id}) is not registered with the reducer: call `Ddp::prepare` on \
         the model before training it"
    )]
    UnknownParameter { id: String },

    #[error("parameter #{param}: its gradient has {got} elements, the parameter has {expected}")]
    GradientShape {
        param: usize,
        expected: usize,
        got: usize,
    },

    #[error("parameter #{param} received two final gradients in one backward")]
    DuplicateGradient { param: usize },

    #[error("a gradient hook ran outside a backward pass")]
    NoBackward,

    /// A parameter has a local gradient that never reached the reducer.
    #[error(
        "parameter #{param} `{name}` has a gradient that was not synchronized because it was not \
         marked: with gradient accumulation, call `ddp.mark(model)` before the forward pass of \
         every micro-batch (Burn consumes the marks in each backward)"
    )]
    NotMarked { param: usize, name: String },

    /// An optimizer step came with gradients that no backward pass synchronized since the
    /// previous step: the model's parameters were not marked for sync.
    #[error(
        "rank {rank}: the optimizer was given gradients that were not averaged over the ranks \
         (no backward pass reached burn-dist since the last step), so every rank would train on \
         its own gradients. The parameters were not marked for sync: burn-train's Learner \
         forks the model, which drops the marks, so mark the copy that runs the forward pass in \
         `TrainStep::step`: `let model = burn_dist::mark_for_sync(self.clone());`"
    )]
    UnsyncedStep { rank: usize },

    /// burn-train's multi-device strategy was used with a burn-dist optimizer.
    #[error(
        "burn-dist runs one process per device: train on one device per process (launched by \
         burn-dist-run) instead of burn-train's multi-device strategy"
    )]
    MultiDevice,

    /// `Ddp` was used before `prepare`.
    #[error("{0}")]
    Usage(String),
}

pub type Result<T, E = DistError> = std::result::Result<T, E>;
