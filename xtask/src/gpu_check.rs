//! `cargo xtask gpu-check`: builds the device check on this (CPU) machine and lays it out in
//! `target-gpu/` (git-ignored), ready to be carried to the GPU machine, which has no registry
//! access. See docs/gpu.md.
//!
//! - The binary is built in release with the `cuda` feature, for x86-64 Linux (the GPU
//!   machine's), with `CUDARC_CUDA_VERSION` fixing cudarc's bindings to the GPU machine's
//!   driver (CUDA 13.0 by default: without nvcc cudarc would pick its latest bindings, whose
//!   newer symbols a 13.0 driver lacks). Debug info is off and symbols are stripped, so the
//!   binary stays far below the 64 MiB that the device tool carries.
//! - It builds in its own target subdirectory (`gpu-check/`), so that the CUDA version and
//!   profile settings do not rebuild the workspace's other artifacts.
//! - `target-gpu/` gets the binary, `run.sh`, `fused_adamw_torch.py` and `gpt2_torch.py`.

use std::path::{Path, PathBuf};
use std::process::Command;

const PACKAGE: &str = "burn-dist-gpu-check";
const OUT_DIR: &str = "target-gpu";
/// What the device tool carries in all (the working tree counts too).
const CARRY_LIMIT: u64 = 64 << 20;
/// The device call's limit: run.sh's 300 s of check limits, its set-up and report, and the
/// few seconds each timeout may take to kill a check (`--kill-after=5`).
const CALL_TIMEOUT_S: u64 = 360;
/// `run.sh both` (core, then device): 540 s of check limits, two set-ups and reports; the
/// device tool's most for one command.
const BOTH_TIMEOUT_S: u64 = 600;
/// An earlier call's packed kernel cache (run.sh writes it into each results folder).
const CARRIED_CACHE: &str = "cubecl-cache.tar.gz";
const USAGE: &str =
    "usage: cargo xtask gpu-check [--cuda-version NNNNN]   (default 13000: CUDA 13.0)";

pub fn gpu_check(args: &[String]) -> Result<(), String> {
    let mut cuda_version = "13000".to_string();
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        match arg.as_str() {
            "--cuda-version" => {
                cuda_version = rest
                    .next()
                    .filter(|v| v.len() == 5 && v.chars().all(|c| c.is_ascii_digit()))
                    .ok_or_else(|| format!("--cuda-version needs a value like 13000\n{USAGE}"))?
                    .clone();
            }
            other => return Err(format!("gpu-check: unknown argument {other:?}\n{USAGE}")),
        }
    }
    if std::env::consts::ARCH != "x86_64" || std::env::consts::OS != "linux" {
        return Err(format!(
            "gpu-check builds for the GPU machine, which is x86-64 Linux; this machine is {} {}: \
             build on an x86-64 Linux machine",
            std::env::consts::ARCH,
            std::env::consts::OS
        ));
    }

    let root = crate::workspace_root();
    let target = crate::target_dir().join("gpu-check");
    crate::run(
        Command::new(env!("CARGO"))
            .current_dir(&root)
            .args(["build", "--release", "--locked", "-p", PACKAGE])
            .args(["--features", "cuda", "--bin", PACKAGE])
            .env("CARGO_TARGET_DIR", &target)
            .env("CUDARC_CUDA_VERSION", &cuda_version)
            .env("CARGO_PROFILE_RELEASE_DEBUG", "0")
            .env("CARGO_PROFILE_RELEASE_STRIP", "symbols"),
    )?;

    let out = root.join(OUT_DIR);
    // An earlier device call's kernel cache, put here to warm the next call (run.sh unpacks
    // it), is kept across rebuilds.
    let carried_cache = out.join(CARRIED_CACHE);
    let cache = std::fs::read(&carried_cache).ok();
    if out.exists() {
        std::fs::remove_dir_all(&out)
            .map_err(|e| format!("cannot clear {}: {e}", out.display()))?;
    }
    std::fs::create_dir_all(&out).map_err(|e| format!("cannot create {}: {e}", out.display()))?;
    if let Some(cache) = &cache {
        std::fs::write(&carried_cache, cache)
            .map_err(|e| format!("cannot keep {}: {e}", carried_cache.display()))?;
    }
    let crate_dir = root.join("crates").join(PACKAGE);
    let files = [
        (target.join("release").join(PACKAGE), PACKAGE),
        (crate_dir.join("run.sh"), "run.sh"),
        (
            crate_dir.join("fused_adamw_torch.py"),
            "fused_adamw_torch.py",
        ),
        (crate_dir.join("gpt2_torch.py"), "gpt2_torch.py"),
    ];
    let mut total = cache.as_ref().map_or(0, |c| c.len() as u64);
    for (from, name) in files {
        total += copy_executable(&from, &out.join(name))?;
    }
    let binary = std::fs::metadata(out.join(PACKAGE)).map_or(0, |m| m.len());
    // The working tree travels too (a few MiB): keep a quarter of the limit for it.
    if total > CARRY_LIMIT / 4 * 3 {
        return Err(format!(
            "{OUT_DIR}/ holds {} MiB: too close to the device tool's {} MiB limit on what it \
             carries (the working tree counts too)",
            total >> 20,
            CARRY_LIMIT >> 20
        ));
    }
    let ignored = Command::new("git")
        .current_dir(&root)
        .args(["check-ignore", "-q", OUT_DIR])
        .status()
        .is_ok_and(|s| s.success());
    if !ignored {
        eprintln!("xtask: warning: {OUT_DIR}/ is not git-ignored: add it to .gitignore");
    }
    println!(
        "\nxtask: {OUT_DIR}/ is ready: {PACKAGE} ({:.1} MiB, stripped, CUDA bindings \
         {cuda_version}), run.sh, fused_adamw_torch.py, gpt2_torch.py; {:.1} MiB in all.\n\
         \n\
         Run the core and the device suites with one call of the device tool (their checks' \
         limits add up to 540 s; one machine start for both; results come back in out/core/ \
         and out/device/ as results.jsonl, gpu-check.md and gpu-check.log; read the libraries, \
         nccl-w1 and ddp-step/address lines first):\n\
         \n    run(command=\"bash {OUT_DIR}/run.sh both\", carry=[\"{OUT_DIR}\"], timeout_s={BOTH_TIMEOUT_S})\n\
         \nthen, if device time is left (15 minutes in all, machine starts included), the \
         end-to-end GPT-2 124M comparison with PyTorch (gpt-f32, gpt-bf16, torch-gpt; 300 s \
         of limits):\n\
         \n    run(command=\"bash {OUT_DIR}/run.sh gpt\", carry=[\"{OUT_DIR}\"], timeout_s={CALL_TIMEOUT_S})\n\
         \nA suite alone: `run.sh core` or `run.sh device`, timeout_s={CALL_TIMEOUT_S}.\n\
         \nEach suite packs cubecl's compiled kernels and autotune results into its results \
         folder (cubecl-cache.tar.gz): copy it into {OUT_DIR}/ (kept across rebuilds{}) and the \
         next call starts warm.\n",
        binary as f64 / (1 << 20) as f64,
        total as f64 / (1 << 20) as f64,
        match &cache {
            Some(cache) => format!(
                "; one is there now, {:.1} MiB",
                cache.len() as f64 / (1 << 20) as f64
            ),
            None => String::new(),
        },
    );
    Ok(())
}

/// Copies `from` to `to` with mode 0755; returns the size.
fn copy_executable(from: &PathBuf, to: &Path) -> Result<u64, String> {
    let size = std::fs::copy(from, to)
        .map_err(|e| format!("cannot copy {} to {}: {e}", from.display(), to.display()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| format!("cannot make {} executable: {e}", to.display()))?;
    }
    Ok(size)
}
