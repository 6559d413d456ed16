//! `plain_params <out> [steps]`: trains the bench transformer for `steps` (default 5) Adam steps
//! on plain `Autodiff<Flex>` from the deterministic init and writes the final parameters to
//! `<out>` (see `burn_dist_models::step::write_params`). Its twin in the main workspace,
//! `ddp_params`, does the same under DDP at world size 1; the equivalence test compares the two.

use burn::backend::Autodiff;
use burn::optim::AdamConfig;
use burn_dist_models::step::{BENCH, train_steps, write_params};
use burn_flex::{Flex, FlexDevice};

type B = Autodiff<Flex>;

fn main() {
    let mut args = std::env::args().skip(1);
    let out = args.next().expect("usage: plain_params <out> [steps]");
    let steps = args
        .next()
        .map_or(5, |s| s.parse().expect("steps: a number"));
    let model = BENCH.model::<B>(&FlexDevice);
    let mut optim = AdamConfig::new().init();
    let params = train_steps(&BENCH, model, &mut optim, steps, &FlexDevice, |_, _| {});
    write_params(out.as_ref(), &params).expect("write the parameters");
}
