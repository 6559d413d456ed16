//! `ddp_params <out> [steps]`: trains the bench transformer for `steps` (default 5) Adam steps
//! on `Autodiff<DistributedBackend<Flex>>` under DDP at world size 1 (reducer fully active,
//! checked after every step) from the deterministic init and writes the final parameters to
//! `<out>`. Its twin, `plain/`'s `plain_params`, does the same on plain `Autodiff<Flex>`.

use burn::optim::AdamConfig;
use burn_dist_benches::prepared_world_size_1;
use burn_dist_models::step::{BENCH, train_steps, write_params};
use burn_flex::FlexDevice;

fn main() {
    let mut args = std::env::args().skip(1);
    let out = args.next().expect("usage: ddp_params <out> [steps]");
    let steps = args
        .next()
        .map_or(5, |s| s.parse().expect("steps: a number"));
    let (ddp, model, mut check) = prepared_world_size_1();
    let mut optim = AdamConfig::new().init();
    let params = train_steps(&BENCH, model, &mut optim, steps, &FlexDevice, |_, _| {
        check.after_step(&ddp)
    });
    eprintln!(
        "ddp_params: {steps} steps, reducer checked: {} buckets on step 1, {} after the \
         rebuild, {} bytes copied per step",
        check.initial_buckets,
        check.buckets(),
        check.bytes_per_step
    );
    write_params(out.as_ref(), &params).expect("write the parameters");
}
