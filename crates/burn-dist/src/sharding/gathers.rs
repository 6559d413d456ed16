//! The gather path of stage 3, in one direction: a use of a parameter asks the schedule
//! (`schedule.rs` decides), the unit it belongs to is gathered in one collective from this
//! rank's pieces (`piece_store.rs`) into a pooled buffer (`pool.rs`), ahead of its use or on
//! demand, and each use takes its parameter's part; what the window allows is then issued
//! ahead. [`Gathers`] owns everything a gather holds until it is used: the schedule with the
//! gathers in flight, the pool, and the tensors kept for a later use (`kept.rs`).

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use burn::tensor::TensorData;
use burn_backend::Backend;
use burn_dist_comm::{CommError, DType, HostCommunicator, Pending, SharedBuffer};

use super::kept::KeptTensors;
use super::ledger::UseLedger;
use super::piece_store::PieceStore;
use super::pool::GatherPool;
use super::schedule::{Phase, PrefetchConfig, Scheduler, Serve, UnitSpan};
use super::shards::ShardedParamInfo;

/// Gathers issued in this process so far: the next [`UnitGather`]'s id.
static GATHERS: AtomicU64 = AtomicU64::new(0);

/// One rank's gathers (see the module docs).
pub(super) struct Gathers {
    comm: Arc<HostCommunicator>,
    params: Arc<[ShardedParamInfo]>,
    pieces: Arc<PieceStore>,
    ledger: Arc<UseLedger>,
    /// The gather schedules and the gathers in flight ahead of their use.
    scheduler: Mutex<Scheduler<UnitGather>>,
    /// The host gathers' buffers, reused from step to step.
    pool: Arc<GatherPool>,
    kept: KeptTensors,
    /// Orders recorded at the last step's end, per phase, to be agreed on and adopted
    /// (`agreement.rs`).
    candidates: Mutex<[Option<Vec<usize>>; 2]>,
}

/// One gather of consecutive parameters `params`: in flight, then their values, one part per
/// parameter, taken by the uses it serves.
pub(super) struct UnitGather {
    /// Which gather this is, unique in the process: `fetch` finds its gather again by it
    /// after waiting with the scheduler unlocked.
    id: u64,
    params: Range<usize>,
    in_flight: Option<InFlight>,
    parts: Vec<Option<Part>>,
    /// Bytes gathered and not yet taken (counted live in the rank's ledger).
    remaining: usize,
}

/// A unit's gather while it runs.
enum InFlight {
    /// The host path: one all-gather of the pieces' bytes, in place in a shared buffer (which
    /// the peers read where it lies when they share this host's memory).
    Host(Pending<SharedBuffer>),
    /// The device path: fresh device buffers being filled (or the error that issuing met).
    #[cfg(feature = "device")]
    Device(Result<Box<dyn crate::device::DeviceGathering>, CommError>),
}

/// How [`Gathers::fetch`] served a use.
pub(super) enum Fetched {
    /// The parameter, gathered; `keep`: a later use of the same parameter is to be served the
    /// tensor made of this part.
    Part { part: Part, keep: bool },
    /// An earlier use of this parameter kept its tensor for this one ([`Gathers::take_kept`]
    /// has it); `keep`: keep it again for a later use.
    Kept { keep: bool },
}

/// One gathered parameter.
pub(super) enum Part {
    /// Its bytes, on the host: its range of the unit's gather buffer, which goes back to the
    /// pool when the unit's last parameter is dropped.
    Host(burn_backend::Bytes),
    /// Already a float primitive of the backend, in device memory (boxed: the sharding types
    /// are not generic over the backend).
    #[cfg(feature = "device")]
    Device(Box<dyn std::any::Any + Send>),
}

impl Part {
    /// The backend's tensor of parameter `info` made of this part.
    pub(super) fn into_tensor<B: Backend>(
        self,
        info: &ShardedParamInfo,
        device: &B::Device,
    ) -> B::FloatTensorPrimitive {
        match self {
            Part::Host(bytes) => {
                let data = TensorData::from_bytes(bytes, info.shape.clone(), info.dtype);
                B::float_from_data(data, device)
            }
            // The device store was built for the inner backend of this decorator: its
            // primitives are `B`'s.
            #[cfg(feature = "device")]
            Part::Device(tensor) => downcast::<B>(tensor, info, "device pieces"),
        }
    }
}

/// A boxed float primitive of parameter `info` as `B`'s (`what` it is, for the message).
pub(super) fn downcast<B: Backend>(
    tensor: Box<dyn std::any::Any + Send>,
    info: &ShardedParamInfo,
    what: &str,
) -> B::FloatTensorPrimitive {
    *tensor
        .downcast::<B::FloatTensorPrimitive>()
        .unwrap_or_else(|_| {
            panic!(
                "burn-dist: the {what} of `{}` are not `{}`'s tensors",
                info.name,
                std::any::type_name::<B>()
            )
        })
}

impl Gathers {
    pub(super) fn new(
        comm: Arc<HostCommunicator>,
        params: Arc<[ShardedParamInfo]>,
        pieces: Arc<PieceStore>,
        ledger: Arc<UseLedger>,
        window: PrefetchConfig,
    ) -> Self {
        Gathers {
            comm,
            params,
            pieces,
            kept: KeptTensors::new(ledger.clone()),
            ledger,
            scheduler: Mutex::new(Scheduler::new(window)),
            pool: Arc::default(),
            candidates: Mutex::new([None, None]),
        }
    }

    fn scheduler(&self) -> MutexGuard<'_, Scheduler<UnitGather>> {
        // A panic while it was held (a failed gather) leaves at worst gathers that are dropped.
        self.scheduler.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn candidates(&self) -> MutexGuard<'_, [Option<Vec<usize>>; 2]> {
        self.candidates.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn window(&self) -> PrefetchConfig {
        self.scheduler().window()
    }

    /// Sets how far ahead gathers go from the next use on (on every rank alike).
    pub(super) fn set_window(&self, window: PrefetchConfig) {
        let dropped = self.scheduler().set_window(window);
        self.discard(dropped);
        self.kept.drop_all();
    }

    /// The agreed order of uses of `phase` and the parameters each of its gathers covers.
    pub(super) fn plan(&self, phase: Phase) -> Option<(Vec<usize>, Vec<Range<usize>>)> {
        let scheduler = self.scheduler();
        scheduler
            .plan(phase)
            .map(|(order, units)| (order.to_vec(), units))
    }

    /// A backward pass of this rank ended: the schedule records it, and gathers ahead wait for
    /// it.
    pub(super) fn end_backward(&self) {
        self.scheduler().end_backward();
    }

    /// Records a use of parameter `index` in the schedule alone, with no gather (fault
    /// injection: `ParamShards::inject_recorded_use`).
    pub(super) fn record_use_alone(&self, index: usize) {
        let dropped = self.scheduler().on_use(Phase::Train, index).dropped;
        self.discard(dropped);
    }

    /// Uses the plans did not expect, since the start.
    pub(super) fn off_schedule(&self) -> u64 {
        self.scheduler().off_plan
    }

    /// The pool's (buffers reused since the start, bytes free now).
    pub(super) fn pooled(&self) -> (u64, usize) {
        (self.pool.reused(), self.pool.free_bytes())
    }

    /// Parameter `index`'s bytes for an op of `phase`, as the schedule serves them; then issues
    /// the gathers the window allows ahead.
    ///
    /// The scheduler stays locked while it decides and while gathers are issued, never while a
    /// gather is waited for: that wait lasts until the slowest peer reaches the gather (up to
    /// the collective timeout), and whatever else asks the scheduler meanwhile (the window, the
    /// plans, the end of a backward pass) must not wait behind it. One thread at a time uses a
    /// rank's parameters (the thread running its forward or backward); another that changed
    /// the schedule while a use waited would make this panic, naming it.
    pub(super) fn fetch(&self, index: usize, phase: Phase) -> Result<Fetched, CommError> {
        let mut scheduler = self.scheduler();
        let decision = scheduler.on_use(phase, index);
        self.discard(decision.dropped);
        if decision.forget_kept {
            self.kept.drop_all();
        }
        let fetched = match decision.serve {
            Serve::Alone => {
                drop(scheduler);
                let part = self.alone(index)?;
                scheduler = self.scheduler();
                Fetched::Part { part, keep: false }
            }
            Serve::Kept { keep } => Fetched::Kept { keep },
            Serve::Ahead { offset, last, keep } => {
                let gather = scheduler.front().expect("the unit gathered ahead");
                if let Some(in_flight) = gather.in_flight.take() {
                    let (id, params) = (gather.id, gather.params.clone());
                    drop(scheduler);
                    let waited = self.wait_for(in_flight, params);
                    scheduler = self.scheduler();
                    let gather = scheduler.front().filter(|gather| gather.id == id).expect(
                        "the unit gathered ahead left the schedule while this rank waited for \
                         it: another thread changed the schedule (the window, or the pieces in \
                         an optimizer step) during a use of the parameters",
                    );
                    self.arrived(gather, waited)?;
                }
                let gather = scheduler.front().expect("the unit gathered ahead");
                let part = self.take(gather, offset)?;
                if last {
                    let done = scheduler.pop_front();
                    self.discard(done);
                }
                Fetched::Part { part, keep }
            }
            Serve::Demand {
                unit,
                unit_index,
                offset,
                last,
                keep,
            } => {
                let mut gather = self.issue(&unit);
                drop(scheduler);
                let part = self.take(&mut gather, offset)?;
                scheduler = self.scheduler();
                if last {
                    // Parameters of the unit that no use took are no longer held.
                    self.discard([gather]);
                } else {
                    scheduler.push_front(unit_index, gather);
                }
                Fetched::Part { part, keep }
            }
        };
        let ahead = scheduler.plan_ahead(|gather| gather.remaining, |unit| self.unit_bytes(unit));
        for (unit_index, unit) in ahead {
            let gather = self.issue(&unit);
            self.ledger.prefetched();
            scheduler.issued(unit_index, gather);
        }
        Ok(fetched)
    }

    /// Parameter `index` alone, on demand (a read, or a use whose kept tensor was dropped).
    pub(super) fn alone(&self, index: usize) -> Result<Part, CommError> {
        let mut gather = self.issue(&UnitSpan {
            positions: 0..1,
            params: index..index + 1,
        });
        self.take(&mut gather, 0)
    }

    /// The tensor kept for this use of parameter `index` (the schedule, the same on every
    /// rank, announced it when an earlier use was served: [`Fetched::Kept`]), its bytes still
    /// live; `None` if it was dropped since.
    pub(super) fn take_kept<B: Backend>(&self, index: usize) -> Option<B::FloatTensorPrimitive> {
        let tensor = self.kept.take(index)?;
        Some(downcast::<B>(tensor, &self.params[index], "tensor kept"))
    }

    /// Keeps parameter `index`'s `tensor` for its next use, which the schedule announced.
    pub(super) fn keep<B: Backend>(&self, index: usize, tensor: B::FloatTensorPrimitive) {
        self.kept
            .keep(index, self.params[index].bytes(), Box::new(tensor));
    }

    fn unit_bytes(&self, unit: &UnitSpan) -> usize {
        unit.params.clone().map(|i| self.params[i].bytes()).sum()
    }

    /// Issues the all-gather of `unit`'s parameters: this rank's pieces of them, which are
    /// next to each other in its shard, so the result is the parameters' values one after
    /// the other. Tagged with the first parameter. On the communicator's gather lane, so that
    /// it never waits behind a gradient reduction issued before it.
    fn issue(&self, unit: &UnitSpan) -> UnitGather {
        let params = unit.params.clone();
        let tag = u32::try_from(params.start + 1).expect("fewer than 2^32 parameters");
        let remaining = self.unit_bytes(unit);
        self.ledger.hold(remaining);
        let in_flight = self.issue_gather(params.clone(), tag);
        UnitGather {
            id: GATHERS.fetch_add(1, Ordering::Relaxed),
            parts: (0..params.len()).map(|_| None).collect(),
            params,
            in_flight: Some(in_flight),
            remaining,
        }
    }

    /// The collective of [`Gathers::issue`]: into fresh device buffers on the device path,
    /// else into host bytes.
    fn issue_gather(&self, params: Range<usize>, tag: u32) -> InFlight {
        use burn_dist_comm::Communicator;
        #[cfg(feature = "device")]
        if let Some(issued) = self.pieces.issue_on_device(params.clone(), tag) {
            return InFlight::Device(issued);
        }
        let world = self.pieces.layout().world;
        let mut counts = vec![0; world];
        for info in &self.params[params.clone()] {
            let elem = info.dtype.size();
            counts
                .iter_mut()
                .zip(&info.counts)
                .for_each(|(c, n)| *c += n * elem);
        }
        let lane = self.comm.gather_lane();
        let total = counts.iter().sum();
        let mut buffer = self
            .pool
            .take(total)
            .unwrap_or_else(|| lane.shared_buffer(DType::U8, total));
        // This rank's pieces go straight to their place in the result.
        let rank = self.comm.rank();
        let own_start: usize = counts[..rank].iter().sum();
        let own_end = own_start + counts[rank];
        let mut at = own_start;
        for i in params.clone() {
            let bytes = buffer.as_bytes_mut();
            at += self.pieces.with_piece(i, |piece| {
                let fits = piece.len().min(own_end.saturating_sub(at));
                bytes[at..at + fits].copy_from_slice(&piece[..fits]);
                piece.len()
            });
        }
        // The pieces come from the layout the counts were summed from; a difference would
        // leave an earlier gather's bytes in the result, or spill into a peer's chunk.
        assert_eq!(
            at - own_start,
            counts[rank],
            "rank {rank}'s pieces of parameters {params:?} do not fill its chunk of their gather"
        );
        InFlight::Host(lane.all_gather_shared(buffer, counts, tag))
    }

    /// The part of `gather` for its parameter at `offset`, waiting for it if it is in flight.
    fn take(&self, gather: &mut UnitGather, offset: usize) -> Result<Part, CommError> {
        if let Some(in_flight) = gather.in_flight.take() {
            let waited = self.wait_for(in_flight, gather.params.clone());
            self.arrived(gather, waited)?;
        }
        let part = gather.parts[offset]
            .take()
            .expect("each part of a unit serves one use");
        let bytes = self.params[gather.params.start + offset].bytes();
        gather.remaining -= bytes;
        self.ledger.release(bytes);
        Ok(part)
    }

    /// Waits for the collective of a gather of `params`, counting the wait.
    fn wait_for(&self, in_flight: InFlight, params: Range<usize>) -> Result<Vec<Part>, CommError> {
        let start = Instant::now();
        let parts = self.finish(in_flight, params);
        self.ledger.waited(start.elapsed().as_nanos() as u64);
        parts
    }

    /// What waiting for `gather`'s collective gave: its parts, or an error, and then its bytes
    /// are no longer held.
    fn arrived(
        &self,
        gather: &mut UnitGather,
        waited: Result<Vec<Part>, CommError>,
    ) -> Result<(), CommError> {
        match waited {
            Ok(parts) => {
                gather.parts = parts.into_iter().map(Some).collect();
                Ok(())
            }
            Err(error) => {
                self.ledger.release(gather.remaining);
                gather.remaining = 0;
                Err(error)
            }
        }
    }

    /// Waits for a unit's gather: one part per parameter of `params`.
    fn finish(&self, in_flight: InFlight, params: Range<usize>) -> Result<Vec<Part>, CommError> {
        // Without the `device` feature the host is the only variant.
        #[cfg_attr(not(feature = "device"), allow(clippy::infallible_destructuring_match))]
        let pending = match in_flight {
            InFlight::Host(pending) => pending,
            #[cfg(feature = "device")]
            InFlight::Device(issued) => {
                let tensors = issued?.finish()?;
                return Ok(tensors.into_iter().map(Part::Device).collect());
            }
        };
        let bytes = pending.wait()?;
        // Each parameter is its range of the result, not a copy of it.
        let mut start = 0;
        let ranges: Vec<Range<usize>> = params
            .map(|i| {
                let range = start..start + self.params[i].bytes();
                start = range.end;
                range
            })
            .collect();
        Ok(super::pool::split(bytes, &ranges, &self.pool)
            .into_iter()
            .map(Part::Host)
            .collect())
    }

    /// Gathers no longer wanted: their bytes are no longer held. (Peers issued the same ones:
    /// the collectives complete on the communicator's thread, and their results are dropped.)
    fn discard(&self, gathers: impl IntoIterator<Item = UnitGather>) {
        for gather in gathers {
            self.ledger.release_unused(gather.remaining);
        }
    }

    /// The pieces change: what was gathered ahead from them, and the tensors kept, are stale.
    pub(super) fn forget_ahead(&self) {
        let dropped = self.scheduler().restart_ahead();
        self.discard(dropped);
        self.kept.drop_all();
    }

    /// The optimizer step: every round ends, what is still gathered ahead or kept is dropped,
    /// and the rounds recorded become candidates for the agreement; from the second step on,
    /// the pool holds what the gathers held at most in a step.
    pub(super) fn end_step(&self) {
        let (candidates, dropped) = self.scheduler().end_step();
        self.discard(dropped);
        self.kept.drop_all();
        *self.candidates() = candidates;
        self.pool.end_step();
    }

    /// Whether each phase has a recorded order waiting for the agreement.
    pub(super) fn has_candidate(&self, phase: Phase) -> bool {
        self.candidates()[phase.slot()].is_some()
    }

    /// The recorded orders, taken for the agreement.
    pub(super) fn take_candidates(&self) -> [Option<Vec<usize>>; 2] {
        std::mem::take(&mut *self.candidates())
    }

    /// Makes `order` (agreed by every rank) the plan of `phase`.
    pub(super) fn adopt(&self, phase: Phase, order: Vec<usize>) {
        self.scheduler().adopt(
            phase,
            order,
            |i| self.params[i].bytes(),
            |first, next| self.params[first].dtype == self.params[next].dtype,
        );
        self.ledger.adopted_schedule();
    }
}
