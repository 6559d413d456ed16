//! A run's phases: the model built, the first forward, backward and optimizer step, then
//! every step and evaluation, in that order, with times that add up; a step the observer asks
//! to split is split; an observer that stops the run makes that step the last, evaluated and
//! finished as a last step is; `--phase-log` prints the same phases.

use std::ops::ControlFlow;
use std::process::Command;

use burn::backend::Autodiff;
use burn_dist::{Ddp, DdpConfig, DistributedBackend};
use burn_dist_comm::{CommConfig, HostCommunicator};
use burn_dist_models::processes::scratch_dir;
use burn_flex::{Flex, FlexDevice};
use clap::Parser;
use gpt_pretrain::cli::Args;
use gpt_pretrain::phases::{Observer, Phase, PhaseEvent};

mod common;

/// Records every phase, splits step 2 and stops the run after step 3.
#[derive(Default)]
struct Recorder(Vec<PhaseEvent>);

impl Observer for Recorder {
    fn observe(&mut self, event: &PhaseEvent) -> ControlFlow<()> {
        self.0.push(event.clone());
        match event.phase {
            Phase::Step { step: 3, .. } => ControlFlow::Break(()),
            _ => ControlFlow::Continue(()),
        }
    }

    fn split(&self, step: u64) -> bool {
        step == 2
    }
}

#[test]
fn phases_come_in_order_with_their_times_and_an_observer_can_end_the_run() {
    let dir = scratch_dir("gpt-phases");
    let metrics = dir.join("metrics.jsonl");
    let args = Args::try_parse_from(
        ["gpt-pretrain"]
            .iter()
            .chain(common::RUN)
            .map(|s| s.to_string())
            .chain([
                "--steps".into(),
                "6".into(),
                "--eval-every".into(),
                "0".into(),
                "--run-dir".into(),
                dir.display().to_string(),
                "--metrics".into(),
                metrics.display().to_string(),
            ]),
    )
    .unwrap();
    let comm = HostCommunicator::local_group(1, &CommConfig::default()).remove(0);
    let mut ddp = Ddp::for_thread(comm, DdpConfig::new());
    let mut recorder = Recorder::default();
    let outcome = gpt_pretrain::train::run_observed::<Autodiff<DistributedBackend<Flex>>>(
        &args,
        &mut ddp,
        &FlexDevice,
        &|zero, _| Ok(zero),
        Some(&mut recorder),
    )
    .unwrap();
    // Stopped after step 3 of 6, evaluated as a last step is.
    assert_eq!(outcome.steps, 3);
    assert!(outcome.final_val_loss.is_some());
    let records = gpt_pretrain::metrics::read(&metrics).unwrap();
    assert_eq!(records.len(), 3);

    let names: Vec<String> = recorder
        .0
        .iter()
        .map(|e| match &e.phase {
            Phase::Step { step, split, .. } => format!("step {step} split {}", split.is_some()),
            other => format!("{other:?}"),
        })
        .collect();
    assert_eq!(
        names,
        [
            "ModelBuilt",
            "FirstForward",
            "FirstBackward",
            "FirstOptimizerStep",
            "step 1 split true",
            "step 2 split true",
            "step 3 split false",
            &format!(
                "Evaluated {{ step: 3, val_loss: {:?} }}",
                outcome.final_val_loss.unwrap()
            ),
        ]
    );
    // Elapsed times only grow. A step's time runs from the end of the step before it (or of
    // the model's build), its first-step parts inside it; any other phase's from the phase
    // before.
    assert!(matches!(recorder.0[0].phase, Phase::ModelBuilt));
    let mut step_began = recorder.0[0].elapsed_s;
    for pair in recorder.0.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        assert!(b.elapsed_s >= a.elapsed_s, "{a:?} then {b:?}");
        let from = match b.phase {
            Phase::Step { .. } => step_began,
            _ => a.elapsed_s,
        };
        assert!(
            (b.elapsed_s - from - b.took_s).abs() < 1e-6,
            "{a:?} then {b:?}"
        );
        if matches!(
            b.phase,
            Phase::ModelBuilt | Phase::Step { .. } | Phase::Evaluated { .. }
        ) {
            step_began = b.elapsed_s;
        }
    }

    // A split step's parts were measured within it.
    for event in &recorder.0 {
        if let Phase::Step {
            split: Some(split), ..
        } = &event.phase
        {
            let parts = split.forward_s + split.backward_s + split.optimizer_s;
            assert!(
                parts > 0.0 && parts <= event.took_s,
                "{event:?}: parts of {parts} s"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_phase_log_prints_each_phase_with_its_time() {
    let dir = scratch_dir("gpt-phase-log");
    let output = Command::new(env!("CARGO_BIN_EXE_gpt-pretrain"))
        .args(common::RUN)
        .args(["--steps", "2", "--phase-log", "--run-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    let phases: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("phase "))
        .map(|l| l.split([':', '(']).next().unwrap().trim_end())
        .collect();
    assert_eq!(
        phases,
        [
            "model built",
            "first forward",
            "first backward",
            "first optimizer step",
            "step 1",
            "step 2",
            "evaluation after step 2",
        ],
        "{stdout}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
