//! The TCP store: requests, waits, authentication, duplicate ranks and limits, and a job that
//! forms through a store flooded with connections that never finish their hello.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use burn_dist_comm::store::codec::{MAX_HELLO, Message, read_frame};
use burn_dist_comm::store::{SPARE_PENDING, StoreClient, StoreServer};
use burn_dist_comm::testing::{assert_all_reduce_matches_reference, join_ranks, test_store};
use burn_dist_comm::{CommConfig, CommError};

const TOKEN: &str = "secret";
/// Ranks of the job behind [`server`].
const WORLD: usize = 4;

fn config() -> CommConfig {
    CommConfig::default().with_timeout(Duration::from_millis(500))
}

fn server() -> StoreServer {
    server_for(WORLD, &config())
}

fn server_for(world: usize, config: &CommConfig) -> StoreServer {
    StoreServer::bind("127.0.0.1:0".parse().unwrap(), TOKEN, world, config).unwrap()
}

#[test]
fn set_get_and_add_round_trip() {
    let server = server();
    let a = StoreClient::connect(server.local_addr(), TOKEN, 0, &config()).unwrap();
    let b = StoreClient::connect(server.local_addr(), TOKEN, 1, &config()).unwrap();
    a.set("k", b"value").unwrap();
    assert_eq!(b.get("k").unwrap(), b"value");
    assert_eq!(a.add("n", 2).unwrap(), 2);
    assert_eq!(b.add("n", 3).unwrap(), 5);
}

#[test]
fn get_waits_for_a_key_set_later() {
    let server = server();
    let slow = CommConfig::default().with_timeout(Duration::from_secs(30));
    let reader = StoreClient::connect(server.local_addr(), TOKEN, 0, &slow).unwrap();
    let writer = StoreClient::connect(server.local_addr(), TOKEN, 1, &slow).unwrap();
    std::thread::scope(|s| {
        let got = s.spawn(|| reader.get("late").unwrap());
        writer.set("late", b"here").unwrap();
        assert_eq!(got.join().unwrap(), b"here");
    });
}

#[test]
fn missing_key_times_out_naming_the_key() {
    let server = server();
    let client = StoreClient::connect(server.local_addr(), TOKEN, 0, &config()).unwrap();
    let started = Instant::now();
    let err = client.get("never").unwrap_err().to_string();
    assert!(
        err.contains("key \"never\" was not set within 0.5 s"),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn wrong_token_is_rejected() {
    let server = server();
    let err = StoreClient::connect(server.local_addr(), "guess", 3, &config()).unwrap_err();
    let err = err.to_string();
    assert!(
        err.contains("refused to let rank 3 join: wrong job token"),
        "{err}"
    );
}

#[test]
fn port_in_use_is_a_clear_error() {
    let first = server();
    let err = StoreServer::bind(first.local_addr(), TOKEN, WORLD, &config())
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("cannot bind") && err.contains("MASTER_PORT"),
        "{err}"
    );
}

#[test]
fn unreachable_store_is_a_clear_error_within_the_timeout() {
    // Bind and release a port so that nothing listens there.
    let addr: SocketAddr = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap()
    };
    let started = Instant::now();
    let err = StoreClient::connect(addr, TOKEN, 1, &config())
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("not reachable within 0.5 s") && err.contains("is rank 0 running"),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn oversized_frame_is_refused_and_the_connection_closed() {
    let server = server();
    let mut raw = TcpStream::connect(server.local_addr()).unwrap();
    raw.write_all(&u32::MAX.to_le_bytes()).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    match read_frame(&mut raw, 1 << 20).unwrap() {
        Message::Error { reason } => assert!(reason.contains("exceeds the limit"), "{reason}"),
        other => panic!("expected an error, got {other:?}"),
    }
    let mut rest = Vec::new();
    assert_eq!(
        raw.read_to_end(&mut rest).unwrap(),
        0,
        "connection should be closed"
    );
}

#[test]
fn hello_longer_than_the_limit_is_refused_before_reading_it() {
    // A long handshake timeout: the refusal must come from the size, not from a timeout.
    let config = config().with_handshake_timeout(Duration::from_secs(60));
    let server = server_for(WORLD, &config);
    let mut raw = TcpStream::connect(server.local_addr()).unwrap();
    let too_long = MAX_HELLO as u32 + 1;
    raw.write_all(&too_long.to_le_bytes()).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    match read_frame(&mut raw, 1 << 20).unwrap() {
        Message::Error { reason } => assert!(
            reason.contains(&format!("exceeds the limit of {MAX_HELLO} bytes")),
            "{reason}"
        ),
        other => panic!("expected an error, got {other:?}"),
    }
}

/// A client that trickles its hello one byte per 50 ms (each byte keeps a per-read timeout
/// alive) is dropped when the one handshake deadline passes.
#[test]
fn trickled_hello_is_dropped_at_one_deadline() {
    let config = config().with_handshake_timeout(Duration::from_millis(300));
    let server = server_for(WORLD, &config);
    let mut raw = TcpStream::connect(server.local_addr()).unwrap();
    // The longest hello the store accepts: trickled whole, it would take 52 s.
    raw.write_all(&(MAX_HELLO as u32).to_le_bytes()).unwrap();
    // The wait for the store's answer paces the trickle.
    raw.set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let started = Instant::now();
    let mut trickled = 0;
    loop {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "still connected after 10 s and {trickled} bytes"
        );
        if raw.write_all(b"x").is_err() {
            break;
        }
        trickled += 1;
        match raw.read(&mut [0u8; 256]) {
            Ok(_) => break, // the refusal, or the end of the connection
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => break,
        }
    }
    assert!(trickled > 2, "only {trickled} bytes were sent");
    assert!(started.elapsed() >= Duration::from_millis(300));
}

/// Many more silent and trickling connections than the store lets wait: the longest waiters
/// are closed, and a job of 3 ranks still forms through the store and all-reduces correctly
/// while the rest stay open.
#[test]
fn flood_of_silent_and_trickling_connections_does_not_stop_the_job() {
    const WORLD: usize = 3;
    const FLOOD: usize = 80;
    // Longer than the join: no flood connection times out before the job has formed.
    let config = CommConfig::default()
        .with_timeout(Duration::from_secs(30))
        .with_handshake_timeout(Duration::from_secs(60));
    let server = test_store(WORLD, &config);
    let mut flood: Vec<TcpStream> = (0..FLOOD)
        .map(|i| {
            let mut stream = TcpStream::connect(server.local_addr()).unwrap();
            if i % 2 == 1 {
                stream.write_all(&[1]).unwrap(); // a first byte of a length prefix
            }
            stream
        })
        .collect();

    let comms = join_ranks(server.local_addr(), WORLD, &config);
    assert_all_reduce_matches_reference(comms, 7);
    // The store let at most WORLD + SPARE_PENDING of them wait: the oldest were closed,
    // unanswered.
    for (i, stream) in flood
        .iter_mut()
        .take(FLOOD - WORLD - SPARE_PENDING)
        .enumerate()
    {
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let read = stream.read(&mut [0u8; 16]);
        assert!(
            matches!(read, Ok(0))
                || read
                    .as_ref()
                    .is_err_and(|e| e.kind() == ErrorKind::ConnectionReset),
            "flood connection {i} is still open: {read:?}"
        );
    }
}

#[test]
fn rank_outside_the_job_is_refused() {
    let server = server();
    let err = StoreClient::connect(server.local_addr(), TOKEN, WORLD, &config()).unwrap_err();
    assert!(
        err.to_string()
            .contains(&format!("rank {WORLD} is not below WORLD_SIZE={WORLD}")),
        "{err}"
    );
}

/// RANK=1 given to two processes of a job of 3: the second is refused, and every rank that
/// waits for the job to form fails too, each naming rank 1.
#[test]
fn a_rank_joining_twice_fails_every_rank_naming_it() {
    // A long timeout, so that only the duplicate can end the wait for rank 2.
    let config = CommConfig::default().with_timeout(Duration::from_secs(60));
    let server = server_for(3, &config);
    let rank0 = StoreClient::connect(server.local_addr(), TOKEN, 0, &config).unwrap();
    let rank1 = StoreClient::connect(server.local_addr(), TOKEN, 1, &config).unwrap();
    let started = Instant::now();
    std::thread::scope(|s| {
        let waiting = s.spawn(|| rank0.wait_for_every_rank());
        let again = StoreClient::connect(server.local_addr(), TOKEN, 1, &config).unwrap_err();
        for err in [
            again,
            waiting.join().unwrap().unwrap_err(),
            rank1.get("k").unwrap_err(),
        ] {
            assert!(
                matches!(err, CommError::DuplicateRank { rank: 1, .. }),
                "{err}"
            );
            assert!(
                err.to_string().contains("rank 1 joined the job twice"),
                "{err}"
            );
        }
    });
    assert!(started.elapsed() < Duration::from_secs(30));
}

/// Once every rank has joined, another process presenting a taken rank is refused alone: the
/// job keeps its store.
#[test]
fn a_stray_duplicate_after_the_job_formed_is_refused_alone() {
    let server = server_for(2, &config());
    let rank0 = StoreClient::connect(server.local_addr(), TOKEN, 0, &config()).unwrap();
    let _rank1 = StoreClient::connect(server.local_addr(), TOKEN, 1, &config()).unwrap();
    rank0.wait_for_every_rank().unwrap();
    let stray = StoreClient::connect(server.local_addr(), TOKEN, 0, &config()).unwrap_err();
    assert!(
        matches!(stray, CommError::DuplicateRank { rank: 0, .. }),
        "{stray}"
    );
    rank0.set("still", b"works").unwrap();
    assert_eq!(rank0.get("still").unwrap(), b"works");
}

#[test]
fn waiting_for_every_rank_names_the_missing_ones() {
    let server = server_for(3, &config());
    let rank1 = StoreClient::connect(server.local_addr(), TOKEN, 1, &config()).unwrap();
    let err = rank1.wait_for_every_rank().unwrap_err().to_string();
    assert!(
        err.contains("ranks 0, 2 did not join within 0.5 s"),
        "{err}"
    );
}

#[test]
fn a_store_that_goes_away_is_reported_as_rank_0_exiting() {
    use burn_dist_comm::store::codec::encode_frame;
    // A stand-in for rank 0's store: it lets the client join, takes one request, and is gone
    // (as when rank 0's process exits after another rank failed).
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let store = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        read_frame(&mut conn, 1 << 16).unwrap();
        conn.write_all(&encode_frame(&Message::Ok)).unwrap();
        read_frame(&mut conn, 1 << 16).unwrap();
    });
    let client = StoreClient::connect(addr, TOKEN, 1, &config()).unwrap();
    let err = client.get("key").unwrap_err().to_string();
    store.join().unwrap();
    assert!(
        err.contains("closed the connection: rank 0, whose process serves the store, has exited"),
        "{err}"
    );
}
