//! Element-wise reduction in rank order, and the split of a buffer into per-rank chunks.
//!
//! Every element is folded as `((x₀ ∘ x₁) ∘ x₂) ∘ …` over ranks 0, 1, 2, …, whatever chunk it
//! falls in. That is what makes results independent of message size and bucket layout (a ring
//! would start each chunk's fold at a different rank).

use std::ops::Range;

use half::{bf16, f16};

use crate::{DType, ReduceOp};

/// Elements `[start, end)` of `len` that rank `index` of `world` owns in a reduce-scatter or
/// contributes to an all-gather. The first `len % world` ranks own one element more.
pub fn chunk_range(len: usize, world: usize, index: usize) -> Range<usize> {
    let base = len / world;
    let extra = len % world;
    let start = index * base + index.min(extra);
    let size = base + usize::from(index < extra);
    start..start + size
}

/// A value type that can be reduced: converted to f32, combined, rounded back once.
trait Element: bytemuck::Pod {
    fn to_f32(self) -> f32;
    fn from_f32(value: f32) -> Self;
}

impl Element for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(value: f32) -> Self {
        value
    }
}
impl Element for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(value: f32) -> Self {
        f16::from_f32(value)
    }
}
impl Element for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(value: f32) -> Self {
        bf16::from_f32(value)
    }
}
impl Element for u8 {
    fn to_f32(self) -> f32 {
        f32::from(self)
    }
    fn from_f32(value: f32) -> Self {
        value as u8
    }
}

/// `a + b` in f32 (sum and average).
#[inline(always)]
fn add(a: f32, b: f32) -> f32 {
    a + b
}

/// `max(a, b)` in f32, NaN if either is (f32::max would drop a NaN).
#[inline(always)]
fn max(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}

/// Folds the contributions of all ranks into `own` (this rank's contribution, overwritten with
/// the result). `others[q]` is rank `q`'s contribution; `others[own_rank]` is ignored.
pub(crate) fn fold_in_rank_order(
    dtype: DType,
    op: ReduceOp,
    own_rank: usize,
    own: &mut [u8],
    others: &[&[u8]],
) {
    match dtype {
        DType::F32 => fold::<f32>(op, own_rank, own, others),
        DType::F16 => fold::<f16>(op, own_rank, own, others),
        DType::BF16 => fold::<bf16>(op, own_rank, own, others),
        DType::U8 => fold::<u8>(op, own_rank, own, others),
    }
}

/// Picks the combining function once, so that the loops of [`fold_with`] are compiled for it
/// and vectorize (a match per element does not).
fn fold<E: Element>(op: ReduceOp, own_rank: usize, own: &mut [u8], others: &[&[u8]]) {
    match op {
        ReduceOp::Sum => fold_with::<E>(add, false, own_rank, own, others),
        ReduceOp::Avg => fold_with::<E>(add, true, own_rank, own, others),
        ReduceOp::Max => fold_with::<E>(max, false, own_rank, own, others),
    }
}

fn fold_with<E: Element>(
    combine: impl Fn(f32, f32) -> f32,
    average: bool,
    own_rank: usize,
    own: &mut [u8],
    others: &[&[u8]],
) {
    // Blocks keep the f32 accumulator and this rank's own contribution in L1 and let the inner
    // loops vectorize. The last contribution is combined, averaged and stored in one pass
    // (at 2 ranks, the only pass): (x₀ ∘ x₁ ∘ … ∘ x_{n−2}) ∘ x_{n−1}, then ÷ n, as always.
    const BLOCK: usize = 512;
    let world = others.len();
    let own: &mut [E] = bytemuck::cast_slice_mut(own);
    let others: Vec<&[E]> = others
        .iter()
        .enumerate()
        .map(|(q, bytes)| {
            if q == own_rank {
                &[][..]
            } else {
                bytemuck::cast_slice(bytes)
            }
        })
        .collect();
    let n = world as f32;
    let finish = |v: f32| E::from_f32(if average { v / n } else { v });
    let mut acc = [0f32; BLOCK];
    let mut mine = [E::zeroed(); BLOCK];
    let mut start = 0;
    while start < own.len() {
        let end = (start + BLOCK).min(own.len());
        let (acc, mine) = (&mut acc[..end - start], &mut mine[..end - start]);
        mine.copy_from_slice(&own[start..end]);
        let src = |q: usize| -> &[E] {
            if q == own_rank {
                mine
            } else {
                &others[q][start..end]
            }
        };
        let out = &mut own[start..end];
        match world {
            1 => out
                .iter_mut()
                .zip(src(0))
                .for_each(|(o, a)| *o = finish(a.to_f32())),
            2 => out
                .iter_mut()
                .zip(src(0).iter().zip(src(1)))
                .for_each(|(o, (a, b))| *o = finish(combine(a.to_f32(), b.to_f32()))),
            _ => {
                acc.iter_mut()
                    .zip(src(0).iter().zip(src(1)))
                    .for_each(|(s, (a, b))| *s = combine(a.to_f32(), b.to_f32()));
                for q in 2..world - 1 {
                    acc.iter_mut()
                        .zip(src(q))
                        .for_each(|(s, x)| *s = combine(*s, x.to_f32()));
                }
                out.iter_mut()
                    .zip(acc.iter().zip(src(world - 1)))
                    .for_each(|(o, (s, x))| *o = finish(combine(*s, x.to_f32())));
            }
        }
        start = end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_tile_the_buffer_in_order() {
        for len in 0..40 {
            for world in 1..6 {
                let mut next = 0;
                for index in 0..world {
                    let r = chunk_range(len, world, index);
                    assert_eq!(r.start, next);
                    assert!(r.len() == len / world || r.len() == len / world + 1);
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }
}
