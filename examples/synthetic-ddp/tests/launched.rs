//! 2, 3 and 4 real processes through `burn-dist-run` train an MLP and a transformer block to
//! the parameters of one in-process rank on the concatenated batch.

use std::process::Command;

use burn::backend::Autodiff;
use burn_dist::{Ddp, DdpConfig, DistributedBackend};
use burn_dist_comm::{CommConfig, HostCommunicator};
use burn_dist_testing::{BurnAdam, Synthetic, relative_error, train_synthetic};
use burn_flex::{Flex, FlexDevice};

use burn_dist_testing::processes::{
    assert_plain_logs, launch_command, launcher, read_f32s, scratch_dir,
};

type B = Autodiff<DistributedBackend<Flex>>;

const STEPS: usize = 20;

fn reference(task: Synthetic) -> Vec<Vec<f32>> {
    let comm = HostCommunicator::local_group(1, &CommConfig::default()).remove(0);
    let mut ddp = Ddp::for_thread(comm, DdpConfig::new());
    train_synthetic::<B>(
        &mut ddp,
        task,
        &BurnAdam,
        STEPS,
        12,
        1e-2,
        &FlexDevice,
        |_, _| {},
    )
    .unwrap()
}

fn launched(model: &str, world: usize) -> Vec<f32> {
    let out = std::env::temp_dir().join(format!(
        "synthetic-ddp-{}-{model}-{world}.bin",
        std::process::id()
    ));
    let status = Command::new(launcher())
        .args([
            "--nproc-per-node",
            &world.to_string(),
            "--master-port",
            "0",
            "--",
        ])
        .arg(env!("CARGO_BIN_EXE_synthetic-ddp"))
        .args([
            "--model",
            model,
            "--steps",
            &STEPS.to_string(),
            "--global-batch",
            "12",
            "--out",
        ])
        .arg(&out)
        .env("BURN_DIST_TIMEOUT_SECS", "120")
        .status()
        .expect("running burn-dist-run");
    assert!(status.success(), "{model}, {world} ranks: {status}");
    let values = read_f32s(&out);
    std::fs::remove_file(&out).ok();
    values
}

fn processes_equal_reference(task: Synthetic, model: &str) {
    let reference = reference(task);
    for world in 2..=4 {
        let got = launched(model, world);
        assert_eq!(got.len(), reference.iter().map(Vec::len).sum::<usize>());
        let mut at = 0;
        for (i, tensor) in reference.iter().enumerate() {
            let error = relative_error(&got[at..at + tensor.len()], tensor);
            assert!(
                error <= 1e-5,
                "{model}, {world} processes: tensor {i} differs from the reference by {error:e}"
            );
            at += tensor.len();
        }
    }
}

#[test]
fn mlp_processes_through_the_launcher_equal_one_rank_on_the_concatenated_batch() {
    processes_equal_reference(Synthetic::Mlp, "mlp");
}

#[test]
fn transformer_processes_through_the_launcher_equal_one_rank_on_the_concatenated_batch() {
    processes_equal_reference(Synthetic::Transformer, "transformer");
}

/// Off a terminal the ranks' logs are plain text: with stdout and stderr redirected to files,
/// no colour codes, in the lines or in the launcher's `[rank R]` prefixes.
#[test]
fn logs_redirected_to_files_carry_no_colour_codes() {
    let dir = scratch_dir("synthetic-ddp-plain-logs");
    let mut command = launch_command(2, env!("CARGO_BIN_EXE_synthetic-ddp").as_ref());
    command.args(["--model", "mlp", "--steps", "2", "--global-batch", "12"]);
    assert_plain_logs(command, &dir, "synthetic-ddp");
    let _ = std::fs::remove_dir_all(&dir);
}
