//! `ranks`: two and three ranks on one GPU, the first run of more than one rank on a real GPU.
//! NCCL refuses two ranks on one device; the staged device collectives do not: threads as
//! ranks, each with `Ddp::for_thread_staged::<Cuda>` over an in-process group, on Burn's
//! default `Cuda` (fusion on). DDP, ZeRO-2 and ZeRO-3 in f32, ZeroAdam's stages 1 to 3 in bf16
//! (which lavapipe cannot run), each against one rank with the whole batch on the same GPU,
//! with the comparisons and tolerances of `burn_dist_testing::one_device`, which the wgpu
//! twin's test runs in CI (burn-dist-zero `tests/ranks_on_one_device.rs`): uneven shards,
//! stage 3's gathers carrying the peers' pieces, the model's `[16, 96]` weight whose rows
//! cubecl-cuda pads through the staging copies, and each rank's device memory against the
//! formula. One line per case, `ranks/<mode>/w<world>/<dtype>`.

use burn::tensor::FloatDType;
use burn_cuda::Cuda;
use burn_dist::CudaDevice;
use burn_dist_testing::one_device::{MODEL, cases, run_case};
use serde_json::json;

use crate::Options;
use crate::libraries::check_cuda_runtime;
use crate::report::{Report, Status, guarded};

pub fn run(report: &mut Report, options: &Options) {
    if let Err(e) = check_cuda_runtime() {
        return report.fail("ranks", e, json!({}));
    }
    let device = CudaDevice::new(options.device);
    for case in cases(FloatDType::BF16) {
        let check = format!("ranks/{}", case.name());
        let size = if case.dtype == FloatDType::F32 { 4 } else { 2 };
        let padded = burn_dist::cuda_pads_rows(&MODEL[..2], size);
        match guarded(|| run_case::<Cuda>(case, &device)) {
            Ok(outcome) => {
                let failures = outcome.failures();
                let mut fields = json!({
                    "relative_error": outcome.relative_error,
                    "tolerance": outcome.tolerance,
                    "ranks_agree": outcome.ranks_agree,
                    "uneven_shards": outcome.uneven_shards,
                    "gathered_bytes": outcome.gathered_bytes,
                    "memory_per_rank": outcome.memory,
                    "padded_rows_predicted": padded,
                });
                let status = if failures.is_empty() {
                    Status::Pass
                } else {
                    fields["error"] = json!(failures.join("; "));
                    Status::Fail
                };
                report.line(&check, status, fields);
            }
            Err(panic) => report.fail(&check, format!("panicked: {panic}"), json!({})),
        }
    }
}
