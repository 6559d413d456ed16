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
//! - `target-gpu/` gets the binary, its `build-tag` (what the kernel pack is tagged with:
//!   [`kernel_pack`]), `run.sh`, `fused_adamw_torch.py` and `gpt2_torch.py`.
//! - The kernel pack is not copied: it is committed (`crates/burn-dist-gpu-check/kernel-pack`)
//!   and the checkout travels with every device call; `--import-pack DIR` puts a returned one
//!   there.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::kernel_pack;

const PACKAGE: &str = "burn-dist-gpu-check";
const OUT_DIR: &str = "target-gpu";
/// What the device tool carries in all (the working tree counts too).
const CARRY_LIMIT: u64 = 64 << 20;
/// The device call's limit: run.sh's deadline (570 s) and the few seconds its end and the
/// last timeout's kill may take; the device tool's most for one command.
const CALL_TIMEOUT_S: u64 = 600;
const USAGE: &str = "usage: cargo xtask gpu-check [--cuda-version NNNNN]   (default 13000: CUDA 13.0)\n       \
                     cargo xtask gpu-check --import-pack DIR   (a kernel-pack/ a device call returned)";

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
            "--import-pack" => {
                let from = rest
                    .next()
                    .ok_or_else(|| format!("--import-pack needs a directory\n{USAGE}"))?;
                return import_pack(Path::new(from));
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
    if out.exists() {
        std::fs::remove_dir_all(&out)
            .map_err(|e| format!("cannot clear {}: {e}", out.display()))?;
    }
    std::fs::create_dir_all(&out).map_err(|e| format!("cannot create {}: {e}", out.display()))?;
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
    let mut total = 0;
    for (from, name) in files {
        total += copy_executable(&from, &out.join(name))?;
    }
    // What the binary was built from, beside it: run.sh tags the pack it writes with it, and
    // drops from the pack it starts from what no longer matches.
    let build_tag = kernel_pack::build_tag(&root)?;
    std::fs::write(out.join("build-tag"), &build_tag)
        .map_err(|e| format!("cannot write {}/build-tag: {e}", out.display()))?;
    let pack = root.join(kernel_pack::COMMITTED);
    // The working tree travels with every call (the committed kernel pack with it), and
    // target-gpu/ beside it.
    let tree = working_tree_bytes(&root)?;
    let binary = std::fs::metadata(out.join(PACKAGE)).map_or(0, |m| m.len());
    if tree + total > CARRY_LIMIT - (1 << 20) {
        return Err(format!(
            "{OUT_DIR}/ ({} MiB) and the working tree ({} MiB, the kernel pack's {} MiB \
             included) come within 1 MiB of the device tool's {} MiB limit on what a call \
             carries: import a smaller kernel pack",
            total >> 20,
            tree >> 20,
            dir_bytes(&pack) >> 20,
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
         {cuda_version}) and its build-tag, run.sh, fused_adamw_torch.py, gpt2_torch.py; {:.1} \
         MiB carried with the working tree.\n\
         {}.\n\
         \n\
         The first run of a session (GPT-2 end to end: PyTorch's reference, the timed DDP step, \
         gpt on Burn's Cuda, two and three ranks on one GPU, bf16, as the deadline allows):\n\
         \n    run(command=\"bash {OUT_DIR}/run.sh e2e\", carry=[\"{OUT_DIR}\"], timeout_s={CALL_TIMEOUT_S})\n\
         \nOther suites: core, device, both, gpt, sanitize, or checks by name (run.sh's usage). \
         Everything comes back in out/: results.jsonl, gpu-check.md, gpu-check.log and \
         kernel-pack/. Keep the pack for the next call and session, then commit it:\n\
         \n    cargo xtask gpu-check --import-pack <files_at>/kernel-pack\n",
        binary as f64 / (1 << 20) as f64,
        (total + tree) as f64 / (1 << 20) as f64,
        kernel_pack::status(&pack, &build_tag),
    );
    Ok(())
}

/// `--import-pack DIR`: a returned pack, checked, into the committed place.
fn import_pack(from: &Path) -> Result<(), String> {
    let root = crate::workspace_root();
    let to = root.join(kernel_pack::COMMITTED);
    let said = kernel_pack::import(from, &to)?;
    let build_tag = kernel_pack::build_tag(&root)?;
    println!(
        "xtask: kernel pack imported into {}: {said}.\n{}.\nCommit it: git add {}",
        kernel_pack::COMMITTED,
        kernel_pack::status(&to, &build_tag),
        kernel_pack::COMMITTED
    );
    Ok(())
}

/// The bytes of what the device tool sends of the checkout: the files git tracks and the
/// untracked ones it does not ignore.
fn working_tree_bytes(root: &Path) -> Result<u64, String> {
    let listed = Command::new("git")
        .current_dir(root)
        .args([
            "ls-files",
            "-z",
            "--cached",
            "--others",
            "--exclude-standard",
        ])
        .output()
        .map_err(|e| format!("git ls-files: {e}"))?;
    Ok(listed
        .stdout
        .split(|&b| b == 0)
        .filter(|name| !name.is_empty())
        .filter_map(|name| {
            std::fs::metadata(root.join(String::from_utf8_lossy(name).as_ref())).ok()
        })
        .map(|m| m.len())
        .sum())
}

/// The bytes of the files directly in `dir` (0 when it does not exist).
fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir).map_or(0, |entries| {
        entries
            .filter_map(|e| e.ok()?.metadata().ok())
            .map(|m| m.len())
            .sum()
    })
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
