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
    CommConfig, CommError, Communicator, DType, HostBuffer, HostCommunicator, Link, Pending,
    ReduceOp,
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

/// Rank 0 waits in a gather on the gather lane that the other ranks never issue, and they wait
/// in a barrier on the main lane that rank 0 never issues: no message of one reaches the
/// other's lane, so no header can show it. With the default collective timeout (10 minutes),
/// every rank fails within a few seconds all the same, and its error names what each rank
/// waits in (the gather by its label) and who has not issued it.
#[test]
fn ranks_waiting_for_each_other_on_different_lanes_fail_within_seconds_naming_both() {
    let config = CommConfig::default();
    for (wire, world) in [
        (Wire::Local, 2),
        (Wire::Local, 3),
        (Wire::Tcp, 2),
        (Wire::Shm, 2),
    ] {
        let started = Instant::now();
        let errors = run_ranks(group(wire, world, &config), |rank, comm| {
            comm.label_tags(vec!["layers.2.weight".into()]);
            let failed = match rank {
                0 => comm
                    .gather_lane()
                    .all_gather_counts(HostBuffer::U8(vec![1; 4]), vec![4; world], 1)
                    .wait()
                    .map(drop),
                _ => comm.barrier().wait(),
            };
            failed.expect_err("the ranks wait for each other")
        });
        let elapsed = started.elapsed();
        assert!(
            elapsed < Duration::from_secs(15),
            "{wire:?}, {world} ranks: failed after {elapsed:?}"
        );
        for (rank, error) in errors.iter().enumerate() {
            let message = error.to_string();
            for part in [
                "rank 0 waits in all_gather #0 on the gather lane tag 1 (u8, 4 B) \
                 (`layers.2.weight`), which rank 1 (issued 0 there)",
                "rank 1 waits in barrier #0 on the main lane, which rank 0 (issued 0 there) has \
                 not issued",
            ] {
                assert!(
                    message.contains(part),
                    "{wire:?}, {world} ranks, rank {rank}: {message}"
                );
            }
            assert!(
                matches!(
                    error,
                    CommError::Diverged { .. } | CommError::Aborted { .. }
                ),
                "{wire:?} rank {rank}: {error:?}"
            );
        }
    }
}

/// A rank that waits long for a peer busy computing (not waiting in any collective) is no
/// divergence: with a grace of 10 ms, the peer computes for 40 graces before it issues the
/// gather, and both finish.
#[test]
fn a_long_wait_for_a_peer_that_computes_is_not_taken_for_a_divergence() {
    let config = CommConfig::default().with_divergence_grace(Duration::from_millis(10));
    for wire in WIRES {
        let results = run_ranks(group(wire, 2, &config), |rank, comm| {
            // Both issue the barrier; rank 1 then computes before the gather rank 0 waits in.
            let mut barrier = Some(comm.barrier());
            if rank == 1 {
                barrier.take().expect("issued").wait()?;
                std::thread::sleep(Duration::from_millis(400)); // stands for compute
            }
            let gathered = comm
                .gather_lane()
                .all_gather_counts(HostBuffer::U8(vec![rank as u8; 4]), vec![4, 4], 1)
                .wait()?;
            barrier.map_or(Ok(()), Pending::wait)?;
            Ok::<_, CommError>(gathered)
        });
        for (rank, result) in results.into_iter().enumerate() {
            let gathered = result.unwrap_or_else(|e| panic!("{wire:?} rank {rank}: {e}"));
            assert_eq!(gathered.as_bytes(), [0, 0, 0, 0, 1, 1, 1, 1], "{wire:?}");
        }
    }
}
