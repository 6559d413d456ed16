//! What can go wrong in a device collective, as variants a caller can match.

use burn_dist_comm::CommError;

use crate::DeviceDType;

/// A device collective's error.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// A slice reaches past the end of its buffer.
    #[error(
        "rank {rank}: {op}: elements {offset}..{end} of {dtype} do not fit in the device buffer of \
         {buffer_bytes} bytes"
    )]
    OutOfBounds {
        rank: usize,
        op: &'static str,
        offset: usize,
        end: usize,
        dtype: DeviceDType,
        buffer_bytes: u64,
    },
    /// The per-rank counts do not describe the slice.
    #[error(
        "rank {rank}: {op}: counts {counts:?} must have one entry per rank ({world}) and sum to \
         the slice's {len} elements"
    )]
    Counts {
        rank: usize,
        op: &'static str,
        counts: Vec<usize>,
        world: usize,
        len: usize,
    },
    /// A root that is not a rank of the group.
    #[error("rank {rank}: {op}: root {root} is not a rank of a group of {world}")]
    Root {
        rank: usize,
        op: &'static str,
        root: usize,
        world: usize,
    },
    /// One group mixes element types (a staged group is one host buffer).
    #[error("rank {rank}: {op}: one group holds slices of {first} and of {other}")]
    MixedDTypes {
        rank: usize,
        op: &'static str,
        first: DeviceDType,
        other: DeviceDType,
    },
    /// The runtime cannot store or copy this element type (bf16 on WGSL, f16 without
    /// `shader-f16`).
    #[error("rank {rank}: {op}: the device runtime ({runtime}) has no {dtype} type")]
    UnsupportedDType {
        rank: usize,
        op: &'static str,
        dtype: DeviceDType,
        runtime: String,
    },
    /// cubecl failed to read or resolve device memory.
    #[error("rank {rank}: {op}: {reason}")]
    Device {
        rank: usize,
        op: &'static str,
        reason: String,
    },
    /// The collective itself failed (a peer died, timed out, aborted…).
    #[error(transparent)]
    Comm(#[from] CommError),
}

/// Results of this crate.
pub type Result<T, E = DeviceError> = std::result::Result<T, E>;
