//! The gather schedule of ZeRO stage 3: which parameter a step uses next, learned from the
//! steps before, so that its gather can be issued ahead of the op that needs it.
//!
//! - A *round* is the sequence of uses (gathers for ops) of one phase between two optimizer
//!   steps: every forward and backward of a training step, recomputation included, or the
//!   forwards of one evaluation, with the ends of its backward passes. The first round of each
//!   phase is recorded.
//! - At the optimizer step every rank's sequence is compared (the step's digest), and rank 0's
//!   recorded order is shared and checked against each rank's own ([`Scheduler::candidates`],
//!   then `ParamShards::adopt_schedules`): from then on it is the phase's *plan*.
//! - A round that follows a plan gathers its *units* (runs of the plan whose parameters lie
//!   together in the flat layout: a layer's weight and bias in forward, its weights in reverse
//!   in backward, with the few bytes between them that backward does not use; one gather of
//!   at most [`PrefetchConfig::unit_bytes`]) ahead of use, with at most
//!   [`PrefetchConfig::gathers`] units and [`PrefetchConfig::bytes`] in flight beyond the one being used.
//! - A use of a parameter used earlier in the round, with no backward's end between the two,
//!   gathers nothing when the earlier use's tensor could be kept for it: always for the use
//!   just before (a tied LM head: the last use of forward, the first of backward), else while
//!   the tensors kept at once hold at most [`PrefetchConfig::reuse_bytes`], by default the
//!   largest parameter's bytes, which its own gather holds at once anyway (the tied token
//!   embedding: the first use of forward, kept for the head at its end, and nothing else
//!   beside it). The caller keeps the tensor until then. FSDP spares the same gathers by not
//!   resharding the root module after forward; DeepSpeed keeps a parameter reused within
//!   `stage3_max_reuse_distance`.
//! - Gathers ahead never cross the end of a backward pass: the first gather after it waits for
//!   every rank to reach it. A rank that ran a whole forward ahead would otherwise sit in its
//!   next backward, inside Burn's lock on its autodiff graph, while a peer thread of the same
//!   process finishing the previous backward waits for that lock (Burn's graph cleanup visits
//!   every graph of the process): in-process ranks would deadlock. One exposed gather per
//!   forward is what FSDP pays too, at the start of each forward.
//! - A use the plan does not expect (another branch, a longer sequence) drops what was gathered
//!   ahead, is gathered on demand like every later use of the round, and the round is recorded
//!   again: the next optimizer step agrees on it as the new plan.
//!
//! Every rank runs the same program, so every rank issues the same gathers in the same order;
//! a rank that does not fails at the gather whose tag differs, within seconds where its peer
//! waits on the main lane (the communicator asks the peers where they are), or at the step's
//! agreement.
//! Which phase a use belongs to is the handle's: `model.valid()` (Burn's evaluation model)
//! marks its parameters as evaluation ones.
//!
//! This file decides; `shards.rs` gathers. The scheduler is generic over what an issued gather
//! is (`T`), so that it holds no communicator.

use std::collections::VecDeque;

use burn::config::Config;
use std::ops::Range;

/// How far ahead stage 3 gathers parameters once it knows the order of their uses
/// (`DdpConfig::prefetch`). Every rank must use the same.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub struct PrefetchConfig {
    /// Gathers in flight beyond the one the running op waits for, as FSDP's default of 2;
    /// 0 turns the schedule off (every parameter is then gathered when an op needs it,
    /// alone).
    #[config(default = 2)]
    pub gathers: usize,
    /// Bytes of those gathers in flight at most; one gather is always allowed, however large.
    /// 200 MB: DeepSpeed's stage-3 prefetch bucket of 5·10⁷ f32 elements.
    #[config(default = 200000000)]
    pub bytes: usize,
    /// The most one gather of adjacent parameters used one after the other holds; a larger
    /// parameter is gathered alone. It bounds what one unit holds live, as a module does
    /// under FSDP. 25 MiB: DDP's bucket, so that a gather moves about what a gradient
    /// bucket's reduction moves.
    #[config(default = 26214400)]
    pub unit_bytes: usize,
    /// The most bytes of gathered parameters kept at once from one use for a later use of the
    /// same round (no backward's end between), instead of gathering them again; a use right
    /// after the parameter's previous one is always served so. `None`: the bytes of the
    /// largest parameter the plan uses, which its gather holds at once anyway, so that keeping
    /// raises the most gathered bytes held at once by little: at GPT-2's shapes the tied token
    /// embedding is kept from the start of forward to the LM head, and nothing else beside
    /// it. More keeps parameters from forward to backward too (FSDP's
    /// `reshard_after_forward=False`, DeepSpeed's `stage3_max_reuse_distance`), trading memory
    /// for gathers.
    #[config(default = "None")]
    pub reuse_bytes: Option<usize>,
}

impl PrefetchConfig {
    /// No schedule: each parameter gathered on demand, alone.
    pub const OFF: PrefetchConfig = PrefetchConfig {
        gathers: 0,
        bytes: 0,
        unit_bytes: 0,
        reuse_bytes: None,
    };
}

/// Which schedule a use follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Train,
    Eval,
}

impl Phase {
    /// Its index among the phases (`Phase::ALL`).
    pub(crate) fn slot(self) -> usize {
        match self {
            Phase::Train => 0,
            Phase::Eval => 1,
        }
    }

    pub(crate) const ALL: [Phase; 2] = [Phase::Train, Phase::Eval];
}

/// In a recorded sequence of uses: a backward pass ended here.
pub(crate) const BACKWARD_END: usize = usize::MAX;

/// A unit gathers parameters it does not serve (between those it does) up to this fraction of
/// [`PrefetchConfig::unit_bytes`], 1/16: a layer's biases between the weights backward uses.
const UNUSED_SHARE: usize = 16;

/// The span of one unit, the parameters gathered as one: plan positions `positions`, which
/// use parameters of `params` (consecutive in the flat layout; each used at most once, in any
/// order, and some perhaps not at all).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct UnitSpan {
    pub positions: Range<usize>,
    pub params: Range<usize>,
}

/// An agreed sequence of uses and its units.
#[derive(Debug)]
struct Plan {
    /// As recorded: the uses and the ends of backward passes ([`BACKWARD_END`]).
    sequence: Vec<usize>,
    /// The uses alone: position `p` is the `p`-th use.
    order: Vec<usize>,
    /// Whether position `p` is served by the tensor its parameter's previous use kept for it:
    /// it is in no unit and gathers nothing.
    kept: Vec<bool>,
    /// Whether position `p`'s tensor is kept for its parameter's next use.
    keep: Vec<bool>,
    /// Positions of the first use after each backward's end, ascending.
    fences: Vec<usize>,
    units: Vec<UnitSpan>,
    /// The unit of each position.
    unit_of: Vec<usize>,
}

impl Plan {
    /// Groups the uses of `sequence` into units: a use joins the previous one's unit when no
    /// backward ended between them, the unit does not serve its parameter yet, and the unit's
    /// range of parameters grown to include it stays within `max_bytes`, of one dtype
    /// (`joins(first, other)`), with at most [`UNUSED_SHARE`] of `max_bytes` in parameters
    /// that the unit gathers but does not serve. Forward uses a layer's parameters in flat
    /// order, all of them; backward in reverse, and skips those its ops do not need (a bias,
    /// a layer norm's shift): both make units of several parameters, not one gather each. A
    /// use served by a tensor kept from an earlier use ([`Plan::reuses`]) is in no unit, and
    /// ends its unit.
    fn new(
        sequence: Vec<usize>,
        bytes: impl Fn(usize) -> usize,
        joins: impl Fn(usize, usize) -> bool,
        max_bytes: usize,
        reuse_bytes: Option<usize>,
    ) -> Plan {
        let mut order = Vec::with_capacity(sequence.len());
        let mut fences = Vec::new();
        for &entry in &sequence {
            if entry == BACKWARD_END {
                fences.push(order.len());
            } else {
                order.push(entry);
            }
        }
        let largest = order.iter().map(|&i| bytes(i)).max().unwrap_or(0);
        let (keep, kept) = Self::reuses(&order, &fences, &bytes, reuse_bytes.unwrap_or(largest));
        let mut units: Vec<UnitSpan> = Vec::new();
        let mut unit_of = Vec::with_capacity(order.len());
        // The last unit's served parameters.
        let mut served: Vec<usize> = Vec::new();
        let range_bytes = |range: Range<usize>| range.map(&bytes).sum::<usize>();
        for (p, &index) in order.iter().enumerate() {
            if kept[p] {
                // Served by a kept tensor: the unit before is still the one "being used".
                unit_of.push(units.len() - 1);
                continue;
            }
            let grown = units.last().and_then(|unit| {
                if unit.positions.end != p || fences.contains(&p) || served.contains(&index) {
                    return None;
                }
                let grown = unit.params.start.min(index)..unit.params.end.max(index + 1);
                // The range holds every parameter served and `index`, none twice.
                let gathered = range_bytes(grown.clone());
                let used: usize = served.iter().map(|&i| bytes(i)).sum::<usize>() + bytes(index);
                let unused = gathered - used;
                let fits = gathered <= max_bytes
                    && unused <= max_bytes / UNUSED_SHARE
                    && (grown.clone())
                        .filter(|other| !unit.params.contains(other))
                        .all(|other| joins(unit.params.start, other));
                fits.then_some(grown)
            });
            match grown {
                Some(grown) => {
                    let unit = units.last_mut().expect("checked");
                    unit.positions.end = p + 1;
                    unit.params = grown;
                }
                None => {
                    units.push(UnitSpan {
                        positions: p..p + 1,
                        params: index..index + 1,
                    });
                    served.clear();
                }
            }
            served.push(index);
            unit_of.push(units.len() - 1);
        }
        Plan {
            sequence,
            order,
            kept,
            keep,
            fences,
            units,
            unit_of,
        }
    }

    /// Which uses keep their tensor for the parameter's next use, and which are served so
    /// (`(keep, kept)`): a next use with no backward's end before it (no fence in `p + 1..=q`),
    /// taken in plan order while the tensors kept at once hold at most `reuse_bytes`; the use
    /// right after is taken whatever its size (its tensor is kept across no other op).
    fn reuses(
        order: &[usize],
        fences: &[usize],
        bytes: impl Fn(usize) -> usize,
        reuse_bytes: usize,
    ) -> (Vec<bool>, Vec<bool>) {
        let mut next_use = vec![None; order.len()];
        let mut later: std::collections::HashMap<usize, usize> = Default::default();
        for (p, &index) in order.iter().enumerate().rev() {
            next_use[p] = later.insert(index, p);
        }
        let (mut keep, mut kept) = (vec![false; order.len()], vec![false; order.len()]);
        let mut held = 0;
        for (p, &index) in order.iter().enumerate() {
            if kept[p] {
                held -= bytes(index);
            }
            let Some(q) = next_use[p] else { continue };
            let crosses_backward = first_fence_from(fences, p + 1) <= q;
            if !crosses_backward && (q == p + 1 || held + bytes(index) <= reuse_bytes) {
                keep[p] = true;
                kept[q] = true;
                held += bytes(index);
            }
        }
        (keep, kept)
    }

    /// The first position, from `cursor` on, that waits for a backward to end: no unit from
    /// there on may be gathered ahead yet.
    fn fence_from(&self, cursor: usize) -> usize {
        first_fence_from(&self.fences, cursor)
    }
}

/// The first of `fences` (ascending positions of the first use after a backward's end) at or
/// after `cursor`; `usize::MAX` if none.
fn first_fence_from(fences: &[usize], cursor: usize) -> usize {
    let next = fences.partition_point(|&f| f < cursor);
    fences.get(next).copied().unwrap_or(usize::MAX)
}

/// One phase's plan and where its current round stands.
#[derive(Debug, Default)]
struct Track {
    plan: Option<Plan>,
    /// The uses of the current round, and the ends of its backward passes.
    recorded: Vec<usize>,
    /// The next position of the plan.
    cursor: usize,
    /// The next unit to issue ahead.
    next_issue: usize,
    /// An unexpected use ended the plan for this round.
    broken: bool,
    /// A finished round's order that differs from the plan, waiting for the agreement.
    candidate: Option<Vec<usize>>,
}

impl Track {
    /// Ends the current round: its order becomes a candidate unless it followed the plan
    /// exactly.
    fn end_round(&mut self) {
        let followed = self
            .plan
            .as_ref()
            .is_some_and(|plan| !self.broken && plan.sequence == self.recorded);
        let recorded = std::mem::take(&mut self.recorded);
        if !followed && !recorded.is_empty() {
            self.candidate = Some(recorded);
        }
        self.cursor = 0;
        self.next_issue = 0;
        self.broken = false;
    }
}

/// How the use just announced is served.
///
/// `keep`: a later use of this parameter is served by the tensor the caller makes of this
/// gather, which it keeps until then ([`Serve::Kept`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Serve {
    /// By the gather at the front of [`Scheduler::front`]: its parameter `offset` of the unit's
    /// range.
    Ahead {
        offset: usize,
        last: bool,
        keep: bool,
    },
    /// By gathering `unit` now; pushed to the front ([`Scheduler::push_front`]) when not
    /// `last`, to serve the unit's later uses.
    Demand {
        unit: UnitSpan,
        unit_index: usize,
        offset: usize,
        last: bool,
        keep: bool,
    },
    /// By the tensor an earlier use of the same parameter kept for it: no gather; `keep`: kept
    /// again, for the next use.
    Kept { keep: bool },
    /// By gathering the parameter alone (no plan, or off the plan).
    Alone,
}

/// What [`Scheduler::on_use`] decided: how to serve, gathers issued ahead that are no
/// longer wanted (to be waited for and dropped by the caller), and whether the tensors kept
/// for later uses are no longer wanted (`forget_kept`: the plan broke, or the phase changed;
/// the same use on every rank, which drops them there: `KeptTensors::drop_all`, `kept.rs`).
pub(crate) struct Decision<T> {
    pub serve: Serve,
    pub dropped: Vec<T>,
    pub forget_kept: bool,
}

/// The schedules of one rank's sharded parameters and its gathers in flight.
pub(crate) struct Scheduler<T> {
    window: PrefetchConfig,
    tracks: [Track; 2],
    /// The phase of the last use.
    current: Option<Phase>,
    /// Units gathered ahead for the current phase, in plan order: (unit index, gather).
    ahead: VecDeque<(usize, T)>,
    /// Uses the plan did not expect, since the start (`ShardStats::off_schedule`).
    pub off_plan: u64,
}

impl<T> Scheduler<T> {
    pub fn new(window: PrefetchConfig) -> Self {
        Scheduler {
            window,
            tracks: Default::default(),
            current: None,
            ahead: VecDeque::new(),
            off_plan: 0,
        }
    }

    pub fn window(&self) -> PrefetchConfig {
        self.window
    }

    /// A new window; with `PrefetchConfig::OFF` the plans are forgotten.
    pub fn set_window(&mut self, window: PrefetchConfig) -> Vec<T> {
        self.window = window;
        if window.gathers == 0 {
            self.tracks = Default::default();
        }
        self.restart_ahead()
    }

    fn drop_ahead(&mut self) -> Vec<T> {
        self.ahead.drain(..).map(|(_, gather)| gather).collect()
    }

    /// Drops what was gathered ahead (the pieces changed, or the window did); the current
    /// round gathers again from its next use on.
    pub fn restart_ahead(&mut self) -> Vec<T> {
        if let Some(phase) = self.current {
            let track = &mut self.tracks[phase.slot()];
            if let Some(plan) = &track.plan {
                track.next_issue = plan
                    .unit_of
                    .get(track.cursor)
                    .copied()
                    .unwrap_or(usize::MAX);
            }
        }
        self.drop_ahead()
    }

    /// Parameter `index` is used by an op of `phase`: records it and decides how it is served.
    pub fn on_use(&mut self, phase: Phase, index: usize) -> Decision<T> {
        let alone = |dropped, forget_kept| Decision {
            serve: Serve::Alone,
            dropped,
            forget_kept,
        };
        if self.window.gathers == 0 {
            return alone(Vec::new(), false);
        }
        let mut dropped = Vec::new();
        let mut forget_kept = false;
        if self.current != Some(phase) {
            // What was gathered ahead belongs to the other phase's round. An evaluation ends at
            // the return to training; a training round only pauses for an evaluation (its
            // kept tensors are dropped too, and gathered again if the plan wants them).
            dropped = self.drop_ahead();
            if self.current == Some(Phase::Eval) {
                self.tracks[Phase::Eval.slot()].end_round();
            }
            self.current = Some(phase);
            dropped.extend(self.restart_ahead());
            forget_kept = true;
        }
        let track = &mut self.tracks[phase.slot()];
        track.recorded.push(index);
        let Some(plan) = track.plan.as_ref().filter(|_| !track.broken) else {
            return alone(dropped, forget_kept);
        };
        let p = track.cursor;
        if plan.order.get(p) != Some(&index) {
            track.broken = true;
            self.off_plan += 1;
            dropped.extend(self.drop_ahead());
            return alone(dropped, true);
        }
        track.cursor += 1;
        let keep = plan.keep[p];
        if plan.kept[p] {
            return Decision {
                serve: Serve::Kept { keep },
                dropped,
                forget_kept,
            };
        }
        let unit_index = plan.unit_of[p];
        let unit = &plan.units[unit_index];
        let (offset, last) = (index - unit.params.start, p + 1 == unit.positions.end);
        // Units gathered ahead but skipped cannot exist (a plan is used in order), but a gather
        // that is not this unit's must never serve it.
        while self.ahead.front().is_some_and(|(u, _)| *u < unit_index) {
            dropped.extend(self.ahead.pop_front().map(|(_, gather)| gather));
        }
        track.next_issue = track.next_issue.max(unit_index + 1);
        let serve = match self.ahead.front() {
            Some((u, _)) if *u == unit_index => Serve::Ahead { offset, last, keep },
            _ => Serve::Demand {
                unit: unit.clone(),
                unit_index,
                offset,
                last,
                keep,
            },
        };
        Decision {
            serve,
            dropped,
            forget_kept,
        }
    }

    /// A backward pass ended: recorded in the current round, and no gather ahead crosses it.
    pub fn end_backward(&mut self) {
        if self.window.gathers == 0 {
            return;
        }
        if let Some(phase) = self.current {
            self.tracks[phase.slot()].recorded.push(BACKWARD_END);
        }
    }

    /// The gather serving the current unit.
    pub fn front(&mut self) -> Option<&mut T> {
        self.ahead.front_mut().map(|(_, gather)| gather)
    }

    /// The current unit's last use was served: its gather is done with.
    pub fn pop_front(&mut self) -> Option<T> {
        self.ahead.pop_front().map(|(_, gather)| gather)
    }

    /// A unit gathered on demand whose later uses are still to come: it becomes the front, and
    /// serves them as a gather ahead would.
    pub fn push_front(&mut self, unit_index: usize, gather: T) {
        self.ahead.push_front((unit_index, gather));
    }

    /// The units to issue ahead now, given the bytes of each gather already ahead
    /// (`bytes_ahead`) and of a unit (`unit_bytes`); each issued one must be passed to
    /// [`Scheduler::issued`] in this order.
    pub fn plan_ahead(
        &mut self,
        bytes_ahead: impl Fn(&T) -> usize,
        unit_bytes: impl Fn(&UnitSpan) -> usize,
    ) -> Vec<(usize, UnitSpan)> {
        let Some(phase) = self.current else {
            return Vec::new();
        };
        let track = &mut self.tracks[phase.slot()];
        let Some(plan) = track.plan.as_ref().filter(|_| !track.broken) else {
            return Vec::new();
        };
        // The unit being used is not "ahead": its op waits for it.
        let current = track.cursor.checked_sub(1).map(|p| plan.unit_of[p]);
        let beyond = |u: usize| current.is_none_or(|c| u > c);
        let mut count = self.ahead.iter().filter(|(u, _)| beyond(*u)).count();
        let mut bytes: usize = self
            .ahead
            .iter()
            .filter(|(u, _)| beyond(*u))
            .map(|(_, gather)| bytes_ahead(gather))
            .sum();
        let fence = plan.fence_from(track.cursor);
        let mut issue = Vec::new();
        while count < self.window.gathers && track.next_issue < plan.units.len() {
            let unit = &plan.units[track.next_issue];
            let size = unit_bytes(unit);
            if unit.positions.start >= fence || (count > 0 && bytes + size > self.window.bytes) {
                break;
            }
            issue.push((track.next_issue, unit.clone()));
            track.next_issue += 1;
            count += 1;
            bytes += size;
        }
        issue
    }

    /// A unit returned by [`Scheduler::plan_ahead`] was issued.
    pub fn issued(&mut self, unit_index: usize, gather: T) {
        self.ahead.push_back((unit_index, gather));
    }

    /// The optimizer step: every round ends. Returns the finished rounds' orders that are to
    /// become plans (`None` for a phase whose plan stands), which every rank must agree on,
    /// and the gathers still ahead (none when the rounds followed their plans).
    pub fn end_step(&mut self) -> ([Option<Vec<usize>>; 2], Vec<T>) {
        let dropped = self.drop_ahead();
        self.current = None;
        for track in &mut self.tracks {
            track.end_round();
        }
        let candidates = self.tracks.each_mut().map(|track| track.candidate.take());
        (candidates, dropped)
    }

    /// Makes `sequence` (uses and [`BACKWARD_END`]s) the plan of `phase` (every rank agreed on
    /// it).
    pub fn adopt(
        &mut self,
        phase: Phase,
        sequence: Vec<usize>,
        bytes: impl Fn(usize) -> usize,
        joins: impl Fn(usize, usize) -> bool,
    ) {
        let plan = Plan::new(
            sequence,
            bytes,
            joins,
            self.window.unit_bytes,
            self.window.reuse_bytes,
        );
        self.tracks[phase.slot()].plan = Some(plan);
    }

    /// The plan of `phase`, as parameter indices in use order, and its units' parameters.
    pub fn plan(&self, phase: Phase) -> Option<(&[usize], Vec<Range<usize>>)> {
        self.tracks[phase.slot()].plan.as_ref().map(|plan| {
            let units = plan.units.iter().map(|unit| unit.params.clone()).collect();
            (plan.order.as_slice(), units)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gather stand-in: the unit it serves.
    type Gather = usize;

    /// What `serve` returns for a use served by a tensor an earlier use kept.
    const KEPT: usize = usize::MAX;

    /// The default window, with units of one 4-byte parameter each and no tensor kept but for
    /// the use right after: the tests that use it follow gathers ahead, not how units form.
    fn one_parameter_units() -> PrefetchConfig {
        PrefetchConfig::new()
            .with_unit_bytes(4)
            .with_reuse_bytes(Some(0))
    }

    fn adopt(scheduler: &mut Scheduler<Gather>, phase: Phase, order: &[usize]) {
        scheduler.adopt(phase, order.to_vec(), |_| 4, |_, _| true);
    }

    /// Serves `index` as the caller in shards.rs does; returns the unit that served it and
    /// issues what the window allows.
    fn serve(scheduler: &mut Scheduler<Gather>, phase: Phase, index: usize) -> Option<usize> {
        let decision = scheduler.on_use(phase, index);
        let served = match decision.serve {
            Serve::Alone => None,
            Serve::Kept { .. } => Some(KEPT),
            Serve::Ahead { last, .. } => {
                let unit = *scheduler.front().unwrap();
                if last {
                    scheduler.pop_front();
                }
                Some(unit)
            }
            Serve::Demand {
                unit_index, last, ..
            } => {
                if !last {
                    scheduler.push_front(unit_index, unit_index);
                }
                Some(unit_index)
            }
        };
        for (unit, _) in scheduler.plan_ahead(|_| 4, |unit| 4 * unit.params.len()) {
            scheduler.issued(unit, unit);
        }
        served
    }

    #[test]
    fn parameters_together_in_the_flat_layout_form_one_unit_in_either_order() {
        // Forward: weight 0 and bias 1, weight 2 and bias 3; backward: weight 2, then 0, one
        // unit that also gathers bias 1 (4 bytes unused, within 100 / 16).
        let plan = Plan::new(vec![0, 1, 2, 3, 2, 0], |_| 4, |_, _| true, 100, Some(0));
        let units: Vec<_> = plan.units.iter().map(|u| u.params.clone()).collect();
        assert_eq!(units, [0..4, 0..3]);
        // More unused bytes than that, or a parameter the unit already serves, start a unit.
        let plan = Plan::new(vec![3, 0], |_| 4, |_, _| true, 100, Some(0));
        let units: Vec<_> = plan.units.iter().map(|u| u.params.clone()).collect();
        assert_eq!(units, [3..4, 0..1]);
        let plan = Plan::new(vec![1, 0, 1], |_| 4, |_, _| true, 100, Some(0));
        let units: Vec<_> = plan.units.iter().map(|u| u.params.clone()).collect();
        assert_eq!(units, [0..2, 1..2]);
        // A parameter between of another dtype, too.
        let plan = Plan::new(vec![2, 0], |_| 4, |_, other| other != 1, 100, Some(0));
        let units: Vec<_> = plan.units.iter().map(|u| u.params.clone()).collect();
        assert_eq!(units, [2..3, 0..1]);
        // Another dtype, or a unit over the byte limit, starts a new unit.
        let plan = Plan::new(vec![0, 1, 2, 3], |_| 4, |_, next| next != 2, 100, Some(0));
        let units: Vec<_> = plan.units.iter().map(|u| u.params.clone()).collect();
        assert_eq!(units, [0..2, 2..4]);
        let plan = Plan::new(vec![0, 1, 2, 3], |_| 4, |_, _| true, 8, Some(0));
        let units: Vec<_> = plan.units.iter().map(|u| u.params.clone()).collect();
        assert_eq!(units, [0..2, 2..4]);
    }

    #[test]
    fn a_use_of_the_parameter_used_just_before_gathers_nothing() {
        // Forward 0, 1, 2 (one unit); backward 2, 1, 0: backward's 2 is forward's again, and
        // ends forward's unit; 1 and 0 are backward's.
        let plan = Plan::new(vec![0, 1, 2, 2, 1, 0], |_| 4, |_, _| true, 100, Some(0));
        let units: Vec<_> = plan.units.iter().map(|u| u.params.clone()).collect();
        assert_eq!(units, [0..3, 0..2]);
        assert_eq!(plan.kept, [false, false, false, true, false, false]);
        // Not across the end of a backward, and a use after a repeat starts a unit.
        let plan = Plan::new(
            vec![2, BACKWARD_END, 2, 2, 3],
            |_| 4,
            |_, _| true,
            100,
            Some(0),
        );
        let units: Vec<_> = plan.units.iter().map(|u| u.params.clone()).collect();
        assert_eq!(units, [2..3, 2..3, 3..4]);
        assert_eq!(plan.kept, [false, false, true, false]);

        let mut scheduler = Scheduler::new(PrefetchConfig::new().with_reuse_bytes(Some(0)));
        adopt(&mut scheduler, Phase::Train, &[0, 1, 2, 2, 1, 0]);
        // Forward's use of 2 is told that the next use is its again.
        assert_eq!(serve(&mut scheduler, Phase::Train, 0), Some(0));
        assert_eq!(serve(&mut scheduler, Phase::Train, 1), Some(0));
        let decision = scheduler.on_use(Phase::Train, 2);
        assert_eq!(
            decision.serve,
            Serve::Ahead {
                offset: 2,
                last: true,
                keep: true
            }
        );
        scheduler.pop_front();
        for (unit, _) in scheduler.plan_ahead(|_| 4, |_| 4) {
            scheduler.issued(unit, unit);
        }
        assert_eq!(serve(&mut scheduler, Phase::Train, 2), Some(KEPT));
        // Backward's unit serves 1 at its offset 1, then 0 at offset 0, its last.
        assert_eq!(
            scheduler.on_use(Phase::Train, 1).serve,
            Serve::Ahead {
                offset: 1,
                last: false,
                keep: false
            }
        );
        assert_eq!(*scheduler.front().unwrap(), 1);
        assert_eq!(
            scheduler.on_use(Phase::Train, 0).serve,
            Serve::Ahead {
                offset: 0,
                last: true,
                keep: false
            }
        );
        scheduler.pop_front();
        assert_eq!(
            scheduler.end_step().0,
            [None, None],
            "the plan was followed"
        );
        // A round whose again does not come breaks the plan there.
        for index in [0, 1, 2] {
            serve(&mut scheduler, Phase::Train, index);
        }
        assert_eq!(scheduler.on_use(Phase::Train, 1).serve, Serve::Alone);
        assert_eq!(scheduler.off_plan, 1);
    }

    #[test]
    fn a_parameter_used_again_later_keeps_its_tensor_within_the_reuse_bytes() {
        // A tied embedding: 0 first and last in forward (its head), first in backward; 1 and 2
        // a layer between. 12 bytes kept at once at most: 0 (8 bytes) from position 0 to 3 and
        // 1 (4 bytes) from position 1 to 6 fit; 2 would be 16 (position 2 to 5).
        let bytes = |i: usize| if i == 0 { 8 } else { 4 };
        let order = vec![0, 1, 2, 0, 0, 2, 1];
        let plan = Plan::new(order.clone(), bytes, |_, _| true, 4, Some(12));
        assert_eq!(plan.keep, [true, true, false, true, false, false, false]);
        assert_eq!(plan.kept, [false, false, false, true, true, false, true]);
        // Kept uses are in no unit: 0, 1, 2, then backward's 2 alone.
        let units: Vec<_> = plan.units.iter().map(|u| u.params.clone()).collect();
        assert_eq!(units, [0..1, 1..2, 2..3, 2..3]);
        // Nothing kept at 0 bytes but the use right after; at 16, 2 as well.
        let plan = Plan::new(order.clone(), bytes, |_, _| true, 4, Some(0));
        assert_eq!(plan.kept, [false, false, false, false, true, false, false]);
        let plan = Plan::new(order.clone(), bytes, |_, _| true, 4, Some(16));
        assert_eq!(plan.kept, [false, false, false, true, true, true, true]);
        // By default, the largest parameter's bytes: 0 alone.
        let plan = Plan::new(order, bytes, |_, _| true, 4, None);
        assert_eq!(plan.kept, [false, false, false, true, true, false, false]);
        // Never across the end of a backward (the next micro-batch's forward).
        let plan = Plan::new(
            vec![0, 1, BACKWARD_END, 0, 1],
            bytes,
            |_, _| true,
            4,
            Some(100),
        );
        assert_eq!(plan.kept, [false, false, false, false]);

        // Served in a round: the kept use gathers nothing, and what the plan expects after it
        // comes from the units ahead.
        let window = PrefetchConfig::new().with_unit_bytes(4);
        let mut scheduler = Scheduler::new(window.with_reuse_bytes(Some(8)));
        adopt(&mut scheduler, Phase::Train, &[0, 1, 0, 1]);
        let decision = scheduler.on_use(Phase::Train, 0);
        assert!(matches!(decision.serve, Serve::Demand { keep: true, .. }));
        for (unit, _) in scheduler.plan_ahead(|_| 4, |_| 4) {
            scheduler.issued(unit, unit);
        }
        assert_eq!(serve(&mut scheduler, Phase::Train, 1), Some(1));
        assert_eq!(serve(&mut scheduler, Phase::Train, 0), Some(KEPT));
        assert_eq!(serve(&mut scheduler, Phase::Train, 1), Some(KEPT));
        assert_eq!(scheduler.end_step().0, [None, None]);
        // A kept use keeps its tensor again for the use right after (the tied head: kept from
        // forward's first use, then for backward's first).
        adopt(&mut scheduler, Phase::Train, &[0, 1, 0, 0]);
        serve(&mut scheduler, Phase::Train, 0);
        serve(&mut scheduler, Phase::Train, 1);
        let decision = scheduler.on_use(Phase::Train, 0);
        assert_eq!(decision.serve, Serve::Kept { keep: true });
        let decision = scheduler.on_use(Phase::Train, 0);
        assert_eq!(decision.serve, Serve::Kept { keep: false });
        scheduler.end_step();
        // A round that leaves the plan forgets what it kept; an evaluation between, too.
        serve(&mut scheduler, Phase::Train, 0);
        let decision = scheduler.on_use(Phase::Train, 2);
        assert!(decision.forget_kept && decision.serve == Serve::Alone);
        scheduler.end_step();
        adopt(&mut scheduler, Phase::Train, &[0, 1, 0, 1]);
        serve(&mut scheduler, Phase::Train, 0);
        assert!(scheduler.on_use(Phase::Eval, 0).forget_kept);
        assert!(!scheduler.on_use(Phase::Eval, 1).forget_kept);
    }

    #[test]
    fn a_plan_is_gathered_ahead_within_the_window() {
        let mut scheduler = Scheduler::new(PrefetchConfig {
            gathers: 2,
            bytes: 1000,
            unit_bytes: 4,
            reuse_bytes: Some(0),
        });
        // Round 1 records; nothing is gathered ahead.
        for index in [0, 2, 4, 6, 4, 2] {
            assert_eq!(serve(&mut scheduler, Phase::Train, index), None);
        }
        let (candidates, dropped) = scheduler.end_step();
        assert!(dropped.is_empty());
        assert_eq!(candidates[0].as_deref(), Some(&[0, 2, 4, 6, 4, 2][..]));
        assert_eq!(candidates[1], None);
        adopt(&mut scheduler, Phase::Train, &[0, 2, 4, 6, 4, 2]);
        // Round 2: the first unit on demand, then two ahead at every use.
        assert_eq!(serve(&mut scheduler, Phase::Train, 0), Some(0));
        assert_eq!(
            scheduler.ahead.iter().map(|a| a.0).collect::<Vec<_>>(),
            [1, 2]
        );
        for (p, index) in [2, 4, 6, 4, 2].into_iter().enumerate() {
            assert_eq!(serve(&mut scheduler, Phase::Train, index), Some(p + 1));
            assert!(scheduler.ahead.len() <= 2);
        }
        assert!(
            scheduler.ahead.is_empty(),
            "nothing is gathered past the plan"
        );
        let (candidates, dropped) = scheduler.end_step();
        assert_eq!(
            candidates,
            [None, None],
            "a round that followed its plan keeps it"
        );
        assert!(dropped.is_empty());
    }

    #[test]
    fn the_byte_window_limits_gathers_ahead_but_always_allows_one() {
        let mut scheduler = Scheduler::new(PrefetchConfig {
            gathers: 3,
            bytes: 4,
            unit_bytes: 4,
            reuse_bytes: Some(0),
        });
        adopt(&mut scheduler, Phase::Train, &[0, 2, 4, 6]);
        serve(&mut scheduler, Phase::Train, 0);
        assert_eq!(scheduler.ahead.len(), 1, "4 bytes: one unit ahead");
        scheduler.set_window(PrefetchConfig {
            gathers: 3,
            bytes: 0,
            unit_bytes: 4,
            reuse_bytes: Some(0),
        });
        adopt(&mut scheduler, Phase::Train, &[0, 2, 4, 6]);
        scheduler.end_step();
        serve(&mut scheduler, Phase::Train, 0);
        assert_eq!(scheduler.ahead.len(), 1, "one is always allowed");
    }

    #[test]
    fn an_unexpected_use_drops_what_was_ahead_and_records_the_round_again() {
        let mut scheduler = Scheduler::new(one_parameter_units());
        adopt(&mut scheduler, Phase::Train, &[0, 2, 4, 6]);
        serve(&mut scheduler, Phase::Train, 0);
        let decision = scheduler.on_use(Phase::Train, 4);
        assert_eq!(decision.serve, Serve::Alone);
        assert_eq!(decision.dropped, [1, 2], "the gathers ahead are dropped");
        assert_eq!(scheduler.off_plan, 1);
        // The rest of the round is gathered alone.
        assert_eq!(serve(&mut scheduler, Phase::Train, 6), None);
        assert!(scheduler.ahead.is_empty());
        let (candidates, _) = scheduler.end_step();
        assert_eq!(candidates[0].as_deref(), Some(&[0, 4, 6][..]));
        // A round shorter than the plan is recorded again too.
        serve(&mut scheduler, Phase::Train, 0);
        let (candidates, dropped) = scheduler.end_step();
        assert_eq!(candidates[0].as_deref(), Some(&[0][..]));
        assert_eq!(dropped, [1, 2]);
    }

    #[test]
    fn evaluation_keeps_its_own_plan_and_training_resumes_where_it_paused() {
        let mut scheduler = Scheduler::new(one_parameter_units());
        adopt(&mut scheduler, Phase::Train, &[0, 2, 4, 2, 0]);
        adopt(&mut scheduler, Phase::Eval, &[0, 2, 4]);
        assert_eq!(serve(&mut scheduler, Phase::Train, 0), Some(0));
        assert_eq!(serve(&mut scheduler, Phase::Train, 2), Some(1));
        // An evaluation in the middle of training: its own plan; training's gathers ahead are
        // dropped.
        let decision = scheduler.on_use(Phase::Eval, 0);
        assert_eq!(decision.dropped, [2, 3]);
        assert!(matches!(
            decision.serve,
            Serve::Demand { unit_index: 0, .. }
        ));
        for (unit, _) in scheduler.plan_ahead(|_| 4, |_| 4) {
            scheduler.issued(unit, unit);
        }
        assert_eq!(serve(&mut scheduler, Phase::Eval, 2), Some(1));
        assert_eq!(serve(&mut scheduler, Phase::Eval, 4), Some(2));
        // Back to training: it goes on from position 2, gathering its unit again.
        assert_eq!(serve(&mut scheduler, Phase::Train, 4), Some(2));
        assert_eq!(serve(&mut scheduler, Phase::Train, 2), Some(3));
        assert_eq!(serve(&mut scheduler, Phase::Train, 0), Some(4));
        let (candidates, dropped) = scheduler.end_step();
        assert_eq!(candidates, [None, None]);
        assert!(dropped.is_empty());
        assert_eq!(scheduler.off_plan, 0);
    }

    #[test]
    fn no_gather_ahead_crosses_the_end_of_a_backward() {
        let mut scheduler = Scheduler::new(one_parameter_units());
        // Two micro-batches: forward 0, 2; backward 2; forward 0, 2; backward 2.
        let round = [0, 2, 2, BACKWARD_END, 0, 2, 2, BACKWARD_END];
        for &entry in &round {
            if entry == BACKWARD_END {
                scheduler.end_backward();
            } else {
                serve(&mut scheduler, Phase::Train, entry);
            }
        }
        let (candidates, _) = scheduler.end_step();
        assert_eq!(candidates[0].as_deref(), Some(&round[..]));
        adopt(&mut scheduler, Phase::Train, &round);
        let (_, units) = scheduler.plan(Phase::Train).unwrap();
        // Backward's use of 2 right after forward's is served by forward's tensor: no unit.
        assert_eq!(units, [0..1, 2..3, 0..1, 2..3]);
        serve(&mut scheduler, Phase::Train, 0);
        serve(&mut scheduler, Phase::Train, 2);
        assert_eq!(serve(&mut scheduler, Phase::Train, 2), Some(KEPT));
        assert!(
            scheduler.ahead.is_empty(),
            "the next forward is not gathered during this backward"
        );
        scheduler.end_backward();
        let decision = scheduler.on_use(Phase::Train, 0);
        assert!(matches!(
            decision.serve,
            Serve::Demand { unit_index: 2, .. }
        ));
        for (unit, _) in scheduler.plan_ahead(|_| 4, |_| 4) {
            scheduler.issued(unit, unit);
        }
        assert_eq!(scheduler.ahead.iter().map(|a| a.0).collect::<Vec<_>>(), [3]);
        assert_eq!(serve(&mut scheduler, Phase::Train, 2), Some(3));
        assert_eq!(serve(&mut scheduler, Phase::Train, 2), Some(KEPT));
        scheduler.end_backward();
        assert_eq!(
            scheduler.end_step().0,
            [None, None],
            "the round followed its plan"
        );
        // A round whose backward ends elsewhere is recorded again.
        for &entry in &[0, 2, 2, 0, 2, 2, BACKWARD_END] {
            if entry == BACKWARD_END {
                scheduler.end_backward();
            } else {
                serve(&mut scheduler, Phase::Train, entry);
            }
        }
        assert!(scheduler.end_step().0[0].is_some());
    }

    #[test]
    fn off_gathers_every_parameter_alone_and_records_nothing() {
        let mut scheduler = Scheduler::<Gather>::new(PrefetchConfig::OFF);
        assert_eq!(scheduler.on_use(Phase::Train, 0).serve, Serve::Alone);
        assert_eq!(scheduler.end_step().0, [None, None]);
    }
}
