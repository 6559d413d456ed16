//! `gpt-pretrain`: see the library documentation and `docs/gpt-pretrain.md`.

use std::process::ExitCode;

use clap::Parser;
use gpt_pretrain::cli::Args;

fn main() -> ExitCode {
    keep_freed_memory();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter("warn")
        .init();
    match gpt_pretrain::backend::run(&Args::parse()) {
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
/// loop reaches every step anyway. Tensors above 32 MiB (glibc's largest mmap threshold) are
/// still mapped and unmapped each time. The trim threshold is 64 MiB, not more: each of a
/// rank's allocator arenas may keep that much free, and with 1 GiB a large model's rank kept
/// gigabytes it no longer used (the GPT-2 774M shape at ZeRO stage 3 was killed for memory;
/// the 124M shape's peak fell from 1339 to 1112 MiB per rank, what glibc's defaults give).
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; it runs first in main, before any other
    // thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 4 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 64 << 20);
    }
}
