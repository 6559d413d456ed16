//! ZeroAdam with its state on a device (`ZeroAdam::on_device`), stepped by the fused kernels,
//! equals the host path and Burn's AdamW, at ZeRO stages 1 and 2, with clipping and with a loss
//! scaler that skips a step. Runs on cubecl's wgpu runtime: Mesa's lavapipe in CI (installed by
//! `.ci/run`); the same code runs on CUDA.

use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use burn_dist::Ddp;
use burn_dist::testing::{BurnAdamW, OptimizerKind, Stepper, Synthetic, assert_close, train_ranks};
use burn_dist::{DdpConfig, DistributedBackend};
use burn_dist_zero::ZeroAdamConfig;
use burn_flex::{Flex, FlexDevice};

type B = Autodiff<DistributedBackend<Flex>>;

const STEPS: usize = 20;
const LR: f64 = 1e-2;
const GLOBAL_BATCH: usize = 12;

/// ZeroAdam with `config`, moved to the wgpu device once built.
struct OnDevice(ZeroAdamConfig);

impl OptimizerKind for OnDevice {
    fn build<B, M>(&self, ddp: &Ddp, model: &M) -> Box<dyn Stepper<B, M>>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B> + 'static,
    {
        let client = burn_dist_kernels::testing::wgpu_client();
        let zero = self
            .0
            .init::<B, M>(ddp, model)
            .and_then(|zero| zero.on_device(client))
            .expect("ZeroAdam on the wgpu device");
        Box::new(zero)
    }
}

fn train(world: usize, optimizer: &(impl OptimizerKind + Sync)) -> Vec<Vec<Vec<f32>>> {
    train_ranks::<B>(
        world,
        &DdpConfig::new(),
        Synthetic::Mlp,
        optimizer,
        STEPS,
        GLOBAL_BATCH,
        LR,
        &FlexDevice,
    )
}

#[test]
fn fused_device_step_equals_the_host_path_and_burn_adamw() {
    let burn = train(1, &BurnAdamW).remove(0);
    for stage in [1, 2] {
        for world in [1, 2, 3] {
            let config = ZeroAdamConfig::new().with_stage(stage);
            let host = train(world, &config.clone());
            let device = train(world, &OnDevice(config));
            let what = format!("stage {stage}, {world} ranks");
            assert!(
                device.iter().all(|r| r == &device[0]),
                "{what}: ranks differ"
            );
            assert_close(
                &device[0],
                &host[0],
                1e-5,
                &format!("{what}: device vs host"),
            );
            assert_close(&device[0], &burn, 1e-5, &format!("{what}: device vs Burn"));
        }
    }
}

#[test]
fn fused_device_step_clips_like_the_host_path() {
    // Far below the gradient norm: every step clips.
    let config = ZeroAdamConfig::new()
        .with_max_grad_norm(Some(1e-3))
        .with_stage(2);
    let host = train(2, &config.clone());
    let device = train(2, &OnDevice(config));
    assert_close(&device[0], &host[0], 1e-5, "clipped, device vs host");
}

#[test]
fn device_state_exports_and_imports_exactly() {
    use burn_dist::testing::{MLP_SIZES, Mlp};
    use burn_dist_comm::{CommConfig, HostCommunicator};
    let comm = HostCommunicator::local_group(1, &CommConfig::default()).remove(0);
    let mut ddp = Ddp::for_thread(comm, DdpConfig::new());
    let model = ddp
        .prepare(Mlp::<B>::new(&MLP_SIZES, 7, &FlexDevice))
        .unwrap();
    let client = burn_dist_kernels::testing::wgpu_client;
    let host = ZeroAdamConfig::new().init::<B, _>(&ddp, &model).unwrap();
    let mut shard = host.export();
    // A state no fresh optimizer has: distinct values everywhere, 5 steps taken.
    for (i, x) in shard.master.iter_mut().enumerate() {
        *x = i as f32 * 0.25 - 3.0;
    }
    shard.m = shard.master.iter().map(|x| x * 0.5).collect();
    shard.v = shard.master.iter().map(|x| x * x).collect();
    shard.time.fill(5);
    let mut device = ZeroAdamConfig::new()
        .init::<B, _>(&ddp, &model)
        .unwrap()
        .on_device(client())
        .unwrap();
    assert_eq!(device.state_len(), host.state_len());
    device.import(shard.clone()).unwrap();
    assert!(
        device.export() == shard,
        "the device round trip changed the state"
    );

    // Uneven per-parameter step counts cannot live in the device's single counter.
    shard.time[0] = 4;
    let error = device.import(shard).unwrap_err().to_string();
    assert!(error.contains("one count for all"), "{error}");
}
