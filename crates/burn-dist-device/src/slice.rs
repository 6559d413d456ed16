//! A range of elements of a cubecl buffer: what every device collective works on, in place.

use std::fmt;
use std::ops::Range;

use burn_dist_comm::DType;
use cubecl::Runtime;
use cubecl::prelude::ComputeClient;
use cubecl::server::Handle;

use crate::error::{DeviceError, Result};

/// The float types the device collectives move and reduce (reductions accumulate in f32, as
/// the host collectives do).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceDType {
    F32,
    F16,
    BF16,
}

impl DeviceDType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        self.host().size()
    }

    /// The host communicator's element type.
    pub fn host(self) -> DType {
        match self {
            DeviceDType::F32 => DType::F32,
            DeviceDType::F16 => DType::F16,
            DeviceDType::BF16 => DType::BF16,
        }
    }
}

impl fmt::Display for DeviceDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.host().fmt(f)
    }
}

/// `len` elements of `dtype` starting at element `offset` of the buffer `handle` on `client`'s
/// device. Every rank of a collective passes slices of the same lengths and dtypes.
pub struct DeviceSlice<R: Runtime> {
    pub client: ComputeClient<R>,
    pub handle: Handle,
    pub offset: usize,
    pub len: usize,
    pub dtype: DeviceDType,
}

impl<R: Runtime> Clone for DeviceSlice<R> {
    fn clone(&self) -> Self {
        DeviceSlice {
            client: self.client.clone(),
            handle: self.handle.clone(),
            offset: self.offset,
            len: self.len,
            dtype: self.dtype,
        }
    }
}

impl<R: Runtime> fmt::Debug for DeviceSlice<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "DeviceSlice({} elements of {} at {} of a {}-byte buffer)",
            self.len,
            self.dtype,
            self.offset,
            self.handle.size_in_used()
        )
    }
}

impl<R: Runtime> DeviceSlice<R> {
    /// Elements `offset..offset + len` of `handle` (checked when a collective uses it).
    pub fn new(
        client: ComputeClient<R>,
        handle: Handle,
        offset: usize,
        len: usize,
        dtype: DeviceDType,
    ) -> Self {
        DeviceSlice {
            client,
            handle,
            offset,
            len,
            dtype,
        }
    }

    /// The whole buffer `handle` as elements of `dtype`.
    pub fn whole(client: ComputeClient<R>, handle: Handle, dtype: DeviceDType) -> Self {
        let len = handle.size_in_used() as usize / dtype.size();
        Self::new(client, handle, 0, len, dtype)
    }

    /// Elements `range` of this slice (relative to its start).
    pub fn range(&self, range: Range<usize>) -> Self {
        DeviceSlice {
            offset: self.offset + range.start,
            len: range.len(),
            ..self.clone()
        }
    }

    /// Its size in bytes.
    pub fn bytes(&self) -> usize {
        self.len * self.dtype.size()
    }

    /// Elements the whole buffer holds.
    pub(crate) fn buffer_len(&self) -> usize {
        self.handle.size_in_used() as usize / self.dtype.size()
    }

    /// Fails unless the slice lies inside its buffer.
    pub(crate) fn check(&self, rank: usize, op: &'static str) -> Result<()> {
        let end = self.offset.saturating_add(self.len);
        if end > self.buffer_len() {
            return Err(DeviceError::OutOfBounds {
                rank,
                op,
                offset: self.offset,
                end,
                dtype: self.dtype,
                buffer_bytes: self.handle.size_in_used(),
            });
        }
        Ok(())
    }
}

/// Checks `counts` against `world` ranks and a slice of `len` elements; returns each rank's
/// element range.
pub(crate) fn chunk_ranges(
    counts: &[usize],
    world: usize,
    len: usize,
    rank: usize,
    op: &'static str,
) -> Result<Vec<Range<usize>>> {
    if counts.len() != world || counts.iter().sum::<usize>() != len {
        return Err(DeviceError::Counts {
            rank,
            op,
            counts: counts.to_vec(),
            world,
            len,
        });
    }
    let mut start = 0;
    Ok(counts
        .iter()
        .map(|&n| {
            start += n;
            start - n..start
        })
        .collect())
}
