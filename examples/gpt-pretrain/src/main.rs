//! `gpt-pretrain`: see the library documentation and `docs/gpt-pretrain.md`.

use std::process::ExitCode;

use clap::Parser;
use gpt_pretrain::cli::Args;

fn main() -> ExitCode {
    let args = Args::parse();
    keep_freed_memory(args.zero_stage);
    burn_dist_comm::logging::init_stderr("warn");
    match gpt_pretrain::backend::run(&args) {
        Ok(_) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Flex allocates every tensor afresh. glibc hands large freed blocks back to the kernel (blocks
/// above its mmap threshold, and the top of the heap beyond its trim threshold), so the next
/// step's tensors fault their pages in again: about 6000 page faults per step of the tiny GPT,
/// 11 % of a rank's CPU time (docs/perf/cpu-throughput.md). Raising both thresholds keeps freed
/// memory in the process for reuse; resident memory then stays at its peak, which a training
/// loop reaches every step anyway.
///
/// - The trim threshold is 64 MiB, not more: each of a rank's allocator arenas may keep that
///   much free, and with 1 GiB the 124M shape's rank kept 290 MiB more at stage 2 (2110 against
///   1821 MiB) for no measurable speed (docs/perf/zero3.md).
/// - The mmap threshold is 32 MiB (glibc's largest automatic one), except at ZeRO stage 3,
///   where it is 16 MiB. There the gathered weights live in the communicator's shared buffers,
///   off the heap, but at 32 MiB the GPT-2 774M shape's weight gradients (20 and 26 MB) and the
///   logits still fragmented the heap until a rank was killed for memory at step 2 (6.5 GB of
///   heap). At 16 MiB those gradients are mapped and the 774M shape trains (5.6 GB per rank),
///   while the 124M shape's (at most 9.4 MB) stay in the heap: its step takes stage 2's time,
///   where 4 MiB, the earlier choice, cost it about a quarter more (docs/perf/zero3.md).
///
/// A user who sets glibc's malloc tunables (`GLIBC_TUNABLES=glibc.malloc.…`) chooses for
/// themselves: `mallopt` would override them.
fn keep_freed_memory(zero_stage: u8) {
    if std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("glibc.malloc.")) {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let mmap_threshold = if zero_stage == 3 { 16 << 20 } else { 32 << 20 };
        // SAFETY: mallopt only sets allocator parameters; it runs in main before any other
        // thread exists (parsing the arguments starts none).
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, mmap_threshold);
            libc::mallopt(libc::M_TRIM_THRESHOLD, 64 << 20);
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = zero_stage;
}
