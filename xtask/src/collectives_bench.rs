//! `cargo xtask bench-collectives`: the host collectives beside PyTorch's gloo, in one run on
//! this machine: burn-dist's criterion bench (`benches/host_all_reduce.rs`: memcpy, all-reduce
//! and all-gather of 64 MiB on 2 ranks over shared memory and over loopback TCP, the ceiling of
//! ranks copying straight out of each other's buffers, the same as built with shared buffers read
//! in place, and a bare loopback exchange), then
//! gloo's all-reduce and all-gather of the same sizes on 2 processes
//! (`benches/torch/gloo_collectives.py`, torch from PyPI in the venv of `bench-host-step`).
//! Figures in docs/perf/host-all-reduce.md; never in CI.

use std::process::Command;

pub fn bench_collectives(args: &[String]) -> Result<(), String> {
    if !args.is_empty() {
        return Err("usage: cargo xtask bench-collectives".into());
    }
    super::cargo(&[
        "bench",
        "-p",
        "burn-dist-benches",
        "--bench",
        "host_all_reduce",
        "--locked",
    ])?;
    let python = super::host_step::torch_python()?;
    let script = super::workspace_root().join("benches/torch/gloo_collectives.py");
    eprintln!("xtask: gloo on 2 processes (all-reduce, all-gather; 64 MiB):");
    super::run(Command::new(python).arg(script))
}
