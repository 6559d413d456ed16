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
    /// A `ZeroAdamRecord` taken on a rank other than 0, which holds none of the state.
    #[error(
        "the ZeroAdam record is empty: `to_record` gathers the state to rank 0 only, so a \
         record taken on another rank holds none of it; load the record rank 0 saved (burn-train's \
         checkpointer with burn_dist::train::RankZeroRecorder saves it there)"
    )]
    RecordNotOnRankZero,
    /// A `DecayRule::Mask` whose length is not the model's number of trainable parameters.
    #[error(
        "ZeroAdamConfig::decay: the mask has {got} flags, but the model has {expected} trainable \
         parameters (one flag per parameter of `Ddp::params()`, in its order)"
    )]
    DecayMaskLength { got: usize, expected: usize },
    /// ZeroAdam was built before `Ddp::prepare`.
    #[error("call `Ddp::prepare(model)` before building ZeroAdam")]
    NotPrepared,
    #[error(
        "ZeRO stage {stage} is not supported: use 1 (sharded optimizer state), 2 (sharded \
         optimizer state and gradients) or 3 (parameters sharded too)"
    )]
    UnsupportedStage { stage: u8 },
    /// Stage 3 on a model that `Ddp::prepare_sharded` did not shard, or the other way round.
    #[error(
        "ZeRO stage {stage} with a model {state}: at stage 3 prepare the model with \
         `Ddp::prepare_sharded` (backend `DistributedBackend<B, Sharded>`); at stages 1 and 2 \
         with `Ddp::prepare`"
    )]
    StageAndModel { stage: u8, state: &'static str },
    /// Stage 3 lays the shards out as the sharded model does.
    #[error(
        "ZeroAdamConfig::align = {align}: at stage 3 the shards are the sharded model's, whose \
         shard lengths are multiples of {model_align} (burn_dist::SHARD_ALIGN); leave `align` \
         at its default"
    )]
    Stage3Align { align: usize, model_align: usize },
    /// `ZeroAdam::on_device` or `ZeroAdam::offloaded` (`asked`) at stage 3 with a model whose
    /// pieces are in host memory.
    #[error(
        "ZeroAdam::{asked} at stage 3 needs the model's pieces in device memory: prepare the \
         model (`Ddp::prepare_sharded`) with a `Ddp` on the device path (`Ddp::init_staged`, \
         `Ddp::init_nccl`), or keep ZeroAdam on the host"
    )]
    Stage3OnDevice { asked: &'static str },
    /// `ZeroAdam::on_device` or `ZeroAdam::offloaded` on a state already placed by one of them.
    #[error(
        "ZeroAdam's state is already {placed}; `ZeroAdam::{asked}` would place it again: call one \
         of `on_device` (state in device memory) and `offloaded` (state on the host, model on the \
         device), once"
    )]
    AlreadyPlaced {
        placed: &'static str,
        asked: &'static str,
    },
    /// `ZeroAdam::on_device` with a `Ddp` that is not on the device path of that runtime.
    #[error(
        "ZeroAdam's device state needs the `Ddp` on the device path of the same runtime \
         (`Ddp::init_staged::<B>` or `Ddp::init_nccl::<B>` with B = {backend})"
    )]
    NotOnDevicePath { backend: &'static str },
    /// `ZeroAdam::on_device`: the state does not fit in what the device has left (known on
    /// CUDA; `burn_dist_device::device_memory`).
    #[error(
        "rank {rank}: ZeroAdam's state in device memory needs {} (f32 master weights, moments \
         and gradient shard: 16 bytes per element of this rank's shard of {shard_len}, plus \
         the model-dtype copy), but only {} of the device's {} are available: keep the state \
         in host memory with `ZeroAdam::offloaded` (gpt-pretrain --offload), or shard it over \
         more ranks",
        gib(*needed),
        gib(*available),
        gib(*total)
    )]
    DeviceMemory {
        rank: usize,
        shard_len: usize,
        needed: u64,
        available: u64,
        total: u64,
    },
    /// The device step writes one dtype for the whole model.
    #[error(
        "the device step writes one dtype for the whole model, but {first} is {first_dtype} and \
         {other} is {other_dtype}"
    )]
    MixedDtypes {
        first: String,
        first_dtype: String,
        other: String,
        other_dtype: String,
    },
    /// The device step cannot handle this dtype (on this runtime).
    #[error("the device step handles f32, f16 and bf16 {what}; {dtype} is not supported{on}")]
    UnsupportedDtype {
        what: &'static str,
        dtype: String,
        /// `" on <runtime>"` when the runtime lacks the type, else empty.
        on: String,
    },
    /// The device keeps one step count, but the parameters' counts differ.
    #[error(
        "the fused device step keeps one count for all parameters' steps, but {param} has taken \
         {steps} steps and {first} has taken {first_steps} (use the host path)"
    )]
    UnevenStepCounts {
        param: String,
        steps: u32,
        first: String,
        first_steps: u32,
    },
    /// A shard given to `ZeroAdam::import` is not this rank's.
    #[error(
        "optimizer shard of rank {rank} ({shard_len} elements per shard over {world} ranks) does \
         not fit rank {expected_rank} ({expected_shard_len} per shard over {expected_world})"
    )]
    ShardMismatch {
        rank: usize,
        shard_len: usize,
        world: usize,
        expected_rank: usize,
        expected_shard_len: usize,
        expected_world: usize,
    },
    /// The fused device step got no gradient for a parameter.
    #[error(
        "the fused device step needs a gradient for every parameter, and {param} has none in \
         this step (no rank used it)"
    )]
    MissingGradient { param: String },
    /// Ranks that found other parameters of the model replaced since the last step (a record
    /// loaded on some ranks only): the values ZeroAdam takes into its master weights would
    /// differ between the ranks' shards.
    #[error(
        "rank {rank} found {found} since the last step, but rank 0 found {rank0_found} (replaced \
         on this rank: {here}): was a record loaded, or an older model put back, on some ranks \
         only? Every rank must load the same at the same point: ZeroAdam takes the loaded values \
         into its master weights, and ranks that took different ones would part ways"
    )]
    ReplacedOnSomeRanks {
        rank: usize,
        found: crate::loaded::Replacements,
        rank0_found: crate::loaded::Replacements,
        here: String,
    },
    /// A gradient (or the reducer's gradient shard) of another backend or shape than the
    /// device state's.
    #[error("ZeroAdam's device state was built for `{expected}`; {got}")]
    WrongGradient { expected: &'static str, got: String },
}

pub type Result<T, E = ZeroError> = std::result::Result<T, E>;

/// `bytes` in GiB, for messages.
fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}
