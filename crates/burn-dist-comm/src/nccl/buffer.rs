//! Flat buffers in GPU memory, the [`Communicator::Buffer`](crate::Communicator::Buffer) of
//! [`NcclCommunicator`](super::NcclCommunicator).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, sys::CUdeviceptr};

use crate::{DType, HostBuffer};

/// `len` elements of `dtype` in GPU memory: a view into an allocation on one device.
///
/// A collective takes the buffer by value and hands it back when it is done. A reduce-scatter
/// hands back the same allocation narrowed to this rank's chunk; an all-gather widens a shard
/// back to the whole buffer in place when the shard sits at its chunk's place in a large
/// enough allocation (as a reduce-scatter's result does), and copies it into a new allocation
/// otherwise. Elements of the allocation outside the view may be overwritten by a collective
/// that runs on it: the view is the only part whose content is defined.
pub struct DeviceBuffer {
    pub(crate) mem: CudaSlice<u8>,
    /// Elements of the allocation before the view.
    pub(crate) offset: usize,
    pub(crate) len: usize,
    pub(crate) dtype: DType,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("device", &self.device())
            .field("dtype", &self.dtype)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("capacity", &self.capacity())
            .finish()
    }
}

impl DeviceBuffer {
    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements in the view.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements of the allocation before the view.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Size of the whole allocation, in elements.
    pub fn capacity(&self) -> usize {
        self.mem.len() / self.dtype.size()
    }

    /// The CUDA device ordinal of the allocation.
    pub fn device(&self) -> usize {
        self.mem.ordinal()
    }

    /// The device address of the view's first element.
    pub(crate) fn ptr(&self) -> CUdeviceptr {
        self.base() + (self.offset * self.dtype.size()) as CUdeviceptr
    }

    /// The device address of the allocation.
    pub(crate) fn base(&self) -> CUdeviceptr {
        // Event tracking is off on the communicator's context (one stream orders everything),
        // so the guard records nothing.
        let (ptr, _guard) = self.mem.device_ptr(self.mem.stream());
        ptr
    }

    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        self.mem.stream()
    }

    /// The same allocation viewed as elements `[offset, offset + len)`.
    pub(crate) fn view(self, offset: usize, len: usize) -> DeviceBuffer {
        debug_assert!(offset + len <= self.capacity());
        DeviceBuffer {
            offset,
            len,
            ..self
        }
    }

    /// Bytes of the view, as a range of the allocation.
    pub(crate) fn byte_range(&self) -> std::ops::Range<usize> {
        let size = self.dtype.size();
        self.offset * size..(self.offset + self.len) * size
    }

    /// An empty host buffer of this view's type and length, to download into.
    pub(crate) fn host_like(&self) -> HostBuffer {
        HostBuffer::zeros(self.dtype, self.len)
    }
}
