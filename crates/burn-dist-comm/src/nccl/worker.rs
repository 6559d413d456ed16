//! The NCCL worker thread: issues collectives on the comm stream in issue order, and completes
//! them by polling a CUDA event and `ncclCommGetAsyncError`, so that no wait outlasts the
//! timeout. On any failure it aborts the NCCL communicator (`ncclCommAbort`), which frees
//! kernels stuck waiting for a peer, and fails every later collective with the cause.

use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use cudarc::nccl::sys::{self, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t};

use super::buffer::DeviceBuffer;
use super::error::{cuda_error, nccl_result};
use super::in_place::{InPlaceGroup, InPlaceOp};
use super::plan::{self, Call};
use crate::algorithms::even_counts;
use crate::communicator::{check_counts, check_reduce};
use crate::{CommError, DType, Lane, OpDesc, OpKind, ReduceOp, Result, chunk_range};

/// The raw NCCL communicator, owned by the worker.
pub(crate) struct RawComm(pub(crate) ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; only the
// worker uses it after construction.
unsafe impl Send for RawComm {}

/// A collective as issued by the caller.
pub(crate) enum Job {
    AllReduce(DeviceBuffer, ReduceOp, Sender<Result<DeviceBuffer>>),
    ReduceScatter(
        DeviceBuffer,
        ReduceOp,
        Vec<usize>,
        Sender<Result<DeviceBuffer>>,
    ),
    AllGather(DeviceBuffer, usize, Sender<Result<DeviceBuffer>>),
    Broadcast(DeviceBuffer, usize, Sender<Result<DeviceBuffer>>),
    Barrier(Sender<Result<()>>),
    /// Grouped calls on memory the caller owns (see `in_place`).
    InPlace(InPlaceGroup, Sender<Result<()>>),
}

impl Job {
    /// Answers the caller with `error` without running anything.
    fn fail(self, error: CommError) {
        match self {
            Job::AllReduce(.., tx)
            | Job::ReduceScatter(.., tx)
            | Job::AllGather(.., tx)
            | Job::Broadcast(.., tx) => _ = tx.send(Err(error)),
            Job::Barrier(tx) => _ = tx.send(Err(error)),
            Job::InPlace(group, tx) => {
                drop(group);
                _ = tx.send(Err(error));
            }
        }
    }
}

/// Where a finished collective's result goes.
enum Done {
    Buffer(DeviceBuffer, Sender<Result<DeviceBuffer>>),
    Unit(Sender<Result<()>>),
    /// An in-place group: its memory is released before the caller hears of it.
    Released(Box<dyn std::any::Any + Send>, Sender<Result<()>>),
}

impl Done {
    fn send(self, result: Result<()>) {
        match self {
            Done::Buffer(buf, tx) => _ = tx.send(result.map(|()| buf)),
            Done::Unit(tx) => _ = tx.send(result),
            Done::Released(keep_alive, tx) => {
                drop(keep_alive);
                _ = tx.send(result);
            }
        }
    }
}

/// A collective enqueued on the stream and not yet seen complete.
struct InFlight {
    op: OpDesc,
    /// Recorded on the stream right after the collective.
    event: CudaEvent,
    done: Done,
    /// When it became the oldest collective in flight: its timeout counts from there.
    head_since: Option<Instant>,
}

/// What a validated collective runs: the NCCL calls, on which buffer, and what it returns.
struct Prepared {
    calls: Vec<Call>,
    /// The buffer the calls run on (their ranges are relative to its view).
    buf: DeviceBuffer,
    /// The view handed back: `(offset, len)` in elements of `buf`'s allocation.
    result: (usize, usize),
    reduce: Option<ReduceOp>,
}

pub(crate) struct Worker {
    pub(crate) rank: usize,
    pub(crate) world: usize,
    pub(crate) comm: RawComm,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) timeout: Duration,
    /// One f32 for the barrier's all-reduce.
    pub(crate) barrier: Option<DeviceBuffer>,
    pub(crate) seq: u64,
    inflight: VecDeque<InFlight>,
    /// Set by the first failure; every later collective fails with it.
    broken: Option<CommError>,
}

impl Worker {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        rank: usize,
        world: usize,
        comm: RawComm,
        ctx: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        timeout: Duration,
        barrier: DeviceBuffer,
    ) -> Self {
        Worker {
            rank,
            world,
            comm,
            ctx,
            stream,
            timeout,
            barrier: Some(barrier),
            seq: 0,
            inflight: VecDeque::new(),
            broken: None,
        }
    }

    pub(crate) fn run(mut self, queue: Receiver<Job>) {
        let span = tracing::info_span!("nccl", rank = self.rank);
        let _entered = span.enter();
        if let Err(e) = self.ctx.bind_to_thread() {
            let cause = cuda_error(self.rank, "binding the context to the NCCL thread", e);
            self.fail(cause);
        }
        let mut idle = Backoff::default();
        loop {
            if self.inflight.is_empty() {
                match queue.recv() {
                    Ok(job) => self.issue(job),
                    Err(_) => break,
                }
            }
            let mut closed = false;
            loop {
                match queue.try_recv() {
                    Ok(job) => self.issue(job),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        closed = true;
                        break;
                    }
                }
            }
            let progressed = self.poll();
            if closed && self.inflight.is_empty() {
                break;
            }
            if progressed {
                idle = Backoff::default();
            } else if !self.inflight.is_empty() {
                idle.wait();
            }
        }
        self.shut_down();
    }

    fn desc(&self, kind: OpKind, buf: Option<&DeviceBuffer>, reduce: Option<ReduceOp>) -> OpDesc {
        OpDesc {
            kind,
            seq: self.seq,
            lane: Lane::Main,
            tag: 0,
            tag_labels: None,
            dtype: buf.map(DeviceBuffer::dtype),
            reduce,
            bytes: buf.map_or(0, |b| b.len() * b.dtype().size()),
        }
    }

    fn issue(&mut self, job: Job) {
        if let Some(broken) = self.broken.clone() {
            self.seq += 1;
            job.fail(broken);
            return;
        }
        let (op, prepared, tx) = match job {
            Job::AllReduce(buf, reduce, tx) => {
                let op = self.desc(OpKind::AllReduce, Some(&buf), Some(reduce));
                (op.clone(), self.prepare_all_reduce(&op, buf, reduce), tx)
            }
            Job::ReduceScatter(buf, reduce, counts, tx) => {
                let op = self.desc(OpKind::ReduceScatter, Some(&buf), Some(reduce));
                let prepared = self.prepare_reduce_scatter(&op, buf, reduce, &counts);
                (op, prepared, tx)
            }
            Job::AllGather(shard, total, tx) => {
                let op = self.desc(OpKind::AllGather, Some(&shard), None);
                (op.clone(), self.prepare_all_gather(&op, shard, total), tx)
            }
            Job::Broadcast(buf, root, tx) => {
                let op = self.desc(OpKind::Broadcast, Some(&buf), None);
                (op.clone(), self.prepare_broadcast(&op, buf, root), tx)
            }
            Job::Barrier(tx) => {
                let op = self.desc(OpKind::Barrier, None, None);
                self.seq += 1;
                self.issue_barrier(op, tx);
                return;
            }
            Job::InPlace(group, tx) => {
                self.issue_in_place(group, tx);
                return;
            }
        };
        self.seq += 1;
        let launched = prepared.and_then(|p| {
            let event = self.launch(&op, &p)?;
            let (offset, len) = p.result;
            Ok((event, p.buf.view(offset, len)))
        });
        match launched {
            Ok((event, buf)) => self.push(op, event, Done::Buffer(buf, tx)),
            Err(cause) => {
                let cause = self.fail(cause);
                _ = tx.send(Err(cause));
            }
        }
    }

    fn issue_barrier(&mut self, op: OpDesc, tx: Sender<Result<()>>) {
        let buf = self
            .barrier
            .take()
            .expect("the barrier buffer is returned after each use");
        let prepared = Prepared {
            calls: plan::all_reduce(1),
            result: (buf.offset, buf.len),
            buf,
            reduce: Some(ReduceOp::Sum),
        };
        let launched = self.launch(&op, &prepared);
        self.barrier = Some(prepared.buf);
        match launched {
            Ok(event) => self.push(op, event, Done::Unit(tx)),
            Err(cause) => {
                let cause = self.fail(cause);
                _ = tx.send(Err(cause));
            }
        }
    }

    /// An in-place group: validated, launched as one NCCL group, completed like any other
    /// collective (its memory released when it is done).
    fn issue_in_place(&mut self, group: InPlaceGroup, tx: Sender<Result<()>>) {
        let first = group.calls.first().map(|&(slice, op)| (slice.dtype, op));
        let op = OpDesc {
            kind: OpKind::AllReduce,
            seq: self.seq,
            lane: Lane::Main,
            tag: 0,
            tag_labels: None,
            dtype: first.map(|(dtype, _)| dtype),
            reduce: first.and_then(|(_, op)| op.reduce()),
            bytes: group.bytes(),
        };
        self.seq += 1;
        let launched = self
            .check_in_place(&op, &group)
            .and_then(|()| self.launch_in_place(&op, &group));
        match launched {
            Ok(event) => self.push(op, event, Done::Released(group.keep_alive, tx)),
            Err(cause) => {
                // Abort first: calls enqueued before the failure must stop before the memory
                // may be released.
                let cause = self.fail(cause);
                drop(group);
                _ = tx.send(Err(cause));
            }
        }
    }

    fn check_in_place(&self, op: &OpDesc, group: &InPlaceGroup) -> Result<()> {
        for (i, &(slice, call)) in group.calls.iter().enumerate() {
            if let Some(reduce) = call.reduce() {
                let desc = OpDesc {
                    dtype: Some(slice.dtype),
                    reduce: Some(reduce),
                    ..op.clone()
                };
                check_reduce(&desc, reduce).map_err(|e| self.on_this_rank(e))?;
            }
            if let Some(root) = call.root()
                && root >= self.world
            {
                return Err(self.invalid(
                    op,
                    format!("call {i}: root {root} is not a rank of {}", self.world),
                ));
            }
            if slice.len > 0 && slice.ptr == 0 {
                return Err(self.invalid(op, format!("call {i}: null device address")));
            }
        }
        Ok(())
    }

    /// Enqueues the group's calls between `ncclGroupStart` and `ncclGroupEnd` (empty slices
    /// are skipped), waits until NCCL has enqueued them, records the completion event.
    fn launch_in_place(&self, op: &OpDesc, group: &InPlaceGroup) -> Result<CudaEvent> {
        let (rank, comm) = (self.rank, self.comm.0);
        let what = op.to_string();
        let stream = self.stream.cu_stream() as sys::cudaStream_t;
        let mut calls = Calls::new(rank, &what, comm);
        // SAFETY: the caller of `NcclCommunicator::in_place` promised that every slice is
        // live device memory of its length on this GPU, used by nothing else until the
        // completion event is seen (the owner object keeps it alive until then); the
        // communicator is live.
        unsafe {
            calls.check(sys::ncclGroupStart());
            for &(slice, call) in group.calls.iter().filter(|(s, _)| s.len > 0) {
                let at = slice.ptr as *mut c_void;
                let dtype = nccl_dtype(slice.dtype);
                calls.check(match call {
                    InPlaceOp::AllReduce(reduce) => {
                        sys::ncclAllReduce(at, at, slice.len, dtype, nccl_op(reduce), comm, stream)
                    }
                    InPlaceOp::Reduce { root, op } => sys::ncclReduce(
                        at,
                        at,
                        slice.len,
                        dtype,
                        nccl_op(op),
                        root as i32,
                        comm,
                        stream,
                    ),
                    InPlaceOp::Broadcast { root } => {
                        sys::ncclBroadcast(at, at, slice.len, dtype, root as i32, comm, stream)
                    }
                });
            }
            // Always closed, even after a failed call: NCCL's groups must balance.
            calls.check(sys::ncclGroupEnd());
        }
        self.enqueued(&what, calls.first_error)
    }

    /// After a run of calls: their first failure, else wait until NCCL has enqueued them (a
    /// non-blocking communicator may still be working on it when the calls return) and record
    /// the completion event after them.
    fn enqueued(&self, what: &str, first_error: Option<CommError>) -> Result<CudaEvent> {
        if let Some(e) = first_error {
            return Err(e);
        }
        self.settle(what, self.timeout)?;
        self.stream
            .record_event(None)
            .map_err(|e| cuda_error(self.rank, &format!("recording the completion of {what}"), e))
    }

    fn push(&mut self, op: OpDesc, event: CudaEvent, done: Done) {
        let head_since = self.inflight.is_empty().then(Instant::now);
        self.inflight.push_back(InFlight {
            op,
            event,
            done,
            head_since,
        });
    }

    fn invalid(&self, op: &OpDesc, reason: String) -> CommError {
        self.on_this_rank(CommError::invalid(op.to_string(), reason))
    }

    /// The host communicator's argument errors, with this rank named (each rank reports its
    /// own; the host's peers learn of it from the abort message instead).
    fn on_this_rank(&self, err: CommError) -> CommError {
        match err {
            CommError::InvalidArgument { op, reason } => CommError::InvalidArgument {
                op: format!("{op} on rank {}", self.rank),
                reason,
            },
            other => other,
        }
    }

    fn check_buffer(
        &self,
        op: &OpDesc,
        buf: &DeviceBuffer,
        reduce: Option<ReduceOp>,
    ) -> Result<()> {
        let device = self.ctx.ordinal();
        if buf.device() != device {
            return Err(self.invalid(
                op,
                format!(
                    "the buffer lives on GPU {}, this communicator on GPU {device}",
                    buf.device()
                ),
            ));
        }
        match reduce {
            Some(reduce) => check_reduce(op, reduce).map_err(|e| self.on_this_rank(e)),
            None => Ok(()),
        }
    }

    fn prepare_all_reduce(
        &self,
        op: &OpDesc,
        buf: DeviceBuffer,
        reduce: ReduceOp,
    ) -> Result<Prepared> {
        self.check_buffer(op, &buf, Some(reduce))?;
        Ok(Prepared {
            calls: plan::all_reduce(buf.len()),
            result: (buf.offset, buf.len),
            buf,
            reduce: Some(reduce),
        })
    }

    fn prepare_reduce_scatter(
        &self,
        op: &OpDesc,
        buf: DeviceBuffer,
        reduce: ReduceOp,
        counts: &[usize],
    ) -> Result<Prepared> {
        self.check_buffer(op, &buf, Some(reduce))?;
        check_counts(op, counts, buf.len(), self.world).map_err(|e| self.on_this_rank(e))?;
        let own = plan::ranges(counts)[self.rank].clone();
        Ok(Prepared {
            calls: plan::reduce_scatter(counts),
            result: (buf.offset + own.start, own.len()),
            buf,
            reduce: Some(reduce),
        })
    }

    fn prepare_all_gather(
        &self,
        op: &OpDesc,
        shard: DeviceBuffer,
        total: usize,
    ) -> Result<Prepared> {
        self.check_buffer(op, &shard, None)?;
        let own = chunk_range(total, self.world, self.rank);
        if shard.len() != own.len() {
            return Err(self.invalid(
                op,
                format!(
                    "rank {} passed {} elements; its chunk of {total} over {} ranks has {}",
                    self.rank,
                    shard.len(),
                    self.world,
                    own.len()
                ),
            ));
        }
        let counts = even_counts(total, self.world);
        // In place when the shard already sits at its chunk's place in an allocation that
        // holds the whole result (a reduce-scatter's result does); else copy it into one.
        let fits =
            shard.offset >= own.start && shard.offset - own.start + total <= shard.capacity();
        let buf = if fits {
            let start = shard.offset - own.start;
            shard.view(start, total)
        } else {
            let mut out = alloc(&self.stream, shard.dtype(), total)
                .map_err(|e| cuda_error(self.rank, &format!("allocating the result of {op}"), e))?;
            if !shard.is_empty() {
                let size = shard.dtype().size();
                let src = shard.mem.slice(shard.byte_range());
                let mut dst = out.mem.slice_mut(own.start * size..own.end * size);
                self.stream
                    .memcpy_dtod(&src, &mut dst)
                    .map_err(|e| cuda_error(self.rank, &format!("copying the shard of {op}"), e))?;
            }
            out
        };
        Ok(Prepared {
            calls: plan::all_gather(&counts),
            result: (buf.offset, total),
            buf,
            reduce: None,
        })
    }

    fn prepare_broadcast(&self, op: &OpDesc, buf: DeviceBuffer, root: usize) -> Result<Prepared> {
        self.check_buffer(op, &buf, None)?;
        if root >= self.world {
            return Err(self.invalid(op, format!("root {root} is not a rank of {}", self.world)));
        }
        Ok(Prepared {
            calls: plan::broadcast(buf.len(), root),
            result: (buf.offset, buf.len),
            buf,
            reduce: None,
        })
    }

    /// Enqueues the calls (grouped when there are several), waits until NCCL has enqueued
    /// them (a non-blocking communicator may still be working on it when the call returns),
    /// and records the completion event after them.
    fn launch(&self, op: &OpDesc, p: &Prepared) -> Result<CudaEvent> {
        let (rank, comm) = (self.rank, self.comm.0);
        let what = op.to_string();
        let dtype = nccl_dtype(p.buf.dtype());
        let redop = p.reduce.map(nccl_op).unwrap_or(ncclRedOp_t::ncclSum);
        let stream = self.stream.cu_stream() as sys::cudaStream_t;
        let size = p.buf.dtype().size() as u64;
        let base = p.buf.ptr();
        let at = |element: usize| (base + element as u64 * size) as *mut c_void;
        let grouped = p.calls.len() > 1;
        let mut calls = Calls::new(rank, &what, comm);
        // SAFETY: every pointer is inside the buffer's allocation (the plans stay within the
        // view, checked above), which stays alive until the completion event is seen; the
        // communicator is live (the worker aborts and stops using it on the first failure).
        unsafe {
            if grouped {
                calls.check(sys::ncclGroupStart());
            }
            for call in &p.calls {
                calls.check(match call {
                    Call::AllReduce { count } => {
                        sys::ncclAllReduce(at(0), at(0), *count, dtype, redop, comm, stream)
                    }
                    Call::ReduceScatter { chunk } => sys::ncclReduceScatter(
                        at(0),
                        at(rank * chunk),
                        *chunk,
                        dtype,
                        redop,
                        comm,
                        stream,
                    ),
                    Call::Reduce { root, range } => sys::ncclReduce(
                        at(range.start),
                        at(range.start),
                        range.len(),
                        dtype,
                        redop,
                        *root as i32,
                        comm,
                        stream,
                    ),
                    Call::AllGather { chunk } => {
                        sys::ncclAllGather(at(rank * chunk), at(0), *chunk, dtype, comm, stream)
                    }
                    Call::Broadcast { root, range } => sys::ncclBroadcast(
                        at(range.start),
                        at(range.start),
                        range.len(),
                        dtype,
                        *root as i32,
                        comm,
                        stream,
                    ),
                });
            }
            if grouped {
                // Always closed, even after a failed call: NCCL's groups must balance.
                calls.check(sys::ncclGroupEnd());
            }
        }
        self.enqueued(&what, calls.first_error)
    }

    /// Waits until the communicator has finished the call in progress (non-blocking mode),
    /// up to `limit`.
    fn settle(&self, what: &str, limit: Duration) -> Result<()> {
        let deadline = Instant::now() + limit;
        let mut idle = Backoff::default();
        while self.async_state(what)? {
            if Instant::now() > deadline {
                return Err(self.timed_out(what, limit));
            }
            idle.wait();
        }
        Ok(())
    }

    /// `Ok(true)` while an operation is still being enqueued, `Ok(false)` when idle, or the
    /// error the communicator reports (a failed kernel, a lost peer).
    fn async_state(&self, what: &str) -> Result<bool> {
        let mut state = ncclResult_t::ncclSuccess;
        // SAFETY: the communicator is live; `state` is a valid out-pointer.
        let code = unsafe { sys::ncclCommGetAsyncError(self.comm.0, &mut state) };
        nccl_result(self.rank, what, code, Some(self.comm.0))?;
        nccl_result(self.rank, what, state, Some(self.comm.0))
    }

    fn timed_out(&self, what: &str, limit: Duration) -> CommError {
        CommError::Aborted {
            by: self.rank,
            reason: format!(
                "{what} did not complete within {} s on rank {}; the NCCL communicator was \
                 aborted (a peer died or hangs, or the ranks issued different collectives)",
                limit.as_secs_f32(),
                self.rank
            ),
        }
    }

    /// Completes the collectives that have finished, in order; fails the group on an error
    /// or when the oldest one outlasts the timeout. Returns whether anything completed.
    fn poll(&mut self) -> bool {
        if self.broken.is_some() || self.inflight.is_empty() {
            return false;
        }
        let mut progressed = false;
        while let Some(head) = self.inflight.front_mut() {
            let what = head.op.to_string();
            match head.event.try_is_complete() {
                Ok(true) => {
                    let done = self.inflight.pop_front().expect("the head exists");
                    done.done.send(Ok(()));
                    progressed = true;
                    if let Some(next) = self.inflight.front_mut() {
                        next.head_since = Some(Instant::now());
                    }
                }
                Ok(false) => {
                    let since = *head.head_since.get_or_insert_with(Instant::now);
                    let cause = match self.async_state(&what) {
                        Err(e) => Some(e),
                        Ok(_) if since.elapsed() > self.timeout => {
                            Some(self.timed_out(&what, self.timeout))
                        }
                        Ok(_) => None,
                    };
                    if let Some(cause) = cause {
                        self.fail_head(cause);
                        progressed = true;
                    }
                    break;
                }
                Err(e) => {
                    let cause = cuda_error(self.rank, &format!("waiting for {what}"), e);
                    self.fail_head(cause);
                    progressed = true;
                    break;
                }
            }
        }
        progressed
    }

    /// The oldest collective failed with `cause`: it gets the cause, the group is aborted.
    fn fail_head(&mut self, cause: CommError) {
        let head = self.inflight.pop_front().expect("the head exists");
        let cause = self.fail(cause);
        head.done.send(Err(cause));
    }

    /// Aborts the NCCL communicator (once) and fails every collective in flight; later ones
    /// fail with [`CommError::Aborted`] naming the cause. Returns the cause.
    fn fail(&mut self, cause: CommError) -> CommError {
        if self.broken.is_none() {
            tracing::error!(rank = self.rank, "aborting the NCCL communicator: {cause}");
            self.abort();
            self.broken = Some(match &cause {
                CommError::Aborted { .. } => cause.clone(),
                other => CommError::Aborted {
                    by: self.rank,
                    reason: other.to_string(),
                },
            });
        }
        let broken = self.broken.clone().expect("set above");
        for f in self.inflight.drain(..) {
            f.done.send(Err(broken.clone()));
        }
        cause
    }

    fn abort(&mut self) {
        let comm = std::mem::replace(&mut self.comm.0, std::ptr::null_mut());
        if !comm.is_null() {
            // SAFETY: the communicator is live and no longer used after this.
            let code = unsafe { sys::ncclCommAbort(comm) };
            if code != ncclResult_t::ncclSuccess {
                tracing::warn!(rank = self.rank, "ncclCommAbort returned {code:?}");
            }
        }
    }

    /// Finalizes and destroys the communicator after the last collective (aborts it when that
    /// does not finish within [`FINALIZE_TIMEOUT`]).
    fn shut_down(&mut self) {
        if self.comm.0.is_null() {
            return;
        }
        // SAFETY: the communicator is live; nothing is in flight.
        let finalized = nccl_result(
            self.rank,
            "ncclCommFinalize",
            unsafe { sys::ncclCommFinalize(self.comm.0) },
            Some(self.comm.0),
        )
        .and_then(|_| self.settle("ncclCommFinalize", self.timeout.min(FINALIZE_TIMEOUT)));
        match finalized {
            Ok(()) => {
                let comm = std::mem::replace(&mut self.comm.0, std::ptr::null_mut());
                // SAFETY: finalized, live, not used after this.
                let code = unsafe { sys::ncclCommDestroy(comm) };
                if code != ncclResult_t::ncclSuccess {
                    tracing::warn!(rank = self.rank, "ncclCommDestroy returned {code:?}");
                }
            }
            Err(e) => {
                tracing::warn!(rank = self.rank, "closing the NCCL communicator: {e}");
                self.abort();
            }
        }
    }
}

/// How long closing may wait for `ncclCommFinalize` before it aborts the communicator. Every
/// collective has completed by then, so a finalize that waits is a peer that is gone or NCCL's
/// proxy stuck; waiting for the whole collective timeout (10 minutes on the DDP path) would
/// only hold the process after its work is done.
const FINALIZE_TIMEOUT: Duration = Duration::from_secs(5);

impl Drop for Worker {
    fn drop(&mut self) {
        // Only reached without `shut_down` if the thread unwinds: never leave NCCL's proxy
        // threads behind.
        self.abort();
    }
}

/// Allocates `len` elements of `dtype` on `stream` (at least one byte: CUDA refuses empty
/// allocations).
pub(crate) fn alloc(
    stream: &Arc<CudaStream>,
    dtype: DType,
    len: usize,
) -> std::result::Result<DeviceBuffer, cudarc::driver::DriverError> {
    // SAFETY: the content is undefined until written, as for any fresh allocation; the view
    // type is plain bytes.
    let mem = unsafe { stream.alloc::<u8>((len * dtype.size()).max(1)) }?;
    Ok(DeviceBuffer {
        mem,
        offset: 0,
        len,
        dtype,
    })
}

fn nccl_dtype(dtype: DType) -> ncclDataType_t {
    match dtype {
        DType::F32 => ncclDataType_t::ncclFloat32,
        DType::F16 => ncclDataType_t::ncclFloat16,
        DType::BF16 => ncclDataType_t::ncclBfloat16,
        DType::U8 => ncclDataType_t::ncclUint8,
    }
}

fn nccl_op(op: ReduceOp) -> ncclRedOp_t {
    match op {
        ReduceOp::Sum => ncclRedOp_t::ncclSum,
        ReduceOp::Avg => ncclRedOp_t::ncclAvg,
        ReduceOp::Max => ncclRedOp_t::ncclMax,
    }
}

/// Polling pace: yield for the first polls (small collectives finish in microseconds), then
/// sleep, up to 1 ms between polls.
#[derive(Default)]
pub(crate) struct Backoff(u32);

impl Backoff {
    pub(crate) fn wait(&mut self) {
        self.0 += 1;
        if self.0 < 64 {
            std::thread::yield_now();
        } else {
            let micros = 20u64 << ((self.0 - 64) / 16).min(6);
            std::thread::sleep(Duration::from_micros(micros.min(1000)));
        }
    }
}

/// The results of a run of NCCL calls that must all be issued (a group is closed even after a
/// failed call, or NCCL's groups would not balance): the first failure is kept.
struct Calls<'a> {
    rank: usize,
    what: &'a str,
    comm: ncclComm_t,
    first_error: Option<CommError>,
}

impl<'a> Calls<'a> {
    fn new(rank: usize, what: &'a str, comm: ncclComm_t) -> Self {
        Calls {
            rank,
            what,
            comm,
            first_error: None,
        }
    }

    fn check(&mut self, code: ncclResult_t) {
        if let Err(e) = nccl_result(self.rank, self.what, code, Some(self.comm))
            && self.first_error.is_none()
        {
            self.first_error = Some(e);
        }
    }
}
