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

    /// `Ddp` was used before `prepare`.
    #[error("{0}")]
    Usage(String),
}

pub type Result<T, E = DistError> = std::result::Result<T, E>;
