//! The fused ZeroAdam step against Burn's stock AdamW on the same backend and size, next to a
//! plain copy of the same bytes in the same run (the bandwidth yardstick).
//!
//! Bytes moved per element, each byte read or written counted once (f32 model copy):
//! pass 1 reads and writes g (8); pass 2 reads master, m, v, g (16) and writes master, m, v and
//! the model copy (16): 40 B. The copy moves 5 f32 per element: 20 B read + 20 B written.
//!
//! - `wgpu/*`: cubecl's wgpu runtime. In CI and on the CPU machines that is Mesa lavapipe, so
//!   these figures are CPU-emulated; the GPU figures come from `cargo xtask gpu-check`.
//! - `cpu/*`: the CPU reference (`burn_dist_kernels::adam_update`) against Burn's `AdamW` on
//!   Flex, the same CPU backend as the tests.
//! - `stock-wgpu` feature: Burn's AdamW on burn-wgpu (the same wgpu runtime); off by default,
//!   since building burn-wgpu would add minutes to CI.
//!
//! Run: `cargo bench -p burn-dist-benches --bench fused_adam` (figures in docs/perf/kernels.md).

use burn::optim::{AdamWConfig, SimpleOptimizer};
use burn::tensor::{Tensor, TensorData};
use burn_dist_kernels::testing::Rng;
use burn_dist_kernels::{FusedAdam, Hyper, ModelCopy, ModelDtype, StepScalars, adam_update};
use burn_flex::{Flex, FlexDevice};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};

/// Elements per shard: 4 Mi (16 MiB per f32 buffer), small enough for lavapipe.
const LEN: usize = 1 << 22;
const STEP_BYTES: u64 = 40 * LEN as u64;

fn scalars() -> StepScalars {
    StepScalars {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        decoupled: true,
        step: 1,
    }
}

fn wgpu(c: &mut Criterion) {
    let fused = FusedAdam::new(burn_dist_kernels::testing::wgpu_client());
    let mut rng = Rng::new(1);
    let master = rng.nonzero_vec(LEN, 1e-2, 2.0);
    let grads = rng.nonzero_vec(LEN, 1e-3, 1.0);
    let zeros = vec![0.0f32; LEN];
    let b = fused.upload(&master, &zeros, &zeros, 0, &grads, 1.0, ModelDtype::F32);
    let src = fused.client().create_from_slice(&vec![1u8; 20 * LEN]);
    let dst = fused.client().empty(20 * LEN);

    let mut group = c.benchmark_group("wgpu");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(STEP_BYTES));
    group.bench_function("copy_same_bytes", |bench| {
        bench.iter(|| {
            fused.copy(&src, &dst, 5 * LEN);
            fused.sync();
        })
    });
    let hyper = Hyper {
        scalars: scalars(),
        max_norm: Some(1.0),
    };
    group.bench_function("fused_step", |bench| {
        bench.iter(|| {
            fused.step(&b, hyper);
            fused.sync();
        })
    });
    #[cfg(feature = "stock-wgpu")]
    {
        use burn::tensor::backend::Backend;
        use burn_wgpu::{Wgpu, WgpuDevice as BurnDevice};
        let device = BurnDevice::default();
        let optim = AdamWConfig::new().with_weight_decay(0.01).build();
        let param = Tensor::<Wgpu, 1>::from_data(TensorData::new(master.clone(), [LEN]), &device);
        let grad = Tensor::<Wgpu, 1>::from_data(TensorData::new(grads.clone(), [LEN]), &device);
        let (mut param, mut state) = optim.step(1e-3, param, grad.clone(), None);
        group.bench_function("burn_adamw_stock", |bench| {
            bench.iter(|| {
                let (p, s) = optim.step(1e-3, param.clone(), grad.clone(), state.take());
                (param, state) = (p, s);
                <Wgpu as Backend>::sync(&device).unwrap();
            })
        });
    }
    group.finish();
}

fn cpu(c: &mut Criterion) {
    let mut rng = Rng::new(2);
    let master = rng.nonzero_vec(LEN, 1e-2, 2.0);
    let grads = rng.nonzero_vec(LEN, 1e-3, 1.0);
    let mut group = c.benchmark_group("cpu");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(STEP_BYTES));

    let src = vec![1.0f32; 5 * LEN];
    let mut dst = vec![0.0f32; 5 * LEN];
    group.bench_function("copy_same_bytes", |bench| {
        bench.iter(|| dst.copy_from_slice(std::hint::black_box(&src)))
    });

    let (mut p, mut m, mut v) = (master.clone(), vec![0.0f32; LEN], vec![0.0f32; LEN]);
    let mut g = grads.clone();
    let mut copy = vec![0.0f32; LEN];
    group.bench_function("reference_step", |bench| {
        bench.iter(|| {
            let (found_inf, sum_sq) = burn_dist_kernels::unscale_and_check(&mut g, 1.0);
            let clip = burn_dist_kernels::clip_factor(sum_sq, Some(1.0));
            let s = scalars();
            adam_update(
                &mut p,
                &mut m,
                &mut v,
                &g,
                clip,
                found_inf,
                &s,
                ModelCopy::F32(&mut copy),
            );
        })
    });

    let optim = AdamWConfig::new().with_weight_decay(0.01).build();
    let tensor =
        |x: &[f32]| Tensor::<Flex, 1>::from_data(TensorData::new(x.to_vec(), [LEN]), &FlexDevice);
    let grad = tensor(&grads);
    let (mut param, mut state) = optim.step(1e-3, tensor(&master), grad.clone(), None);
    group.bench_function("burn_adamw_stock_flex", |bench| {
        bench.iter(|| {
            let (p, s) = optim.step(1e-3, param.clone(), grad.clone(), state.take());
            (param, state) = (p, s);
        })
    });
    group.finish();
}

criterion_group!(benches, wgpu, cpu);
criterion_main!(benches);
