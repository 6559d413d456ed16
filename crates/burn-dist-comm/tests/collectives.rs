//! Every collective, dtype and world size 1–4 against the straightforward reference, on every
//! transport (in-process channels, loopback TCP, shared memory); bitwise agreement across
//! ranks; independence from message splitting.

use std::time::Duration;

use burn_dist_comm::testing::{linked_group, rank_data, reference_reduce, run_ranks};
use burn_dist_comm::{
    CommConfig, Communicator, DType, HostBuffer, HostCommunicator, Link, ReduceOp, chunk_range,
};

const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];
const OPS: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max];
/// Includes empty, shorter than the world, and lengths not divisible by 2, 3 or 4.
const LENGTHS: [usize; 6] = [0, 1, 3, 7, 1000, 1003];

fn config() -> CommConfig {
    CommConfig::default().with_timeout(Duration::from_secs(30))
}

#[derive(Clone, Copy)]
enum Wire {
    Local,
    Tcp,
    Shm,
}

/// Runs `f` on `world` ranks connected by `wire` (checked: see [`linked_group`]).
fn with_group<T: Send>(
    wire: Wire,
    world: usize,
    f: impl Fn(usize, HostCommunicator) -> T + Sync,
) -> Vec<T> {
    let link = match wire {
        Wire::Local => return run_ranks(HostCommunicator::local_group(world, &config()), f),
        Wire::Tcp => Link::Tcp,
        Wire::Shm => Link::SharedMemory,
    };
    let (_store, comms) = linked_group(world, &config(), link);
    run_ranks(comms, f)
}

/// The (dtype, op) pairs that are defined: every float op, and max on bytes.
fn reductions() -> Vec<(DType, ReduceOp)> {
    let mut pairs: Vec<_> = FLOATS
        .iter()
        .flat_map(|&d| OPS.iter().map(move |&o| (d, o)))
        .collect();
    pairs.push((DType::U8, ReduceOp::Max));
    pairs
}

fn assert_bitwise(got: &HostBuffer, want: &HostBuffer, what: &str) {
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    assert_eq!(got.as_bytes(), want.as_bytes(), "{what}: values differ");
}

fn all_reduce_matches_reference(wire: Wire, lengths: &[usize]) {
    for world in 1..=4 {
        for (dtype, op) in reductions() {
            for &len in lengths {
                let inputs: Vec<_> = (0..world).map(|r| rank_data(dtype, len, 7, r)).collect();
                let want = reference_reduce(&inputs, op);
                let got = with_group(wire, world, |rank, comm| {
                    comm.all_reduce(inputs[rank].clone(), op).wait().unwrap()
                });
                for (rank, got) in got.iter().enumerate() {
                    let what =
                        format!("all_reduce {dtype} {op} len {len} world {world} rank {rank}");
                    assert_bitwise(got, &want, &what);
                }
            }
        }
    }
}

fn reduce_scatter_matches_reference(wire: Wire, lengths: &[usize]) {
    for world in 1..=4 {
        for (dtype, op) in reductions() {
            for &len in lengths {
                let inputs: Vec<_> = (0..world).map(|r| rank_data(dtype, len, 11, r)).collect();
                let want = reference_reduce(&inputs, op);
                let got = with_group(wire, world, |rank, comm| {
                    comm.reduce_scatter(inputs[rank].clone(), op)
                        .wait()
                        .unwrap()
                });
                for (rank, got) in got.iter().enumerate() {
                    let what =
                        format!("reduce_scatter {dtype} {op} len {len} world {world} rank {rank}");
                    assert_bitwise(got, &want.slice(chunk_range(len, world, rank)), &what);
                }
            }
        }
    }
}

/// Uneven splits, empty chunks included (ZeRO-2's bucket segments): every rank gets its chunk
/// of the reference, bitwise. The last two split chunks into several messages (pieces of
/// 256 KiB), a different number per rank, down to a last piece of one element.
fn reduce_scatter_counts_match_reference(wire: Wire) {
    let splits: [&[usize]; 8] = [
        &[5],
        &[0, 9],
        &[9, 0],
        &[3, 0, 4],
        &[0, 0, 7, 0],
        &[1, 8, 0, 2],
        &[200_000, 0, 70_001],
        &[65_537, 140_000, 3],
    ];
    for counts in splits {
        let (world, len) = (counts.len(), counts.iter().sum::<usize>());
        for (dtype, op) in reductions() {
            let inputs: Vec<_> = (0..world).map(|r| rank_data(dtype, len, 19, r)).collect();
            let want = reference_reduce(&inputs, op);
            let got = with_group(wire, world, |rank, comm| {
                comm.reduce_scatter_counts(inputs[rank].clone(), op, counts.to_vec())
                    .wait()
                    .unwrap()
            });
            for (rank, got) in got.iter().enumerate() {
                let start: usize = counts[..rank].iter().sum();
                let what = format!("reduce_scatter_counts {dtype} {op} {counts:?} rank {rank}");
                assert_bitwise(got, &want.slice(start..start + counts[rank]), &what);
            }
        }
    }
}

#[test]
fn reduce_scatter_counts_match_reference_in_process() {
    reduce_scatter_counts_match_reference(Wire::Local);
}

#[test]
fn reduce_scatter_counts_match_reference_over_tcp() {
    reduce_scatter_counts_match_reference(Wire::Tcp);
}

#[test]
fn reduce_scatter_counts_match_reference_over_shared_memory() {
    reduce_scatter_counts_match_reference(Wire::Shm);
}

#[test]
fn reduce_scatter_counts_that_do_not_fit_are_refused() {
    let got = with_group(Wire::Local, 2, |_, comm| {
        comm.reduce_scatter_counts(HostBuffer::F32(vec![1.0; 5]), ReduceOp::Sum, vec![2, 2])
            .wait()
    });
    for (rank, result) in got.into_iter().enumerate() {
        let message = result
            .expect_err("counts summing to 4 for 5 elements")
            .to_string();
        assert!(
            message.contains("sum to the buffer's 5 elements")
                && message.contains("reduce_scatter"),
            "rank {rank}: {message}"
        );
    }
}

fn all_gather_and_broadcast_match_reference(wire: Wire, lengths: &[usize]) {
    for world in 1..=4 {
        for dtype in [DType::F32, DType::F16, DType::BF16, DType::U8] {
            for &len in lengths {
                let full = rank_data(dtype, len, 13, 99);
                let gathered = with_group(wire, world, |rank, comm| {
                    let shard = full.slice(chunk_range(len, world, rank));
                    comm.all_gather(shard, len).wait().unwrap()
                });
                for (rank, got) in gathered.iter().enumerate() {
                    assert_bitwise(
                        got,
                        &full,
                        &format!("all_gather {dtype} len {len} world {world} rank {rank}"),
                    );
                }
                for root in 0..world {
                    let inputs: Vec<_> = (0..world).map(|r| rank_data(dtype, len, 17, r)).collect();
                    let got = with_group(wire, world, |rank, comm| {
                        comm.broadcast(inputs[rank].clone(), root).wait().unwrap()
                    });
                    for (rank, got) in got.iter().enumerate() {
                        let what = format!(
                            "broadcast {dtype} len {len} world {world} root {root} rank {rank}"
                        );
                        assert_bitwise(got, &inputs[root], &what);
                    }
                }
            }
        }
    }
}

/// Uneven chunks, empty ones included (stage 3's parameter pieces): every rank gets the
/// concatenation, bitwise, whatever the dtype, also into a reused buffer whose old contents
/// must all be overwritten; the large splits take several messages' worth of a link's buffer.
fn all_gather_counts_match_reference(wire: Wire) {
    let splits: [&[usize]; 7] = [
        &[5],
        &[0, 9],
        &[9, 0],
        &[3, 0, 4],
        &[0, 0, 7, 0],
        &[1, 8, 0, 2],
        &[300_001, 0, 70_001],
    ];
    for counts in splits {
        let (world, len) = (counts.len(), counts.iter().sum::<usize>());
        for dtype in [DType::F32, DType::F16, DType::BF16, DType::U8] {
            let full = rank_data(dtype, len, 29, 5);
            let got = with_group(wire, world, |rank, comm| {
                let start: usize = counts[..rank].iter().sum();
                let shard = full.slice(start..start + counts[rank]);
                let fresh = comm
                    .all_gather_counts(shard.clone(), counts.to_vec(), 7)
                    .wait()
                    .unwrap();
                let stale = rank_data(dtype, len, 31, 3);
                let reused = comm
                    .all_gather_counts_into(shard, counts.to_vec(), 7, stale)
                    .wait()
                    .unwrap();
                (fresh, reused)
            });
            for (rank, (fresh, reused)) in got.iter().enumerate() {
                let what = format!("all_gather_counts {dtype} {counts:?} rank {rank}");
                assert_bitwise(fresh, &full, &what);
                assert_bitwise(reused, &full, &format!("{what}, into a reused buffer"));
            }
        }
    }
}

#[test]
fn all_gather_counts_match_reference_in_process() {
    all_gather_counts_match_reference(Wire::Local);
}

#[test]
fn all_gather_counts_match_reference_over_tcp() {
    all_gather_counts_match_reference(Wire::Tcp);
}

#[test]
fn all_gather_counts_match_reference_over_shared_memory() {
    all_gather_counts_match_reference(Wire::Shm);
}

#[test]
fn all_gather_counts_refuse_a_chunk_of_another_length_naming_the_rank() {
    let got = with_group(Wire::Local, 3, |rank, comm| {
        let len = if rank == 2 { 4 } else { 2 };
        comm.all_gather_counts(HostBuffer::F32(vec![0.0; len]), vec![2, 2, 2], 1)
            .wait()
            .unwrap_err()
            .to_string()
    });
    assert_refused_naming(&got, 2, "rank 2 passed 4 elements; its count is 2");
}

/// Every rank's error names `culprit`, whose own says `reason`.
fn assert_refused_naming(errors: &[String], culprit: usize, reason: &str) {
    assert!(errors[culprit].contains(reason), "{}", errors[culprit]);
    let name = format!("rank {culprit}");
    for (rank, message) in errors.iter().enumerate() {
        assert!(message.contains(&name), "rank {rank}: {message}");
    }
}

#[test]
fn all_gather_counts_into_refuses_a_result_buffer_of_another_size_naming_the_rank() {
    let got = with_group(Wire::Local, 2, |rank, comm| {
        let into = HostBuffer::F32(vec![0.0; if rank == 1 { 3 } else { 4 }]);
        comm.all_gather_counts_into(HostBuffer::F32(vec![0.0; 2]), vec![2, 2], 1, into)
            .wait()
            .unwrap_err()
            .to_string()
    });
    assert_refused_naming(
        &got,
        1,
        "rank 1's result buffer holds 3 f32 elements; the result is 4 f32",
    );
}

#[test]
fn all_reduce_matches_reference_in_process() {
    all_reduce_matches_reference(Wire::Local, &LENGTHS);
}

#[test]
fn all_reduce_matches_reference_over_tcp() {
    all_reduce_matches_reference(Wire::Tcp, &[0, 7, 1003]);
}

#[test]
fn all_reduce_matches_reference_over_shared_memory() {
    all_reduce_matches_reference(Wire::Shm, &[0, 7, 1003]);
}

#[test]
fn reduce_scatter_matches_reference_in_process() {
    reduce_scatter_matches_reference(Wire::Local, &LENGTHS);
}

#[test]
fn reduce_scatter_matches_reference_over_tcp() {
    reduce_scatter_matches_reference(Wire::Tcp, &[3, 1003]);
}

#[test]
fn reduce_scatter_matches_reference_over_shared_memory() {
    reduce_scatter_matches_reference(Wire::Shm, &[3, 1003]);
}

#[test]
fn all_gather_and_broadcast_match_reference_in_process() {
    all_gather_and_broadcast_match_reference(Wire::Local, &LENGTHS);
}

#[test]
fn all_gather_and_broadcast_match_reference_over_tcp() {
    all_gather_and_broadcast_match_reference(Wire::Tcp, &[0, 1003]);
}

#[test]
fn all_gather_and_broadcast_match_reference_over_shared_memory() {
    all_gather_and_broadcast_match_reference(Wire::Shm, &[0, 1003]);
}

/// Splitting a buffer into messages (buckets) at arbitrary points gives the same bits as
/// reducing it whole: the fold order of an element depends only on the ranks.
fn result_does_not_depend_on_message_split(wire: Wire) {
    let len = 10_007;
    for world in 2..=4 {
        for dtype in FLOATS {
            let inputs: Vec<_> = (0..world).map(|r| rank_data(dtype, len, 23, r)).collect();
            let cuts = [0, 1, 333, 4096, 4097, 9000, len];
            let (whole, pieces): (Vec<_>, Vec<_>) = with_group(wire, world, |rank, comm| {
                let whole = comm
                    .all_reduce(inputs[rank].clone(), ReduceOp::Sum)
                    .wait()
                    .unwrap();
                // All pieces in flight at once, as buckets are during backward.
                let pending: Vec<_> = cuts
                    .windows(2)
                    .map(|w| comm.all_reduce(inputs[rank].slice(w[0]..w[1]), ReduceOp::Sum))
                    .collect();
                let pieces: Vec<HostBuffer> =
                    pending.into_iter().map(|p| p.wait().unwrap()).collect();
                let mut joined = Vec::new();
                pieces
                    .iter()
                    .for_each(|p| joined.extend_from_slice(p.as_bytes()));
                (whole, joined)
            })
            .into_iter()
            .unzip();
            for rank in 0..world {
                assert_eq!(
                    whole[rank].as_bytes(),
                    &pieces[rank][..],
                    "{dtype} world {world} rank {rank}"
                );
                assert_eq!(
                    whole[rank].as_bytes(),
                    whole[0].as_bytes(),
                    "ranks disagree"
                );
            }
        }
    }
}

#[test]
fn result_does_not_depend_on_message_split_in_process() {
    result_does_not_depend_on_message_split(Wire::Local);
}

#[test]
fn result_does_not_depend_on_message_split_over_tcp() {
    result_does_not_depend_on_message_split(Wire::Tcp);
}

#[test]
fn result_does_not_depend_on_message_split_over_shared_memory() {
    result_does_not_depend_on_message_split(Wire::Shm);
}

#[test]
fn nan_on_one_rank_reaches_every_rank_through_max() {
    let got = with_group(Wire::Local, 3, |rank, comm| {
        let mut flags = vec![0.0f32, 1.0, -2.0];
        if rank == 1 {
            flags[0] = f32::NAN;
        }
        comm.all_reduce(HostBuffer::F32(flags), ReduceOp::Max)
            .wait()
            .unwrap()
    });
    for buf in got {
        let HostBuffer::F32(v) = buf else {
            panic!("dtype")
        };
        assert!(v[0].is_nan());
        assert_eq!(&v[1..], &[1.0, -2.0]);
    }
}

#[test]
fn many_collectives_in_flight_complete_in_issue_order() {
    let got = with_group(Wire::Local, 2, |rank, comm| {
        let mut pending: Vec<_> = (0..8)
            .map(|i| comm.all_reduce(HostBuffer::F32(vec![(rank + i) as f32; 5]), ReduceOp::Sum))
            .collect();
        let barrier = comm.barrier();
        barrier.wait().unwrap();
        // The barrier was issued last, so everything before it is done.
        assert!(pending.iter_mut().all(|p| p.is_done()));
        pending
            .into_iter()
            .map(|p| p.wait().unwrap())
            .collect::<Vec<_>>()
    });
    for results in got {
        for (i, buf) in results.iter().enumerate() {
            assert_eq!(buf, &HostBuffer::F32(vec![(2 * i + 1) as f32; 5]));
        }
    }
}

/// Reduces of several pieces each (256 KiB), after buffers whose byte lengths are not multiples
/// of 8. Over shared memory a reduce folds each piece where the peers wrote it in their rings:
/// those lengths (u8 and f16) leave the ring positions anywhere, and buffers larger than a ring
/// (1 MiB) make
/// pieces straddle a ring's end. Every result must be the reference's, bitwise, at 2 and 3
/// ranks.
fn large_reduces_match_reference_after_odd_sized_messages(wire: Wire) {
    let sequence = [
        (DType::U8, 13, ReduceOp::Max),
        (DType::F16, 600_001, ReduceOp::Sum),
        (DType::U8, 5, ReduceOp::Max),
        (DType::F32, 700_003, ReduceOp::Avg),
        (DType::F16, 3, ReduceOp::Max),
        (DType::BF16, 1_000_001, ReduceOp::Sum),
    ];
    for world in [2, 3] {
        let inputs = |seed: u64| -> Vec<Vec<HostBuffer>> {
            (0..world)
                .map(|r| {
                    sequence
                        .iter()
                        .map(|&(dtype, len, _)| rank_data(dtype, len, seed, r))
                        .collect()
                })
                .collect()
        };
        let (reduced, scattered) = (inputs(31), inputs(37));
        let got = with_group(wire, world, |rank, comm| {
            let ops = sequence.iter().map(|&(_, _, op)| op);
            let pending: Vec<_> = (reduced[rank].iter().zip(&scattered[rank]))
                .zip(ops)
                .map(|((a, b), op)| {
                    (
                        comm.all_reduce(a.clone(), op),
                        comm.reduce_scatter(b.clone(), op),
                    )
                })
                .collect();
            pending
                .into_iter()
                .map(|(a, b)| (a.wait().unwrap(), b.wait().unwrap()))
                .collect::<Vec<_>>()
        });
        for (i, &(dtype, len, op)) in sequence.iter().enumerate() {
            let column = |all: &[Vec<HostBuffer>]| -> Vec<HostBuffer> {
                all.iter().map(|rank| rank[i].clone()).collect()
            };
            let want_reduced = reference_reduce(&column(&reduced), op);
            let want_scattered = reference_reduce(&column(&scattered), op);
            for (rank, (all_reduced, scattered)) in got.iter().map(|g| &g[i]).enumerate() {
                let what = format!("{dtype} {op} len {len} world {world} rank {rank}");
                assert_bitwise(all_reduced, &want_reduced, &format!("all_reduce {what}"));
                let own = want_scattered.slice(chunk_range(len, world, rank));
                assert_bitwise(scattered, &own, &format!("reduce_scatter {what}"));
            }
        }
    }
}

#[test]
fn large_reduces_match_reference_after_odd_sized_messages_in_process() {
    large_reduces_match_reference_after_odd_sized_messages(Wire::Local);
}

#[test]
fn large_reduces_match_reference_after_odd_sized_messages_over_tcp() {
    large_reduces_match_reference_after_odd_sized_messages(Wire::Tcp);
}

#[test]
fn large_reduces_match_reference_after_odd_sized_messages_over_shared_memory() {
    large_reduces_match_reference_after_odd_sized_messages(Wire::Shm);
}
