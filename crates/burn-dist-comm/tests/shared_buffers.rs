//! In-place collectives on shared buffers: read straight out of the peers' arenas when every
//! rank's buffer is in shared memory, through the links otherwise, bitwise the same results
//! either way and the same as the ordinary collectives.

use std::time::{Duration, Instant};

use burn_dist_comm::testing::{linked_group, rank_data, reference_reduce, run_ranks};
use burn_dist_comm::{
    CommConfig, Communicator, DType, HostBuffer, HostCommunicator, Link, ReduceOp, SharedBuffer,
    SharedMemory,
};

/// How a rank's shared buffer is made.
#[derive(Clone, Copy, PartialEq)]
enum Place {
    /// `HostCommunicator::shared_buffer`: in shared memory where the group allows it.
    Communicator,
    /// `SharedBuffer::on_heap`: never readable in place.
    Heap,
}

fn buffer(comm: &HostCommunicator, place: Place, input: &HostBuffer) -> SharedBuffer {
    let mut buffer = match place {
        Place::Communicator => comm.shared_buffer(input.dtype(), input.len()),
        Place::Heap => SharedBuffer::on_heap(input.dtype(), input.len()),
    };
    assert!(buffer.copy_from(input));
    buffer
}

/// Uneven counts of `len` elements over `world` ranks, one of them 0 when there are 3.
fn uneven(len: usize, world: usize) -> Vec<usize> {
    match world {
        1 => vec![len],
        2 => vec![len / 3, len - len / 3],
        _ => {
            let mut counts = vec![len / 2, 0];
            counts.resize(world - 1, 1);
            counts.push(len - counts.iter().sum::<usize>());
            counts
        }
    }
}

/// Rank `rank`'s element range under `counts`.
fn range_of(counts: &[usize], rank: usize) -> std::ops::Range<usize> {
    let start = counts[..rank].iter().sum();
    start..start + counts[rank]
}

/// Every in-place collective on every rank of `comms`, with buffers made as `places[rank]`
/// says, checked bitwise against the reference and the ordinary collectives. Returns each
/// rank's count of collectives that read the peers' buffers in place.
fn check_in_place_collectives(comms: Vec<HostCommunicator>, places: &[Place]) -> Vec<u64> {
    let world = comms.len();
    let len = 70_001;
    run_ranks(comms, |rank, comm| {
        let place = places[rank];
        for (dtype, op) in [
            (DType::F32, ReduceOp::Sum),
            (DType::F32, ReduceOp::Avg),
            (DType::BF16, ReduceOp::Avg),
            (DType::F16, ReduceOp::Max),
        ] {
            let inputs: Vec<_> = (0..world).map(|q| rank_data(dtype, len, 11, q)).collect();
            let expected = reference_reduce(&inputs, op);
            let what = format!("rank {rank}, {dtype} {op}");

            let reduced = comm
                .all_reduce_shared(buffer(&comm, place, &inputs[rank]), op)
                .wait()
                .expect("all_reduce_shared");
            assert_eq!(reduced.to_host(), expected, "all-reduce, {what}");
            let ordinary = comm.all_reduce(inputs[rank].clone(), op).wait().unwrap();
            assert_eq!(reduced.to_host(), ordinary, "against all_reduce, {what}");

            let counts = uneven(len, world);
            let scattered = comm
                .reduce_scatter_shared(buffer(&comm, place, &inputs[rank]), op, counts.clone())
                .wait()
                .expect("reduce_scatter_shared")
                .to_host();
            for q in 0..world {
                let range = range_of(&counts, q);
                let want = if q == rank { &expected } else { &inputs[rank] };
                assert_eq!(
                    scattered.slice(range.clone()),
                    want.slice(range),
                    "reduce-scatter chunk {q}, {what}"
                );
            }
        }

        let dtype = DType::F32;
        let counts = uneven(len, world);
        let every: Vec<_> = (0..world).map(|q| rank_data(dtype, len, 5, q)).collect();
        // Each rank's contribution at its place; the rest of its buffer is not its to give.
        let mut gathered = buffer(&comm, place, &rank_data(dtype, len, 99, rank));
        let own = range_of(&counts, rank);
        let own_bytes = own.start * 4..own.end * 4;
        gathered.as_bytes_mut()[own_bytes.clone()]
            .copy_from_slice(&every[rank].as_bytes()[own_bytes]);
        let lane = comm.gather_lane();
        let gathered = lane
            .all_gather_shared(gathered, counts.clone(), 7)
            .wait()
            .expect("all_gather_shared")
            .to_host();
        for (q, input) in every.iter().enumerate() {
            let range = range_of(&counts, q);
            assert_eq!(
                gathered.slice(range.clone()),
                input.slice(range),
                "rank {rank}'s gathered chunk {q}"
            );
        }
        comm.direct_collectives() + lane.direct_collectives()
    })
}

#[test]
fn shared_buffers_over_shared_memory_are_read_in_place_and_reduce_bitwise_like_the_links() {
    for world in [2, 3] {
        let (_store, comms) = linked_group(world, &CommConfig::default(), Link::SharedMemory);
        let shared = comms[0].shared_buffer(DType::F32, 10);
        assert!(shared.is_in_shared_memory(), "{shared:?}");
        assert_eq!(shared.capacity(), 1024, "a whole page of f32");
        assert!(comms[0].holds(&shared) && !comms[1].holds(&shared));
        assert!(!comms[0].shared_buffer(DType::F32, 0).is_in_shared_memory());
        // Its page is what rank 0's arena holds, for either lane; rank 1's holds nothing.
        let held = SharedMemory {
            held: 4096,
            peak: 4096,
        };
        assert_eq!(comms[0].shared_memory(), held);
        assert_eq!(comms[0].gather_lane().shared_memory(), held);
        assert_eq!(comms[1].shared_memory(), SharedMemory::default());
        drop(shared);
        let returned = SharedMemory { held: 0, ..held };
        assert_eq!(comms[0].shared_memory(), returned);
        let direct = check_in_place_collectives(comms, &vec![Place::Communicator; world]);
        // 4 all-reduces, 4 reduce-scatters and the all-gather on the gather lane.
        assert_eq!(direct, vec![9; world], "{world} ranks");
    }
}

/// The gather lane maps its peers' arenas read-only: an all-reduce there, which in place
/// would write into the peers' buffers, goes through the links with the same bits, while its
/// all-gather still reads in place.
#[test]
fn on_the_gather_lane_an_all_reduce_goes_through_the_links_and_a_gather_reads_in_place() {
    let world = 2;
    let (_store, comms) = linked_group(world, &CommConfig::default(), Link::SharedMemory);
    let len = 70_001;
    let inputs: Vec<_> = (0..world)
        .map(|q| rank_data(DType::F32, len, 13, q))
        .collect();
    let expected = reference_reduce(&inputs, ReduceOp::Sum);
    let counted = run_ranks(comms, |rank, comm| {
        let lane = comm.gather_lane();
        let reduced = lane
            .all_reduce_shared(
                buffer(&comm, Place::Communicator, &inputs[rank]),
                ReduceOp::Sum,
            )
            .wait()
            .expect("all_reduce_shared on the gather lane");
        assert_eq!(reduced.to_host(), expected, "rank {rank}'s sum");
        let after_reduce = lane.direct_collectives();
        let counts = vec![len / 2, len - len / 2];
        let gathered = lane
            .all_gather_shared(reduced, counts, 3)
            .wait()
            .expect("all_gather_shared");
        assert_eq!(gathered.to_host(), expected, "rank {rank}'s gather");
        (after_reduce, lane.direct_collectives())
    });
    assert_eq!(
        counted,
        vec![(0, 1); world],
        "(after the all-reduce, after the gather)"
    );
}

#[test]
fn shared_buffers_elsewhere_live_on_the_heap_and_go_through_the_links() {
    let (_store, comms) = linked_group(3, &CommConfig::default(), Link::Tcp);
    assert!(!comms[0].shared_buffer(DType::F32, 10).is_in_shared_memory());
    assert_eq!(comms[0].shared_memory(), SharedMemory::default());
    assert_eq!(
        check_in_place_collectives(comms, &[Place::Communicator; 3]),
        [0; 3]
    );

    let comms = HostCommunicator::local_group(2, &CommConfig::default());
    assert!(!comms[0].shared_buffer(DType::F32, 10).is_in_shared_memory());
    assert_eq!(
        check_in_place_collectives(comms, &[Place::Communicator; 2]),
        [0; 2]
    );

    let comms = HostCommunicator::local_group(1, &CommConfig::default());
    assert_eq!(
        check_in_place_collectives(comms, &[Place::Communicator]),
        [0]
    );
}

#[test]
fn one_rank_on_the_heap_sends_every_rank_through_the_links() {
    let (_store, comms) = linked_group(3, &CommConfig::default(), Link::SharedMemory);
    let places = [Place::Communicator, Place::Heap, Place::Communicator];
    assert_eq!(check_in_place_collectives(comms, &places), [0; 3]);
}

#[test]
fn a_rank_gone_during_an_in_place_collective_is_named_by_the_others() {
    let config = CommConfig::default().with_timeout(Duration::from_secs(30));
    let (_store, comms) = linked_group(3, &config, Link::SharedMemory);
    let started = Instant::now();
    let errors = run_ranks(comms, |rank, comm| {
        let buffer = comm.shared_buffer(DType::F32, 1 << 16);
        if rank == 2 {
            drop(comm);
            return None;
        }
        Some(
            comm.all_reduce_shared(buffer, ReduceOp::Sum)
                .wait()
                .unwrap_err(),
        )
    });
    for error in errors.into_iter().flatten() {
        assert!(
            error.to_string().contains("rank 2"),
            "does not name rank 2: {error}"
        );
    }
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
}

#[test]
fn in_place_collectives_refuse_bad_counts_and_mismatched_peers_by_name() {
    let (_store, comms) = linked_group(2, &CommConfig::default(), Link::SharedMemory);
    let errors = run_ranks(comms, |rank, comm| {
        let bad_counts = comm
            .reduce_scatter_shared(
                comm.shared_buffer(DType::F32, 10),
                ReduceOp::Sum,
                vec![5, 4],
            )
            .wait()
            .unwrap_err()
            .to_string();
        (rank, bad_counts)
    });
    for (rank, error) in errors {
        assert!(
            error.contains("sum to the buffer's 10 elements"),
            "rank {rank}: {error}"
        );
    }

    let (_store, comms) = linked_group(2, &CommConfig::default(), Link::SharedMemory);
    let errors = run_ranks(comms, |rank, comm| {
        let len = 1000 + rank;
        let buffer = comm.shared_buffer(DType::F32, len);
        comm.all_reduce_shared(buffer, ReduceOp::Sum)
            .wait()
            .unwrap_err()
            .to_string()
    });
    assert_each_names_its_peer(&errors);

    // Same length, split differently: read in place, each would fold the wrong elements.
    let (_store, comms) = linked_group(2, &CommConfig::default(), Link::SharedMemory);
    let errors = run_ranks(comms, |rank, comm| {
        let counts = if rank == 0 { vec![4, 6] } else { vec![5, 5] };
        let buffer = comm.shared_buffer(DType::F32, 10);
        let scattered = comm.reduce_scatter_shared(buffer, ReduceOp::Sum, counts);
        scattered.wait().unwrap_err().to_string()
    });
    assert_each_names_its_peer(&errors);
}

/// Each of 2 ranks' errors is the shape mismatch, naming its peer: as what the peer sent, or,
/// when the peer found the mismatch first, as the peer that aborted the group with it.
fn assert_each_names_its_peer(errors: &[String]) {
    for (rank, error) in errors.iter().enumerate() {
        let peer = 1 - rank;
        let names_peer = error.contains(&format!("rank {peer} sent"))
            || error.contains(&format!("rank {peer} aborted the group: rank {rank} sent"));
        assert!(
            names_peer && error.contains("chunks digest"),
            "rank {rank}: {error}"
        );
    }
}
