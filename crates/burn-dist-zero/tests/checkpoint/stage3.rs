//! ZeRO stage 3's checkpoints: saved with no rank holding the model (its trainable values are
//! the shards' master weights), resumed at other world sizes and at stage 1, loaded from a
//! stage-2 checkpoint, exported to one safetensors file equal to the consolidated state.

use burn_dist_zero::checkpoint::{self, MODEL_FILE, Weights};
use safetensors::SafeTensors;

use super::{OTHER_SEED, Plan, SAVE_AT, SEED, STEPS, assert_close, train};

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
