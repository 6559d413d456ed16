//! The gather lane: a second lane of the same group, with its own links and worker, on every
//! transport. A gather issued there completes while a reduction issued before it on the main
//! lane still waits for a peer; a failure on either lane stops both; and the two sides of a pair
//! must agree on having it.

use std::time::{Duration, Instant};

use burn_dist_comm::env::GATHER_LANE_VAR;
use burn_dist_comm::store::StoreClient;
use burn_dist_comm::testing::{
    TEST_TOKEN, linked_group, rank_data, reference_reduce, run_ranks, test_store,
};
use burn_dist_comm::{
    CommConfig, CommError, Communicator, DType, HostBuffer, HostCommunicator, Link, ReduceOp,
};

#[derive(Clone, Copy, Debug)]
enum Wire {
    Local,
    Tcp,
    Shm,
}

const WIRES: [Wire; 3] = [Wire::Local, Wire::Tcp, Wire::Shm];

/// The communicators of `world` ranks linked by `wire` (checked: see [`linked_group`]).
fn group(wire: Wire, world: usize, config: &CommConfig) -> Vec<HostCommunicator> {
    let link = match wire {
        Wire::Local => return HostCommunicator::local_group(world, config),
        Wire::Tcp => Link::Tcp,
        Wire::Shm => Link::SharedMemory,
    };
    let (store, comms) = linked_group(world, config, link);
    // The store is only needed to join; the links outlive it.
    drop(store);
    comms
}

/// Rank 0 issues a 4 MiB all-reduce and, before waiting for it, a gather on the gather lane;
/// the other ranks issue the all-reduce only once that gather is done. The gather cannot queue
/// behind the all-reduce: with one lane this order deadlocks until the timeout.
fn gather_overtakes(
    comms: Vec<HostCommunicator>,
) -> Vec<Result<(HostBuffer, HostBuffer), CommError>> {
    const LEN: usize = 1 << 20;
    let world = comms.len();
    let counts: Vec<usize> = (0..world).map(|q| 1000 + q).collect();
    run_ranks(comms, |rank, comm| {
        let reduce = || comm.all_reduce(rank_data(DType::F32, LEN, 3, rank), ReduceOp::Sum);
        let gather = || {
            let piece = rank_data(DType::BF16, counts[rank], 5, rank);
            comm.gather_lane()
                .all_gather_counts(piece, counts.clone(), 9)
                .wait()
        };
        let (gathered, reduced) = if rank == 0 {
            let reduced = reduce();
            (gather()?, reduced.wait()?)
        } else {
            let gathered = gather()?;
            (gathered, reduce().wait()?)
        };
        assert_eq!(comm.issued(), 1, "rank {rank}: main lane");
        assert_eq!(comm.gather_lane().issued(), 1, "rank {rank}: gather lane");
        Ok((gathered, reduced))
    })
}

#[test]
fn a_gather_is_not_stuck_behind_a_reduction_on_any_transport() {
    let config = CommConfig::default().with_timeout(Duration::from_secs(60));
    for wire in WIRES {
        for world in [2, 3] {
            let inputs: Vec<HostBuffer> = (0..world)
                .map(|rank| rank_data(DType::F32, 1 << 20, 3, rank))
                .collect();
            let sum = reference_reduce(&inputs, ReduceOp::Sum);
            let pieces: Vec<HostBuffer> = (0..world)
                .map(|rank| rank_data(DType::BF16, 1000 + rank, 5, rank))
                .collect();
            let concatenated: Vec<u8> = pieces.iter().flat_map(|p| p.as_bytes().to_vec()).collect();
            for (rank, result) in gather_overtakes(group(wire, world, &config))
                .into_iter()
                .enumerate()
            {
                let (gathered, reduced) =
                    result.unwrap_or_else(|e| panic!("{wire:?}, {world} ranks, rank {rank}: {e}"));
                assert!(
                    gathered.as_bytes() == concatenated,
                    "{wire:?} rank {rank}: gather"
                );
                assert!(
                    reduced.as_bytes() == sum.as_bytes(),
                    "{wire:?} rank {rank}: sum"
                );
            }
        }
    }
}

/// The scenario above needs the lane: on one lane the ranks issue the two collectives in
/// different orders, which every rank reports.
#[test]
fn without_the_gather_lane_the_same_calls_are_a_mismatch() {
    let config = CommConfig::default()
        .with_timeout(Duration::from_secs(60))
        .with_gather_lane(false);
    for result in gather_overtakes(HostCommunicator::local_group(2, &config)) {
        let err = result.expect_err("one lane cannot let the gather pass");
        let message = err.to_string();
        assert!(message.contains("in the same order"), "{message}");
    }
}

/// Rank 1 waits on the gather lane for a gather rank 0 never issues; rank 0 aborts its main
/// lane instead. Rank 1 hears of it on the other lane at once, with rank 0's reason, not after
/// its 60 s timeout.
#[test]
fn an_abort_on_the_main_lane_stops_a_gather_waiting_on_the_other() {
    let config = CommConfig::default().with_timeout(Duration::from_secs(60));
    for wire in WIRES {
        let started = Instant::now();
        let errors = run_ranks(group(wire, 2, &config), |rank, comm| {
            if rank == 0 {
                comm.abort("the model diverged".into())
            } else {
                comm.gather_lane()
                    .all_gather_counts(HostBuffer::U8(vec![1; 10]), vec![10, 10], 2)
                    .wait()
                    .expect_err("rank 0 aborted")
            }
        });
        assert!(
            matches!(&errors[1], CommError::Aborted { by: 0, reason } if reason.contains("the model diverged")),
            "{wire:?}: {}",
            errors[1]
        );
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{wire:?}: waited for the timeout"
        );
    }
}

/// A mismatch on the gather lane says where it happened.
#[test]
fn a_mismatch_on_the_gather_lane_is_named_as_such() {
    let config = CommConfig::default().with_timeout(Duration::from_secs(60));
    let errors = run_ranks(group(Wire::Tcp, 2, &config), |rank, comm| {
        comm.gather_lane()
            .all_gather_counts(HostBuffer::U8(vec![1; 4]), vec![4, 4], 1 + rank as u32)
            .wait()
            .expect_err("the tags differ")
            .to_string()
    });
    for (rank, message) in errors.iter().enumerate() {
        assert!(
            message.contains("on the gather lane"),
            "rank {rank}: {message}"
        );
    }
}

/// A rank with the gather lane and one without cannot form a group: the one that dials is told
/// which variable to set, and the other gives up at its join timeout, neither hangs.
#[test]
fn ranks_that_disagree_on_the_gather_lane_are_refused_by_name() {
    let base = CommConfig::default()
        .with_timeout(Duration::from_secs(3))
        .with_shared_memory(false);
    let server = test_store(2, &base);
    let errors: Vec<String> = std::thread::scope(|scope| {
        let joins: Vec<_> = (0..2)
            .map(|rank| {
                let config = base.clone().with_gather_lane(rank == 0);
                let addr = server.local_addr();
                scope.spawn(move || {
                    let store = StoreClient::connect(addr, TEST_TOKEN, rank, &config)?;
                    burn_dist_comm::connect(rank, 2, &store, TEST_TOKEN, &config)
                })
            })
            .collect();
        joins
            .into_iter()
            .map(|j| j.join().unwrap().err().expect("no group forms").to_string())
            .collect()
    });
    assert!(
        errors[1].contains(GATHER_LANE_VAR) && errors[1].contains("1 data lane(s), this rank 2"),
        "{}",
        errors[1]
    );
}
