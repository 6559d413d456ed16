//! The staged device collectives on wgpu (Mesa's lavapipe in CI), 1 to 4 ranks as threads of
//! this process on one device: every result equals the host collectives' reference bit for
//! bit, only the ranges a call must change are written, the host traffic is exactly what the
//! staging needs, and bad arguments fail with the rank and the problem.

use std::ops::Range;
use std::sync::Arc;

use burn_dist_comm::testing::{rank_data, reference_reduce, run_ranks};
use burn_dist_comm::{CommConfig, DType, HostBuffer, HostCommunicator, ReduceOp};
use burn_dist_device::{
    DeviceCollectives, DeviceDType, DeviceError, DeviceSlice, StagedCollectives, Traffic,
    TrafficCounter, download, upload_into,
};
use cubecl::wgpu::WgpuRuntime;

type Slice = DeviceSlice<WgpuRuntime>;

/// Elements of filler before, between and after the slices under test, so that a write
/// outside a slice shows.
const PAD: usize = 13;

/// One rank: its staged collectives and a device buffer of `len` elements of `dtype`
/// holding `values` (uploaded without counting).
struct Rank {
    collectives: StagedCollectives,
    rank: usize,
}

impl Rank {
    fn new(comm: HostCommunicator) -> Self {
        Rank {
            rank: burn_dist_comm::Communicator::rank(&comm),
            collectives: StagedCollectives::new(Arc::new(comm), Arc::default()),
        }
    }

    fn buffer(&self, values: &HostBuffer, dtype: DeviceDType) -> Slice {
        let client = burn_dist_kernels::testing::wgpu_client();
        let handle = client.create_from_slice(values.as_bytes());
        DeviceSlice::whole(client, handle, dtype)
    }

    fn read(&self, slice: &Slice) -> HostBuffer {
        download(slice, &TrafficCounter::default(), self.rank).expect("read back")
    }

    fn traffic(&self) -> Traffic {
        DeviceCollectives::<WgpuRuntime>::traffic(&self.collectives).get()
    }
}

fn ranks<T: Send>(world: usize, f: impl Fn(Rank) -> T + Sync) -> Vec<T> {
    let comms = HostCommunicator::local_group(world, &CommConfig::default());
    run_ranks(comms, |_, comm| f(Rank::new(comm)))
}

/// Rank `rank`'s whole buffer: PAD, a slice of `a`, PAD, a slice of `b`, PAD elements.
fn layout(a: usize, b: usize) -> (usize, Range<usize>, Range<usize>) {
    let first = PAD..PAD + a;
    let second = first.end + PAD..first.end + PAD + b;
    (second.end + PAD, first, second)
}

fn all_reduce_matches_the_host_reference(dtype: DeviceDType) {
    for world in 1..=4 {
        let (len, first, second) = layout(1000, 37);
        let inputs: Vec<HostBuffer> = (0..world)
            .map(|q| rank_data(dtype.host(), len, 7, q))
            .collect();
        let expected = |r: &Range<usize>| {
            let parts: Vec<_> = inputs.iter().map(|i| i.slice(r.clone())).collect();
            reference_reduce(&parts, ReduceOp::Avg)
        };
        let results = ranks(world, |rank| {
            let whole = rank.buffer(&inputs[rank.rank], dtype);
            let slices = [whole.range(first.clone()), whole.range(second.clone())];
            rank.collectives
                .all_reduce(&slices, ReduceOp::Avg)
                .expect("issue")
                .wait()
                .expect("all_reduce");
            (rank.read(&whole), rank.traffic())
        });
        for (q, (out, traffic)) in results.into_iter().enumerate() {
            assert_eq!(
                out.slice(first.clone()),
                expected(&first),
                "world {world} rank {q}"
            );
            assert_eq!(
                out.slice(second.clone()),
                expected(&second),
                "world {world} rank {q}"
            );
            for pad in [0..PAD, first.end..second.start, second.end..len] {
                assert_eq!(
                    out.slice(pad.clone()),
                    inputs[q].slice(pad),
                    "rank {q} wrote outside"
                );
            }
            let bytes = ((first.len() + second.len()) * dtype.size()) as u64;
            assert_eq!(
                traffic,
                Traffic {
                    to_host: bytes,
                    to_device: bytes
                }
            );
        }
    }
}

#[test]
fn all_reduce_of_a_group_of_slices_equals_the_host_reduction_bit_for_bit_f32() {
    all_reduce_matches_the_host_reference(DeviceDType::F32);
}

#[test]
fn all_reduce_of_a_group_of_slices_equals_the_host_reduction_bit_for_bit_f16() {
    all_reduce_matches_the_host_reference(DeviceDType::F16);
}

#[test]
fn reduce_scatter_of_uneven_chunks_writes_only_this_ranks_chunk() {
    for world in 1..=4 {
        // Uneven, with an empty chunk when there are at least 3 ranks.
        let counts: Vec<usize> = (0..world)
            .map(|q| if q == 1 && world > 2 { 0 } else { 100 + 7 * q })
            .collect();
        let n: usize = counts.iter().sum();
        let (len, slice, _) = layout(n, 0);
        let inputs: Vec<HostBuffer> = (0..world)
            .map(|q| rank_data(DType::F32, len, 11, q))
            .collect();
        let parts: Vec<_> = inputs.iter().map(|i| i.slice(slice.clone())).collect();
        let reduced = reference_reduce(&parts, ReduceOp::Sum);
        let results = ranks(world, |rank| {
            let whole = rank.buffer(&inputs[rank.rank], DeviceDType::F32);
            rank.collectives
                .reduce_scatter(&whole.range(slice.clone()), &counts, ReduceOp::Sum)
                .expect("issue")
                .wait()
                .expect("reduce_scatter");
            (rank.read(&whole), rank.traffic())
        });
        for (q, (out, traffic)) in results.into_iter().enumerate() {
            let start: usize = counts[..q].iter().sum();
            let mine = start..start + counts[q];
            let at = |r: &Range<usize>| slice.start + r.start..slice.start + r.end;
            assert_eq!(
                out.slice(at(&mine)),
                reduced.slice(mine.clone()),
                "world {world} rank {q}"
            );
            // Everything else is this rank's own input, untouched.
            assert_eq!(
                out.slice(0..at(&mine).start),
                inputs[q].slice(0..at(&mine).start)
            );
            assert_eq!(
                out.slice(at(&mine).end..len),
                inputs[q].slice(at(&mine).end..len)
            );
            assert_eq!(
                traffic,
                Traffic {
                    to_host: 4 * n as u64,
                    to_device: 4 * counts[q] as u64
                },
                "rank {q} stages the slice down and its chunk up"
            );
        }
    }
}

/// ZeRO-2's bucket call: two slices, each reduce-scattered into its own uneven counts, in
/// one collective (one host reduce-scatter, one call counted, where two `reduce_scatter`s
/// would be two), with exactly the results of reducing each alone and nothing else written.
#[test]
fn reduce_scatter_each_is_one_call_with_each_slices_own_chunks() {
    for world in 1..=4 {
        let counts_a: Vec<usize> = (0..world).map(|q| 50 + 3 * q).collect();
        let counts_b: Vec<usize> = (0..world)
            .map(|q| if q == 0 && world > 1 { 0 } else { 9 + q })
            .collect();
        let (na, nb) = (counts_a.iter().sum(), counts_b.iter().sum());
        let (len, a, b) = layout(na, nb);
        let inputs: Vec<HostBuffer> = (0..world)
            .map(|q| rank_data(DType::F32, len, 13, q))
            .collect();
        let reduced = |r: &Range<usize>| {
            let parts: Vec<_> = inputs.iter().map(|i| i.slice(r.clone())).collect();
            reference_reduce(&parts, ReduceOp::Avg)
        };
        let (reduced_a, reduced_b) = (reduced(&a), reduced(&b));
        let results = ranks(world, |rank| {
            let whole = rank.buffer(&inputs[rank.rank], DeviceDType::F32);
            let parts = [
                (whole.range(a.clone()), counts_a.clone()),
                (whole.range(b.clone()), counts_b.clone()),
            ];
            let calls = DeviceCollectives::<WgpuRuntime>::traffic(&rank.collectives).calls();
            rank.collectives
                .reduce_scatter_each(&parts, ReduceOp::Avg)
                .expect("issue")
                .wait()
                .expect("reduce_scatter_each");
            let calls =
                DeviceCollectives::<WgpuRuntime>::traffic(&rank.collectives).calls() - calls;
            (rank.read(&whole), calls)
        });
        for (q, (out, calls)) in results.into_iter().enumerate() {
            assert_eq!(calls, 1, "world {world} rank {q}: one collective");
            let mut expected = inputs[q].clone();
            for (slice, counts, reduced) in
                [(&a, &counts_a, &reduced_a), (&b, &counts_b, &reduced_b)]
            {
                let start: usize = counts[..q].iter().sum();
                let mine = start..start + counts[q];
                let at = slice.start + mine.start..slice.start + mine.end;
                expected.as_bytes_mut()[4 * at.start..4 * at.end]
                    .copy_from_slice(reduced.slice(mine).as_bytes());
            }
            assert_eq!(out, expected, "world {world} rank {q}");
        }
    }
}

#[test]
fn all_gather_of_uneven_chunks_gives_every_rank_every_owners_chunk() {
    for world in 1..=4 {
        let counts: Vec<usize> = (0..world)
            .map(|q| if q == 2 { 0 } else { 64 + 5 * q })
            .collect();
        let n: usize = counts.iter().sum();
        let (len, slice, _) = layout(n, 0);
        let inputs: Vec<HostBuffer> = (0..world)
            .map(|q| rank_data(DType::F32, len, 13, q))
            .collect();
        let chunk = |q: usize| {
            let start: usize = counts[..q].iter().sum();
            slice.start + start..slice.start + start + counts[q]
        };
        let results = ranks(world, |rank| {
            let whole = rank.buffer(&inputs[rank.rank], DeviceDType::F32);
            rank.collectives
                .all_gather(&whole.range(slice.clone()), &counts)
                .expect("issue")
                .wait()
                .expect("all_gather");
            (rank.read(&whole), rank.traffic())
        });
        for (q, (out, traffic)) in results.into_iter().enumerate() {
            for (owner, input) in inputs.iter().enumerate() {
                assert_eq!(
                    out.slice(chunk(owner)),
                    input.slice(chunk(owner)),
                    "rank {q}, chunk of {owner}"
                );
            }
            assert_eq!(out.slice(0..slice.start), inputs[q].slice(0..slice.start));
            assert_eq!(out.slice(slice.end..len), inputs[q].slice(slice.end..len));
            let own = 4 * counts[q] as u64;
            assert_eq!(
                traffic,
                Traffic {
                    to_host: own,
                    to_device: 4 * n as u64 - own
                }
            );
        }
    }
}

#[test]
fn all_gather_each_is_one_call_that_fills_each_slice_with_its_owners_chunks() {
    for world in 1..=4 {
        let counts_a: Vec<usize> = (0..world).map(|q| 40 + 3 * q).collect();
        // Rank 1 owns nothing of the second slice: an empty chunk in the middle.
        let counts_b: Vec<usize> = (0..world).map(|q| if q == 1 { 0 } else { 7 + q }).collect();
        let (na, nb) = (counts_a.iter().sum(), counts_b.iter().sum());
        let (len, a, b) = layout(na, nb);
        let inputs: Vec<HostBuffer> = (0..world)
            .map(|q| rank_data(DType::F32, len, 13, q))
            .collect();
        let chunk = |slice: &Range<usize>, counts: &[usize], q: usize| {
            let start: usize = counts[..q].iter().sum();
            slice.start + start..slice.start + start + counts[q]
        };
        let results = ranks(world, |rank| {
            let whole = rank.buffer(&inputs[rank.rank], DeviceDType::F32);
            let parts = [
                (whole.range(a.clone()), counts_a.clone()),
                (whole.range(b.clone()), counts_b.clone()),
            ];
            let counter = DeviceCollectives::<WgpuRuntime>::traffic(&rank.collectives).clone();
            rank.collectives
                .all_gather_each(&parts, 7)
                .expect("issue")
                .wait()
                .expect("all_gather_each");
            (rank.read(&whole), rank.traffic(), counter.calls())
        });
        for (q, (out, traffic, calls)) in results.into_iter().enumerate() {
            let mut expected = inputs[q].clone();
            for (slice, counts) in [(&a, &counts_a), (&b, &counts_b)] {
                for (owner, input) in inputs.iter().enumerate() {
                    let at = chunk(slice, counts, owner);
                    expected.as_bytes_mut()[4 * at.start..4 * at.end]
                        .copy_from_slice(input.slice(at).as_bytes());
                }
            }
            assert_eq!(out, expected, "world {world} rank {q}");
            let own = 4 * (counts_a[q] + counts_b[q]) as u64;
            assert_eq!(
                traffic,
                Traffic {
                    to_host: own,
                    to_device: 4 * (na + nb) as u64 - own,
                },
                "world {world} rank {q}: its own chunks down, the others' up"
            );
            assert_eq!(calls, 1, "world {world} rank {q}: one collective");
        }
    }
}

#[test]
fn broadcast_gives_every_rank_the_roots_slice_and_reads_only_on_the_root() {
    let world = 3;
    let (len, slice, _) = layout(300, 0);
    let inputs: Vec<HostBuffer> = (0..world)
        .map(|q| rank_data(DType::F32, len, 17, q))
        .collect();
    let results = ranks(world, |rank| {
        let whole = rank.buffer(&inputs[rank.rank], DeviceDType::F32);
        rank.collectives
            .broadcast(&whole.range(slice.clone()), 1)
            .expect("issue")
            .wait()
            .expect("broadcast");
        (rank.read(&whole), rank.traffic())
    });
    for (q, (out, traffic)) in results.into_iter().enumerate() {
        assert_eq!(
            out.slice(slice.clone()),
            inputs[1].slice(slice.clone()),
            "rank {q}"
        );
        assert_eq!(out.slice(0..PAD), inputs[q].slice(0..PAD));
        let bytes = 4 * slice.len() as u64;
        let expected = if q == 1 {
            Traffic {
                to_host: bytes,
                to_device: 0,
            }
        } else {
            Traffic {
                to_host: 0,
                to_device: bytes,
            }
        };
        assert_eq!(traffic, expected, "rank {q}");
    }
}

#[test]
fn bad_arguments_fail_naming_the_rank_and_the_problem() {
    ranks(1, |rank| {
        let whole = rank.buffer(&HostBuffer::F32(vec![0.0; 100]), DeviceDType::F32);
        let past_the_end = whole.range(90..110);
        let err = rank
            .collectives
            .all_reduce(&[past_the_end], ReduceOp::Sum)
            .unwrap_err();
        assert!(
            matches!(
                err,
                DeviceError::OutOfBounds {
                    rank: 0,
                    offset: 90,
                    end: 110,
                    ..
                }
            ),
            "{err}"
        );
        assert!(
            err.to_string()
                .contains("rank 0: device all_reduce: elements 90..110 of f32"),
            "{err}"
        );

        let err = rank
            .collectives
            .reduce_scatter(&whole, &[50, 40], ReduceOp::Sum)
            .unwrap_err();
        assert!(
            matches!(
                err,
                DeviceError::Counts {
                    world: 1,
                    len: 100,
                    ..
                }
            ),
            "{err}"
        );

        let err = rank.collectives.broadcast(&whole, 1).unwrap_err();
        assert!(
            matches!(
                err,
                DeviceError::Root {
                    root: 1,
                    world: 1,
                    ..
                }
            ),
            "{err}"
        );

        let halves =
            DeviceSlice::whole(whole.client.clone(), whole.handle.clone(), DeviceDType::F16);
        let err = rank
            .collectives
            .all_reduce(&[whole.range(0..4), halves.range(0..4)], ReduceOp::Sum)
            .unwrap_err();
        assert!(matches!(err, DeviceError::MixedDTypes { .. }), "{err}");

        // WGSL has no bf16: refused by name, never a panic deep inside cubecl.
        let bf16 = DeviceSlice::whole(
            whole.client.clone(),
            whole.handle.clone(),
            DeviceDType::BF16,
        );
        let err = rank
            .collectives
            .all_reduce(&[bf16], ReduceOp::Sum)
            .unwrap_err();
        assert!(matches!(err, DeviceError::UnsupportedDType { .. }), "{err}");
        assert!(err.to_string().contains("has no bf16 type"), "{err}");

        // Nothing was staged by the refused calls.
        assert_eq!(rank.traffic(), Traffic::default());
        let err = upload_into(
            &whole.range(0..3),
            &HostBuffer::F32(vec![1.0; 4]),
            &TrafficCounter::default(),
            0,
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("4 elements of f32 given for a slice of 3"),
            "{err}"
        );
    });
}

#[test]
fn a_rank_that_dies_fails_the_others_device_collective_with_its_name() {
    let comms = HostCommunicator::local_group(2, &CommConfig::default());
    let results = run_ranks(comms, |q, comm| {
        let rank = Rank::new(comm);
        if q == 1 {
            // Rank 1 leaves without taking part.
            drop(rank);
            return None;
        }
        let whole = rank.buffer(&HostBuffer::F32(vec![1.0; 64]), DeviceDType::F32);
        let result = rank
            .collectives
            .all_reduce(&[whole], ReduceOp::Sum)
            .and_then(|p| p.wait());
        Some(result.unwrap_err().to_string())
    });
    let message = results[0].clone().expect("rank 0's error");
    assert!(message.contains("rank 1"), "{message}");
}
