//! ZeRO stage 3's checkpoints: saved with no rank holding the model (its trainable values are
//! the shards' master weights), resumed at other world sizes and at stage 1, loaded from a
//! stage-2 checkpoint, exported to one safetensors file equal to the consolidated state; a
//! load that fails on one rank changes no rank's model.

use std::path::Path;

use burn_dist_zero::ZeroAdam;
use burn_dist_zero::checkpoint::{self, MODEL_FILE, Weights};
use safetensors::SafeTensors;

use super::*;

/// The uninterrupted stage-3 run of `world` ranks, which saves at [`SAVE_AT`] under `root`.
fn stage3_reference(root: &std::path::Path, world: usize) -> Vec<super::Outcome> {
    train(Plan {
        world,
        seed: SEED,
        save: Some((root, &[SAVE_AT])),
        until: STEPS,
        stage: 3,
        ..Default::default()
    })
}

fn resumed(root: &std::path::Path, world: usize, stage: u8) -> Vec<super::Outcome> {
    train(Plan {
        world,
        seed: OTHER_SEED,
        resume: Some(root),
        until: STEPS,
        stage,
        ..Default::default()
    })
}

#[test]
fn a_stage_three_checkpoint_of_4_ranks_resumes_at_4_and_2_ranks_and_at_stage_1_on_1() {
    let root = tempfile::tempdir().unwrap();
    let uninterrupted = stage3_reference(root.path(), 4);
    let dir = checkpoint::step_dir(root.path(), SAVE_AT);
    let manifest = checkpoint::Manifest::read(&dir).unwrap();
    assert_eq!(manifest.weights, Weights::MasterShards);
    // Rank 0 wrote no trainable tensor: it never held them.
    let model = std::fs::read(dir.join(MODEL_FILE)).unwrap();
    let model = SafeTensors::deserialize(&model).unwrap();
    for p in &manifest.params {
        assert!(
            model.tensor(&p.name).is_err(),
            "{} is in the model file",
            p.name
        );
    }

    let same = resumed(root.path(), 4, 3);
    for (rank, (a, b)) in same.iter().zip(&uninterrupted).enumerate() {
        assert!(
            a.params == b.params,
            "rank {rank}: resumed at 4 ranks, parameters differ"
        );
        assert!(a.shard == b.shard, "rank {rank}: optimizer state differs");
    }
    for (world, stage) in [(2, 3), (1, 1)] {
        let what = format!("resumed at {world} ranks, stage {stage}");
        let run = resumed(root.path(), world, stage);
        assert_close(&run[0].params, &uninterrupted[0].params, 1e-5, &what);
        assert!(
            run.iter().all(|r| r.params == run[0].params),
            "{what}: ranks differ"
        );
    }
}

#[test]
fn a_stage_two_checkpoint_loads_into_stage_three_and_continues_bit_for_bit() {
    let root = tempfile::tempdir().unwrap();
    let stage2 = train(Plan {
        world: 2,
        seed: SEED,
        save: Some((root.path(), &[SAVE_AT])),
        until: STEPS,
        stage: 2,
        ..Default::default()
    });
    let manifest = checkpoint::Manifest::read(&checkpoint::step_dir(root.path(), SAVE_AT)).unwrap();
    assert_eq!(manifest.weights, Weights::ModelFile);
    let into_stage3 = resumed(root.path(), 2, 3);
    for (rank, (a, b)) in into_stage3.iter().zip(&stage2).enumerate() {
        assert!(a.params == b.params, "rank {rank}: parameters differ");
        assert!(a.shard == b.shard, "rank {rank}: optimizer state differs");
    }
}

#[test]
fn the_export_of_a_stage_three_checkpoint_equals_consolidate_and_the_cli_writes_it() {
    let root = tempfile::tempdir().unwrap();
    stage3_reference(root.path(), 3);
    let out = tempfile::tempdir().unwrap();
    let (exported, consolidated) = (
        out.path().join("model.safetensors"),
        out.path().join("full.safetensors"),
    );
    let manifest = checkpoint::export(root.path(), &exported).unwrap();
    checkpoint::consolidate(root.path(), &consolidated).unwrap();
    let exported = std::fs::read(&exported).unwrap();
    let consolidated = std::fs::read(&consolidated).unwrap();
    let (exported, consolidated) = (
        SafeTensors::deserialize(&exported).unwrap(),
        SafeTensors::deserialize(&consolidated).unwrap(),
    );
    for p in &manifest.params {
        let (a, b) = (
            exported.tensor(&p.name).unwrap(),
            consolidated.tensor(&p.name).unwrap(),
        );
        assert_eq!(a.shape(), b.shape(), "{}", p.name);
        assert_eq!(
            a.data(),
            b.data(),
            "{}: the export differs from the master weights",
            p.name
        );
    }
    // Every tensor of the model: the trainable ones and the rest (none in this MLP).
    assert_eq!(exported.len(), manifest.params.len());

    let cli = out.path().join("cli.safetensors");
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_burn-dist-ckpt"))
        .arg("export")
        .arg(root.path())
        .arg(&cli)
        .status()
        .unwrap();
    assert!(status.success());
    assert_eq!(
        std::fs::read(&cli).unwrap(),
        std::fs::read(out.path().join("model.safetensors")).unwrap()
    );
}

type Stage3 = Autodiff<DistributedBackend<Flex, Sharded>>;

/// What one rank saw around a checkpoint load that must fail at stage 3.
struct AfterFailedLoad {
    error: Option<String>,
    /// The model's parameters and the optimizer's shard before the load and after it failed.
    before: (Vec<Vec<f32>>, OptimizerShard),
    after: (Vec<Vec<f32>>, OptimizerShard),
    /// The parameters after one more step, taken from the model as it was after the failure.
    next_step: Vec<Vec<f32>>,
}

/// One ZeroAdam step of `model` on step `step`'s rows of this rank.
fn one_step(ddp: &mut Ddp, zero: &mut ZeroAdam, model: Mlp<Stage3>, step: u64) -> Mlp<Stage3> {
    let rows = shard_rows(GLOBAL_BATCH, ddp.rank(), ddp.world_size());
    let grads = ddp
        .backward(loss::<Stage3>(&model, step, rows), &model)
        .unwrap()
        .unwrap();
    zero.step(1e-2, model, grads, ddp).unwrap().0
}

/// `world` thread ranks at stage 3: a fresh model trains one step, tries to load `path`
/// (which must fail; `None`: tries nothing), and trains one more step with the model it kept.
fn load_failing_at_stage_3(world: usize, path: Option<&Path>) -> Vec<AfterFailedLoad> {
    run_ranks(
        HostCommunicator::local_group(world, &CommConfig::default()),
        |rank, comm| {
            let mut ddp = Ddp::for_thread(comm, DdpConfig::new());
            let model = Mlp::<Stage3>::new(&MLP_SIZES, OTHER_SEED, &FlexDevice);
            let model = ddp.prepare_sharded(model).unwrap();
            let mut zero = ZeroAdamConfig::new()
                .with_stage(3)
                .init::<Stage3, _>(&ddp, &model)
                .unwrap();
            let model = one_step(&mut ddp, &mut zero, model, 0);
            let snapshot = |model: &Mlp<Stage3>, zero: &ZeroAdam| {
                (parameters::<Stage3, _>(model), zero.export())
            };
            let before = snapshot(&model, &zero);
            let error =
                path.map(
                    |path| match checkpoint::load(path, &ddp, model.clone(), &mut zero) {
                        Ok(_) => panic!("rank {rank}: the load of a damaged checkpoint succeeded"),
                        Err(error) => error.to_string(),
                    },
                );
            let after = snapshot(&model, &zero);
            let next_step = parameters::<Stage3, _>(&one_step(&mut ddp, &mut zero, model, 1));
            AfterFailedLoad {
                error,
                before,
                after,
                next_step,
            }
        },
    )
}

#[test]
fn a_checkpoint_load_that_fails_on_one_rank_leaves_every_ranks_stage_3_model_as_it_was() {
    // A stage-2 checkpoint, whose model file holds every weight (each rank cuts its pieces out
    // of it), with rank 1's optimizer shard corrupted; and a stage-3 checkpoint with rank 1's
    // shard missing. Only rank 1 reads its shard, and the others would have written their
    // pieces before it found out.
    let (stage2, stage3) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    for (root, stage) in [(&stage2, 2), (&stage3, 3)] {
        train(Plan {
            world: 3,
            seed: SEED,
            save: Some((root.path(), &[SAVE_AT])),
            until: SAVE_AT,
            stage,
            ..Default::default()
        });
    }
    let shard = "optim-rank-00001.bin";
    let (_corrupted, corrupted) = copy_checkpoint(&checkpoint::step_dir(stage2.path(), SAVE_AT));
    let mut bytes = std::fs::read(corrupted.join(shard)).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x10;
    std::fs::write(corrupted.join(shard), bytes).unwrap();
    let (_missing, missing) = copy_checkpoint(&checkpoint::step_dir(stage3.path(), SAVE_AT));
    std::fs::remove_file(missing.join(shard)).unwrap();

    // The reference: the same two steps with no load tried between them.
    let reference = load_failing_at_stage_3(3, None);
    for (what, dir) in [("corrupted", &corrupted), ("missing", &missing)] {
        for (rank, run) in load_failing_at_stage_3(3, Some(dir)).iter().enumerate() {
            let what = format!("rank 1's shard {what}, rank {rank}");
            let error = run.error.as_deref().expect("a load was tried");
            assert!(error.contains(shard), "{what}: {error}");
            if rank != 1 {
                assert!(error.starts_with("rank 1: "), "{what}: {error}");
            }
            assert!(
                run.after.0 == run.before.0,
                "{what}: the failed load changed the model"
            );
            assert!(
                run.after.1 == run.before.1,
                "{what}: the failed load changed the optimizer"
            );
            assert!(
                run.next_step == reference[rank].next_step,
                "{what}: the step after the failed load differs from one with no load tried"
            );
        }
    }
}
