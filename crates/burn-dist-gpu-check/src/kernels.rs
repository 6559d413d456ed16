//! `kernels`: the fused-kernel checks of `burn_dist_kernels::testing` (the same functions the
//! wgpu tests run) on cubecl's CUDA runtime, where bf16 exists. Each check gets a fresh seed,
//! written in its line (replay with `BURN_DIST_SEED`).

use std::time::Instant;

use burn_dist_kernels::testing::{
    Rng, check_bandwidth_copy, check_consecutive_steps, check_decay_mask,
    check_fused_step_equals_f64_reference, check_half_precision_copies,
    check_inf_and_nan_skip_the_step, check_kernels_stay_within_len,
    check_overflowing_norm_skips_the_step,
};
use burn_dist_kernels::{FusedAdam, ModelDtype};
use cubecl::Runtime;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use serde_json::json;

use crate::Options;
use crate::libraries::check_cuda_runtime;
use crate::report::{Report, guarded};

type Check = fn(&FusedAdam<CudaRuntime>, &mut Rng) -> Result<(), String>;

pub fn run(report: &mut Report, options: &Options) {
    if let Err(e) = check_cuda_runtime() {
        return report.fail("kernels/runtime", e, json!({}));
    }
    let device = CudaDevice::new(options.device);
    let fused = match guarded(|| FusedAdam::new(CudaRuntime::client(&device))) {
        Ok(fused) => fused,
        Err(e) => {
            return report.fail(
                "kernels/runtime",
                format!("creating the CUDA client: {e}"),
                json!({}),
            );
        }
    };
    let checks: [(&str, Check); 8] = [
        // First: its time includes NVRTC's compilation of the kernels.
        ("fused_step_equals_f64_reference", |f, rng| {
            check_fused_step_equals_f64_reference(f, rng);
            Ok(())
        }),
        (
            "half_precision_copy_is_rne_of_master",
            |f, rng| match check_half_precision_copies(f, rng).as_slice() {
                [] => Ok(()),
                skipped => Err(format!(
                    "the CUDA runtime reports no support for {skipped:?}: nothing was checked \
                     for them"
                )),
            },
        ),
        ("inf_and_nan_skip_the_step", |f, rng| {
            check_inf_and_nan_skip_the_step(f, rng);
            Ok(())
        }),
        ("consecutive_steps_follow_the_reference", |f, rng| {
            check_consecutive_steps(f, rng);
            Ok(())
        }),
        ("decay_mask_exempts_its_elements", |f, rng| {
            check_decay_mask(f, rng);
            Ok(())
        }),
        ("overflowing_norm_skips_the_step", |f, rng| {
            check_overflowing_norm_skips_the_step(f, rng);
            Ok(())
        }),
        ("kernels_stay_within_len", |f, rng| {
            check_kernels_stay_within_len(f, rng);
            Ok(())
        }),
        ("bandwidth_copy_copies_exactly", |f, rng| {
            check_bandwidth_copy(f, rng);
            Ok(())
        }),
    ];
    for (name, check) in checks {
        let seed = Rng::fresh_seed();
        let start = Instant::now();
        let result = guarded(|| check(&fused, &mut Rng::new(seed))).and_then(|r| r);
        let fields = json!({
            "seed": seed,
            "device": options.device,
            "bf16_supported": fused.supports(ModelDtype::Bf16),
            "seconds": start.elapsed().as_secs_f64(),
        });
        let check = format!("kernels/{name}");
        match result {
            Ok(()) => report.pass(&check, fields),
            Err(e) => report.fail(&check, e, fields),
        }
    }
}
