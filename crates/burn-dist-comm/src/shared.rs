//! Buffers that peers on the same host read where they lie.

use std::fmt;

use crate::{DType, HostBuffer};

/// What this rank's shared buffers hold in its arena under `/dev/shm`
/// ([`HostCommunicator::shared_memory`](crate::HostCommunicator::shared_memory)), in bytes
/// (whole pages): the memory reserved for the buffers alive, and the most reserved at once
/// since the group formed. The host holds these pages once, though the kernel counts a page
/// in the resident memory (`RssShmem`) of every rank that read it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SharedMemory {
    pub held: usize,
    pub peak: usize,
}

/// A flat buffer for the communicator's in-place collectives
/// ([`HostCommunicator::all_reduce_shared`](crate::HostCommunicator::all_reduce_shared) and its
/// siblings), made by [`HostCommunicator::shared_buffer`](crate::HostCommunicator::shared_buffer).
///
/// Where every peer shares this host's memory, it lives in this rank's arena under `/dev/shm`
/// and the peers read it directly (and, in an all-reduce, write their reduced chunks into it):
/// an all-reduce then moves each byte through memory about half as often as through the rings. Elsewhere (peers on other hosts, in-process groups, shared memory turned
/// off or full) it lives on the heap and the same collectives run through the links, with
/// bitwise the same results. Its bytes are 4096-byte aligned in an arena and 8-byte aligned
/// on the heap.
pub struct SharedBuffer {
    dtype: DType,
    len: usize,
    storage: Storage,
}

enum Storage {
    /// u64 words, so that every element type is aligned.
    Heap(Vec<u64>),
    #[cfg(target_os = "linux")]
    Arena(crate::transport::Region),
}

impl SharedBuffer {
    /// `len` zeros on the heap: what [`HostCommunicator::shared_buffer`] gives where its peers
    /// cannot read this rank's memory. The collectives accept it anywhere.
    ///
    /// [`HostCommunicator::shared_buffer`]: crate::HostCommunicator::shared_buffer
    pub fn on_heap(dtype: DType, len: usize) -> Self {
        let words = (len * dtype.size()).div_ceil(8);
        SharedBuffer {
            dtype,
            len,
            storage: Storage::Heap(vec![0; words]),
        }
    }

    /// `len` zeros in `arena`, or `None` when the arena has no room.
    #[cfg(target_os = "linux")]
    pub(crate) fn in_arena(
        arena: &std::sync::Arc<crate::transport::shm::Arena>,
        dtype: DType,
        len: usize,
    ) -> Option<Self> {
        let region = arena.alloc(len * dtype.size())?;
        Some(SharedBuffer {
            dtype,
            len,
            storage: Storage::Arena(region),
        })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The most elements its memory holds (at least [`SharedBuffer::len`]; an arena's buffer
    /// is whole pages).
    pub fn capacity(&self) -> usize {
        let bytes = match &self.storage {
            Storage::Heap(words) => words.len() * 8,
            #[cfg(target_os = "linux")]
            Storage::Arena(region) => region.size(),
        };
        bytes / self.dtype.size()
    }

    /// Makes it `len` elements long, in the same memory, if its capacity allows (else `false`
    /// and nothing changes): a kept buffer serves a collective shorter than its last. Elements
    /// past the old length hold whatever the memory held.
    pub fn set_len(&mut self, len: usize) -> bool {
        let fits = len <= self.capacity();
        if fits {
            self.len = len;
        }
        fits
    }

    /// Whether the buffer lives in shared memory that the peers read directly.
    pub fn is_in_shared_memory(&self) -> bool {
        self.region().is_some()
    }

    pub fn as_bytes(&self) -> &[u8] {
        let bytes = self.len * self.dtype.size();
        match &self.storage {
            Storage::Heap(words) => &bytemuck::cast_slice(words)[..bytes],
            #[cfg(target_os = "linux")]
            Storage::Arena(region) => region.bytes(bytes),
        }
    }

    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        let bytes = self.len * self.dtype.size();
        match &mut self.storage {
            Storage::Heap(words) => &mut bytemuck::cast_slice_mut(words)[..bytes],
            #[cfg(target_os = "linux")]
            Storage::Arena(region) => region.bytes_mut(bytes),
        }
    }

    /// Bytes `range` of the buffer (inside its length), for writing, and no byte outside
    /// them: what an in-place collective writes while peers touch the rest of the buffer (see
    /// `Region::range_mut`).
    pub(crate) fn range_mut(&mut self, range: std::ops::Range<usize>) -> &mut [u8] {
        let bytes = self.len * self.dtype.size();
        assert!(
            range.end <= bytes,
            "bytes {range:?} of a {bytes}-byte buffer"
        );
        match &mut self.storage {
            Storage::Heap(words) => &mut bytemuck::cast_slice_mut(words)[range],
            #[cfg(target_os = "linux")]
            Storage::Arena(region) => region.range_mut(range),
        }
    }

    /// Its length in bytes.
    pub(crate) fn byte_len(&self) -> usize {
        self.len * self.dtype.size()
    }

    /// The elements, if the buffer holds f32.
    pub fn as_f32(&self) -> Option<&[f32]> {
        (self.dtype == DType::F32).then(|| bytemuck::cast_slice(self.as_bytes()))
    }

    /// The elements for writing, if the buffer holds f32.
    pub fn as_f32_mut(&mut self) -> Option<&mut [f32]> {
        (self.dtype == DType::F32).then(|| bytemuck::cast_slice_mut(self.as_bytes_mut()))
    }

    /// Overwrites the elements with `host`'s, which must have this buffer's dtype and length
    /// (`false`, and nothing written, otherwise).
    pub fn copy_from(&mut self, host: &HostBuffer) -> bool {
        let fits = host.dtype() == self.dtype && host.len() == self.len;
        if fits {
            self.as_bytes_mut().copy_from_slice(host.as_bytes());
        }
        fits
    }

    /// A copy of the elements as a [`HostBuffer`].
    pub fn to_host(&self) -> HostBuffer {
        let mut host = HostBuffer::zeros(self.dtype, self.len);
        host.as_bytes_mut().copy_from_slice(self.as_bytes());
        host
    }

    /// Where the buffer lies in this rank's arena, if it does.
    #[cfg(target_os = "linux")]
    pub(crate) fn region(&self) -> Option<&crate::transport::Region> {
        match &self.storage {
            Storage::Arena(region) => Some(region),
            Storage::Heap(_) => None,
        }
    }

    #[cfg(not(target_os = "linux"))]
    pub(crate) fn region(&self) -> Option<&std::convert::Infallible> {
        None
    }
}

impl fmt::Debug for SharedBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let place = if self.is_in_shared_memory() {
            "shared memory"
        } else {
            "heap"
        };
        write!(f, "SharedBuffer({} {}, {place})", self.len, self.dtype)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_heap_buffer_holds_its_elements_and_refuses_another_shape() {
        let mut buffer = SharedBuffer::on_heap(DType::BF16, 3);
        assert_eq!(buffer.as_bytes(), &[0; 6]);
        assert!(!buffer.is_in_shared_memory());
        assert!(buffer.as_f32().is_none());
        let host = crate::testing::rank_data(DType::BF16, 3, 7, 0);
        assert!(buffer.copy_from(&host));
        assert_eq!(buffer.to_host(), host);
        assert!(!buffer.copy_from(&crate::testing::rank_data(DType::BF16, 4, 7, 0)));
        assert!(!buffer.copy_from(&crate::testing::rank_data(DType::F16, 3, 7, 0)));
        assert_eq!(buffer.to_host(), host);
        // Three bf16 take one 8-byte word: room for a fourth, not a fifth.
        assert_eq!(buffer.capacity(), 4);
        assert!(!buffer.set_len(5));
        assert!(buffer.set_len(2));
        assert_eq!(buffer.as_bytes(), &host.as_bytes()[..4]);
        assert!(buffer.set_len(4));
        assert_eq!(&buffer.as_bytes()[..6], host.as_bytes());
    }
}
