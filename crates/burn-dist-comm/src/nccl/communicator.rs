//! [`NcclCommunicator`]: construction, rendezvous, and the [`Communicator`] implementation.

use std::ffi::c_int;
use std::sync::Arc;
use std::sync::mpsc::{self, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::sys::{self, ncclComm_t, ncclConfig_t, ncclResult_t, ncclUniqueId};

use super::buffer::DeviceBuffer;
use super::error::{check_libraries, cuda_error, nccl_error, nccl_result};
use super::in_place::InPlaceGroup;
use super::worker::{self, Backoff, Job, RawComm, Worker};

use crate::algorithms::even_counts;
use crate::communicator::Pending;
use crate::store::StoreClient;
use crate::{CommConfig, CommError, Communicator, DType, Group, HostBuffer, ReduceOp, Result};

/// Collectives on GPU buffers through NCCL, one rank per GPU.
///
/// Built with [`NcclCommunicator::new`] (or [`NcclCommunicator::join`] from a [`Group`]).
/// Every rank must issue the same collectives in the same order with buffers of the same
/// dtype and length, as with the host communicator.
pub struct NcclCommunicator {
    rank: usize,
    world: usize,
    version: (i32, i32, i32),
    stream: Arc<CudaStream>,
    jobs: Option<Sender<Job>>,
    worker: Option<JoinHandle<()>>,
}

impl NcclCommunicator {
    /// Joins the NCCL group of `world` ranks as `rank`, on CUDA device `device`, exchanging
    /// NCCL's unique id through `store`. Fails (never panics) when libcuda or libnccl cannot
    /// be loaded, the device does not exist, or the other ranks do not join within
    /// `config.join_timeout`.
    pub fn new(
        store: &StoreClient,
        rank: usize,
        world: usize,
        device: usize,
        config: &CommConfig,
    ) -> Result<Self> {
        if world == 0 || rank >= world {
            return Err(CommError::invalid(
                "NCCL communicator",
                format!("rank {rank} is not a rank of a group of {world}"),
            ));
        }
        let version = check_libraries(rank)?;
        let ctx = open_device(rank, device)?;
        // Every buffer of this communicator lives on its one stream, whose order is the only
        // synchronization needed: cudarc's per-buffer events would only add work.
        // SAFETY: no buffer of this context is used on another stream.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(|e| cuda_error(rank, "creating the comm stream", e))?;
        let id = exchange_unique_id(store, rank)?;
        let comm = init_comm(rank, world, id, &ctx, config.join_timeout)?;
        let barrier = worker::alloc(&stream, DType::F32, 1)
            .and_then(|mut b| stream.memset_zeros(&mut b.mem).map(|()| b))
            .map_err(|e| {
                abort_raw(comm);
                cuda_error(rank, "allocating the barrier buffer", e)
            })?;
        let worker = Worker::new(
            rank,
            world,
            RawComm(comm),
            ctx,
            stream.clone(),
            config.timeout,
            barrier,
        );
        let (jobs, queue) = mpsc::channel();
        let worker = std::thread::Builder::new()
            .name(format!("burn-dist-nccl-{rank}"))
            .spawn(move || worker.run(queue))
            .map_err(|e| CommError::io("spawning the NCCL thread", e))?;
        tracing::info!(
            rank,
            world,
            device,
            nccl = %format!("{}.{}.{}", version.0, version.1, version.2),
            "NCCL communicator ready"
        );
        Ok(NcclCommunicator {
            rank,
            world,
            version,
            stream,
            jobs: Some(jobs),
            worker: Some(worker),
        })
    }

    /// Joins with the rank, world size and store of `group`, on GPU `LOCAL_RANK`.
    pub fn join(group: &Group, config: &CommConfig) -> Result<Self> {
        let info = &group.info;
        Self::new(
            &group.store,
            info.rank,
            info.world_size,
            info.local_rank,
            config,
        )
    }

    /// The version of the NCCL library in use, as `(major, minor, patch)`.
    pub fn nccl_version(&self) -> (i32, i32, i32) {
        self.version
    }

    /// The CUDA device ordinal of this rank.
    pub fn device(&self) -> usize {
        self.stream.context().ordinal()
    }

    /// The comm stream on which collectives, uploads and downloads run.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A buffer of `len` zeros on this rank's GPU.
    pub fn zeros(&self, dtype: DType, len: usize) -> Result<DeviceBuffer> {
        let mut buf = worker::alloc(&self.stream, dtype, len)
            .map_err(|e| self.cuda("allocating a buffer", e))?;
        self.stream
            .memset_zeros(&mut buf.mem)
            .map_err(|e| self.cuda("zeroing a buffer", e))?;
        Ok(buf)
    }

    /// Copies `host` to a new buffer on this rank's GPU (ordered before every later
    /// collective of this communicator).
    pub fn upload(&self, host: &HostBuffer) -> Result<DeviceBuffer> {
        let mut buf = worker::alloc(&self.stream, host.dtype(), host.len())
            .map_err(|e| self.cuda("allocating a buffer", e))?;
        if !host.is_empty() {
            let mut dst = buf.mem.slice_mut(0..host.as_bytes().len());
            self.stream
                .memcpy_htod(host.as_bytes(), &mut dst)
                .map_err(|e| self.cuda("copying a buffer to the GPU", e))?;
        }
        Ok(buf)
    }

    /// Copies the view of `buf` back to the host. Waits for the comm stream, so call it on a
    /// buffer that a finished collective handed back.
    pub fn download(&self, buf: &DeviceBuffer) -> Result<HostBuffer> {
        let mut host = buf.host_like();
        if !buf.is_empty() {
            let src = buf.mem.slice(buf.byte_range());
            buf.stream()
                .memcpy_dtoh(&src, host.as_bytes_mut())
                .map_err(|e| self.cuda("copying a buffer to the host", e))?;
        }
        Ok(host)
    }

    /// Runs `group`'s calls as one NCCL group, in place on memory this communicator does not
    /// own, after every collective issued before it (same comm stream, issue order). The
    /// group's `keep_alive` is dropped on the NCCL thread when the calls have completed or
    /// failed, before the `Pending` is answered. Argument errors (a reduction on u8, a root
    /// outside the group, a null address) abort the group, as for the other collectives.
    ///
    /// The comm stream does not wait for any other stream: the caller must make sure the
    /// memory holds its final values before calling this (e.g. by synchronizing the stream
    /// that wrote it).
    ///
    /// # Safety
    ///
    /// Every slice must be `len` elements of `dtype` of live device memory on this
    /// communicator's GPU (in the primary context), and nothing may read or write it from the
    /// call until the `Pending` is answered; `keep_alive` must keep it allocated until dropped.
    pub unsafe fn in_place(&self, group: InPlaceGroup) -> Pending<()> {
        self.submit(|done| Job::InPlace(group, done))
    }

    fn cuda(&self, what: &str, err: cudarc::driver::DriverError) -> CommError {
        cuda_error(self.rank, what, err)
    }

    fn submit<T>(&self, make: impl FnOnce(Sender<Result<T>>) -> Job) -> Pending<T> {
        crate::communicator::submit(self.rank, self.jobs.as_ref(), make)
    }
}

impl Communicator for NcclCommunicator {
    type Buffer = DeviceBuffer;

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce(&self, buf: DeviceBuffer, op: ReduceOp) -> Pending<DeviceBuffer> {
        self.submit(|done| Job::AllReduce(buf, op, done))
    }

    fn reduce_scatter(&self, buf: DeviceBuffer, op: ReduceOp) -> Pending<DeviceBuffer> {
        let counts = even_counts(buf.len(), self.world);
        self.reduce_scatter_counts(buf, op, counts)
    }

    fn reduce_scatter_counts(
        &self,
        buf: DeviceBuffer,
        op: ReduceOp,
        counts: Vec<usize>,
    ) -> Pending<DeviceBuffer> {
        self.submit(|done| Job::ReduceScatter(buf, op, counts, done))
    }

    fn all_gather(&self, shard: DeviceBuffer, total_len: usize) -> Pending<DeviceBuffer> {
        self.submit(|done| Job::AllGather(shard, total_len, done))
    }

    fn broadcast(&self, buf: DeviceBuffer, root: usize) -> Pending<DeviceBuffer> {
        self.submit(|done| Job::Broadcast(buf, root, done))
    }

    fn barrier(&self) -> Pending<()> {
        self.submit(Job::Barrier)
    }
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        // Closing the queue lets the worker finish what was issued, then finalize NCCL.
        self.jobs.take();
        if let Some(worker) = self.worker.take() {
            _ = worker.join();
        }
    }
}

fn open_device(rank: usize, device: usize) -> Result<Arc<CudaContext>> {
    CudaContext::new(device).map_err(|e| {
        let count = CudaContext::device_count()
            .map(|n| format!("this machine has {n} GPU(s)"))
            .unwrap_or_else(|_| "no GPU could be counted".into());
        let mut err = cuda_error(rank, &format!("opening GPU {device}"), e);
        if let CommError::Io { message, .. } = &mut err {
            message.push_str(&format!(
                " ({count}; the GPU is LOCAL_RANK, one rank per GPU: NCCL refuses two ranks on \
                 one GPU)"
            ));
        }
        err
    })
}

/// Rank 0 mints NCCL's unique id and publishes it in the store; the others wait for it.
fn exchange_unique_id(store: &StoreClient, rank: usize) -> Result<ncclUniqueId> {
    // The n-th NCCL communicator a rank joins uses the n-th id: ranks join in the same order.
    let joined = store.add(&format!("burn-dist/nccl/rank-{rank}/joined"), 1)?;
    let key = format!("burn-dist/nccl/{joined}/unique-id");
    if rank == 0 {
        let id = cudarc::nccl::result::get_uniqueid()
            .map_err(|e| nccl_error(rank, "ncclGetUniqueId", e.0, None))?;
        let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
        store.set(&key, &bytes)?;
        Ok(id)
    } else {
        let bytes = store.get(&key)?;
        let mut id = ncclUniqueId { internal: [0; 128] };
        if bytes.len() != id.internal.len() {
            return Err(CommError::Store {
                addr: store.addr().to_string(),
                reason: format!(
                    "{key:?} holds {} bytes, not an NCCL unique id of {}",
                    bytes.len(),
                    id.internal.len()
                ),
            });
        }
        for (dst, &src) in id.internal.iter_mut().zip(&bytes) {
            *dst = src as _;
        }
        Ok(id)
    }
}

/// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`. The version is that of cudarc's bindings
/// (2.30); an older library reads only the fields it knows (it clamps `size`).
fn nonblocking_config() -> ncclConfig_t {
    const UNDEF: c_int = c_int::MIN;
    ncclConfig_t {
        size: std::mem::size_of::<ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: 23000,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

/// Creates this rank's NCCL communicator and polls until every rank has joined, up to
/// `timeout`.
fn init_comm(
    rank: usize,
    world: usize,
    id: ncclUniqueId,
    ctx: &Arc<CudaContext>,
    timeout: Duration,
) -> Result<ncclComm_t> {
    const WHAT: &str = "ncclCommInitRankConfig";
    ctx.bind_to_thread()
        .map_err(|e| cuda_error(rank, "binding the context", e))?;
    let mut comm: ncclComm_t = std::ptr::null_mut();
    let mut config = nonblocking_config();
    // SAFETY: valid out-pointer and config; the device is current on this thread.
    let code = unsafe {
        sys::ncclCommInitRankConfig(&mut comm, world as c_int, id, rank as c_int, &mut config)
    };
    let live = |comm: ncclComm_t| (!comm.is_null()).then_some(comm);
    if let Err(e) = nccl_result(rank, WHAT, code, live(comm)) {
        abort_raw(comm);
        return Err(e);
    }
    let deadline = Instant::now() + timeout;
    let mut idle = Backoff::default();
    loop {
        let mut state = ncclResult_t::ncclSuccess;
        // SAFETY: `comm` was returned by the init call above.
        let code = unsafe { sys::ncclCommGetAsyncError(comm, &mut state) };
        let polled = nccl_result(rank, WHAT, code, Some(comm))
            .and_then(|_| nccl_result(rank, WHAT, state, Some(comm)));
        match polled {
            Ok(false) => return Ok(comm),
            Ok(true) if Instant::now() > deadline => {
                abort_raw(comm);
                return Err(CommError::Aborted {
                    by: rank,
                    reason: format!(
                        "NCCL initialisation did not complete within {} s on rank {rank}: are \
                         all {world} ranks running, each on its own GPU, and can they reach \
                         each other?",
                        timeout.as_secs_f32()
                    ),
                });
            }
            Ok(true) => idle.wait(),
            Err(e) => {
                abort_raw(comm);
                return Err(e);
            }
        }
    }
}

fn abort_raw(comm: ncclComm_t) {
    if !comm.is_null() {
        // SAFETY: a communicator returned by NCCL, not used after this.
        unsafe { sys::ncclCommAbort(comm) };
    }
}
