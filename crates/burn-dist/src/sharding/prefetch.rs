//! The gathering side of the schedule (`schedule.rs` decides): a unit of adjacent parameters
//! gathered in one collective, ahead of its use or on demand, and what it holds until used.

use std::ops::Range;
use std::sync::MutexGuard;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use burn_dist_comm::{CommError, DType, HostBuffer, Pending, SharedBuffer};

use super::ParamShards;
use super::schedule::{BACKWARD_END, Phase, PrefetchConfig, Scheduler, Serve, UnitSpan};

/// Gathers issued in this process so far: the next [`UnitGather`]'s id.
static GATHERS: AtomicU64 = AtomicU64::new(0);

/// One gather of consecutive parameters `params`: in flight, then their values, one part per
/// parameter, taken by the uses it serves.
pub(crate) struct UnitGather {
    /// Which gather this is, unique in the process: `fetch` finds its gather again by it
    /// after waiting with the scheduler unlocked.
    id: u64,
    params: Range<usize>,
    in_flight: Option<InFlight>,
    parts: Vec<Option<Part>>,
    /// Bytes gathered and not yet taken (counted live in the rank's stats).
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

/// How [`ParamShards::fetch`] served a use.
pub(crate) enum Fetched {
    /// The parameter, gathered; `keep`: a later use of the same parameter is to be served the
    /// tensor made of this part.
    Part { part: Part, keep: bool },
    /// An earlier use of this parameter kept its tensor for this one; `keep`: keep it again
    /// for a later use.
    Kept { keep: bool },
}

/// One gathered parameter.
pub(crate) enum Part {
    /// Its bytes, on the host (made a tensor of the backend by the gather's caller): its range
    /// of the unit's gather buffer, which goes back to the pool when the unit's last
    /// parameter is dropped.
    Host(burn_backend::Bytes),
    /// Already a float primitive of the backend, in device memory (boxed: `ParamShards` is
    /// not generic over the backend).
    #[cfg(feature = "device")]
    Device(Box<dyn std::any::Any + Send>),
}

impl ParamShards {
    pub(super) fn scheduler(&self) -> MutexGuard<'_, Scheduler<UnitGather>> {
        // A panic while it was held (a failed gather) leaves at worst gathers that are dropped.
        self.scheduler.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How far ahead this rank gathers (see [`PrefetchConfig`]); every rank must set the same.
    pub fn prefetch(&self) -> PrefetchConfig {
        self.scheduler().window()
    }

    /// Sets how far ahead gathers go from the next use on, on every rank alike
    /// ([`PrefetchConfig::OFF`]: each parameter gathered on demand, alone, and the schedules
    /// forgotten).
    pub fn set_prefetch(&self, window: PrefetchConfig) {
        let dropped = self.scheduler().set_window(window);
        self.discard(dropped);
        self.drop_kept();
    }

    /// The agreed order of uses of `phase` (parameter indices), and the parameters each of its
    /// gathers covers; `None` before the first optimizer step.
    pub fn schedule(&self, phase: Phase) -> Option<(Vec<usize>, Vec<Range<usize>>)> {
        let scheduler = self.scheduler();
        scheduler
            .plan(phase)
            .map(|(order, units)| (order.to_vec(), units))
    }

    /// A backward pass of this rank ended (the reducer's end-of-backward hook): the schedule
    /// records it, and gathers ahead wait for it. The step's digest counts it, so that ranks
    /// whose backward passes end at different points fail the step's agreement.
    pub(crate) fn end_backward(&self) {
        self.scheduler().end_backward();
        self.hash_into_digest(BACKWARD_END);
    }

    /// Fault injection for the schedule tests: records a use of parameter `index` in this
    /// rank's schedule alone, with no gather and no trace in the step's digest, as a digest
    /// collision would leave it, so that only the check of the recorded orders can see it. For
    /// a step without a schedule yet (the first): under one it would also take a gather's
    /// place.
    #[doc(hidden)]
    pub fn inject_recorded_use(&self, index: usize) {
        let dropped = self.scheduler().on_use(Phase::Train, index).dropped;
        self.discard(dropped);
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
            self.drop_kept();
        }
        let fetched = match decision.serve {
            Serve::Alone => {
                drop(scheduler);
                let part = self.gather_alone(index)?;
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
            self.state().stats.prefetched += 1;
            scheduler.issued(unit_index, gather);
        }
        Ok(fetched)
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
        self.state().stats.hold(remaining);
        let in_flight = self.issue_gather(params.clone(), tag);
        UnitGather {
            id: GATHERS.fetch_add(1, Ordering::Relaxed),
            parts: (0..params.len()).map(|_| None).collect(),
            params,
            in_flight: Some(in_flight),
            remaining,
        }
    }

    /// The collective of [`ParamShards::issue`]: into fresh device buffers on the device path,
    /// else into host bytes.
    fn issue_gather(&self, params: Range<usize>, tag: u32) -> InFlight {
        #[cfg(feature = "device")]
        if let Some(issued) = self.issue_on_device(params.clone(), tag) {
            return InFlight::Device(issued);
        }
        let world = self.layout().world;
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
        let rank = self.rank();
        let own_start: usize = counts[..rank].iter().sum();
        let own_end = own_start + counts[rank];
        let mut at = own_start;
        for i in params.clone() {
            let bytes = buffer.as_bytes_mut();
            at += self.with_piece(i, |piece| {
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

    /// Parameter `index` alone, on demand.
    pub(super) fn gather_alone(&self, index: usize) -> Result<Part, CommError> {
        let mut gather = self.issue(&UnitSpan {
            positions: 0..1,
            params: index..index + 1,
        });
        self.take(&mut gather, 0)
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
        self.release(bytes);
        Ok(part)
    }

    /// Waits for the collective of a gather of `params`, counting the wait in the stats.
    fn wait_for(&self, in_flight: InFlight, params: Range<usize>) -> Result<Vec<Part>, CommError> {
        let start = Instant::now();
        let parts = self.finish(in_flight, params);
        self.state().stats.wait_nanos += start.elapsed().as_nanos() as u64;
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
                self.release(gather.remaining);
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
    pub(super) fn discard(&self, gathers: impl IntoIterator<Item = UnitGather>) {
        for gather in gathers {
            self.release(gather.remaining);
            self.state().stats.unused_bytes += gather.remaining as u64;
        }
    }

    /// The pieces change: what was gathered ahead from them is stale.
    pub(super) fn forget_ahead(&self) {
        let dropped = self.scheduler().restart_ahead();
        self.discard(dropped);
        self.drop_kept();
    }

    /// After every rank agreed on the step's sequence of uses (the step's digest) and on which
    /// phases have a new one ([`ParamShards::check_new_schedules`]): rank 0's recorded sequence
    /// of each such phase is shared, every rank checks its own against it (the ends of
    /// backward passes included), and once every rank has, they become the phases'
    /// schedules. A rank whose sequence differs fails with [`crate::DistError::Schedule`] and
    /// aborts the group, as [`ParamShards::check_model`] does, so that every other rank fails
    /// here too, naming it, instead of gathering ahead what this rank will not.
    pub fn adopt_schedules(&self) -> crate::Result<()> {
        use burn_dist_comm::Communicator;
        let candidates = std::mem::take(&mut self.state().candidates);
        let mut agreed = Vec::new();
        for (phase, order) in Phase::ALL.into_iter().zip(candidates) {
            let Some(order) = order else { continue };
            // The digests agreed, so every rank should hold the same sequence; rank 0's length
            // goes first all the same, so that a rank whose sequence differs still takes part
            // in the broadcast and names the difference instead of failing inside it.
            let length = (order.len() as u64).to_le_bytes().to_vec();
            let length = self.comm.broadcast(HostBuffer::U8(length), 0).wait()?;
            let length = u64::from_le_bytes(length.as_bytes().try_into().expect("8 bytes"));
            let mut bytes: Vec<u8> = order
                .iter()
                .flat_map(|&i| encode_entry(i).to_le_bytes())
                .collect();
            bytes.resize(4 * length as usize, 0);
            let shared = self.comm.broadcast(HostBuffer::U8(bytes), 0).wait()?;
            let rank0: Vec<usize> = shared
                .as_bytes()
                .chunks_exact(4)
                .map(|b| decode_entry(u32::from_le_bytes(b.try_into().expect("4 bytes"))))
                .collect();
            if let Some(position) =
                (0..order.len().max(rank0.len())).find(|&p| order.get(p) != rank0.get(p))
            {
                let name = |i: Option<&usize>| match i {
                    None => "nothing".to_string(),
                    Some(&BACKWARD_END) => "the end of a backward pass".to_string(),
                    Some(&i) => format!("`{}`", self.params[i].name),
                };
                let error = crate::DistError::Schedule {
                    rank: self.rank(),
                    phase,
                    position,
                    here: name(order.get(position)),
                    rank0: name(rank0.get(position)),
                };
                self.comm.abort(error.to_string());
                return Err(error);
            }
            agreed.push((phase, order));
        }
        if agreed.is_empty() {
            return Ok(());
        }
        // Every rank has checked its sequences: a rank that found a difference aborted the group,
        // and the others learn it here rather than at their next gather.
        self.comm.barrier().wait()?;
        for (phase, order) in agreed {
            self.scheduler().adopt(
                phase,
                order,
                |i| self.params[i].bytes(),
                |first, next| self.params[first].dtype == self.params[next].dtype,
            );
            self.state().stats.schedules += 1;
        }
        Ok(())
    }
}

/// A sequence entry on the wire: a parameter index, or `u32::MAX` for [`BACKWARD_END`].
fn encode_entry(entry: usize) -> u32 {
    if entry == BACKWARD_END {
        u32::MAX
    } else {
        u32::try_from(entry).expect("fewer than 2^32 - 1 parameters")
    }
}

fn decode_entry(wire: u32) -> usize {
    if wire == u32::MAX {
        BACKWARD_END
    } else {
        wire as usize
    }
}
