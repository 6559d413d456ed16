//! The canonical flat layout of a model's trainable parameters and its split into shards.
//!
//! Parameters are laid out back to back in module visit order. The flat vector is padded to a
//! multiple of `world × align` elements and split into `world` contiguous shards of equal
//! length (a multiple of `align`, the kernels' vector width); rank `r` owns shard `r`. The
//! padding is zero and is never a parameter.

use std::ops::Range;

/// Where every parameter lives in the flat vector and which rank owns what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlatLayout {
    /// Start of each parameter (visit order) in the flat vector.
    pub offsets: Vec<usize>,
    pub numels: Vec<usize>,
    /// Elements of all parameters, without padding.
    pub total: usize,
    /// Elements per shard (equal for every rank; a multiple of the alignment).
    pub shard_len: usize,
    pub world: usize,
}

/// The part of one parameter that falls in a shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// Parameter index (visit order).
    pub param: usize,
    /// Elements of the parameter (flattened) in the shard.
    pub within: Range<usize>,
    /// The same elements' positions in the shard.
    pub in_shard: Range<usize>,
}

impl FlatLayout {
    pub fn new(numels: &[usize], world: usize, align: usize) -> Self {
        let mut offsets = Vec::with_capacity(numels.len());
        let mut total = 0;
        for &n in numels {
            offsets.push(total);
            total += n;
        }
        let align = align.max(1);
        let shard_len = total.div_ceil(world).div_ceil(align) * align;
        FlatLayout {
            offsets,
            numels: numels.to_vec(),
            total,
            shard_len,
            world,
        }
    }

    /// Rank `rank`'s elements of the padded flat vector.
    pub fn shard(&self, rank: usize) -> Range<usize> {
        rank * self.shard_len..(rank + 1) * self.shard_len
    }

    /// Where parameter `param` lies in the flat vector.
    pub fn param_range(&self, param: usize) -> Range<usize> {
        self.offsets[param]..self.offsets[param] + self.numels[param]
    }

    /// The part of the flat range `range` that lies in rank `rank`'s shard (empty, at the
    /// shard's start, when none does).
    pub fn in_shard(&self, range: Range<usize>, rank: usize) -> Range<usize> {
        let shard = self.shard(rank);
        let start = range.start.clamp(shard.start, shard.end);
        start..range.end.clamp(start, shard.end)
    }

    /// Length of the padded flat vector.
    pub fn padded_len(&self) -> usize {
        self.shard_len * self.world
    }

    /// The parameters (or parts of them) in rank `rank`'s shard, in order.
    pub fn pieces(&self, rank: usize) -> Vec<Piece> {
        let shard_start = self.shard(rank).start;
        (0..self.numels.len())
            .filter_map(|param| {
                let offset = self.offsets[param];
                let r = self.in_shard(self.param_range(param), rank);
                (!r.is_empty()).then(|| Piece {
                    param,
                    within: r.start - offset..r.end - offset,
                    in_shard: r.start - shard_start..r.end - shard_start,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_equal_aligned_and_cover_every_element_once() {
        let numels = [7, 1, 300, 12, 5];
        for world in 1..=4 {
            let layout = FlatLayout::new(&numels, world, 4);
            assert_eq!(layout.shard_len % 4, 0);
            assert!(
                layout.padded_len() >= layout.total
                    && layout.padded_len() - layout.total < 4 * world
            );
            let mut seen = vec![0u8; layout.total];
            for rank in 0..world {
                for piece in layout.pieces(rank) {
                    assert_eq!(piece.within.len(), piece.in_shard.len());
                    for (e, s) in piece.within.clone().zip(piece.in_shard.clone()) {
                        let flat = layout.offsets[piece.param] + e;
                        assert_eq!(flat, layout.shard(rank).start + s);
                        seen[flat] += 1;
                    }
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "world {world}");
        }
    }

    #[test]
    fn in_shard_clips_a_range_to_each_shard() {
        let layout = FlatLayout::new(&[10], 3, 1); // shards 0..4, 4..8, 8..12
        let parts: Vec<_> = (0..3).map(|r| layout.in_shard(2..9, r)).collect();
        assert_eq!(parts, [2..4, 4..8, 8..9]);
        assert!(layout.in_shard(0..3, 2).is_empty());
        assert!(layout.in_shard(9..12, 0).is_empty());
    }

    #[test]
    fn a_parameter_can_span_shards() {
        let layout = FlatLayout::new(&[10], 3, 1);
        let spans: Vec<_> = (0..3).map(|r| layout.pieces(r)[0].within.clone()).collect();
        assert_eq!(spans, [0..4, 4..8, 8..10]);
    }
}
