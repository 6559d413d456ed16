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

    /// The ranks prepared their models with different settings that must be the same on
    /// every rank (ZeRO stage 3's `DdpConfig::prefetch`: which gathers each rank issues ahead).
    #[error(
        "the ranks prepared the model with different settings: `{setting}` is `{here}` on rank \
         {rank} but `{rank0}` on rank 0; every rank must use the same"
    )]
    SettingMismatch {
        setting: &'static str,
        rank: usize,
        here: String,
        rank0: String,
    },

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
         marked: a model Burn rebuilt drops the marks (`model.load_record(record)`: write \
         `ddp.mark(model.load_record(record))`), and with gradient accumulation call \
         `ddp.mark(model)` before the forward pass of every micro-batch (Burn consumes the marks \
         in each backward)"
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

    /// A `Ddp` method that needs the model's parameters ran before `Ddp::prepare`.
    #[error("call `Ddp::prepare(model)` before `{call}`")]
    NotPrepared { call: &'static str },

    /// ZeRO stage 2 was asked for its gradient shard, but gradients are not sharded.
    #[error(
        "gradients are not sharded (ZeRO stage 2 is not on): call `Ddp::shard_gradients` first"
    )]
    NotSharded,

    /// ZeRO stage 2: no reduced gradient shard is waiting (taken twice in one window, or taken
    /// before the window's last backward).
    #[error(
        "no reduced gradient shard{}: run `Ddp::backward` to the end of an accumulation window \
         before each optimizer step, and take the shard once per window",
        if *on_device { " on the device" } else { "" }
    )]
    NoGradientShard { on_device: bool },

    /// The flat layout given to `Ddp::shard_gradients` is not the prepared model's.
    #[error(
        "the flat layout to shard gradients over ({layout_params} parameters, {layout_ranks} \
         ranks) does not match the prepared model ({model_params} parameters, {model_ranks} \
         ranks): build it from `Ddp::params` of this `Ddp`"
    )]
    LayoutMismatch {
        layout_params: usize,
        layout_ranks: usize,
        model_params: usize,
        model_ranks: usize,
    },

    /// `Ddp::shard_gradients` was called inside an accumulation window.
    #[error("gradient sharding can only start between optimizer steps, not inside a window")]
    ShardingMidWindow,

    /// A bucket order (e.g. a checkpoint's) is not a permutation of the trainable parameters.
    #[error(
        "a bucket order must list each of the {params} trainable parameters once; got {got} \
         entries"
    )]
    BadBucketOrder { params: usize, got: usize },

    /// The device reducer was built for another backend than the one training.
    #[error(
        "the device reducer was set up for gradients of `{expected}`, and this backend's are \
         `{got}`: build the `Ddp` for the backend you train on (`Ddp::init` for any backend on \
         the host path)"
    )]
    WrongBackend { expected: String, got: String },

    /// The device reducer reduces f32, f16 and bf16 gradients only.
    #[error(
        "parameter #{param}: the device reducer reduces f32, f16 and bf16 gradients; this one is \
         {dtype}"
    )]
    UnsupportedDtype { param: usize, dtype: String },

    /// A tensor's values could not be read to the host (for a gradient hook or a collective).
    #[error("reading {what}: {reason}")]
    TensorRead { what: &'static str, reason: String },

    /// Tensors given to a collective do not agree across ranks.
    #[error("{op}: rank {rank}'s tensor has {got} bytes, {expected} were expected ({reason})")]
    TensorMismatch {
        op: &'static str,
        rank: usize,
        expected: usize,
        got: usize,
        reason: &'static str,
    },

    /// An integer all-reduce overflowed u64.
    #[error("{op} of u64 values overflows u64")]
    Overflow { op: &'static str },

    /// `Ddp::init_nccl` needs a launched job (its NCCL communicator meets through the job's
    /// store), and no launcher variable was set.
    #[error(
        "{call} needs a job started by a launcher (no launcher variable, such as RANK or SLURM_PROCID, is set): start it with \
         `burn-dist-run --nproc-per-node N -- ...`, even for one GPU"
    )]
    NotLaunched { call: &'static str },

    /// ZeRO stage 3: gathering a sharded parameter for an op failed: the ranks' programs
    /// diverged (a rank used another parameter at this point, because it branched differently,
    /// or used one alone, printing or evaluating a weight on one rank, so the ranks' gathers no
    /// longer pair up), or a peer died or failed. The advice follows the cause
    /// ([`gather_advice`]).
    #[error(
        "rank {rank} gathering sharded parameter #{param} `{name}`: {source}{}",
        gather_advice(source)
    )]
    Gather {
        rank: usize,
        param: usize,
        name: String,
        #[source]
        source: Box<CommError>,
    },

    /// ZeRO stage 3: a trainable parameter of the model no longer holds its shard (a write
    /// replaced it: slice-assign, a mapper storing a new tensor, a stock Burn optimizer's step),
    /// so this rank would hold a full copy that the sharded optimizer never updates.
    #[error(
        "rank {rank}: sharded parameter #{param} `{name}` was replaced by a full local tensor \
         (a write into a sharded parameter: slice_assign, a ModuleMapper storing a new tensor, \
         or a stock Burn optimizer's step). Under ZeRO stage 3 only ZeroAdam (stage 3) updates \
         the parameters; to load new values into a sharded model, `load_record` a record into \
         it (each rank keeps its piece), or call `Ddp::prepare_sharded` on it again and build \
         its optimizer again (the handles of an earlier preparation count as replaced)"
    )]
    ShardReplaced {
        rank: usize,
        param: usize,
        name: String,
    },

    /// ZeRO stage 3: a record taken with `into_record` holds the parameters' values on rank 0
    /// only (each was gathered to rank 0, the other ranks keep no copy), and a rank other than
    /// 0 tried to read one out of its record.
    #[error(
        "rank {rank}: parameter `{name}` of this model record has its values on rank 0 only: \
         at ZeRO stage 3 `into_record` gathers each parameter to rank 0, so save records on \
         rank 0 (burn_dist::train::RankZeroRecorder does it for burn-train), or read weights \
         from the model itself on every rank"
    )]
    RecordOnRankZero { rank: usize, name: String },

    /// ZeRO stage 3: the ranks used the sharded parameters in different sequences during one
    /// optimizer step (each use is hashed; the hashes are compared with the step's agreement).
    #[error(
        "rank {rank} used the sharded parameters in another sequence than rank 0 during this \
         step ({uses} uses, rank 0: {rank0_uses}): every rank must run the same forward and \
         backward under ZeRO stage 3"
    )]
    UseSequence {
        rank: usize,
        uses: u64,
        rank0_uses: u64,
    },

    /// ZeRO stage 3: the order in which this rank used the sharded parameters during the
    /// recorded step (and where its backward passes ended) differs from rank 0's, so the ranks
    /// would gather them ahead in different orders.
    #[error(
        "rank {rank}: the {phase:?} gather schedule differs from rank 0's at entry #{position} \
         (uses and ends of backward passes, from 0): this rank has {here}, rank 0 {rank0} \
         (every rank must run the same forwards and backwards under ZeRO stage 3)"
    )]
    Schedule {
        rank: usize,
        phase: crate::sharding::Phase,
        position: usize,
        here: String,
        rank0: String,
    },

    /// ZeRO stage 3: at an optimizer step some ranks recorded a new gather schedule of a phase
    /// to agree on and others did not, so their gathers ahead already differed (their
    /// `PrefetchConfig`s or their earlier schedules differ).
    #[error(
        "rank {rank} {} a new {phase:?} gather schedule to agree on at this step, and rank 0 {}: \
         the ranks' gather schedules or their `PrefetchConfig`s differ (set it on every rank \
         alike, `DdpConfig::prefetch` or `ParamShards::set_prefetch`)",
        if *here { "has" } else { "has no" },
        if *here { "has none" } else { "has one" }
    )]
    NewSchedules {
        rank: usize,
        phase: crate::sharding::Phase,
        here: bool,
    },

    /// An internal invariant did not hold (a bug, or a misuse with no better name).
    #[error("{0}")]
    Usage(String),
}

pub type Result<T, E = DistError> = std::result::Result<T, E>;

/// What to do about a failed gather, by its cause: a peer's message that paired with another
/// collective, or no message in time, is what diverged programs look like; a closed connection
/// is a peer that died (its own log says why); a peer's abort carries that peer's own error and
/// advice, and is told as it is.
fn gather_advice(source: &CommError) -> &'static str {
    match source {
        CommError::Mismatch { .. } | CommError::Timeout { .. } => {
            ". Under ZeRO stage 3 every rank must use the sharded parameters in the same order: \
             run the same forward and backward on every rank (evaluate on every rank, each on its \
             share of the data), and read parameter values on every rank together (a read is a \
             gather)"
        }
        CommError::PeerClosed { .. } | CommError::PeerLost { .. } => {
            ". That rank's process ended (it failed, was killed, or its node was lost): its own \
             log, or its launcher's, says why"
        }
        _ => "",
    }
}

/// Ends an op, which cannot return an error, with `error`: written once on stderr as the error
/// line it is (`error: burn-dist: …`), then the op unwinds with `burn-dist: …` as its panic
/// payload (what `catch_unwind` callers read), without running the panic hook. The hook would
/// print `thread '…' panicked at <a file of burn-dist>` before the cause, and, under
/// `RUST_BACKTRACE`, a backtrace from inside the op that says nothing of it, whose last note a
/// launcher would quote as the rank's error.
pub(crate) fn fail_op(error: impl std::fmt::Display) -> ! {
    let message = format!("burn-dist: {error}");
    eprintln!("error: {message}");
    std::panic::resume_unwind(Box::new(message))
}
