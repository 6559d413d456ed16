//! The binary format of one rank's optimizer shard (`optim-rank-NNNNN.bin`).
//!
//! All integers and floats are little-endian. A fixed 56-byte header, then the arrays:
//!
//! | bytes | field |
//! |---|---|
//! | 8 | magic `BDZSHARD` |
//! | 4 | format version (u32, 1) |
//! | 4 | header length in bytes (u32, 56) |
//! | 4 | rank (u32) |
//! | 4 | world size (u32) |
//! | 8 | parameters `n` (u64) |
//! | 8 | shard length `s` in elements (u64) |
//! | 8 | total elements of the flat vector, without padding (u64) |
//! | 8 | skipped steps (u64) |
//! | 8·n | elements per parameter (u64) |
//! | 4·n | Adam step count per parameter (u32) |
//! | 4·s | master weights (f32) |
//! | 4·s | first moments m (f32) |
//! | 4·s | second moments v (f32) |

use std::path::Path;

use super::error::{CheckpointError, Result};
use crate::{FlatLayout, OptimizerShard};

pub const MAGIC: &[u8; 8] = b"BDZSHARD";
pub const SHARD_VERSION: u32 = 1;
const HEADER_LEN: usize = 56;

// The arrays are the host's bytes (bytemuck casts), which are the format's only on
// little-endian hosts (every platform Burn's GPU backends run on).
const _: () = assert!(
    cfg!(target_endian = "little"),
    "checkpoint shards are little-endian"
);

/// The shard file's bytes.
pub fn encode(shard: &OptimizerShard) -> Vec<u8> {
    let layout = &shard.layout;
    let n = layout.numels.len();
    let s = layout.shard_len;
    let mut out = Vec::with_capacity(HEADER_LEN + 12 * n + 12 * s);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&SHARD_VERSION.to_le_bytes());
    out.extend_from_slice(&(HEADER_LEN as u32).to_le_bytes());
    out.extend_from_slice(&(shard.rank as u32).to_le_bytes());
    out.extend_from_slice(&(layout.world as u32).to_le_bytes());
    for x in [n, s, layout.total] {
        out.extend_from_slice(&(x as u64).to_le_bytes());
    }
    out.extend_from_slice(&shard.skipped.to_le_bytes());
    let numels: Vec<u64> = layout.numels.iter().map(|&x| x as u64).collect();
    out.extend_from_slice(bytemuck::cast_slice(&numels));
    out.extend_from_slice(bytemuck::cast_slice(&shard.time));
    for values in [&shard.master, &shard.m, &shard.v] {
        assert_eq!(values.len(), s, "a shard holds shard_len elements");
        out.extend_from_slice(bytemuck::cast_slice(values));
    }
    out
}

/// What a shard file's fixed header says, checked against the file's length.
pub(crate) struct Header {
    pub rank: usize,
    pub world: usize,
    /// Parameters, elements per shard, total elements, skipped steps.
    pub n: u64,
    pub s: u64,
    pub total: u64,
    pub skipped: u64,
}

impl Header {
    /// Where the master weights start in the file (the header and the per-parameter arrays
    /// come before them).
    pub fn master_offset(&self) -> u64 {
        HEADER_LEN as u64 + 12 * self.n
    }
}

/// Parses the fixed header of a shard file of `len` bytes whose first bytes are `bytes`.
pub(crate) fn header(path: &Path, bytes: &[u8], len: u64) -> Result<Header> {
    let corrupt = |reason: String| CheckpointError::corrupt(path, reason);
    if bytes.len() < HEADER_LEN {
        return Err(corrupt(format!(
            "{} bytes, shorter than the {HEADER_LEN}-byte header (truncated)",
            bytes.len()
        )));
    }
    if &bytes[..8] != MAGIC {
        return Err(corrupt("not an optimizer shard (bad magic)".into()));
    }
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    let version = u32_at(8);
    if version > SHARD_VERSION {
        return Err(CheckpointError::NewerFormat {
            path: path.to_path_buf(),
            found: version,
            supported: SHARD_VERSION,
        });
    }
    let header_len = u32_at(12) as usize;
    let (rank, world) = (u32_at(16) as usize, u32_at(20) as usize);
    let (n, s, total, skipped) = (u64_at(24), u64_at(32), u64_at(40), u64_at(48));
    let expected = (n.checked_mul(12))
        .and_then(|a| s.checked_mul(12).and_then(|b| a.checked_add(b)))
        .and_then(|a| a.checked_add(header_len as u64));
    if header_len != HEADER_LEN || expected != Some(len) {
        return Err(corrupt(format!(
            "{len} bytes, but its header ({n} parameters, {s} elements per shard) needs {} (truncated or corrupt)",
            expected.map_or("more".into(), |e| e.to_string())
        )));
    }
    Ok(Header {
        rank,
        world,
        n,
        s,
        total,
        skipped,
    })
}

/// Parses a shard file read from `path`; `align` is unknown and irrelevant here (the layout's
/// shard length already includes it).
pub fn decode(path: &Path, bytes: &[u8]) -> Result<OptimizerShard> {
    let corrupt = |reason: String| CheckpointError::corrupt(path, reason);
    let Header {
        rank,
        world,
        n,
        s,
        total,
        skipped,
    } = header(path, bytes, bytes.len() as u64)?;
    let (n, s) = (n as usize, s as usize);
    let mut at = HEADER_LEN;
    let mut take = |len: usize| {
        let slice = &bytes[at..at + len];
        at += len;
        slice
    };
    let numels: Vec<usize> = bytemuck::pod_collect_to_vec::<u8, u64>(take(8 * n))
        .into_iter()
        .map(|x| x as usize)
        .collect();
    let time = bytemuck::pod_collect_to_vec::<u8, u32>(take(4 * n));
    let master = bytemuck::pod_collect_to_vec::<u8, f32>(take(4 * s));
    let m = bytemuck::pod_collect_to_vec::<u8, f32>(take(4 * s));
    let v = bytemuck::pod_collect_to_vec::<u8, f32>(take(4 * s));
    let mut layout = FlatLayout::new(&numels, world.max(1), 1);
    layout.shard_len = s;
    if layout.total != total as usize
        || rank >= world
        || s.checked_mul(world).is_none_or(|p| p < layout.total)
    {
        return Err(corrupt(format!(
            "inconsistent header (rank {rank} of {world}, {total} elements, {s} per shard)"
        )));
    }
    Ok(OptimizerShard {
        rank,
        layout,
        master,
        m,
        v,
        time,
        skipped,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rank 2's shard of three parameters over three ranks, with `short` elements fewer per
    /// shard than the layout needs.
    fn sample(short: usize) -> OptimizerShard {
        let mut layout = FlatLayout::new(&[7, 1, 30], 3, 4);
        layout.shard_len -= short;
        let s = layout.shard_len;
        OptimizerShard {
            rank: 2,
            layout,
            master: (0..s).map(|i| i as f32 * 0.5).collect(),
            m: (0..s).map(|i| -(i as f32)).collect(),
            v: (0..s).map(|i| i as f32 * 1e-3).collect(),
            time: vec![3, 2, 3],
            skipped: 1,
        }
    }

    #[test]
    fn a_shard_round_trips_and_any_cut_is_refused() {
        let shard = sample(0);
        let bytes = encode(&shard);
        let path = Path::new("optim-rank-00002.bin");
        assert_eq!(decode(path, &bytes).unwrap(), shard);
        for cut in [0, 10, HEADER_LEN, bytes.len() - 1] {
            let error = decode(path, &bytes[..cut]).unwrap_err().to_string();
            assert!(error.contains("optim-rank-00002.bin"), "{error}");
        }
        let mut newer = bytes.clone();
        newer[8..12].copy_from_slice(&(SHARD_VERSION + 1).to_le_bytes());
        let error = decode(path, &newer).unwrap_err().to_string();
        assert!(error.contains("format version 2 is newer"), "{error}");
    }

    /// Each inconsistency of the header alone is refused: a total that is not the sum of the
    /// sizes, a rank outside the world, shards that do not cover the total.
    #[test]
    fn an_inconsistent_header_is_refused_each_inconsistency_alone() {
        let path = Path::new("optim-rank-00002.bin");
        let good = encode(&sample(0));
        let total = u64::from_le_bytes(good[40..48].try_into().unwrap());
        let mut wrong_total = good.clone();
        wrong_total[40..48].copy_from_slice(&(total - 1).to_le_bytes());
        let mut outside = good.clone();
        outside[16..20].copy_from_slice(&3u32.to_le_bytes()); // rank 3 of 3
        let too_short = encode(&sample(4));
        for (what, bytes) in [
            ("total", wrong_total),
            ("rank", outside),
            ("shard length", too_short),
        ] {
            let error = decode(path, &bytes).unwrap_err().to_string();
            assert!(error.contains("inconsistent header"), "{what}: {error}");
        }
    }
}
