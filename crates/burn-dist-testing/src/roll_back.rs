//! "Roll back to the best model", the program the record tests of ZeroAdam run at every stage,
//! on the host and on the device path: train, keep `model.clone().into_record()` in memory,
//! train on, load the record back, train on again.

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use burn_dist::Ddp;
use burn_dist_zero::ZeroAdam;

use crate::parameters;

/// What [`roll_back`] does right after loading the record back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterLoad {
    /// Nothing: the program a user writes.
    TrainOn,
    /// The reference: gives ZeroAdam the loaded values as its master weights itself
    /// (`ZeroAdam::export`, then `import` with the master weights replaced), keeping its
    /// moments and step counts, so that training goes on from the rolled-back weights with the
    /// same optimizer state whatever ZeroAdam would have done with the load. Every float
    /// parameter of the model must be trainable (the values are taken by visit order).
    ImportLoadedMaster,
}

/// What one rank of [`roll_back`] saw: the parameters when the record was taken, just before
/// it was loaded back, right after, and at the end.
#[derive(Debug, Clone)]
pub struct RolledBack<T> {
    pub at_record: Vec<Vec<f32>>,
    pub before_load: Vec<Vec<f32>>,
    pub loaded: Vec<Vec<f32>>,
    /// What `probe` said of the loaded model.
    pub probed: T,
    pub end: Vec<Vec<f32>>,
}

/// On this rank: `step` (one training step of `model` at its step number, with `ddp` and
/// `zero`) 2 times, keeps `model.clone().into_record()`, 2 more steps, loads the record back
/// (`ddp.mark(model.load_record(kept))`), does what `after_load` says, runs `probe` on the
/// loaded model, and 2 more steps.
pub fn roll_back<B, M, T>(
    ddp: &mut Ddp,
    zero: &mut ZeroAdam,
    model: M,
    mut step: impl FnMut(&mut Ddp, &mut ZeroAdam, M, usize) -> M,
    after_load: AfterLoad,
    probe: impl FnOnce(&M) -> T,
) -> RolledBack<T>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    let mut train = |ddp: &mut Ddp, zero: &mut ZeroAdam, mut model, steps| {
        for s in steps {
            model = step(ddp, zero, model, s);
        }
        model
    };
    let model = train(ddp, zero, model, 0..2);
    let kept = model.clone().into_record();
    let at_record = parameters::<B, _>(&model);
    let model = train(ddp, zero, model, 2..4);
    let before_load = parameters::<B, _>(&model);
    let model = ddp.mark(model.load_record(kept));
    let loaded = parameters::<B, _>(&model);
    if after_load == AfterLoad::ImportLoadedMaster {
        assert_eq!(loaded.len(), ddp.params().len(), "every float is trainable");
        let mut shard = zero.export();
        for piece in zero.layout().pieces(ddp.rank()) {
            shard.master[piece.in_shard].copy_from_slice(&loaded[piece.param][piece.within]);
        }
        zero.import(shard).expect("the state's own layout");
    }
    let probed = probe(&model);
    let model = train(ddp, zero, model, 4..6);
    RolledBack {
        at_record,
        before_load,
        loaded,
        probed,
        end: parameters::<B, _>(&model),
    }
}

/// Asserts, rank by rank, that the load brought the record's values back and that the steps
/// after it ended where `reference` ([`AfterLoad::ImportLoadedMaster`]) ends, bit for bit:
/// training went on from the loaded weights with the same optimizer state.
pub fn assert_trained_on_from_the_load<T>(
    runs: &[RolledBack<T>],
    reference: &[RolledBack<T>],
    what: &str,
) {
    assert_eq!(runs.len(), reference.len(), "{what}: ranks");
    for (rank, (run, reference)) in runs.iter().zip(reference).enumerate() {
        assert!(
            run.before_load != run.at_record && run.loaded == run.at_record,
            "{what}, rank {rank}: the load did not bring the record's values back"
        );
        assert!(
            run.end == reference.end,
            "{what}, rank {rank}: the steps after the load did not go on from the loaded weights \
             (as a run that gives ZeroAdam those as its master weights does)"
        );
    }
}
