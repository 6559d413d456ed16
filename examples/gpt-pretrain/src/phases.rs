//! The phases of a training run, with their times: the model built, the first forward, the
//! first backward, the first optimizer step, then every step and every evaluation. The first
//! step on a GPU compiles and tunes every kernel (minutes, cold), so a run that says only
//! "step 1" after its first step leaves a reader guessing where the time went; `--phase-log`
//! prints each phase as it ends, and an [`Observer`] (the device check's) receives them.
//!
//! When anyone listens, the run's first step's phases end with a device sync each (GPU work is
//! queued, so without one the time would land in whichever phase waits next); so does every
//! phase of a step the observer asks to have split ([`Observer::split`]). Other steps, and
//! every step of a run nobody listens to, run unsynced, as training does.

use std::ops::ControlFlow;
use std::time::Instant;

/// One moment of a run.
#[derive(Debug, Clone, PartialEq)]
pub enum Phase {
    /// The model is built, prepared by the `Ddp` (sharded or checked and broadcast) and the
    /// optimizer is built.
    ModelBuilt,
    /// The first micro-batch's forward is done and its loss read.
    FirstForward,
    /// The first backward is done, gradients reduced (device synced).
    FirstBackward,
    /// The first optimizer step is done (device synced).
    FirstOptimizerStep,
    /// A step is done (`step` counts from 1), with its mean loss over ranks, and, for a step
    /// that was split, the seconds of each part.
    Step {
        step: u64,
        loss: f64,
        split: Option<Split>,
    },
    /// An evaluation is done.
    Evaluated { step: u64, val_loss: f64 },
}

/// One step's seconds by part, each ended by a device sync. Communication is inside them: the
/// gradient reduction in `backward_s` (buckets reduced while backward runs, waited for at its
/// end), ZeroAdam's collectives in `optimizer_s`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Split {
    pub forward_s: f64,
    pub backward_s: f64,
    pub optimizer_s: f64,
}

/// A phase with its times.
#[derive(Debug, Clone, PartialEq)]
pub struct PhaseEvent {
    pub phase: Phase,
    /// Seconds since the run started (before the corpus is read).
    pub elapsed_s: f64,
    /// The phase's own seconds: for a step, from the end of the step before (or of the model's
    /// build, or of an evaluation) to its end, its first-step parts included; for any other
    /// phase, since the phase before it ended.
    pub took_s: f64,
}

/// Receives a run's phases. Returning `Break` from a step's phase makes that step the last:
/// the run evaluates and finishes as after its final step. At a world size above 1 every
/// rank's observer must decide alike, or the ranks part ways.
pub trait Observer {
    fn observe(&mut self, event: &PhaseEvent) -> ControlFlow<()>;

    /// Whether step `step` (from 1) is to be split into its parts, each ended by a sync.
    fn split(&self, _step: u64) -> bool {
        false
    }
}

/// The run's clock and where its phases go: printed (`--phase-log`, rank 0) and to the
/// observer, if any.
pub struct Phases<'a> {
    began: Instant,
    last: Instant,
    /// Where the next step's time starts: the end of the model's build, a step or an
    /// evaluation.
    step_began: Instant,
    print: bool,
    observer: Option<&'a mut dyn Observer>,
}

impl<'a> Phases<'a> {
    pub fn start(print: bool, observer: Option<&'a mut dyn Observer>) -> Self {
        let now = Instant::now();
        Phases {
            began: now,
            last: now,
            step_began: now,
            print,
            observer,
        }
    }

    /// Whether the observer asks for step `step` (from 1) to be split (the run's first step
    /// always is, when anyone listens).
    pub fn splits(&self, step: u64) -> bool {
        self.observer.as_ref().is_some_and(|o| o.split(step))
    }

    /// Whether anyone reads the phases: without, the run times nothing extra.
    pub fn listened(&self) -> bool {
        self.print || self.observer.is_some()
    }

    /// Ends a phase: prints it, hands it to the observer, and returns what the observer said.
    pub fn reach(&mut self, phase: Phase) -> ControlFlow<()> {
        let now = Instant::now();
        let from = match phase {
            Phase::Step { .. } => self.step_began,
            _ => self.last,
        };
        if matches!(
            phase,
            Phase::ModelBuilt | Phase::Step { .. } | Phase::Evaluated { .. }
        ) {
            self.step_began = now;
        }
        let event = PhaseEvent {
            phase,
            elapsed_s: now.duration_since(self.began).as_secs_f64(),
            took_s: now.duration_since(from).as_secs_f64(),
        };
        self.last = now;
        if self.print {
            println!("{}", describe(&event));
        }
        match &mut self.observer {
            Some(observer) => observer.observe(&event),
            None => ControlFlow::Continue(()),
        }
    }
}

/// One line: `phase first backward: 41.20 s (at 96.51 s)`.
pub fn describe(event: &PhaseEvent) -> String {
    let what = match &event.phase {
        Phase::ModelBuilt => "model built".to_string(),
        Phase::FirstForward => "first forward".to_string(),
        Phase::FirstBackward => "first backward".to_string(),
        Phase::FirstOptimizerStep => "first optimizer step".to_string(),
        Phase::Step { step, loss, split } => {
            let mut line = format!("step {step} (loss {loss:.4})");
            if let Some(s) = split {
                line += &format!(
                    " [forward {:.4} s, backward {:.4} s, optimizer {:.4} s]",
                    s.forward_s, s.backward_s, s.optimizer_s
                );
            }
            line
        }
        Phase::Evaluated { step, val_loss } => {
            format!("evaluation after step {step} (val {val_loss:.4})")
        }
    };
    format!(
        "phase {what}: {:.2} s (at {:.2} s)",
        event.took_s, event.elapsed_s
    )
}
