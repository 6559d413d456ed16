//! Failures are loud, fast and named: dead or silent peers, mismatched collectives, bad
//! arguments. (Real process deaths are covered by burn-dist-run's multi-process tests.)

use std::sync::mpsc;
use std::time::{Duration, Instant};

use burn_dist_comm::testing::{linked_group, run_ranks};
use burn_dist_comm::{
    CommConfig, CommError, Communicator, HostBuffer, HostCommunicator, Link, ReduceOp,
};

fn config(timeout_ms: u64) -> CommConfig {
    CommConfig::default().with_timeout(Duration::from_millis(timeout_ms))
}

fn all_reduce_f32(comm: &HostCommunicator, len: usize) -> Result<HostBuffer, CommError> {
    comm.all_reduce(HostBuffer::F32(vec![1.0; len]), ReduceOp::Sum)
        .wait()
}

/// Rank 2 leaves (drops its communicator) while ranks 0 and 1 still need it: both fail with
/// an error naming rank 2, well before the timeout.
fn departed_rank_is_named_by_every_survivor(comms: Vec<HostCommunicator>) {
    let started = Instant::now();
    let errors = run_ranks(comms, |rank, comm| {
        if rank == 2 {
            drop(comm);
            return None;
        }
        Some(all_reduce_f32(&comm, 1 << 16).unwrap_err())
    });
    for error in errors.into_iter().flatten() {
        assert!(
            error.to_string().contains("rank 2"),
            "error does not name rank 2: {error}"
        );
    }
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
}

#[test]
fn departed_rank_is_named_by_every_survivor_in_process() {
    departed_rank_is_named_by_every_survivor(HostCommunicator::local_group(3, &config(30_000)));
}

#[test]
fn departed_rank_is_named_by_every_survivor_over_tcp() {
    let (_store, comms) = linked_group(3, &config(30_000), Link::Tcp);
    departed_rank_is_named_by_every_survivor(comms);
}

#[test]
fn departed_rank_is_named_by_every_survivor_over_shared_memory() {
    let (_store, comms) = linked_group(3, &config(30_000), Link::SharedMemory);
    departed_rank_is_named_by_every_survivor(comms);
}

/// Rank 1 of 3 stays alive but never joins the collective: ranks 0 and 2 fail naming it. Rank
/// 0 first waits on rank 2 (the order in which it receives, and its upstream neighbour in a
/// ring), which answers: the error must name the rank that is silent, not the peer a rank
/// happened to be waiting on first, which a world of 2 cannot tell apart.
fn silent_rank_times_out_naming_it(comms: Vec<HostCommunicator>) {
    const SILENT: usize = 1;
    let live = comms.len() - 1;
    assert!(live >= 2, "the silent rank must not be the only peer");
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let done_rx = std::sync::Mutex::new(done_rx);
    let errors = run_ranks(comms, |rank, comm| {
        if rank == SILENT {
            // Keep the communicator alive until every other rank has its answer.
            let done_rx = done_rx.lock().unwrap();
            for _ in 0..live {
                _ = done_rx.recv();
            }
            return None;
        }
        let started = Instant::now();
        let error = all_reduce_f32(&comm, 8).unwrap_err();
        done_tx.send(()).unwrap();
        Some((rank, error, started.elapsed()))
    });
    for (rank, error, elapsed) in errors.into_iter().flatten() {
        // Its own timeout, or a peer's that aborted the group first: either way, rank 1.
        let named = match &error {
            CommError::Timeout { peer, .. } => *peer == SILENT,
            CommError::Aborted { reason, .. } => reason.starts_with("rank 1 did not answer"),
            _ => false,
        };
        assert!(named, "rank {rank}: {error}");
        assert!(
            error
                .to_string()
                .contains("rank 1 did not answer within 0.3 s during all_reduce #0"),
            "rank {rank}: {error}"
        );
        assert!(elapsed < Duration::from_secs(5), "rank {rank}: {elapsed:?}");
    }
}

#[test]
fn silent_rank_times_out_naming_it_in_process() {
    silent_rank_times_out_naming_it(HostCommunicator::local_group(3, &config(300)));
}

#[test]
fn silent_rank_times_out_naming_it_over_tcp() {
    // The mesh is built with a generous timeout; only the collective's wait is short.
    let (_store, comms) = linked_group(3, &config(300), Link::Tcp);
    silent_rank_times_out_naming_it(comms);
}

#[test]
fn silent_rank_times_out_naming_it_over_shared_memory() {
    let (_store, comms) = linked_group(3, &config(300), Link::SharedMemory);
    silent_rank_times_out_naming_it(comms);
}

#[test]
fn mismatched_sizes_are_reported_not_garbage() {
    let errors = run_ranks(
        HostCommunicator::local_group(2, &config(30_000)),
        |rank, comm| {
            all_reduce_f32(&comm, 10 + 2 * rank)
                .unwrap_err()
                .to_string()
        },
    );
    assert!(
        errors
            .iter()
            .any(|e| e.contains("expected all_reduce #0 f32")),
        "{errors:?}"
    );
    assert!(
        errors.iter().all(|e| e.contains("same sizes")),
        "{errors:?}"
    );
}

#[test]
fn mismatched_collectives_over_tcp_are_reported() {
    let (_store, comms) = linked_group(2, &config(30_000), Link::Tcp);
    mismatched_collectives_are_reported(comms);
}

#[test]
fn mismatched_collectives_over_shared_memory_are_reported() {
    let (_store, comms) = linked_group(2, &config(30_000), Link::SharedMemory);
    mismatched_collectives_are_reported(comms);
}

fn mismatched_collectives_are_reported(comms: Vec<HostCommunicator>) {
    let errors = run_ranks(comms, |rank, comm| match rank {
        0 => all_reduce_f32(&comm, 64).unwrap_err().to_string(),
        _ => comm
            .broadcast(HostBuffer::F32(vec![0.0; 64]), 0)
            .wait()
            .unwrap_err()
            .to_string(),
    });
    assert!(
        errors
            .iter()
            .any(|e| e.contains("sent broadcast #0") || e.contains("sent all_reduce #0")),
        "{errors:?}"
    );
}

/// Two ranks gather different things at the same point of their programs (stage 3: rank 1
/// took a branch that uses another parameter): same collective, same size, different tags.
/// Every rank fails, and the message names both payloads by their labels.
fn different_tags_are_reported_by_label(comms: Vec<HostCommunicator>) {
    let errors = run_ranks(comms, |rank, comm| {
        comm.label_tags(vec!["layers.0.weight".into(), "layers.1.weight".into()]);
        let tag = 1 + u32::from(rank == 1);
        comm.all_gather_counts(HostBuffer::F32(vec![0.0; 4]), vec![4, 4], tag)
            .wait()
            .unwrap_err()
            .to_string()
    });
    for (rank, error) in errors.iter().enumerate() {
        assert!(
            error.contains("tag 1") && error.contains("tag 2"),
            "rank {rank}: {error}"
        );
        assert!(
            error.contains("`layers.0.weight`") && error.contains("`layers.1.weight`"),
            "rank {rank}: {error}"
        );
    }
}

#[test]
fn different_tags_are_reported_by_label_in_process() {
    different_tags_are_reported_by_label(HostCommunicator::local_group(2, &config(30_000)));
}

#[test]
fn different_tags_are_reported_by_label_over_tcp() {
    let (_store, comms) = linked_group(2, &config(30_000), Link::Tcp);
    different_tags_are_reported_by_label(comms);
}

#[test]
fn sum_of_raw_bytes_is_refused_on_every_rank() {
    let errors = run_ranks(
        HostCommunicator::local_group(2, &config(30_000)),
        |_, comm| {
            comm.all_reduce(HostBuffer::U8(vec![1, 2]), ReduceOp::Sum)
                .wait()
                .unwrap_err()
        },
    );
    for error in errors {
        assert!(
            error
                .to_string()
                .contains("sum is not defined on raw bytes"),
            "{error}"
        );
    }
}

#[test]
fn wrong_shard_length_names_the_rank_and_stops_the_group() {
    let errors = run_ranks(
        HostCommunicator::local_group(3, &config(30_000)),
        |rank, comm| {
            let len = if rank == 1 { 5 } else { 3 };
            comm.all_gather(HostBuffer::F32(vec![0.0; len]), 9)
                .wait()
                .unwrap_err()
                .to_string()
        },
    );
    assert!(
        errors[1].contains("rank 1 passed 5 elements"),
        "{}",
        errors[1]
    );
    for error in &errors {
        assert!(error.contains("rank 1"), "{error}");
    }
}

#[test]
fn a_failed_group_fails_later_collectives_at_once_with_the_root_cause() {
    let errors = run_ranks(
        HostCommunicator::local_group(2, &config(30_000)),
        |rank, comm| {
            let first = all_reduce_f32(&comm, 4 + rank).unwrap_err().to_string();
            let started = Instant::now();
            let second = all_reduce_f32(&comm, 4).unwrap_err().to_string();
            assert!(started.elapsed() < Duration::from_secs(1));
            (first, second)
        },
    );
    for (first, second) in errors {
        assert_eq!(first, second);
    }
}
