//! The header in front of every message between two ranks. It lets the receiver check that both
//! sides are in the same collective with the same dtype and size, and fail with a clear
//! `Mismatch` instead of reading garbage when they are not.

use std::fmt;

use crate::{DType, OpDesc, OpKind};

pub(crate) const HEADER_LEN: usize = 24;
const MAGIC: u8 = 0xBD;

/// `[magic, op, dtype, 0] tag:u32 seq:u64 len:u64`, little endian.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub op: OpKind,
    pub dtype: Option<DType>,
    /// What the caller says the payload is ([`OpDesc::tag`]); 0 for none.
    pub tag: u32,
    pub seq: u64,
    /// Payload bytes that follow.
    pub len: u64,
}

impl Header {
    pub fn for_op(desc: &OpDesc) -> Self {
        Header {
            op: desc.kind,
            dtype: desc.dtype,
            tag: desc.tag,
            seq: desc.seq,
            len: 0,
        }
    }

    pub fn with_len(self, len: usize) -> Self {
        Header {
            len: len as u64,
            ..self
        }
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0] = MAGIC;
        out[1] = self.op.code();
        out[2] = self.dtype.map_or(0, DType::code);
        out[4..8].copy_from_slice(&self.tag.to_le_bytes());
        out[8..16].copy_from_slice(&self.seq.to_le_bytes());
        out[16..24].copy_from_slice(&self.len.to_le_bytes());
        out
    }

    /// Decodes a header; `Err` carries a description of what arrived instead.
    pub fn decode(bytes: &[u8; HEADER_LEN]) -> Result<Self, String> {
        if bytes[0] != MAGIC {
            return Err(format!("a frame with bad magic byte {:#04x}", bytes[0]));
        }
        let op =
            OpKind::from_code(bytes[1]).ok_or_else(|| format!("unknown op code {}", bytes[1]))?;
        let dtype = match bytes[2] {
            0 => None,
            1 => Some(DType::F32),
            2 => Some(DType::F16),
            3 => Some(DType::BF16),
            4 => Some(DType::U8),
            code => return Err(format!("unknown dtype code {code}")),
        };
        let tag = u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes"));
        let seq = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
        let len = u64::from_le_bytes(bytes[16..24].try_into().expect("8 bytes"));
        Ok(Header {
            op,
            dtype,
            tag,
            seq,
            len,
        })
    }
}

impl fmt::Display for Header {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} #{}", self.op, self.seq)?;
        if self.tag != 0 {
            write!(f, " tag {}", self.tag)?;
        }
        if let Some(dtype) = self.dtype {
            write!(f, " {dtype}")?;
        }
        write!(f, " with {} bytes", self.len)
    }
}
