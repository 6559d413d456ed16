//! Names of collectives, for wire headers and for error messages.

use std::fmt;
use std::sync::Arc;

use crate::{DType, ReduceOp};

/// Which collective a message belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    Barrier,
}

impl OpKind {
    pub(crate) fn code(self) -> u8 {
        match self {
            OpKind::AllReduce => 1,
            OpKind::ReduceScatter => 2,
            OpKind::AllGather => 3,
            OpKind::Broadcast => 4,
            OpKind::Barrier => 5,
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => OpKind::AllReduce,
            2 => OpKind::ReduceScatter,
            3 => OpKind::AllGather,
            4 => OpKind::Broadcast,
            5 => OpKind::Barrier,
            _ => return None,
        })
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllGather => "all_gather",
            OpKind::Broadcast => "broadcast",
            OpKind::Barrier => "barrier",
        })
    }
}

/// Which of a communicator's lanes a collective runs on. Each lane has its own links, worker
/// and sequence numbers; collectives are ordered within a lane, not across lanes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Lane {
    /// Everything but parameter gathers.
    #[default]
    Main,
    /// Stage-3 parameter gathers ([`HostCommunicator::gather_lane`](crate::HostCommunicator::gather_lane)).
    Gather,
}

impl Lane {
    /// Its place among a rank's lanes: 0 for the main lane, 1 for the gather lane.
    pub(crate) fn index(self) -> usize {
        match self {
            Lane::Main => 0,
            Lane::Gather => 1,
        }
    }
}

/// One collective as issued by this rank: what it is, its sequence number and its size.
/// Displays as `all_reduce #17 (f32 sum, 12.5 MiB)`.
#[derive(Debug, Clone, PartialEq)]
pub struct OpDesc {
    pub kind: OpKind,
    /// Position of this collective in its lane's issue order, from 0.
    pub seq: u64,
    pub lane: Lane,
    /// What the caller says the payload is (burn-dist: which parameter a stage-3 gather
    /// carries), checked like the kind and the size; 0 for none. Displays by its label when the
    /// communicator has one ([`HostCommunicator::label_tags`](crate::HostCommunicator::label_tags)).
    pub tag: u32,
    /// What the communicator's tags stand for (`tag_labels[t - 1]` for tag `t`), so that a
    /// mismatch names both sides' payloads; `None` when nobody labelled them.
    pub tag_labels: Option<Arc<[String]>>,
    pub dtype: Option<DType>,
    pub reduce: Option<ReduceOp>,
    /// Size of the buffer handed to the collective.
    pub bytes: usize,
}

impl fmt::Display for OpDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} #{}", self.kind, self.seq)?;
        if self.lane == Lane::Gather {
            f.write_str(" on the gather lane")?;
        }
        if self.tag != 0 {
            write!(f, " tag {}", self.tag)?;
        }
        if let Some(dtype) = self.dtype {
            write!(f, " ({dtype}")?;
            if let Some(reduce) = self.reduce {
                write!(f, " {reduce}")?;
            }
            write!(f, ", {})", human_bytes(self.bytes))?;
        }
        Ok(())
    }
}

impl OpDesc {
    /// ` (`label`)` for `tag` when the labels name it, else nothing.
    pub(crate) fn label_of(&self, tag: u32) -> String {
        (tag as usize)
            .checked_sub(1)
            .and_then(|i| self.tag_labels.as_deref()?.get(i))
            .map_or_else(String::new, |label| format!(" (`{label}`)"))
    }
}

/// `12.5 MiB`, `3 KiB`, `17 B`.
pub fn human_bytes(bytes: usize) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}
