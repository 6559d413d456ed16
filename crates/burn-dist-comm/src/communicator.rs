//! The communicator: collectives issued from any thread, executed in issue order on a worker
//! thread (the host analogue of a CUDA comm stream), completed through [`Pending`] handles.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::thread::JoinHandle;

use crate::algorithms::{self, Scratch};
use crate::direct::{self, Path};
use crate::divergence::{Issued, Peers, Watch};
use crate::reduce::chunk_range;
use crate::transport::local::local_group;
use crate::transport::{Arenas, Link, Transport};
use crate::{
    CommConfig, CommError, DType, HostBuffer, Lane, OpDesc, OpKind, ReduceOp, Result, SharedBuffer,
    SharedMemory,
};

/// Collectives over flat buffers with asynchronous completion.
///
/// Every rank of a group must issue the same collectives in the same order, with buffers of
/// the same dtype and length. Results are bit-identical on every rank.
pub trait Communicator: Send + Sync {
    /// The buffer type the collectives run on (host vectors here; device buffers for NCCL).
    type Buffer;

    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;

    /// Reduces `buf` over all ranks; every rank gets the whole result.
    fn all_reduce(&self, buf: Self::Buffer, op: ReduceOp) -> Pending<Self::Buffer>;

    /// Reduces `buf` over all ranks; this rank gets its chunk, elements
    /// [`chunk_range`]`(buf.len(), world_size, rank)`.
    fn reduce_scatter(&self, buf: Self::Buffer, op: ReduceOp) -> Pending<Self::Buffer>;

    /// Reduce-scatter into uneven chunks: rank `q` gets the `counts[q]` elements that follow
    /// the chunks of ranks `0..q` (a count may be 0). `counts` must have one entry per rank,
    /// sum to `buf.len()` and be the same on every rank. ZeRO-2 uses it to reduce each bucket's
    /// segments straight to the ranks that own them.
    fn reduce_scatter_counts(
        &self,
        buf: Self::Buffer,
        op: ReduceOp,
        counts: Vec<usize>,
    ) -> Pending<Self::Buffer>;

    /// Concatenates every rank's chunk into `total_len` elements; `shard` must hold exactly
    /// this rank's [`chunk_range`] of `total_len`.
    fn all_gather(&self, shard: Self::Buffer, total_len: usize) -> Pending<Self::Buffer>;

    /// Every rank gets `root`'s buffer.
    fn broadcast(&self, buf: Self::Buffer, root: usize) -> Pending<Self::Buffer>;

    /// Returns once every rank has reached it.
    fn barrier(&self) -> Pending<()>;
}

/// The result of a collective that may still be running.
#[must_use = "a collective's result must be waited for"]
pub struct Pending<T> {
    rank: usize,
    rx: Receiver<Result<T>>,
    ready: Option<Result<T>>,
    /// The host communicator's: checks, past a grace, that the group has not diverged across
    /// lanes while this waits (`divergence`).
    watch: Option<Watch>,
}

impl<T> Pending<T> {
    fn new(rank: usize) -> (Sender<Result<T>>, Self) {
        let (tx, rx) = mpsc::channel();
        (
            tx,
            Pending {
                rank,
                rx,
                ready: None,
                watch: None,
            },
        )
    }

    /// A handle that has already failed.
    pub(crate) fn failed(rank: usize, error: CommError) -> Self {
        let (_, rx) = mpsc::channel();
        Pending {
            rank,
            rx,
            ready: Some(Err(error)),
            watch: None,
        }
    }

    /// Blocks until the collective is done. It always returns: every wait inside is bounded
    /// by the communicator's timeout. On the host communicator, a wait that lasts past
    /// [`CommConfig::divergence_grace`] asks the peers where they stand, and fails with
    /// [`CommError::Diverged`] (every rank fails) when the ranks wait for each other on
    /// different lanes.
    pub fn wait(mut self) -> Result<T> {
        if let Some(result) = self.ready.take() {
            return result;
        }
        match self.watch.take() {
            Some(watch) => watch.wait(&self.rx, self.rank),
            None => self
                .rx
                .recv()
                .unwrap_or(Err(CommError::ShutDown { rank: self.rank })),
        }
    }

    /// Whether [`wait`](Self::wait) would return at once.
    pub fn is_done(&mut self) -> bool {
        if self.ready.is_none() {
            self.ready = match self.rx.try_recv() {
                Ok(result) => Some(result),
                Err(TryRecvError::Empty) => return false,
                Err(TryRecvError::Disconnected) => {
                    Some(Err(CommError::ShutDown { rank: self.rank }))
                }
            };
        }
        true
    }
}

type Done<T> = Sender<Result<T>>;

enum Job {
    AllReduce(HostBuffer, ReduceOp, Done<HostBuffer>),
    /// With every rank's element count (the even [`chunk_range`] split unless given).
    ReduceScatter(HostBuffer, ReduceOp, Vec<usize>, Done<HostBuffer>),
    AllGather(HostBuffer, usize, Done<HostBuffer>),
    /// This rank's chunk, every rank's element count, the tag, and the buffer to write the
    /// result into (a fresh one when `None`).
    AllGatherCounts(
        HostBuffer,
        Vec<usize>,
        u32,
        Option<HostBuffer>,
        Done<HostBuffer>,
    ),
    Broadcast(HostBuffer, usize, Done<HostBuffer>),
    Barrier(Done<()>),
    /// An in-place collective on a shared buffer, with every rank's element count.
    Shared(InPlace, SharedBuffer, Vec<usize>, Done<SharedBuffer>),
    /// Names for tags, index `tag - 1` (not a collective: no message, no sequence number).
    Labels(Vec<String>),
    /// Stops the group with the caller's reason (not a collective).
    Abort(String, Done<()>),
}

/// The in-place collectives on a [`SharedBuffer`].
#[derive(Debug, Clone, Copy)]
enum InPlace {
    AllReduce(ReduceOp),
    ReduceScatter(ReduceOp),
    /// With its tag.
    AllGather(u32),
}

/// The host (CPU) communicator, over in-process channels, TCP or shared memory.
///
/// A group may have two lanes (see [`CommConfig::gather_lane`]): this communicator is the main
/// one, and [`HostCommunicator::gather_lane`] the other, with its own links and worker.
pub struct HostCommunicator {
    rank: usize,
    world: usize,
    links: Vec<Option<Link>>,
    jobs: Option<Sender<Job>>,
    worker: Option<JoinHandle<()>>,
    lane: Lane,
    /// What the rank's lanes share: their collectives issued (counted per lane) and long
    /// waits, and how to ask the peers about theirs.
    peers: Arc<dyn Peers>,
    /// Collectives of this lane that read the peers' buffers in place.
    direct: Arc<AtomicU64>,
    /// Every rank's arena, where the peers share this host's memory: shared buffers go there.
    arenas: Option<Arc<Arenas>>,
    /// The gather lane, if the group has one.
    gathers: Option<Box<HostCommunicator>>,
}

impl HostCommunicator {
    /// A communicator over `lanes` (the main lane's transport first, then the gather lane's if
    /// the group has one): one worker thread per lane.
    pub(crate) fn new<T: Transport + 'static>(lanes: Vec<T>) -> Result<Self> {
        let mut lanes = lanes.into_iter().map(|t| Box::new(t) as Box<dyn Transport>);
        let main = lanes.next().expect("a communicator has a main lane");
        let gathers = lanes
            .next()
            .map(|t| HostCommunicator::lane(t, Lane::Gather, None).map(Box::new))
            .transpose()?;
        HostCommunicator::lane(main, Lane::Main, gathers)
    }

    fn lane(
        transport: Box<dyn Transport>,
        lane: Lane,
        gathers: Option<Box<HostCommunicator>>,
    ) -> Result<Self> {
        let (rank, world, links) = (transport.rank(), transport.world(), transport.links());
        let arenas = transport.arenas();
        let peers = transport.peers();
        let direct = Arc::new(AtomicU64::new(0));
        let (jobs, queue) = mpsc::channel();
        let name = match lane {
            Lane::Main => format!("burn-dist-comm-{rank}"),
            Lane::Gather => format!("burn-dist-gather-{rank}"),
        };
        let counted = direct.clone();
        let worker = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                Worker {
                    transport,
                    seq: 0,
                    lane,
                    scratch: Scratch::default(),
                    labels: None,
                    direct: counted,
                }
                .run(queue)
            })
            .map_err(|e| CommError::io("spawning the communicator thread", e))?;
        Ok(HostCommunicator {
            rank,
            world,
            links,
            jobs: Some(jobs),
            worker: Some(worker),
            lane,
            peers,
            direct,
            arenas,
            gathers,
        })
    }

    /// A group of `world` ranks in this process, linked by channels: one communicator per
    /// rank, to be moved to one thread each. For tests and single-process use.
    pub fn local_group(world: usize, config: &CommConfig) -> Vec<HostCommunicator> {
        local_group(
            world,
            config.lanes(),
            config.timeout,
            config.divergence_grace,
        )
        .into_iter()
        .map(|lanes| HostCommunicator::new(lanes).expect("spawning a communicator thread"))
        .collect()
    }

    /// The lane for parameter gathers: a communicator of the same group with its own links to
    /// every peer and its own worker, so that a gather issued there never waits behind a large
    /// reduction issued here. Its collectives are ordered among themselves only: every rank
    /// must issue the same ones in the same order on it, as on this one. `self` when the group
    /// has no gather lane ([`CommConfig::gather_lane`] off).
    pub fn gather_lane(&self) -> &HostCommunicator {
        self.gathers.as_deref().unwrap_or(self)
    }

    /// Collectives issued on this lane so far (its gather lane's are counted there).
    pub fn issued(&self) -> u64 {
        self.peers.own().issued(self.lane)
    }

    /// How the data reaches each peer: `links()[peer]`, `None` for this rank.
    pub fn links(&self) -> &[Option<Link>] {
        &self.links
    }

    /// Collectives of this lane so far that read the peers' shared buffers where they lie
    /// (see [`HostCommunicator::shared_buffer`]); the others went through the links.
    pub fn direct_collectives(&self) -> u64 {
        self.direct.load(Ordering::Relaxed)
    }

    /// A buffer of `len` zeros for this group's in-place collectives
    /// ([`all_reduce_shared`](Self::all_reduce_shared),
    /// [`reduce_scatter_shared`](Self::reduce_scatter_shared),
    /// [`all_gather_shared`](Self::all_gather_shared)), on either lane.
    ///
    /// Where every peer is on this host and linked through shared memory, it lives in this
    /// rank's arena under `/dev/shm`, and those collectives read the peers' buffers where they
    /// lie instead of copying through the rings (at 2 ranks, about half the copies). Elsewhere,
    /// or when `/dev/shm` has no room for it, it is on the heap and the collectives go through
    /// the links; a collective reads in place only if every rank's buffer is shared. Its memory
    /// counts as shared memory (`RssShmem`) to this rank and, once read, to its peers.
    pub fn shared_buffer(&self, dtype: DType, len: usize) -> SharedBuffer {
        #[cfg(target_os = "linux")]
        if let Some(arenas) = self.arenas.as_ref().filter(|_| len > 0)
            && let Some(buffer) = SharedBuffer::in_arena(&arenas.own, dtype, len)
        {
            return buffer;
        }
        SharedBuffer::on_heap(dtype, len)
    }

    /// What this rank's shared buffers (of either lane) hold in `/dev/shm` now and at most;
    /// zeros where the group has no arenas (every buffer on the heap).
    pub fn shared_memory(&self) -> SharedMemory {
        #[cfg(target_os = "linux")]
        if let Some(arenas) = &self.arenas {
            let (held, peak) = arenas.own.usage();
            return SharedMemory { held, peak };
        }
        SharedMemory::default()
    }

    /// This lane's view of every rank's arena, for tests of how the peers' are mapped.
    #[cfg(test)]
    pub(crate) fn arenas(&self) -> Option<&Arc<Arenas>> {
        self.arenas.as_ref()
    }

    /// Whether `buf` lies in this group's shared memory (made by this group's
    /// [`shared_buffer`](Self::shared_buffer), not another group's), so that this group's
    /// collectives can read it in place.
    pub fn holds(&self, buf: &SharedBuffer) -> bool {
        self.arenas
            .as_ref()
            .is_some_and(|arenas| arenas.offset_of(buf).is_some())
    }

    /// Reduces `buf` over all ranks in place: every rank gets the whole result, bitwise what
    /// [`Communicator::all_reduce`] gives.
    pub fn all_reduce_shared(&self, buf: SharedBuffer, op: ReduceOp) -> Pending<SharedBuffer> {
        let counts = algorithms::even_counts(buf.len(), self.world);
        let issued = Issued::of(OpKind::AllReduce, buf.dtype(), buf.as_bytes().len()).reducing(op);
        self.submit(issued, |done| {
            Job::Shared(InPlace::AllReduce(op), buf, counts, done)
        })
    }

    /// Reduces `buf` over all ranks in place into uneven chunks, as
    /// [`Communicator::reduce_scatter_counts`]: afterwards this rank's chunk (the
    /// `counts[rank]` elements after those of the ranks before it) holds the reduction, and
    /// the other chunks hold this rank's input still.
    pub fn reduce_scatter_shared(
        &self,
        buf: SharedBuffer,
        op: ReduceOp,
        counts: Vec<usize>,
    ) -> Pending<SharedBuffer> {
        let issued = Issued::of(OpKind::ReduceScatter, buf.dtype(), buf.as_bytes().len());
        self.submit(issued.reducing(op), |done| {
            Job::Shared(InPlace::ReduceScatter(op), buf, counts, done)
        })
    }

    /// All-gather in place, tagged as [`HostCommunicator::all_gather_counts`]: this rank's
    /// chunk of `buf` (the `counts[rank]` elements after those of the ranks before it) must hold
    /// its contribution; afterwards every chunk holds its owner's.
    pub fn all_gather_shared(
        &self,
        buf: SharedBuffer,
        counts: Vec<usize>,
        tag: u32,
    ) -> Pending<SharedBuffer> {
        let issued = Issued::of(OpKind::AllGather, buf.dtype(), buf.as_bytes().len());
        self.submit(issued.tagged(tag), |done| {
            Job::Shared(InPlace::AllGather(tag), buf, counts, done)
        })
    }

    /// Queues a collective, `issued` describing it; its wait is watched for divergence
    /// across lanes. Its sequence number on the lane is the worker's only when one thread
    /// issues on the lane at a time, which the order of collectives needs anyway.
    fn submit<T>(&self, issued: Issued, make: impl FnOnce(Done<T>) -> Job) -> Pending<T> {
        let seq = self.peers.own().issue(self.lane);
        let mut pending = submit(self.rank, self.jobs.as_ref(), make);
        if pending.ready.is_none() {
            pending.watch = Some(Watch {
                peers: self.peers.clone(),
                lane: self.lane,
                seq,
                issued,
            });
        }
        pending
    }

    /// All-gather into uneven chunks, tagged: every rank gets the concatenation, in rank
    /// order, of every rank's chunk, rank `q`'s holding `counts[q]` elements (a count may be
    /// 0). `shard` must hold exactly `counts[rank]` elements, and `counts` and `tag` must be the
    /// same on every rank. The tag (not 0 for "none") says what the payload is and travels in
    /// every message: a rank whose peer sent another tag fails with `CommError::Mismatch`
    /// naming both, instead of concatenating two different things. Stage-3 parameter sharding
    /// gathers each parameter this way, its pieces being the parameter's intersections with
    /// the ranks' shards of the flat layout, tagged with the parameter.
    pub fn all_gather_counts(
        &self,
        shard: HostBuffer,
        counts: Vec<usize>,
        tag: u32,
    ) -> Pending<HostBuffer> {
        let issued = Issued::of(OpKind::AllGather, shard.dtype(), shard.as_bytes().len());
        self.submit(issued.tagged(tag), |done| {
            Job::AllGatherCounts(shard, counts, tag, None, done)
        })
    }

    /// [`HostCommunicator::all_gather_counts`] into `into`, which is returned holding the
    /// result: it must hold as many elements as `counts` sums to, of the shard's dtype (its
    /// contents are overwritten). A caller that keeps its result buffers (stage 3 gathers the
    /// same parameters every step) reuses them instead of faulting in fresh memory each time.
    pub fn all_gather_counts_into(
        &self,
        shard: HostBuffer,
        counts: Vec<usize>,
        tag: u32,
        into: HostBuffer,
    ) -> Pending<HostBuffer> {
        let issued = Issued::of(OpKind::AllGather, shard.dtype(), shard.as_bytes().len());
        self.submit(issued.tagged(tag), |done| {
            Job::AllGatherCounts(shard, counts, tag, Some(into), done)
        })
    }

    /// Stops the group because of `reason`, a failure the caller found (say, a rank whose
    /// model is no longer in the state the others expect): every peer's pending and later
    /// collectives fail at once with "rank r aborted the group: {reason}", instead of waiting
    /// for this rank until the timeout. Runs after the collectives issued before it; the
    /// returned error is the group's first failure (this one unless another came first).
    pub fn abort(&self, reason: String) -> CommError {
        // Every lane of the rank shares the failure: the gather lane stops too.
        match submit(self.rank, self.jobs.as_ref(), |done| {
            Job::Abort(reason, done)
        })
        .wait()
        {
            Err(cause) => cause,
            Ok(()) => unreachable!("an abort always fails the group"),
        }
    }

    /// Names the tags of later collectives in error messages: `labels[t - 1]` for tag `t`.
    /// Ordered with the collectives issued before and after it; it sends nothing.
    pub fn label_tags(&self, labels: Vec<String>) {
        // The lanes share their progress: a long wait on either describes its tag with these.
        self.peers.own().set_labels(labels.clone().into());
        if let Some(gathers) = &self.gathers {
            gathers.label_tags(labels.clone());
        }
        if let Some(jobs) = &self.jobs {
            _ = jobs.send(Job::Labels(labels));
        }
    }
}

/// Queues the job `make` builds on a communicator's worker (`jobs`, `None` once shut down) and
/// returns the handle its result comes back through: fails at once if the worker is gone.
pub(crate) fn submit<J, T>(
    rank: usize,
    jobs: Option<&Sender<J>>,
    make: impl FnOnce(Done<T>) -> J,
) -> Pending<T> {
    let (done, pending) = Pending::new(rank);
    if jobs.is_some_and(|jobs| jobs.send(make(done)).is_ok()) {
        pending
    } else {
        Pending::failed(rank, CommError::ShutDown { rank })
    }
}

impl Communicator for HostCommunicator {
    type Buffer = HostBuffer;

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce(&self, buf: HostBuffer, op: ReduceOp) -> Pending<HostBuffer> {
        let issued = Issued::of(OpKind::AllReduce, buf.dtype(), buf.as_bytes().len());
        self.submit(issued.reducing(op), |done| Job::AllReduce(buf, op, done))
    }

    fn reduce_scatter(&self, buf: HostBuffer, op: ReduceOp) -> Pending<HostBuffer> {
        let counts = algorithms::even_counts(buf.len(), self.world);
        self.reduce_scatter_counts(buf, op, counts)
    }

    fn reduce_scatter_counts(
        &self,
        buf: HostBuffer,
        op: ReduceOp,
        counts: Vec<usize>,
    ) -> Pending<HostBuffer> {
        let issued = Issued::of(OpKind::ReduceScatter, buf.dtype(), buf.as_bytes().len());
        self.submit(issued.reducing(op), |done| {
            Job::ReduceScatter(buf, op, counts, done)
        })
    }

    fn all_gather(&self, shard: HostBuffer, total_len: usize) -> Pending<HostBuffer> {
        let issued = Issued::of(OpKind::AllGather, shard.dtype(), shard.as_bytes().len());
        self.submit(issued, |done| Job::AllGather(shard, total_len, done))
    }

    fn broadcast(&self, buf: HostBuffer, root: usize) -> Pending<HostBuffer> {
        let issued = Issued::of(OpKind::Broadcast, buf.dtype(), buf.as_bytes().len());
        self.submit(issued, |done| Job::Broadcast(buf, root, done))
    }

    fn barrier(&self) -> Pending<()> {
        self.submit(Issued::new(OpKind::Barrier), Job::Barrier)
    }
}

impl Drop for HostCommunicator {
    fn drop(&mut self) {
        // The gather lane first: the main lane's goodbye closes the links the lanes share.
        self.gathers.take();
        // Closing the queue lets the worker finish what was issued, say goodbye and exit.
        self.jobs.take();
        if let Some(worker) = self.worker.take() {
            _ = worker.join();
        }
    }
}

struct Worker {
    transport: Box<dyn Transport>,
    seq: u64,
    lane: Lane,
    scratch: Scratch,
    /// What each tag stands for, for error messages ([`HostCommunicator::label_tags`]).
    labels: Option<Arc<[String]>>,
    /// See [`HostCommunicator::direct_collectives`].
    direct: Arc<AtomicU64>,
}

impl Worker {
    fn run(mut self, queue: Receiver<Job>) {
        let span = tracing::info_span!("comm", rank = self.transport.rank());
        let _entered = span.enter();
        while let Ok(job) = queue.recv() {
            match job {
                Job::Labels(labels) => {
                    self.labels = Some(labels.into());
                    continue;
                }
                Job::Abort(reason, done) => {
                    let cause = self.transport.abort(CommError::Cancelled { reason });
                    _ = done.send(Err(cause));
                    continue;
                }
                _ => {}
            }
            self.execute(job);
            self.seq += 1;
        }
        self.transport.close();
    }

    fn desc(&self, kind: OpKind, buf: Option<&HostBuffer>, reduce: Option<ReduceOp>) -> OpDesc {
        let buf = buf.map(|b| (b.dtype(), b.as_bytes().len()));
        self.desc_of(kind, buf, reduce)
    }

    /// The collective's description, for a buffer of `(dtype, bytes)` if it has one.
    fn desc_of(
        &self,
        kind: OpKind,
        buf: Option<(DType, usize)>,
        reduce: Option<ReduceOp>,
    ) -> OpDesc {
        OpDesc {
            kind,
            seq: self.seq,
            lane: self.lane,
            tag: 0,
            // An untagged collective can still meet a tagged one from a diverged peer.
            tag_labels: self.labels.clone(),
            dtype: buf.map(|(dtype, _)| dtype),
            reduce,
            bytes: buf.map_or(0, |(_, bytes)| bytes),
        }
    }

    /// Runs an in-place collective on a shared buffer, in place when every rank's is shared.
    fn in_place(
        &mut self,
        what: InPlace,
        mut buf: SharedBuffer,
        counts: &[usize],
    ) -> Result<SharedBuffer> {
        let (rank, world) = (self.transport.rank(), self.transport.world());
        let shape = Some((buf.dtype(), buf.as_bytes().len()));
        let (kind, reduce, tag) = match what {
            InPlace::AllReduce(reduce) => (OpKind::AllReduce, Some(reduce), 0),
            InPlace::ReduceScatter(reduce) => (OpKind::ReduceScatter, Some(reduce), 0),
            InPlace::AllGather(tag) => (OpKind::AllGather, None, tag),
        };
        let op = OpDesc {
            tag,
            ..self.desc_of(kind, shape, reduce)
        };
        reduce.map_or(Ok(()), |reduce| check_reduce(&op, reduce))?;
        check_counts(&op, counts, buf.len(), world)?;
        let t = &mut *self.transport;
        let path = match what {
            InPlace::AllReduce(reduce) => {
                direct::all_reduce(t, &op, &mut buf, reduce, counts, &mut self.scratch)
            }
            InPlace::ReduceScatter(reduce) => {
                direct::reduce_scatter(t, &op, &mut buf, reduce, counts, &mut self.scratch)
            }
            InPlace::AllGather(_) => direct::all_gather(t, &op, &mut buf, counts),
        };
        let path = match path {
            Ok(path) => path,
            Err(error) => {
                // A peer may still be reading this buffer where it lies (its last barrier is
                // what failed): freeing it would hand its pages to the next buffer, or punch a
                // hole a peer's read faults in. The group has failed; the memory stays until
                // the process ends.
                if buf.is_in_shared_memory() {
                    std::mem::forget(buf);
                }
                return Err(error);
            }
        };
        if path == Path::Direct {
            self.direct.fetch_add(1, Ordering::Relaxed);
        }
        tracing::trace!(rank, %op, ?path, "in-place collective");
        Ok(buf)
    }

    fn execute(&mut self, job: Job) {
        let (rank, world) = (self.transport.rank(), self.transport.world());
        match job {
            Job::AllReduce(mut buf, reduce, done) => {
                let op = self.desc(OpKind::AllReduce, Some(&buf), Some(reduce));
                let result = check_reduce(&op, reduce).and_then(|()| {
                    algorithms::all_reduce(
                        &mut *self.transport,
                        &op,
                        &mut buf,
                        reduce,
                        &mut self.scratch,
                    )
                });
                self.finish(done, result.map(|()| buf));
            }
            Job::ReduceScatter(buf, reduce, counts, done) => {
                let op = self.desc(OpKind::ReduceScatter, Some(&buf), Some(reduce));
                let result = check_reduce(&op, reduce)
                    .and_then(|()| check_counts(&op, &counts, buf.len(), world))
                    .and_then(|()| {
                        algorithms::reduce_scatter(
                            &mut *self.transport,
                            &op,
                            buf,
                            reduce,
                            &counts,
                            &mut self.scratch,
                        )
                    });
                self.finish(done, result);
            }
            Job::AllGather(shard, total_len, done) => {
                let op = self.desc(OpKind::AllGather, Some(&shard), None);
                let expected = chunk_range(total_len, world, rank).len();
                let result = if shard.len() != expected {
                    Err(CommError::invalid(
                        op.to_string(),
                        format!(
                            "rank {rank} passed {} elements; its chunk of {total_len} over \
                             {world} ranks has {expected}",
                            shard.len()
                        ),
                    ))
                } else {
                    algorithms::all_gather(&mut *self.transport, &op, &shard, total_len)
                };
                self.finish(done, result);
            }
            Job::AllGatherCounts(shard, counts, tag, into, done) => {
                let op = OpDesc {
                    tag,
                    ..self.desc(OpKind::AllGather, Some(&shard), None)
                };
                let total: usize = counts.iter().sum();
                let result = check_counts(&op, &counts, total, world)
                    .and_then(|()| {
                        if shard.len() == counts[rank] {
                            return Ok(());
                        }
                        let reason = format!(
                            "rank {rank} passed {} elements; its count is {}",
                            shard.len(),
                            counts[rank]
                        );
                        Err(CommError::invalid(op.to_string(), reason))
                    })
                    .and_then(|()| match into {
                        Some(into) if into.dtype() != shard.dtype() || into.len() != total => {
                            let reason = format!(
                                "rank {rank}'s result buffer holds {} {} elements; the result \
                                 is {total} {} elements",
                                into.len(),
                                into.dtype(),
                                shard.dtype()
                            );
                            Err(CommError::invalid(op.to_string(), reason))
                        }
                        Some(into) => Ok(into),
                        None => Ok(HostBuffer::for_result(shard.dtype(), total)),
                    })
                    .and_then(|full| {
                        algorithms::all_gather_counts(
                            &mut *self.transport,
                            &op,
                            &shard,
                            &counts,
                            full,
                        )
                    });
                self.finish(done, result);
            }
            Job::Broadcast(mut buf, root, done) => {
                let op = self.desc(OpKind::Broadcast, Some(&buf), None);
                let result = if root >= world {
                    Err(CommError::invalid(
                        op.to_string(),
                        format!("root {root} is not a rank of {world}"),
                    ))
                } else {
                    algorithms::broadcast(&mut *self.transport, &op, &mut buf, root)
                };
                self.finish(done, result.map(|()| buf));
            }
            Job::Barrier(done) => {
                let op = self.desc(OpKind::Barrier, None, None);
                let result = algorithms::barrier(&mut *self.transport, &op);
                self.finish(done, result);
            }
            Job::Shared(what, buf, counts, done) => {
                let result = self.in_place(what, buf, &counts);
                self.finish(done, result);
            }
            Job::Labels(_) | Job::Abort(..) => unreachable!("taken in `run`: not collectives"),
        }
    }

    /// Hands the result back. A failure aborts the group, so that every peer stops at once
    /// with the root cause instead of waiting for this rank until its timeout.
    fn finish<T>(&mut self, done: Done<T>, result: Result<T>) {
        let result = result.map_err(|e| self.transport.abort(e));
        _ = done.send(result);
    }
}

pub(crate) fn check_counts(op: &OpDesc, counts: &[usize], len: usize, world: usize) -> Result<()> {
    let total: usize = counts.iter().sum();
    if counts.len() != world || total != len {
        let reason = format!(
            "the counts {counts:?} must give one chunk per rank ({world}) and sum to the buffer's \
             {len} elements"
        );
        return Err(CommError::invalid(op.to_string(), reason));
    }
    Ok(())
}

pub(crate) fn check_reduce(op: &OpDesc, reduce: ReduceOp) -> Result<()> {
    if op.dtype == Some(DType::U8) && reduce != ReduceOp::Max {
        let reason = format!("{reduce} is not defined on raw bytes (u8); use max, or a float type");
        return Err(CommError::invalid(op.to_string(), reason));
    }
    Ok(())
}
