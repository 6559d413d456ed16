//! Which NCCL calls run each collective, as pure functions of the element counts, so that the
//! layout logic is tested on machines without a GPU.
//!
//! NCCL's `ncclReduceScatter` and `ncclAllGather` need every rank's chunk to have the same
//! size, at `rank * chunk`. Our chunks ([`chunk_range`](crate::chunk_range), or the counts of
//! `reduce_scatter_counts`) may be uneven and empty. So:
//! - equal counts use the native call, in place;
//! - uneven counts use one grouped call per non-empty chunk (`ncclGroupStart`/`ncclGroupEnd`):
//!   `ncclReduce` of chunk `q` to its owner `q` for a reduce-scatter, `ncclBroadcast` of chunk
//!   `q` from its owner `q` for an all-gather. Each rank sends or receives its share of every
//!   chunk once, so the bytes moved per rank are those of the native call; no padding and no
//!   copy of the buffer is needed, and the layout stays exactly the host communicator's.

use std::ops::Range;

/// One NCCL call of a collective. Ranges and counts are elements from the start of the
/// buffer the collective runs on; every call runs in place on that buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Call {
    /// `ncclAllReduce` of elements `[0, count)`.
    AllReduce { count: usize },
    /// `ncclReduceScatter` with `chunk` elements per rank: rank `r` receives
    /// `[r·chunk, (r+1)·chunk)`.
    ReduceScatter { chunk: usize },
    /// `ncclReduce` of `range` to `root` (the other ranks' copies of `range` are unchanged).
    Reduce { root: usize, range: Range<usize> },
    /// `ncclAllGather` with `chunk` elements per rank: rank `r` sends `[r·chunk, (r+1)·chunk)`.
    AllGather { chunk: usize },
    /// `ncclBroadcast` of `range` from `root`.
    Broadcast { root: usize, range: Range<usize> },
}

/// Consecutive ranges of `counts[0]`, `counts[1]`, … elements.
pub(crate) fn ranges(counts: &[usize]) -> Vec<Range<usize>> {
    let mut start = 0;
    counts
        .iter()
        .map(|&n| {
            let range = start..start + n;
            start = range.end;
            range
        })
        .collect()
}

fn all_equal(counts: &[usize]) -> bool {
    counts.windows(2).all(|w| w[0] == w[1])
}

/// All-reduce of `len` elements.
pub(crate) fn all_reduce(len: usize) -> Vec<Call> {
    match len {
        0 => Vec::new(),
        count => vec![Call::AllReduce { count }],
    }
}

/// Reduce-scatter where rank `q` owns the `counts[q]` elements after those of ranks `0..q`.
pub(crate) fn reduce_scatter(counts: &[usize]) -> Vec<Call> {
    if counts.iter().all(|&n| n == 0) {
        Vec::new()
    } else if all_equal(counts) {
        vec![Call::ReduceScatter { chunk: counts[0] }]
    } else {
        non_empty(counts, |root, range| Call::Reduce { root, range })
    }
}

/// All-gather where rank `q` contributes the `counts[q]` elements after those of ranks `0..q`.
pub(crate) fn all_gather(counts: &[usize]) -> Vec<Call> {
    if counts.iter().all(|&n| n == 0) {
        Vec::new()
    } else if all_equal(counts) {
        vec![Call::AllGather { chunk: counts[0] }]
    } else {
        non_empty(counts, |root, range| Call::Broadcast { root, range })
    }
}

/// Broadcast of `len` elements from `root`.
pub(crate) fn broadcast(len: usize, root: usize) -> Vec<Call> {
    match len {
        0 => Vec::new(),
        len => vec![Call::Broadcast {
            root,
            range: 0..len,
        }],
    }
}

fn non_empty(counts: &[usize], call: impl Fn(usize, Range<usize>) -> Call) -> Vec<Call> {
    ranges(counts)
        .into_iter()
        .enumerate()
        .filter(|(_, range)| !range.is_empty())
        .map(|(q, range)| call(q, range))
        .collect()
}

#[cfg(test)]
mod tests {
    //! The plans, run by a model of NCCL's documented semantics on host buffers, give the host
    //! communicator's results.

    use super::*;
    use crate::chunk_range;

    /// Runs `calls` on every rank's buffer (`bufs[r]`) as NCCL defines each call (sums only:
    /// the reduction itself is NCCL's; the layout is what is under test).
    fn simulate(bufs: &mut [Vec<f64>], calls: &[Call]) {
        let world = bufs.len();
        let sum = |bufs: &[Vec<f64>], i: usize| bufs.iter().map(|b| b[i]).sum::<f64>();
        for call in calls {
            match call {
                Call::AllReduce { count } => {
                    let total: Vec<f64> = (0..*count).map(|i| sum(bufs, i)).collect();
                    bufs.iter_mut()
                        .for_each(|b| b[..*count].copy_from_slice(&total));
                }
                Call::ReduceScatter { chunk } => {
                    let total: Vec<f64> = (0..chunk * world).map(|i| sum(bufs, i)).collect();
                    for (r, b) in bufs.iter_mut().enumerate() {
                        let own = r * chunk..(r + 1) * chunk;
                        b[own.clone()].copy_from_slice(&total[own]);
                    }
                }
                Call::Reduce { root, range } => {
                    let total: Vec<f64> = range.clone().map(|i| sum(bufs, i)).collect();
                    bufs[*root][range.clone()].copy_from_slice(&total);
                }
                Call::AllGather { chunk } => {
                    let gathered: Vec<f64> = (0..world)
                        .flat_map(|r| bufs[r][r * chunk..(r + 1) * chunk].to_vec())
                        .collect();
                    bufs.iter_mut()
                        .for_each(|b| b[..chunk * world].copy_from_slice(&gathered));
                }
                Call::Broadcast { root, range } => {
                    let data = bufs[*root][range.clone()].to_vec();
                    bufs.iter_mut()
                        .for_each(|b| b[range.clone()].copy_from_slice(&data));
                }
            }
        }
    }

    fn inputs(world: usize, len: usize) -> Vec<Vec<f64>> {
        (0..world)
            .map(|r| (0..len).map(|i| (r * 1000 + i + 1) as f64).collect())
            .collect()
    }

    fn even(len: usize, world: usize) -> Vec<usize> {
        (0..world)
            .map(|q| chunk_range(len, world, q).len())
            .collect()
    }

    #[test]
    fn reduce_scatter_plans_leave_each_owner_its_reduced_chunk() {
        let mut cases: Vec<Vec<usize>> = Vec::new();
        for world in 1..6 {
            for len in 0..23 {
                cases.push(even(len, world));
            }
        }
        cases.extend([
            vec![0, 5, 0],
            vec![3, 0, 0, 1],
            vec![7],
            vec![0, 0],
            vec![2, 9],
        ]);
        for counts in cases {
            let (world, len) = (counts.len(), counts.iter().sum::<usize>());
            let mut bufs = inputs(world, len);
            let reference: Vec<f64> = (0..len).map(|i| bufs.iter().map(|b| b[i]).sum()).collect();
            let calls = reduce_scatter(&counts);
            simulate(&mut bufs, &calls);
            for (r, range) in ranges(&counts).into_iter().enumerate() {
                assert_eq!(
                    bufs[r][range.clone()],
                    reference[range],
                    "counts {counts:?} rank {r}"
                );
            }
        }
    }

    #[test]
    fn all_gather_plans_give_every_rank_every_chunk() {
        for world in 1..6 {
            for len in 0..23 {
                let counts = even(len, world);
                let mut bufs = inputs(world, len);
                // What every rank must end with: rank q's own chunk, from rank q's buffer.
                let expected: Vec<f64> = (0..world)
                    .flat_map(|q| bufs[q][chunk_range(len, world, q)].to_vec())
                    .collect();
                simulate(&mut bufs, &all_gather(&counts));
                for (r, b) in bufs.iter().enumerate() {
                    assert_eq!(*b, expected, "len {len} world {world} rank {r}");
                }
            }
        }
    }

    #[test]
    fn equal_chunks_use_the_native_call_and_uneven_ones_skip_empty_chunks() {
        assert_eq!(reduce_scatter(&[4, 4]), [Call::ReduceScatter { chunk: 4 }]);
        assert_eq!(all_gather(&[3; 3]), [Call::AllGather { chunk: 3 }]);
        assert_eq!(
            reduce_scatter(&[0, 2, 0, 1]),
            [
                Call::Reduce {
                    root: 1,
                    range: 0..2
                },
                Call::Reduce {
                    root: 3,
                    range: 2..3
                }
            ]
        );
        assert_eq!(
            all_gather(&[2, 1]),
            [
                Call::Broadcast {
                    root: 0,
                    range: 0..2
                },
                Call::Broadcast {
                    root: 1,
                    range: 2..3
                }
            ]
        );
        assert!(reduce_scatter(&[0, 0]).is_empty());
        assert!(all_gather(&[0]).is_empty());
        assert!(all_reduce(0).is_empty());
        assert!(broadcast(0, 1).is_empty());
    }
}
