//! Flat host buffers, their element types and the reduction operators.

use std::fmt;

use half::{bf16, f16};

/// Element type of a flat buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    /// Raw bytes: moved by broadcast and all-gather, reduced only with `Max` (flags).
    U8,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }

    pub(crate) fn code(self) -> u8 {
        match self {
            DType::F32 => 1,
            DType::F16 => 2,
            DType::BF16 => 3,
            DType::U8 => 4,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::U8 => "u8",
        })
    }
}

/// How contributions of the ranks are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum in rank order, accumulated in f32 for every float type.
    Sum,
    /// The rank-order sum divided by the world size.
    Avg,
    /// Element-wise maximum; NaN wins, so a NaN on any rank is seen by every rank.
    Max,
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
        })
    }
}

/// A flat buffer in host memory, owned by the collective while it runs and handed back after.
#[derive(Debug, Clone, PartialEq)]
pub enum HostBuffer {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    U8(Vec<u8>),
}

impl HostBuffer {
    /// A buffer of `len` zeros.
    pub fn zeros(dtype: DType, len: usize) -> Self {
        match dtype {
            DType::F32 => HostBuffer::F32(vec![0.0; len]),
            DType::F16 => HostBuffer::F16(vec![f16::ZERO; len]),
            DType::BF16 => HostBuffer::BF16(vec![bf16::ZERO; len]),
            DType::U8 => HostBuffer::U8(vec![0; len]),
        }
    }

    /// A zeroed buffer of `len` elements for a collective to fill. One of at least
    /// [`HUGE_PAGE_RESULT_BYTES`] is fresh memory from the kernel under glibc's malloc with its
    /// default thresholds (or gpt-pretrain's), which maps every allocation that large; its
    /// first touch faults in each 4 KiB page: 17 ms per 64 MiB on the project's 2-vCPU VM,
    /// more than the copy that fills it. On Linux such a buffer is
    /// advised to take transparent huge pages (where the system allows them on advice), 512
    /// times fewer faults.
    pub(crate) fn for_result(dtype: DType, len: usize) -> Self {
        let mut buffer = HostBuffer::zeros(dtype, len);
        #[cfg(target_os = "linux")]
        if buffer.as_bytes().len() >= HUGE_PAGE_RESULT_BYTES {
            advise_huge_pages(buffer.as_bytes_mut());
        }
        buffer
    }

    pub fn dtype(&self) -> DType {
        match self {
            HostBuffer::F32(_) => DType::F32,
            HostBuffer::F16(_) => DType::F16,
            HostBuffer::BF16(_) => DType::BF16,
            HostBuffer::U8(_) => DType::U8,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.as_bytes().len() / self.dtype().size()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn as_bytes(&self) -> &[u8] {
        match self {
            HostBuffer::F32(v) => bytemuck::cast_slice(v),
            HostBuffer::F16(v) => bytemuck::cast_slice(v),
            HostBuffer::BF16(v) => bytemuck::cast_slice(v),
            HostBuffer::U8(v) => v,
        }
    }

    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        match self {
            HostBuffer::F32(v) => bytemuck::cast_slice_mut(v),
            HostBuffer::F16(v) => bytemuck::cast_slice_mut(v),
            HostBuffer::BF16(v) => bytemuck::cast_slice_mut(v),
            HostBuffer::U8(v) => v,
        }
    }

    /// The elements converted to f32 (bytes as their values).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match self {
            HostBuffer::F32(v) => v.clone(),
            HostBuffer::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
            HostBuffer::BF16(v) => v.iter().map(|x| x.to_f32()).collect(),
            HostBuffer::U8(v) => v.iter().map(|&x| f32::from(x)).collect(),
        }
    }

    /// The elements `range` as a new buffer of the same type.
    pub fn slice(&self, range: std::ops::Range<usize>) -> HostBuffer {
        match self {
            HostBuffer::F32(v) => HostBuffer::F32(v[range].to_vec()),
            HostBuffer::F16(v) => HostBuffer::F16(v[range].to_vec()),
            HostBuffer::BF16(v) => HostBuffer::BF16(v[range].to_vec()),
            HostBuffer::U8(v) => HostBuffer::U8(v[range].to_vec()),
        }
    }
}

impl From<Vec<f32>> for HostBuffer {
    fn from(v: Vec<f32>) -> Self {
        HostBuffer::F32(v)
    }
}
impl From<Vec<f16>> for HostBuffer {
    fn from(v: Vec<f16>) -> Self {
        HostBuffer::F16(v)
    }
}
impl From<Vec<bf16>> for HostBuffer {
    fn from(v: Vec<bf16>) -> Self {
        HostBuffer::BF16(v)
    }
}
impl From<Vec<u8>> for HostBuffer {
    fn from(v: Vec<u8>) -> Self {
        HostBuffer::U8(v)
    }
}

/// Results this large get huge pages: glibc's largest dynamic mmap threshold, so that with
/// glibc's default settings the advice covers a mapping of the buffer's own, never part of the
/// heap. (A program that raises `M_MMAP_THRESHOLD` above it, or another allocator, may see part
/// of its heap advised: harmless to contents, possibly more memory in huge pages.)
pub const HUGE_PAGE_RESULT_BYTES: usize = 32 << 20;

/// Advises the 2 MiB-aligned part of `bytes` (untouched memory of a fresh mapping) to be backed
/// by transparent huge pages. Advice only: where it is refused nothing changes.
#[cfg(target_os = "linux")]
fn advise_huge_pages(bytes: &mut [u8]) {
    const HUGE_PAGE: usize = 2 << 20;
    let start = bytes.as_mut_ptr() as usize;
    let (first, end) = (
        start.next_multiple_of(HUGE_PAGE),
        (start + bytes.len()) / HUGE_PAGE * HUGE_PAGE,
    );
    if first < end {
        // SAFETY: the range lies inside `bytes`, memory this buffer owns; MADV_HUGEPAGE only
        // changes how its pages are backed, never their contents.
        unsafe { libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_result_buffer_is_zeros_of_its_length_with_or_without_huge_pages() {
        for len in [0, 5, HUGE_PAGE_RESULT_BYTES / 4 + 3] {
            let mut buffer = HostBuffer::for_result(DType::F32, len);
            assert_eq!(buffer.len(), len);
            assert!(buffer.as_bytes().iter().all(|&b| b == 0));
            // Written through, as a collective does: every byte is there.
            buffer.as_bytes_mut().fill(7);
            assert!(buffer.as_bytes().iter().all(|&b| b == 7));
        }
    }
}
