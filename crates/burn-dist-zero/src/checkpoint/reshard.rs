//! Resharding: which parts of the old shards make up a new shard.
//!
//! The flat order of elements (parameters back to back in visit order) does not depend on the
//! world size; only the cut into shards does. So a new rank's shard at any world size is a
//! concatenation of slices of old shards, and the copy is exact.

use std::ops::Range;

/// One slice to copy: elements `from` of old rank `old_rank`'s shard go to `to` of the new one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Copy {
    pub old_rank: usize,
    pub from: Range<usize>,
    pub to: Range<usize>,
}

/// The copies that build the shard covering flat elements `new` from old shards of
/// `old_shard_len` elements. Only the first `total` elements are parameters; the rest of the
/// new shard is padding and stays zero.
pub fn copies(new: Range<usize>, old_shard_len: usize, total: usize) -> Vec<Copy> {
    let end = new.end.min(total);
    let mut out = Vec::new();
    let mut at = new.start;
    while at < end {
        let old_rank = at / old_shard_len;
        let old_start = old_rank * old_shard_len;
        let stop = end.min(old_start + old_shard_len);
        out.push(Copy {
            old_rank,
            from: at - old_start..stop - old_start,
            to: at - new.start..stop - new.start,
        });
        at = stop;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FlatLayout;

    #[test]
    fn any_world_size_is_rebuilt_exactly_from_any_other() {
        let numels = [7, 1, 300, 12, 5];
        let flat: Vec<f32> = (0..325).map(|i| i as f32 + 0.25).collect();
        for old_world in 1..=5 {
            let old = FlatLayout::new(&numels, old_world, 4);
            let old_shards: Vec<Vec<f32>> = (0..old_world)
                .map(|r| {
                    old.shard(r)
                        .map(|i| flat.get(i).copied().unwrap_or(0.0))
                        .collect()
                })
                .collect();
            for new_world in 1..=5 {
                let new = FlatLayout::new(&numels, new_world, 8);
                for rank in 0..new_world {
                    let mut shard = vec![0.0; new.shard_len];
                    for c in copies(new.shard(rank), old.shard_len, old.total) {
                        shard[c.to].copy_from_slice(&old_shards[c.old_rank][c.from]);
                    }
                    let expected: Vec<f32> = new
                        .shard(rank)
                        .map(|i| flat.get(i).copied().unwrap_or(0.0))
                        .collect();
                    assert_eq!(shard, expected, "{old_world} -> {new_world}, rank {rank}");
                }
            }
        }
    }
}
