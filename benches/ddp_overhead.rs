//! The DDP half of the overhead measurement: `transformer_step` on
//! `Autodiff<DistributedBackend<Flex>>` with DDP at world size 1 and the reducer fully active
//! (every gradient copied into its bucket, all-reduced, written back). Each step's collectives
//! and copied bytes are asserted, so the figure cannot come from a reducer that did nothing.
//!
//! Its reference is `plain/benches/plain_step.rs` (plain `Autodiff<Flex>`, another workspace);
//! `cargo xtask bench-overhead` runs the two interleaved. Keep their criterion settings equal.

use burn::optim::AdamConfig;
use burn_dist_benches::{DdpFlex, prepared_world_size_1};
use burn_dist_models::step::{BENCH, LR, trainable_f32_bytes, transformer_step};
use burn_flex::FlexDevice;
use criterion::{Criterion, SamplingMode, Throughput, black_box, criterion_group, criterion_main};

/// The decorator alone: `Autodiff<DistributedBackend<Flex>>` with no `Ddp` on this thread, so no
/// parameter is marked and no hook runs. Separates the cost of the decorator and of Burn's
/// `distributed` feature from that of the reducer. Runs before `step` installs the `Ddp`.
fn decorated(c: &mut Criterion) {
    let (x, y) = BENCH.batch::<DdpFlex>(0, &FlexDevice);
    let mut model = Some(BENCH.model::<DdpFlex>(&FlexDevice));
    let mut optim = AdamConfig::new().init();
    let mut group = c.benchmark_group("transformer_step");
    group.sampling_mode(SamplingMode::Flat).sample_size(20);
    group.bench_function("decorated_no_ddp", |b| {
        b.iter(|| {
            let m = model.take().expect("model");
            let (m, loss) = transformer_step(m, &mut optim, x.clone(), y.clone(), LR);
            model = Some(m);
            loss
        })
    });
    group.finish();
}

fn step(c: &mut Criterion) {
    let (x, y) = BENCH.batch::<DdpFlex>(0, &FlexDevice);
    let (ddp, model, mut check) = prepared_world_size_1();
    let mut optim = AdamConfig::new().init();
    // The first step also broadcasts the ready order and rebuilds the layout; take it here so
    // that the measured steps are all steady-state ones (criterion's warm-up would hide it too).
    let (model, _) = transformer_step(model, &mut optim, x.clone(), y.clone(), LR);
    check.after_step(&ddp);
    let mut model = Some(model);
    let mut group = c.benchmark_group("transformer_step");
    group.sampling_mode(SamplingMode::Flat).sample_size(20);
    group.bench_function("ddp_world_1", |b| {
        b.iter(|| {
            let m = model.take().expect("model");
            let (m, loss) = transformer_step(m, &mut optim, x.clone(), y.clone(), LR);
            check.after_step(&ddp);
            model = Some(m);
            loss
        })
    });
    group.finish();
    eprintln!(
        "ddp_overhead: {} steps checked, each {} collectives ({} buckets + usage bitmap), {} bytes copied",
        check.steps,
        check.buckets() + 1,
        check.buckets(),
        check.bytes_per_step
    );
}

/// Yardstick for reading the overhead: one copy of the step's gradient bytes into a fresh
/// buffer, which is what each pass of the reducer over the gradients costs at least (reading
/// them off the tensors, filling the buckets, the reduction pass, the write-back). Its group
/// name keeps it out of `cargo xtask bench-overhead`'s "transformer_step" filter.
fn gradient_copy(c: &mut Criterion) {
    let model = BENCH.model::<DdpFlex>(&FlexDevice);
    let floats = (trainable_f32_bytes::<DdpFlex, _>(&model) / 4) as usize;
    let src = vec![1.0f32; floats];
    let mut group = c.benchmark_group("gradient_bytes");
    group.throughput(Throughput::Bytes(4 * floats as u64));
    group.bench_function("copy_into_fresh_vec", |b| {
        b.iter(|| black_box(&src).to_vec())
    });
    group.finish();
}

criterion_group!(benches, decorated, step, gradient_copy);
criterion_main!(benches);
