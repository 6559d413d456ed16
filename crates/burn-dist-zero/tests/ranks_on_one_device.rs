//! Two and three ranks on one device, the CPU twin of the device check's `ranks` line: threads
//! as ranks on Burn's `Wgpu` (fusion on) over Mesa's lavapipe, each with the staged device
//! collectives, DDP, ZeRO-2 and ZeRO-3 in f32 and f16 (WGSL has no bf16; the GPU line runs
//! bf16), against one rank with the whole batch on the same device, with the comparisons and
//! tolerances of `burn_dist_testing::one_device`, which the CUDA line uses unchanged.
//!
//! Every rank on one device, as on the GPU: each rank's device memory is its own thread's
//! stream's count, checked against the formula of one rank.

use burn::tensor::FloatDType;
use burn_dist_testing::one_device::{cases, run_case};
use burn_wgpu::{Wgpu, WgpuDevice};

#[test]
fn two_and_three_ranks_on_one_device_equal_one_rank_with_the_whole_batch() {
    burn_dist_kernels::testing::wgpu_client();
    let device = WgpuDevice::default();
    let mut failures = Vec::new();
    // One case at a time: the ranks of a case are the only users of the devices' memory.
    for case in cases(FloatDType::F16) {
        let outcome = run_case::<Wgpu>(case, &device);
        eprintln!(
            "{}: {:.3e} from one rank (at most {:e}), ranks agree {}, gathered {} B, memory {:?}",
            case.name(),
            outcome.relative_error,
            outcome.tolerance,
            outcome.ranks_agree,
            outcome.gathered_bytes,
            outcome.memory
        );
        failures.extend(outcome.failures());
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
