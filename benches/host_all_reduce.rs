//! Host all-reduce bus bandwidth, 2 ranks connected through the real store and mesh, next to a
//! single-threaded memcpy of the same 64 MiB in the same run: once over shared memory (what two
//! ranks on one host use) and once over loopback TCP (what ranks on different hosts use, here
//! over loopback). At 2 ranks the bus bandwidth (nccl-tests' definition, 2(n−1)/n × bytes /
//! time) equals bytes / time, so the throughputs compare directly.
//!
//! A fourth measurement gives TCP's ceiling: two loopback sockets that each send and receive
//! the 64 MiB an all-reduce moves per rank at 2 ranks, with nothing else to do.
//!
//! `cargo bench -p burn-dist-benches --bench host_all_reduce`; results in docs/perf/.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::Duration;

use burn_dist_comm::testing::{linked_group, rank_data};
use burn_dist_comm::{CommConfig, Communicator, DType, HostBuffer, Link, ReduceOp};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};

const BYTES: usize = 64 << 20;

fn memcpy(c: &mut Criterion) {
    let src = vec![1u8; BYTES];
    let mut dst = vec![0u8; BYTES];
    let mut group = c.benchmark_group("host_64MiB");
    group
        .throughput(Throughput::Bytes(BYTES as u64))
        .sample_size(20);
    group.bench_function("memcpy", |b| {
        b.iter(|| dst.copy_from_slice(std::hint::black_box(&src)))
    });
    group.finish();
}

/// Both ends of one loopback connection send `BYTES` and receive `BYTES` at the same time.
fn tcp_exchange(c: &mut Criterion) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let a = TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
    let (b, _) = listener.accept().expect("accept");
    let send_buf = vec![1u8; BYTES];
    let mut sinks = [vec![0u8; BYTES], vec![0u8; BYTES]];
    let mut group = c.benchmark_group("host_64MiB");
    group
        .throughput(Throughput::Bytes(BYTES as u64))
        .sample_size(20);
    group.bench_function("tcp_loopback_exchange", |bench| {
        bench.iter(|| {
            std::thread::scope(|scope| {
                for ((mut tx, mut rx), sink) in [(&a, &b), (&b, &a)].into_iter().zip(&mut sinks) {
                    let payload = &send_buf;
                    scope.spawn(move || tx.write_all(payload).expect("send"));
                    scope.spawn(move || rx.read_exact(sink).expect("recv"));
                }
            })
        })
    });
    group.finish();
}

fn all_reduce_shared_memory(c: &mut Criterion) {
    all_reduce(c, "all_reduce_f32_2_ranks_shm", Link::SharedMemory);
}

fn all_reduce_tcp(c: &mut Criterion) {
    all_reduce(c, "all_reduce_f32_2_ranks_tcp", Link::Tcp);
}

fn all_reduce(c: &mut Criterion, name: &str, link: Link) {
    let (_store, mut comms) = linked_group(2, &CommConfig::default(), link);
    let peer = comms.pop().expect("rank 1");
    let rank0 = comms.pop().expect("rank 0");
    let len = BYTES / 4;
    // Avg of equal inputs is a fixed point, so the values stay finite however many iterations.
    let input = rank_data(DType::F32, len, 1, 0);

    // Rank 1 runs on its own thread and mirrors every all-reduce rank 0 issues.
    let (go, went) = mpsc::channel::<()>();
    let (done, finished) = mpsc::channel::<()>();
    let peer_input = input.clone();
    let peer_thread = std::thread::spawn(move || {
        let mut buf = peer_input;
        while went.recv().is_ok() {
            buf = peer
                .all_reduce(buf, ReduceOp::Avg)
                .wait()
                .expect("rank 1 all_reduce");
            done.send(()).expect("bench thread");
        }
    });

    let mut group = c.benchmark_group("host_64MiB");
    group
        .throughput(Throughput::Bytes(BYTES as u64))
        .sample_size(20)
        .measurement_time(Duration::from_secs(10));
    let mut buf: Option<HostBuffer> = Some(input);
    group.bench_function(name, |b| {
        b.iter(|| {
            go.send(()).expect("rank 1 thread");
            let out = rank0.all_reduce(buf.take().unwrap(), ReduceOp::Avg).wait();
            buf = Some(out.expect("rank 0 all_reduce"));
            finished.recv().expect("rank 1 thread");
        })
    });
    group.finish();
    drop(go);
    peer_thread.join().expect("rank 1 thread");
}

criterion_group!(
    benches,
    memcpy,
    all_reduce_shared_memory,
    all_reduce_tcp,
    tcp_exchange
);
criterion_main!(benches);
