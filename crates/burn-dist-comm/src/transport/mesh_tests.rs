//! The mesh handshake under silent and trickling connections: the job still forms and works.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::{DATA, MAGIC, accept_higher, dial, kinds, link, listen};
use crate::env::MAX_TOKEN_BYTES;
use crate::store::StoreClient;
use crate::testing::{TEST_TOKEN, assert_all_reduce_matches_reference, test_store};
use crate::{CommConfig, HostCommunicator};

/// Connections to each listener beyond what it lets wait (`3 (world − 1 − rank) + 32`).
const FLOOD: usize = 48;

/// Opens `FLOOD` connections to `listener`: half silent, half with one byte of a hello sent.
fn flood(listener: &TcpListener) -> Vec<TcpStream> {
    let addr = listener.local_addr().unwrap();
    (0..FLOOD)
        .map(|i| {
            let mut stream = TcpStream::connect(addr).unwrap();
            if i % 2 == 1 {
                stream.write_all(&MAGIC[..1]).unwrap();
            }
            stream
        })
        .collect()
}

/// Every rank's mesh listener and the store itself are flooded before any peer dials: the
/// links still form, and an all-reduce over them matches the reference.
#[test]
fn flood_of_silent_and_trickling_connections_does_not_stop_the_mesh() {
    const WORLD: usize = 3;
    // Hellos may take longer than the join: only eviction can let the peers in.
    let config = CommConfig::default()
        .with_timeout(Duration::from_secs(30))
        .with_handshake_timeout(Duration::from_secs(60))
        .with_shared_memory(false);
    let server = test_store(WORLD, &config);
    let _store_flood = (0..FLOOD)
        .map(|_| TcpStream::connect(server.local_addr()).unwrap())
        .collect::<Vec<_>>();
    let stores: Vec<StoreClient> = (0..WORLD)
        .map(|rank| StoreClient::connect(server.local_addr(), TEST_TOKEN, rank, &config).unwrap())
        .collect();
    let listeners: Vec<TcpListener> = (0..WORLD)
        .map(|rank| listen(rank, &stores[rank]).unwrap())
        .collect();
    let _mesh_flood: Vec<Vec<TcpStream>> = listeners.iter().map(flood).collect();

    let comms: Vec<HostCommunicator> = std::thread::scope(|scope| {
        let joins: Vec<_> = (0..WORLD)
            .map(|rank| {
                let (store, listener, config) = (&stores[rank], &listeners[rank], &config);
                scope.spawn(move || link(listener, rank, WORLD, store, TEST_TOKEN, config))
            })
            .collect();
        joins
            .into_iter()
            .map(|j| j.join().unwrap().unwrap())
            .map(|lanes| HostCommunicator::new(lanes).unwrap())
            .collect()
    });
    assert_all_reduce_matches_reference(comms, 3);
}

/// A connection that trickles its mesh hello one byte per 50 ms is dropped when the one
/// handshake deadline passes, while the rank still waits for its real peer.
#[test]
fn trickled_mesh_hello_is_dropped_at_one_deadline() {
    let config = CommConfig::default()
        .with_timeout(Duration::from_secs(30))
        .with_handshake_timeout(Duration::from_millis(300));
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::scope(|scope| {
        let (listener, config) = (&listener, &config);
        let accepting = scope.spawn(move || {
            let mut links = vec![None, None];
            accept_higher(listener, 0, 2, TEST_TOKEN, config, &mut links)
        });

        let mut trickler = TcpStream::connect(addr).unwrap();
        // The wait for the rank's answer paces the trickle.
        trickler
            .set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        // The head of a hello from rank 1 announcing the longest token: 1040 bytes in all.
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(&1u32.to_le_bytes());
        hello.extend_from_slice(&2u32.to_le_bytes());
        hello.push(DATA);
        hello.push(config.lanes() as u8);
        hello.extend_from_slice(&(MAX_TOKEN_BYTES as u16).to_le_bytes());
        hello.resize(hello.len() + MAX_TOKEN_BYTES, b't');
        let started = Instant::now();
        let mut trickled = 0;
        for byte in &hello {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "still connected"
            );
            if trickler.write_all(&[*byte]).is_err() {
                break;
            }
            trickled += 1;
            match trickler.read(&mut [0u8; 64]) {
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                _ => break, // closed by the rank
            }
        }
        assert!(
            trickled > 2 && trickled < hello.len(),
            "{trickled} bytes trickled"
        );
        assert!(started.elapsed() >= Duration::from_millis(300));

        // The real rank 1 still gets in.
        for kind in kinds(config.lanes()) {
            dial(addr, 0, 1, 2, TEST_TOKEN, kind, config).unwrap();
        }
        accepting.join().unwrap().unwrap();
    });
}
