//! The reference half of the DDP-overhead measurement: `transformer_step` on plain
//! `Autodiff<Flex>`. Its twin is `benches/ddp_overhead.rs` in the main workspace; run both with
//! `cargo xtask bench-overhead`, which interleaves them. Keep the criterion settings of the two
//! identical.

use burn::backend::Autodiff;
use burn::optim::AdamConfig;
use burn_dist_models::step::{BENCH, LR, transformer_step};
use burn_flex::{Flex, FlexDevice};
use criterion::{Criterion, SamplingMode, criterion_group, criterion_main};

type B = Autodiff<Flex>;

fn step(c: &mut Criterion) {
    let (x, y) = BENCH.batch::<B>(0, &FlexDevice);
    let mut model = Some(BENCH.model::<B>(&FlexDevice));
    let mut optim = AdamConfig::new().init();
    let mut group = c.benchmark_group("transformer_step");
    group.sampling_mode(SamplingMode::Flat).sample_size(20);
    group.bench_function("plain_flex", |b| {
        b.iter(|| {
            let m = model.take().expect("model");
            let (m, loss) = transformer_step(m, &mut optim, x.clone(), y.clone(), LR);
            model = Some(m);
            loss
        })
    });
    group.finish();
}

criterion_group!(benches, step);
criterion_main!(benches);
