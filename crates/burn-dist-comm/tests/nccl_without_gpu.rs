//! The NCCL communicator on a machine without a GPU (CI): it fails with an error that names
//! the missing library, never a panic from inside the bindings. On a GPU machine where libcuda
//! and libnccl are found it builds a world-size-1 communicator instead (the GPU check,
//! `cargo xtask gpu-check`, tests its collectives).

#![cfg(feature = "cuda")]

use std::time::Duration;

use burn_dist_comm::store::{StoreClient, StoreServer};
use burn_dist_comm::{CommConfig, CommError, NcclCommunicator};

fn store(config: &CommConfig) -> (StoreServer, StoreClient) {
    let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), "token", 1, config).unwrap();
    let client = StoreClient::connect(server.local_addr(), "token", 0, config).unwrap();
    (server, client)
}

#[test]
fn missing_libraries_are_named_instead_of_panicking() {
    let config = CommConfig::default().with_timeout(Duration::from_secs(30));
    let (_server, client) = store(&config);
    match NcclCommunicator::new(&client, 0, 1, 0, &config) {
        Ok(comm) => println!(
            "libcuda and NCCL {:?} found: this machine has a GPU",
            comm.nccl_version()
        ),
        Err(e @ CommError::Env { .. }) => {
            let message = e.to_string();
            println!("{message}");
            assert!(
                message.starts_with("LD_LIBRARY_PATH: rank 0: "),
                "{message}"
            );
            assert!(
                message.contains("CUDA driver library") || message.contains("NCCL"),
                "the error names the library: {message}"
            );
            assert!(
                message.contains("tried"),
                "the error lists the names tried: {message}"
            );
        }
        Err(other) => panic!("expected a missing-library error on this machine, got {other}"),
    }
}

#[test]
fn a_rank_outside_the_group_is_refused_before_any_library_is_loaded() {
    let config = CommConfig::default().with_timeout(Duration::from_secs(30));
    let (_server, client) = store(&config);
    let err = NcclCommunicator::new(&client, 2, 2, 0, &config)
        .err()
        .expect("rank 2 of 2 is refused");
    assert!(
        matches!(err, CommError::InvalidArgument { .. }) && err.to_string().contains("rank 2"),
        "{err}"
    );
}
