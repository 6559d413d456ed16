//! Host collectives' bus bandwidth, 2 ranks connected through the real store and mesh, next to
//! a single-threaded memcpy of the same 64 MiB in the same run: an all-reduce of 64 MiB and an
//! all-gather of 32 MiB per rank into 64 MiB, each once over shared memory (what two ranks on
//! one host use) and once over loopback TCP (what ranks on different hosts use, here over
//! loopback). Bus bandwidth is nccl-tests' definition: 2(n−1)/n × bytes / time for an
//! all-reduce (at 2 ranks, bytes / time) and (n−1)/n × bytes / time for an all-gather (at 2
//! ranks, half the result's bytes / time), so the throughputs compare directly with memcpy's.
//!
//! The all-gather runs twice per link: into a fresh result each call (`all_gather`, what a
//! caller that keeps nothing gets: a 64 MiB mapping whose pages fault in), and into a result
//! buffer each rank kept from its previous call (`all_gather_counts_into`, what stage 3's
//! pooled gathers do, and what gloo's `all_gather_into_tensor` into the caller's tensor does).
//!
//! Two more rows give the ceiling of a design not built yet, buffers that live in shared memory
//! so that a rank reads and writes its peer's directly (docs/perf/host-all-reduce.md): two
//! threads, one per rank, with no ring in between. The all-gather: each rank writes its shard
//! into its kept result, then copies the peer's shard out of the peer's result. The all-reduce
//! (avg, in place): each rank folds its half of both inputs into its own buffer, then copies the
//! peer's folded half out of the peer's buffer. Threads join between the two phases (what a
//! barrier would do). Threads of one process share memory as two processes mapping one
//! shared-memory file do, so the copies cost the same.
//!
//! Two rows run that design as built (`HostCommunicator::shared_buffer`): each rank's buffer in
//! its arena under `/dev/shm`, which the peer maps and reads in place. The all-reduce
//! (`all_reduce_shared`, avg) and the all-gather (`all_gather_shared`: each rank writes its
//! shard into its kept buffer, then gathers in place) each reuse one buffer per rank, as the
//! kept all-gather does. The all-reduce runs twice: with its input copied into the buffer
//! before each timed call, and reducing the last call's result again as the ceiling row does.
//!
//! A last measurement gives TCP's ceiling: two loopback sockets that each send and receive
//! the 64 MiB an all-reduce moves per rank at 2 ranks, with nothing else to do.
//!
//! `cargo bench -p burn-dist-benches --bench host_all_reduce`, or `cargo xtask
//! bench-collectives` for it and PyTorch's gloo in one run; results in docs/perf/.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::Duration;

use burn_dist_comm::testing::{linked_group, rank_data};
use burn_dist_comm::{
    CommConfig, Communicator, DType, HostBuffer, HostCommunicator, Link, ReduceOp, SharedBuffer,
};
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};

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

fn all_gather_shared_memory(c: &mut Criterion) {
    all_gather(c, "all_gather_f32_2_ranks_shm", Link::SharedMemory);
}

fn all_gather_tcp(c: &mut Criterion) {
    all_gather(c, "all_gather_f32_2_ranks_tcp", Link::Tcp);
}

fn all_gather_kept_shared_memory(c: &mut Criterion) {
    all_gather_into_kept(c, "all_gather_kept_f32_2_ranks_shm", Link::SharedMemory);
}

fn all_gather_kept_tcp(c: &mut Criterion) {
    all_gather_into_kept(c, "all_gather_kept_f32_2_ranks_tcp", Link::Tcp);
}

/// An all-reduce (avg) of `BYTES` of f32: at 2 ranks its bus bandwidth is bytes / time.
fn all_reduce(c: &mut Criterion, name: &str, link: Link) {
    let input = rank_data(DType::F32, BYTES / 4, 1, 0);
    mirrored(
        c,
        name,
        link,
        BYTES,
        move |_, _| input.clone(),
        |comm, buf| comm.all_reduce(buf, ReduceOp::Avg).wait(),
    );
}

thread_local! {
    /// This rank's shared buffer, kept from its previous call (rank 0 runs on criterion's
    /// thread, rank 1 on its own).
    static SHARED: std::cell::RefCell<Option<SharedBuffer>> = const { std::cell::RefCell::new(None) };
}

/// This thread's kept shared buffer of `len` f32, or a new one from `comm` (then `true`) when
/// it has none or one of another group's arena (an earlier bench's).
fn kept_shared(comm: &HostCommunicator, len: usize) -> (SharedBuffer, bool) {
    let kept = SHARED.take().filter(|kept| comm.holds(kept));
    let fresh = kept.is_none();
    let buffer = kept.unwrap_or_else(|| comm.shared_buffer(DType::F32, len));
    assert!(
        buffer.is_in_shared_memory(),
        "the bench measures buffers in shared memory: {buffer:?}"
    );
    (buffer, fresh)
}

/// [`all_reduce`] in place on a shared buffer each rank keeps, its input copied in untimed
/// before every call (as a gradient bucket is filled before its reduction).
fn all_reduce_shared_buffers(c: &mut Criterion) {
    all_reduce_kept(c, "all_reduce_shared_buffers_f32_2_ranks", true);
}

/// [`all_reduce_shared_buffers`] reducing the last call's result again, with nothing in
/// between: what the ceiling row does with its buffers.
fn all_reduce_shared_buffers_again(c: &mut Criterion) {
    all_reduce_kept(c, "all_reduce_shared_buffers_again_f32_2_ranks", false);
}

/// An in-place all-reduce (avg) of a kept shared buffer, its input copied in before every call
/// with `refill`, else only into a new buffer (averages of the inputs stay finite).
fn all_reduce_kept(c: &mut Criterion, name: &str, refill: bool) {
    let input = rank_data(DType::F32, BYTES / 4, 1, 0);
    mirrored(
        c,
        name,
        Link::SharedMemory,
        BYTES,
        move |comm, _| {
            let (mut buffer, fresh) = kept_shared(comm, BYTES / 4);
            if refill || fresh {
                assert!(buffer.copy_from(&input));
            }
            buffer
        },
        |comm, buf| {
            SHARED.set(Some(comm.all_reduce_shared(buf, ReduceOp::Avg).wait()?));
            Ok(())
        },
    );
}

/// [`all_gather`] in place into a shared buffer each rank keeps: the rank's shard is written
/// into its place (timed, as the other all-gathers copy it), then gathered.
fn all_gather_shared_buffers(c: &mut Criterion) {
    let len = BYTES / 4;
    let shards = [0, 1].map(|rank| rank_data(DType::F32, len / 2, 1, rank));
    mirrored(
        c,
        "all_gather_shared_buffers_f32_2_ranks",
        Link::SharedMemory,
        BYTES / 2,
        move |comm, rank| (kept_shared(comm, len).0, shards[rank].clone()),
        move |comm, (mut buf, shard)| {
            let own = comm.rank() * shard.as_bytes().len();
            buf.as_bytes_mut()[own..own + shard.as_bytes().len()].copy_from_slice(shard.as_bytes());
            SHARED.set(Some(
                comm.all_gather_shared(buf, vec![len / 2; 2], 1).wait()?,
            ));
            // Freed after the timed call, as the other rows' inputs are.
            Ok(shard)
        },
    );
}

/// An all-gather of `BYTES / 2` of f32 per rank into `BYTES`, into a fresh result each call.
fn all_gather(c: &mut Criterion, name: &str, link: Link) {
    gathers(c, name, link, |comm, shard, len| {
        comm.all_gather(shard, len).wait()
    });
}

/// [`all_gather`] into the result buffer the calling rank's thread kept from its previous
/// call (the first call of a thread writes into a fresh one).
fn all_gather_into_kept(c: &mut Criterion, name: &str, link: Link) {
    thread_local! {
        /// This rank's last result (rank 0 runs on criterion's thread, rank 1 on its own).
        static KEPT: std::cell::RefCell<Option<HostBuffer>> = const { std::cell::RefCell::new(None) };
    }
    gathers(c, name, link, |comm, shard, len| {
        let counts = vec![len / 2; 2];
        let result = match KEPT.take() {
            Some(kept) => comm.all_gather_counts_into(shard, counts, 1, kept),
            None => comm.all_gather_counts(shard, counts, 1),
        }
        .wait()?;
        KEPT.set(Some(result));
        // Nothing to hand back: the result stays with the rank for its next call.
        Ok(HostBuffer::zeros(DType::F32, 0))
    });
}

/// Times `gather(comm, shard, len)`, an all-gather of each rank's `BYTES / 2` of f32 into
/// `len` elements (`BYTES`): at 2 ranks its bus bandwidth ((n−1)/n · bytes / time) is
/// `BYTES / 2` / time.
fn gathers<G>(c: &mut Criterion, name: &str, link: Link, gather: G)
where
    G: Fn(&HostCommunicator, HostBuffer, usize) -> burn_dist_comm::Result<HostBuffer>
        + Clone
        + Send
        + 'static,
{
    let len = BYTES / 4;
    let shards = [0, 1].map(|rank| rank_data(DType::F32, len / 2, 1, rank));
    mirrored(
        c,
        name,
        link,
        BYTES / 2,
        move |_, rank| shards[rank].clone(),
        move |comm, shard| gather(comm, shard, len),
    );
}

/// Times rank 0's half of `run` on 2 ranks joined through the real store and mesh over
/// `link`, with `bus_bytes` of bus traffic per call; rank 1 mirrors every call on its own
/// thread. Each rank's input, `input(comm, rank)`, is made before rank 0's timed call starts;
/// what `run` returns is dropped after it.
fn mirrored<B, O, I, R>(
    c: &mut Criterion,
    name: &str,
    link: Link,
    bus_bytes: usize,
    input: I,
    run: R,
) where
    B: Send + 'static,
    I: Fn(&HostCommunicator, usize) -> B + Clone + Send + 'static,
    R: Fn(&HostCommunicator, B) -> burn_dist_comm::Result<O> + Clone + Send + 'static,
{
    let (_store, mut comms) = linked_group(2, &CommConfig::default(), link);
    let peer = comms.pop().expect("rank 1");
    let rank0 = comms.pop().expect("rank 0");
    let (ready, is_ready) = mpsc::channel::<()>();
    let (go, went) = mpsc::channel::<()>();
    let (done, finished) = mpsc::channel::<()>();
    let (peer_input, peer_run) = (input.clone(), run.clone());
    let peer_thread = std::thread::spawn(move || {
        loop {
            let buf = peer_input(&peer, 1);
            ready.send(()).ok();
            if went.recv().is_err() {
                break;
            }
            let out = peer_run(&peer, buf).expect("rank 1's collective");
            done.send(()).expect("bench thread");
            // Freed once the timed call is over, as rank 0's output is.
            drop(out);
        }
    });

    host_group(c, name, bus_bytes, |b| {
        b.iter_batched(
            || {
                is_ready.recv().expect("rank 1 thread");
                input(&rank0, 0)
            },
            |buf| {
                go.send(()).expect("rank 1 thread");
                let out = run(&rank0, buf).expect("rank 0's collective");
                finished.recv().expect("rank 1 thread");
                out
            },
            BatchSize::PerIteration,
        )
    });
    drop(go);
    peer_thread.join().expect("rank 1 thread");
}

/// The all-gather of [`gathers`] with no ring: each rank's result readable by the other.
fn all_gather_direct_ceiling(c: &mut Criterion) {
    let half = BYTES / 8;
    let shards: [Vec<f32>; 2] = [0, 1].map(|r| vec![r as f32 + 1.0; half]);
    let mut results = [vec![0f32; 2 * half], vec![0f32; 2 * half]];
    host_group(c, "all_gather_direct_ceiling_f32_2_ranks", BYTES / 2, |b| {
        b.iter(|| {
            let [r0, r1] = &mut results;
            let ((own0, peer0), (peer1, own1)) = (r0.split_at_mut(half), r1.split_at_mut(half));
            // Each rank's own shard into its own result.
            std::thread::scope(|scope| {
                scope.spawn(|| own1.copy_from_slice(&shards[1]));
                own0.copy_from_slice(&shards[0]);
            });
            // Each rank copies the peer's shard out of the peer's result.
            std::thread::scope(|scope| {
                scope.spawn(|| peer1.copy_from_slice(own0));
                peer0.copy_from_slice(own1);
            });
            std::hint::black_box(&results);
        })
    });
}

/// The all-reduce (avg, in place) of [`all_reduce`] with no ring: each rank folds its half of
/// the peer's buffer into its own, then copies the other half out of the peer's buffer.
fn all_reduce_direct_ceiling(c: &mut Criterion) {
    let half = BYTES / 8;
    let mut buffers = [vec![1f32; 2 * half], vec![3f32; 2 * half]];
    // At 2 ranks the sum's order does not matter: IEEE addition of two values commutes.
    fn fold(own: &mut [f32], peer: &[f32]) {
        for (o, p) in own.iter_mut().zip(peer) {
            *o = (*o + p) * 0.5;
        }
    }
    host_group(c, "all_reduce_direct_ceiling_f32_2_ranks", BYTES, |b| {
        b.iter(|| {
            let [b0, b1] = &mut buffers;
            let ((lo0, hi0), (lo1, hi1)) = (b0.split_at_mut(half), b1.split_at_mut(half));
            // Rank 0 folds the low half, rank 1 the high half, each into its own buffer.
            std::thread::scope(|scope| {
                scope.spawn(|| fold(hi1, hi0));
                fold(lo0, lo1);
            });
            // Each rank copies the half the peer folded.
            std::thread::scope(|scope| {
                scope.spawn(|| lo1.copy_from_slice(lo0));
                hi0.copy_from_slice(hi1);
            });
            std::hint::black_box(&buffers);
        })
    });
}

/// One `host_64MiB` measurement of the 2-rank collectives, `bus_bytes` of bus traffic a call.
fn host_group(
    c: &mut Criterion,
    name: &str,
    bus_bytes: usize,
    bench: impl FnMut(&mut criterion::Bencher),
) {
    let mut group = c.benchmark_group("host_64MiB");
    group
        .throughput(Throughput::Bytes(bus_bytes as u64))
        .sample_size(20)
        .measurement_time(Duration::from_secs(10));
    group.bench_function(name, bench);
    group.finish();
}

criterion_group!(
    benches,
    memcpy,
    all_reduce_shared_memory,
    all_reduce_tcp,
    all_gather_shared_memory,
    all_gather_tcp,
    all_gather_kept_shared_memory,
    all_gather_kept_tcp,
    all_reduce_shared_buffers,
    all_reduce_shared_buffers_again,
    all_gather_shared_buffers,
    all_gather_direct_ceiling,
    all_reduce_direct_ceiling,
    tcp_exchange
);
criterion_main!(benches);
