//! The TCP store: requests, waits, authentication and limits.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use burn_dist_comm::CommConfig;
use burn_dist_comm::store::codec::{Message, read_frame};
use burn_dist_comm::store::{StoreClient, StoreServer};

const TOKEN: &str = "secret";

fn config() -> CommConfig {
    CommConfig::default().with_timeout(Duration::from_millis(500))
}

fn server() -> StoreServer {
    StoreServer::bind("127.0.0.1:0".parse().unwrap(), TOKEN, &config()).unwrap()
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
    let err = StoreServer::bind(first.local_addr(), TOKEN, &config())
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
