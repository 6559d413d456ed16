//! Sharded checkpoints: exact resume, resharding to other world sizes, refusal of damaged
//! checkpoints, consolidation and atomicity; checkpoints as untrusted input (`untrusted.rs`);
//! failing disks, ranks without a shared directory and retention (`disk.rs`); checkpoints of
//! any Burn optimizer (`any_optimizer.rs`); saves written in the background (`async_save.rs`).

mod any_optimizer;
mod async_save;
mod disk;
mod stage3;
mod untrusted;

use std::path::{Path, PathBuf};

use burn::backend::Autodiff;
use burn::tensor::Tensor;
use burn_dist::{
    Ddp, DdpConfig, DistributedAutodiff, DistributedBackend, GradScalerConfig, Sharded,
};
use burn_dist_comm::testing::run_ranks;
use burn_dist_comm::{CommConfig, HostCommunicator};
use burn_dist_testing::{MLP_SIZES, Mlp, assert_close, parameters, shard_rows, synthetic_rows};
use burn_dist_zero::checkpoint::{
    self, AsyncSaver, CheckpointError, MANIFEST, MODEL_FILE, SaveStage, TrainingState,
};
use burn_dist_zero::{OptimizerShard, ZeroAdamConfig};
use burn_flex::{Flex, FlexDevice};
use safetensors::{Dtype, SafeTensors};

type B = Autodiff<DistributedBackend<Flex>>;

/// Divisible by every world size used here, so every world size trains on the same batches.
const GLOBAL_BATCH: usize = 12;
const SAVE_AT: u64 = 3;
const STEPS: u64 = 6;
const SEED: u64 = 7;
/// Fresh models of resumed runs start elsewhere, to prove the state comes from the files.
const OTHER_SEED: u64 = 99;

fn loss<Bk: DistributedAutodiff<Device = FlexDevice>>(
    model: &Mlp<Bk>,
    step: u64,
    rows: std::ops::Range<usize>,
) -> Tensor<Bk, 1> {
    let [input, .., output] = MLP_SIZES;
    let step = step as usize;
    let x = synthetic_rows::<Bk, 2>(0, step, [GLOBAL_BATCH, input], rows.clone(), &FlexDevice);
    let y = synthetic_rows::<Bk, 2>(1, step, [GLOBAL_BATCH, output], rows, &FlexDevice);
    (model.forward(x) - y).powi_scalar(2).mean()
}

/// One rank's result of [`train`].
#[derive(Debug, Clone)]
struct Outcome {
    /// Parameters and optimizer shard after the last step.
    params: Vec<Vec<f32>>,
    shard: OptimizerShard,
    scaler: (f32, u32),
    /// The optimizer shard right after a load (before any step), or when saving.
    snapshot: Option<OptimizerShard>,
    /// What `load` returned.
    loaded: Option<TrainingState>,
    /// The buckets (parameters in each) at the end, and how often they were rebuilt.
    buckets: Vec<Vec<usize>>,
    layout_rebuilds: u64,
    /// The save that failed (training stopped there).
    save_failure: Option<SaveFailure>,
    /// Per asynchronous save: its step and what its snapshot held (`AsyncSaver::pending`,
    /// `AsyncSaver::snapshot_bytes`).
    snapshot_bytes: Vec<(Option<u64>, u64)>,
}

/// A failed save's typed error, taken apart.
#[derive(Debug, Clone)]
struct SaveFailure {
    stage: SaveStage,
    step: u64,
    message: String,
}

#[derive(Clone, Copy, Default)]
struct Plan<'a> {
    world: usize,
    seed: u64,
    resume: Option<&'a Path>,
    /// Where to save, and after which steps.
    save: Option<(&'a Path, &'a [u64])>,
    until: u64,
    /// An injected disk fault (`checkpoint::FAULT_VAR`'s syntax) on one rank.
    fault: Option<(usize, &'a str)>,
    /// Every rank saves under its own `<root>/rank-<r>`, as nodes without a shared filesystem.
    private_roots: bool,
    /// ZeRO stage (0 for the default, 1); at 3 the model is sharded too.
    stage: u8,
    /// Saves through `checkpoint::AsyncSaver` (polled after every step, waited for at the
    /// end) instead of `checkpoint::save`.
    asynchronous: bool,
}

impl SaveFailure {
    fn of(error: CheckpointError, rank: usize) -> SaveFailure {
        let CheckpointError::Save { stage, step, .. } = error else {
            panic!("rank {rank}: not a save error: {error}");
        };
        SaveFailure {
            stage,
            step,
            message: error.to_string(),
        }
    }
}

/// Where rank `rank` saves: `root`, or its own directory under it (`plan.private_roots`).
fn rank_root(plan: &Plan<'_>, root: &Path, rank: usize) -> PathBuf {
    match plan.private_roots {
        true => root.join(format!("rank-{rank}")),
        false => root.to_path_buf(),
    }
}

/// 2 ranks train 2 steps and save a checkpoint of step 2 under `root`.
fn saved_at_step_2(root: &Path) -> Vec<Outcome> {
    train(Plan {
        world: 2,
        seed: SEED,
        save: Some((root, &[2])),
        until: 2,
        ..Default::default()
    })
}

/// Trains an MLP with ZeroAdam and a loss scaler on `plan.world` thread ranks, optionally
/// resuming from a checkpoint first and saving on the way; stops at a failed save.
fn train(plan: Plan<'_>) -> Vec<Outcome> {
    match plan.stage {
        3 => train_on::<Autodiff<DistributedBackend<Flex, Sharded>>>(plan),
        _ => train_on::<B>(plan),
    }
}

/// [`train`] on the backend `Bk` (its mode: replicated or sharded).
fn train_on<Bk: DistributedAutodiff<Device = FlexDevice>>(plan: Plan<'_>) -> Vec<Outcome> {
    let world = plan.world;
    run_ranks(
        HostCommunicator::local_group(world, &CommConfig::default()),
        |rank, comm| {
            let mut ddp = Ddp::for_thread(comm, DdpConfig::new());
            let model = Mlp::<Bk>::new(&MLP_SIZES, plan.seed, &FlexDevice);
            let mut model = Bk::prepare_model(&mut ddp, model).unwrap();
            let mut zero = ZeroAdamConfig::new()
                .with_stage(plan.stage.max(1))
                .init::<Bk, _>(&ddp, &model)
                .unwrap();
            let mut scaler = GradScalerConfig::new().with_growth_interval(2).init();
            let (mut start, mut snapshot, mut loaded, mut save_failure) = (0, None, None, None);
            let mut snapshot_bytes = Vec::new();
            if let Some((faulty, spec)) = plan.fault
                && faulty == rank
            {
                checkpoint::inject_fault_on_this_thread(Some(spec));
            }
            if let Some(path) = plan.resume {
                let (m, state) = checkpoint::load(path, &ddp, model, &mut zero).unwrap();
                model = m;
                scaler = state.restore_scaler(scaler);
                assert_eq!(state.samples_consumed, state.step * GLOBAL_BATCH as u64);
                start = state.step;
                snapshot = Some(zero.export());
                loaded = Some(state);
            }
            let mut saver = plan.save.and_then(|(root, _)| {
                plan.asynchronous
                    .then(|| AsyncSaver::new(rank_root(&plan, root, rank)))
            });
            for step in start..plan.until {
                ddp.set_step(step);
                let l = scaler.scale_loss(loss::<Bk>(
                    &model,
                    step,
                    shard_rows(GLOBAL_BATCH, rank, world),
                ));
                let grads = ddp.backward(l, &model).unwrap().unwrap();
                model = zero
                    .step_scaled(1e-2, model, grads, &ddp, &mut scaler)
                    .unwrap()
                    .0;
                let done = step + 1;
                if let Some(saver) = &mut saver
                    && let Err(error) = saver.poll(&ddp)
                {
                    save_failure = Some(SaveFailure::of(error, rank));
                    break;
                }
                if let Some((root, at)) = plan.save
                    && at.contains(&done)
                {
                    let state = TrainingState::new(done, done * GLOBAL_BATCH as u64)
                        .with_scaler(&scaler)
                        .with_random(0, done);
                    let saved = match &mut saver {
                        Some(saver) => saver.save(&ddp, &model, &zero, &state).map(|()| {
                            snapshot_bytes.push((saver.pending(), saver.snapshot_bytes()))
                        }),
                        None => {
                            let root = rank_root(&plan, root, rank);
                            checkpoint::save(&root, &ddp, &model, &zero, &state).map(|_| ())
                        }
                    };
                    match saved {
                        Ok(()) => snapshot = Some(zero.export()),
                        Err(error) => {
                            save_failure = Some(SaveFailure::of(error, rank));
                            break;
                        }
                    }
                }
            }
            if let Some(saver) = &mut saver
                && save_failure.is_none()
                && let Err(error) = saver.wait(&ddp)
            {
                save_failure = Some(SaveFailure::of(error, rank));
            }
            Outcome {
                params: parameters::<Bk, _>(&model),
                shard: zero.export(),
                scaler: (scaler.scale(), scaler.growth_tracker()),
                snapshot,
                loaded,
                buckets: ddp.next_layout().bucket_params(),
                layout_rebuilds: ddp.stats().layout_rebuilds,
                save_failure,
                snapshot_bytes,
            }
        },
    )
}

/// The uninterrupted 2-rank run, which saves at [`SAVE_AT`] under `root`.
fn reference(root: &Path) -> Vec<Outcome> {
    train(Plan {
        world: 2,
        seed: SEED,
        save: Some((root, &[SAVE_AT])),
        until: STEPS,
        ..Default::default()
    })
}

/// Master weights, m and v of every rank's shard joined, padding dropped.
fn joined(shards: &[OptimizerShard]) -> [Vec<f32>; 3] {
    let total = shards[0].layout.total;
    let join = |f: fn(&OptimizerShard) -> &Vec<f32>| -> Vec<f32> {
        let mut out: Vec<f32> = shards.iter().flat_map(|s| f(s).iter().copied()).collect();
        out.truncate(total);
        out
    };
    [join(|s| &s.master), join(|s| &s.m), join(|s| &s.v)]
}

fn snapshots(outcomes: &[Outcome]) -> Vec<OptimizerShard> {
    outcomes
        .iter()
        .map(|o| o.snapshot.clone().unwrap())
        .collect()
}

#[test]
fn resume_is_bitwise_identical() {
    let root = tempfile::tempdir().unwrap();
    let uninterrupted = reference(root.path());
    let fresh = train(Plan {
        world: 2,
        seed: OTHER_SEED,
        until: 0,
        ..Default::default()
    });
    assert_ne!(fresh[0].params, uninterrupted[0].params);

    let resumed = train(Plan {
        world: 2,
        seed: OTHER_SEED,
        resume: Some(root.path()),
        until: STEPS,
        ..Default::default()
    });
    let manifest = checkpoint::Manifest::read(&checkpoint::step_dir(root.path(), SAVE_AT)).unwrap();
    for (rank, (a, b)) in resumed.iter().zip(&uninterrupted).enumerate() {
        assert!(a.params == b.params, "rank {rank}: parameters differ");
        assert!(a.shard == b.shard, "rank {rank}: optimizer state differs");
        assert_eq!(a.scaler, b.scaler, "rank {rank}: loss scaler");
        assert_eq!(a.loaded.unwrap().step, SAVE_AT);
        // The tuned buckets come back from the manifest: no rebuild after the resume.
        assert_eq!(
            b.layout_rebuilds, 1,
            "rank {rank}: the first run tunes its buckets"
        );
        assert_eq!(manifest.buckets, b.buckets, "rank {rank}: saved buckets");
        assert_eq!(a.buckets, b.buckets, "rank {rank}: restored buckets");
        assert_eq!(
            a.layout_rebuilds, 0,
            "rank {rank}: no rebuild after a resume"
        );
    }
}

#[test]
fn resharding_is_exact_at_any_world_size() {
    let root = tempfile::tempdir().unwrap();
    let uninterrupted = reference(root.path());
    let saved = joined(&snapshots(&uninterrupted));
    let full = checkpoint::read_full(root.path()).unwrap();
    assert!(
        [full.master, full.m, full.v] == saved,
        "read_full joins the shards"
    );

    for world in [1, 3, 4] {
        let resumed = train(Plan {
            world,
            seed: OTHER_SEED,
            resume: Some(root.path()),
            until: STEPS,
            ..Default::default()
        });
        let loaded = snapshots(&resumed);
        assert_eq!(loaded.len(), world);
        assert!(
            joined(&loaded) == saved,
            "{world} ranks: the resharded state differs from the saved one"
        );
        assert!(loaded.iter().all(|s| {
            s.time == loaded[0].time
                && s.time
                    == uninterrupted[0]
                        .shard
                        .time
                        .iter()
                        .map(|&t| t - (STEPS - SAVE_AT) as u32)
                        .collect::<Vec<_>>()
        }));
        let what = format!("resumed at {world} ranks");
        assert_close(&resumed[0].params, &uninterrupted[0].params, 1e-5, &what);
        for rank in 1..world {
            assert!(
                resumed[rank].params == resumed[0].params,
                "{world} ranks: rank {rank} diverged"
            );
        }
    }
}

/// Loads `path` at 2 ranks into fresh models; every rank's error.
fn load_errors(path: &Path) -> Vec<String> {
    run_ranks(
        HostCommunicator::local_group(2, &CommConfig::default()),
        |_, comm| {
            let mut ddp = Ddp::for_thread(comm, DdpConfig::new());
            let model = ddp
                .prepare(Mlp::<B>::new(&MLP_SIZES, OTHER_SEED, &FlexDevice))
                .unwrap();
            let mut zero = ZeroAdamConfig::new().init::<B, _>(&ddp, &model).unwrap();
            match checkpoint::load(path, &ddp, model, &mut zero) {
                Ok(_) => "loaded".to_string(),
                Err(e) => e.to_string(),
            }
        },
    )
}

/// A copy of the step directory `src` under a fresh root, to damage.
fn copy_checkpoint(src: &Path) -> (tempfile::TempDir, PathBuf) {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join(src.file_name().unwrap());
    std::fs::create_dir(&dir).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
    }
    (root, dir)
}

fn assert_refused(errors: &[String], needles: &[&str]) {
    for (rank, error) in errors.iter().enumerate() {
        for needle in needles {
            assert!(
                error.contains(needle),
                "rank {rank}: `{error}` does not mention `{needle}`"
            );
        }
    }
}

/// A complete 2-rank checkpoint of step 1 under a fresh root (kept alive by the `TempDir`).
fn good_checkpoint() -> (tempfile::TempDir, PathBuf) {
    let root = tempfile::tempdir().unwrap();
    train(Plan {
        world: 2,
        seed: SEED,
        save: Some((root.path(), &[1])),
        until: 1,
        ..Default::default()
    });
    let dir = checkpoint::step_dir(root.path(), 1);
    (root, dir)
}

#[test]
fn damaged_checkpoints_are_refused_naming_the_file() {
    let (_root, good) = good_checkpoint();
    assert_eq!(load_errors(&good), ["loaded", "loaded"]);

    // A flipped byte in a shard and in the weights.
    for name in ["optim-rank-00001.bin", MODEL_FILE] {
        let (_keep, dir) = copy_checkpoint(&good);
        let path = dir.join(name);
        let mut bytes = std::fs::read(&path).unwrap();
        let at = bytes.len() / 2;
        bytes[at] ^= 0x10;
        std::fs::write(&path, bytes).unwrap();
        assert_refused(&load_errors(&dir), &[name, "checksum mismatch"]);
    }

    // A truncated shard.
    let (_keep, dir) = copy_checkpoint(&good);
    let path = dir.join("optim-rank-00000.bin");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    let errors = load_errors(&dir);
    assert_refused(&errors, &["optim-rank-00000.bin", "truncated"]);
    assert!(
        errors[1].starts_with("rank 0:"),
        "names the failing rank: {}",
        errors[1]
    );

    // No manifest: incomplete, by directory and by root.
    let (keep, dir) = copy_checkpoint(&good);
    std::fs::remove_file(dir.join(MANIFEST)).unwrap();
    assert_refused(&load_errors(&dir), &[dir.to_str().unwrap(), "incomplete"]);
    assert_refused(&load_errors(keep.path()), &["no complete checkpoint"]);

    // A manifest from a newer format.
    let (_keep, dir) = copy_checkpoint(&good);
    let path = dir.join(MANIFEST);
    let text = std::fs::read_to_string(&path).unwrap();
    let newer = text.replace("\"format_version\": 2", "\"format_version\": 3");
    assert_ne!(text, newer);
    std::fs::write(&path, newer).unwrap();
    assert_refused(&load_errors(&dir), &["manifest.json", "format version 3"]);
}

#[test]
fn consolidation_holds_the_gathered_state() {
    let root = tempfile::tempdir().unwrap();
    let outcomes = saved_at_step_2(root.path());
    let [master, m, v] = joined(&snapshots(&outcomes));
    let out = root.path().join("full.safetensors");
    checkpoint::consolidate(root.path(), &out).unwrap();

    let bytes = std::fs::read(&out).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let manifest = checkpoint::Manifest::read(&checkpoint::step_dir(root.path(), 2)).unwrap();
    assert_eq!(file.len(), 3 * manifest.params.len());
    let mut at = 0;
    for p in &manifest.params {
        let n: usize = p.shape.iter().product();
        for (suffix, flat) in [("", &master), (".exp_avg", &m), (".exp_avg_sq", &v)] {
            let tensor = file.tensor(&format!("{}{suffix}", p.name)).unwrap();
            assert_eq!(tensor.dtype(), Dtype::F32);
            assert_eq!(tensor.shape(), p.shape.as_slice());
            let values: Vec<f32> = bytemuck::pod_collect_to_vec(tensor.data());
            assert!(values == flat[at..at + n], "{}{suffix}", p.name);
        }
        at += n;
    }
    assert_eq!(at, master.len());

    // The model weights are plain safetensors too, named by path, in the model's dtype.
    let bytes = std::fs::read(checkpoint::step_dir(root.path(), 2).join(MODEL_FILE)).unwrap();
    let weights = SafeTensors::deserialize(&bytes).unwrap();
    assert!(manifest.params.iter().any(|p| p.name == "layers.0.weight"));
    for (p, values) in manifest.params.iter().zip(&outcomes[0].params) {
        let tensor = weights.tensor(&p.name).unwrap();
        assert_eq!(tensor.dtype(), Dtype::F32);
        let stored: Vec<f32> = bytemuck::pod_collect_to_vec(tensor.data());
        assert!(&stored == values, "{}", p.name);
    }
}

#[test]
fn an_interrupted_save_leaves_the_previous_checkpoint_latest() {
    let root = tempfile::tempdir().unwrap();
    saved_at_step_2(root.path());
    // A later save that wrote its shards but crashed before the manifest: simulated by a
    // complete save with its manifest removed, and one that wrote a single shard.
    train(Plan {
        world: 2,
        seed: SEED,
        save: Some((root.path(), &[4])),
        until: 4,
        ..Default::default()
    });
    std::fs::remove_file(checkpoint::step_dir(root.path(), 4).join(MANIFEST)).unwrap();
    let partial = checkpoint::step_dir(root.path(), 6);
    std::fs::create_dir(&partial).unwrap();
    std::fs::write(partial.join("optim-rank-00000.bin"), b"BDZSHARD").unwrap();

    let latest = checkpoint::latest(root.path()).unwrap().unwrap();
    assert_eq!(latest, checkpoint::step_dir(root.path(), 2));
    let resumed = train(Plan {
        world: 2,
        seed: OTHER_SEED,
        resume: Some(root.path()),
        until: 2,
        ..Default::default()
    });
    assert_eq!(resumed[0].loaded.unwrap().step, 2);
}

#[test]
fn the_cli_inspects_and_consolidates() {
    let root = tempfile::tempdir().unwrap();
    let outcomes = saved_at_step_2(root.path());
    let cli = |args: &[&std::ffi::OsStr]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_burn-dist-ckpt"))
            .args(args)
            .output()
            .unwrap()
    };
    let inspect = cli(&["inspect".as_ref(), root.path().as_os_str()]);
    let stdout = String::from_utf8_lossy(&inspect.stdout);
    assert!(inspect.status.success(), "{inspect:?}");
    for needle in [
        "step         2",
        "world size   2",
        "layers.0.weight",
        "optim-rank-00001.bin",
        "verified",
    ] {
        assert!(
            stdout.contains(needle),
            "inspect output lacks `{needle}`:\n{stdout}"
        );
    }

    let out = root.path().join("full.safetensors");
    let consolidate = cli(&[
        "consolidate".as_ref(),
        root.path().as_os_str(),
        out.as_os_str(),
    ]);
    assert!(consolidate.status.success(), "{consolidate:?}");
    let bytes = std::fs::read(&out).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let [master, ..] = joined(&snapshots(&outcomes));
    let first: Vec<f32> =
        bytemuck::pod_collect_to_vec(file.tensor("layers.0.weight").unwrap().data());
    assert!(first == master[..first.len()]);

    // A damaged shard: the summary, then an error naming the file, and a failure status.
    let shard = checkpoint::step_dir(root.path(), 2).join("optim-rank-00001.bin");
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[200] ^= 1;
    std::fs::write(&shard, bytes).unwrap();
    let inspect = cli(&["inspect".as_ref(), root.path().as_os_str()]);
    let stderr = String::from_utf8_lossy(&inspect.stderr);
    assert!(!inspect.status.success());
    assert!(
        stderr.contains("optim-rank-00001.bin") && stderr.contains("checksum"),
        "{stderr}"
    );
}
