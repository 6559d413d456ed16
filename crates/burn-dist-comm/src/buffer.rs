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
