//! Checkpoints of any Burn optimizer (`checkpoint::save_optimizer` / `load_optimizer`): the
//! model, the optimizer's record (written once, by rank 0) and the training state under the
//! same manifest; resumed exactly at the same world size and at another.

use std::path::Path;

use burn::optim::{AdamWConfig, Optimizer};
use burn_dist::{Ddp, DdpConfig};
use burn_dist_comm::testing::run_ranks;
use burn_dist_comm::{CommConfig, HostCommunicator};
use burn_dist_testing::{MLP_SIZES, Mlp, assert_close, parameters, shard_rows};
use burn_dist_zero::ZeroAdamConfig;
use burn_dist_zero::checkpoint::{
    self, MANIFEST, Manifest, OPTIMIZER_FILE, OptimizerState, TrainingState,
};
use burn_flex::FlexDevice;

use super::{B, GLOBAL_BATCH, OTHER_SEED, SAVE_AT, SEED, STEPS, loss};

/// Trains with Burn's AdamW on `world` thread ranks from step 0 (saving the step [`SAVE_AT`]
/// checkpoint under `save`) or from the checkpoint at `resume`, until [`STEPS`]; returns every
/// rank's final parameters.
fn train_adamw(world: usize, save: Option<&Path>, resume: Option<&Path>) -> Vec<Vec<Vec<f32>>> {
    run_ranks(
        HostCommunicator::local_group(world, &CommConfig::default()),
        |rank, comm| {
            let mut ddp = Ddp::for_thread(comm, DdpConfig::new());
            let seed = if resume.is_some() { OTHER_SEED } else { SEED };
            let mut model = ddp
                .prepare(Mlp::<B>::new(&MLP_SIZES, seed, &FlexDevice))
                .unwrap();
            let mut optim = ddp.optimizer(AdamWConfig::new().init());
            let mut start = 0;
            if let Some(path) = resume {
                let (m, o, state) = checkpoint::load_optimizer(path, &ddp, model, optim).unwrap();
                (model, optim, start) = (m, o, state.step);
                assert_eq!(state.samples_consumed, state.step * GLOBAL_BATCH as u64);
            }
            for step in start..STEPS {
                ddp.set_step(step);
                let l = loss(&model, step, shard_rows(GLOBAL_BATCH, rank, world));
                let grads = ddp.backward(l, &model).unwrap().unwrap();
                model = optim.step(1e-2, model, grads);
                if let (Some(root), SAVE_AT) = (save, step + 1) {
                    let state = TrainingState::new(SAVE_AT, SAVE_AT * GLOBAL_BATCH as u64);
                    checkpoint::save_optimizer(root, &ddp, &model, &optim, &state).unwrap();
                }
            }
            parameters::<B, _>(&model)
        },
    )
}

#[test]
fn a_burn_optimizer_resumes_bitwise_at_the_same_world_size_and_exactly_at_another() {
    let root = tempfile::tempdir().unwrap();
    let reference = train_adamw(2, Some(root.path()), None);

    let dir = checkpoint::latest(root.path())
        .unwrap()
        .expect("a checkpoint");
    let manifest = Manifest::read(&dir).unwrap();
    assert_eq!(manifest.optimizer, OptimizerState::Record);
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [MANIFEST, "model.safetensors", OPTIMIZER_FILE],
        "one record, written by rank 0, and no shards"
    );

    let same = train_adamw(2, None, Some(&dir));
    assert_eq!(
        same, reference,
        "resumed on 2 ranks: bitwise the uninterrupted run"
    );
    for world in [1, 3] {
        let other = train_adamw(world, None, Some(&dir));
        for (rank, params) in other.iter().enumerate() {
            assert_close(
                params,
                &reference[0],
                1e-5,
                &format!("resumed on {world} ranks, rank {rank}"),
            );
        }
    }
}

#[test]
fn each_kind_of_checkpoint_is_refused_by_the_other_loader_naming_the_right_one() {
    let root = tempfile::tempdir().unwrap();
    train_adamw(1, Some(root.path()), None);
    let record_dir = checkpoint::latest(root.path()).unwrap().unwrap();
    let sharded = tempfile::tempdir().unwrap();
    let errors = run_ranks(
        HostCommunicator::local_group(1, &CommConfig::default()),
        |_, comm| {
            let mut ddp = Ddp::for_thread(comm, DdpConfig::new());
            let model = ddp
                .prepare(Mlp::<B>::new(&MLP_SIZES, SEED, &FlexDevice))
                .unwrap();
            let mut zero = ZeroAdamConfig::new().init::<B, _>(&ddp, &model).unwrap();
            let as_zero = checkpoint::load(&record_dir, &ddp, model.clone(), &mut zero)
                .err()
                .map(|e| e.to_string());
            let state = TrainingState::new(1, 0);
            checkpoint::save(sharded.path(), &ddp, &model, &zero, &state).unwrap();
            let adam = ddp.optimizer(AdamWConfig::new().init());
            let as_record = checkpoint::load_optimizer(sharded.path(), &ddp, model, adam)
                .err()
                .map(|e| e.to_string());
            (as_zero, as_record)
        },
    );
    let (as_zero, as_record) = &errors[0];
    let as_zero = as_zero
        .as_deref()
        .expect("ZeroAdam loaded a record checkpoint");
    assert!(as_zero.contains("load_optimizer"), "{as_zero}");
    let as_record = as_record.as_deref().expect("a record loaded from shards");
    assert!(as_record.contains("checkpoint::load`"), "{as_record}");
}
