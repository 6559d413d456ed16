//! `run.sh` rehearsed without a GPU: a fake CUDA toolkit (its `lib64` a symbolic link, as in
//! NVIDIA's packages), fake nvidia-* wheels laid out like the Python packages (`nvidia/cu13/lib`,
//! `nvidia/nccl/lib`, a namespace package `nvidia`), empty files for the libraries, a stand-in
//! for the binary (it records how it was called and answers `versions` as told) and for the
//! Python interpreter's PyTorch scripts. The tests read which libraries `run.sh` chose, what
//! it put on `LD_LIBRARY_PATH`, which checks it ran with which limits, and the one line it
//! writes when NVRTC is newer than the driver or a libcuda stub would shadow the driver.
//!
//! Runs in CI (no feature needed): it only needs bash, coreutils and python3, as run.sh does.

use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// The deadline of a whole run (run.sh's DEADLINE_S) and what it keeps for the end (RESERVE_S).
const DEADLINE_S: u64 = 570;
const RESERVE_S: u64 = 15;

/// The binary's stand-in. It records how it was called (under run.sh's name for the check,
/// `GPU_CHECK_NAME`, else its first argument), reads what the cache holds and adds this
/// check's kernels to it as cubecl and the driver would (`FAKE_KERNEL_BYTES` of random bytes
/// each, so that a test can make the pack large), moves the fake clock on by
/// `FAKE_SECONDS_<name>` (default 1), and writes one passing line.
const STAND_IN_BIN: &str = r#"#!/usr/bin/env bash
name="${GPU_CHECK_NAME:-$1}"
first="${LD_LIBRARY_PATH%%:*}"
cache=""; out=""; previous=""
for arg in "$@"; do
    [ "$previous" = --cache ] && cache="$arg"
    [ "$previous" = --out ] && out="$arg"
    previous="$arg"
done
seen=""
if [ -n "$cache" ]; then
    seen="$(find "$cache" -type f -printf '%P,' 2>/dev/null | tr '/' ':')"
    for part in compilation autotune; do
        mkdir -p "$cache/$part"
        head -c "${FAKE_KERNEL_BYTES:-16}" /dev/urandom >"$cache/$part/kernel-$name"
    done
    mkdir -p "$CUDA_CACHE_PATH"
    head -c "${FAKE_KERNEL_BYTES:-16}" /dev/urandom >"$CUDA_CACHE_PATH/kernel-$name"
fi
echo "$name ARGS=[$*] CACHE_SEEN=$seen NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-} FIRST_DIR=$(ls "$first" | tr '\n' ,) LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}" >>"$FAKE_CALLS"
seconds_var="FAKE_SECONDS_${name//-/_}"
[ -n "${GPU_CHECK_CLOCK:-}" ] && [ "$1" != versions ] && echo $(($(cat "$GPU_CHECK_CLOCK") + ${!seconds_var:-1})) >"$GPU_CHECK_CLOCK"
case "$1" in
    versions) echo "nvrtc=$FAKE_NVRTC_VERSION driver=$FAKE_DRIVER_VERSION" ;;
    *) echo "{\"check\": \"$name/stand-in\", \"status\": \"pass\", \"unix_time\": 0}" >>"$out" ;;
esac
# A run stopped from outside (the device tool's limit): TERM to run.sh, the parent of timeout.
if [ "${FAKE_STOP_AT:-}" = "$name" ]; then
    kill -TERM "$(awk '{print $4}' "/proc/$PPID/stat")"
fi
"#;

/// python3 without site-packages (-S: a real `nvidia` package there would join the namespace),
/// except that PyTorch's scripts are only recorded.
const STAND_IN_PYTHON: &str = r#"#!/usr/bin/env bash
case "${1:-}" in
    *_torch.py)
        echo "$(basename "$1") ARGS=[$*] NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-} LD_LIBRARY_PATH=${LD_LIBRARY_PATH-unset}" >>"$FAKE_CALLS"
        seconds_var="FAKE_SECONDS_${GPU_CHECK_NAME//-/_}"
        [ -n "${GPU_CHECK_CLOCK:-}" ] && echo $(($(cat "$GPU_CHECK_CLOCK") + ${!seconds_var:-1})) >"$GPU_CHECK_CLOCK"
        exit 0 ;;
esac
exec python3 -S "$@"
"#;

/// The fake machine: a toolkit, the wheels, the stand-ins, a results folder.
struct Machine {
    dir: tempfile::TempDir,
}

impl Machine {
    fn new() -> Self {
        let machine = Machine {
            dir: tempfile::tempdir().expect("a scratch directory"),
        };
        // The toolkit: lib64 -> targets/x86_64-linux/lib, NVRTC as NVIDIA links it.
        let lib = machine.path("cuda-13.0/targets/x86_64-linux/lib");
        machine.file("cuda-13.0/targets/x86_64-linux/lib/libnvrtc.so.13.0.88");
        symlink("libnvrtc.so.13.0.88", lib.join("libnvrtc.so.13")).unwrap();
        symlink("libnvrtc.so.13", lib.join("libnvrtc.so")).unwrap();
        machine.file("cuda-13.0/targets/x86_64-linux/lib/libnvrtc-builtins.so.13.0");
        machine.file("cuda-13.0/targets/x86_64-linux/lib/stubs/libcuda.so");
        machine.file("cuda-13.0/targets/x86_64-linux/lib/stubs/libnvrtc.so");
        symlink("targets/x86_64-linux/lib", machine.path("cuda-13.0/lib64")).unwrap();
        for header in ["cuda_runtime.h", "cuda_fp16.h", "cuda_bf16.h", "mma.h"] {
            machine.file(&format!("cuda-13.0/include/{header}"));
            machine.file(&format!("site/nvidia/cu13/include/{header}"));
        }
        // CUDA 13 keeps CCCL under include/cccl/ (cubecl-cuda adds it to NVRTC's path).
        machine.file("cuda-13.0/include/cccl/cuda/pipeline");
        machine.file("site/nvidia/cu13/include/cccl/cuda/pipeline");
        // The wheels (nvidia-cuda-nvrtc, nvidia-nccl-cu13): `nvidia` has no __init__.py.
        machine.file("site/nvidia/cu13/lib/libnvrtc.so.13");
        machine.file("site/nvidia/cu13/lib/libnvrtc-builtins.so.13.0");
        machine.file("site/nvidia/nccl/lib/libnccl.so.2");
        // Link-time stand-ins sort before it, and must never be taken.
        machine.file("site/nvidia/cu13/lib/stubs/libnccl.so");
        machine.executable("bin/burn-dist-gpu-check", STAND_IN_BIN);
        machine.executable("bin/python", STAND_IN_PYTHON);
        // What `cargo xtask gpu-check` writes beside the binary.
        std::fs::write(machine.path("bin/build-tag"), "kernels=k1\nlock=l1\n").unwrap();
        machine.set_clock(1000);
        machine
    }

    /// Sets the fake clock that run.sh reads instead of the time (`GPU_CHECK_CLOCK`).
    fn set_clock(&self, seconds: u64) {
        std::fs::write(self.path("clock"), seconds.to_string()).unwrap();
    }

    fn path(&self, relative: &str) -> PathBuf {
        self.dir.path().join(relative)
    }

    /// A fresh path for a file, its directory created.
    fn new_file(&self, relative: &str) -> PathBuf {
        let path = self.path(relative);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        path
    }

    fn file(&self, relative: &str) -> PathBuf {
        let path = self.new_file(relative);
        std::fs::write(&path, b"not a library").unwrap();
        path
    }

    fn executable(&self, relative: &str, text: &str) {
        let path = self.new_file(relative);
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    fn resolved(&self, relative: &str) -> String {
        std::fs::canonicalize(self.dir.path().join(relative))
            .unwrap()
            .display()
            .to_string()
    }

    /// Runs `bash run.sh suite` with the stand-ins; `env` adds or overrides variables.
    fn run(&self, suite: &str, env: &[(&str, &str)]) -> Run {
        self.run_removing(&[suite], env, &[])
    }

    /// Runs `bash run.sh words...` (no word: run.sh's default).
    fn run_suites(&self, words: &[&str], env: &[(&str, &str)]) -> Run {
        self.run_removing(words, env, &[])
    }

    /// [`Machine::run_suites`] with the variables `removed` taken out of the environment.
    fn run_removing(&self, words: &[&str], env: &[(&str, &str)], removed: &[&str]) -> Run {
        let run_sh = std::path::PathBuf::from(
            std::env::var_os("CARGO_MANIFEST_DIR")
                .expect("cargo sets CARGO_MANIFEST_DIR when it runs a test"),
        )
        .join("run.sh");
        let out = self.dir.path().join("out");
        let calls = self.dir.path().join("calls.txt");
        let _ = std::fs::remove_file(&calls);
        let mut command = Command::new("bash");
        command
            .arg(&run_sh)
            .args(words)
            .env_remove("CUDA_PATH")
            .env_remove("NCCL_SOCKET_IFNAME")
            .env_remove("NCCL_DEBUG")
            .env_remove("ELEMENTS")
            .env("LD_LIBRARY_PATH", "")
            .env("PYTHONPATH", self.dir.path().join("site"))
            .env("PYTHON", self.dir.path().join("bin/python"))
            .env(
                "GPU_CHECK_BIN",
                self.dir.path().join("bin/burn-dist-gpu-check"),
            )
            .env("CUDA_ROOTS", self.dir.path().join("no-toolkit-here"))
            .env("OUT", &out)
            .env("FAKE_CALLS", &calls)
            .env("FAKE_NVRTC_VERSION", "13.0")
            .env("FAKE_DRIVER_VERSION", "13.0");
        command
            .env("GPU_CHECK_CACHE", self.dir.path().join("cache"))
            .env("GPU_CHECK_CLOCK", self.dir.path().join("clock"))
            .env("GPU_CHECK_CC", "9.0")
            // Never the pack committed in the checkout.
            .env("GPU_CHECK_PACK", self.dir.path().join("no-pack-here"))
            .env_remove("DEADLINE_S");
        for (name, value) in env {
            command.env(name, value);
        }
        for name in removed {
            command.env_remove(name);
        }
        let output = command.output().expect("bash runs");
        let read = |name: &str| std::fs::read_to_string(out.join(name)).unwrap_or_default();
        let results = read("results.jsonl")
            .lines()
            .map(|line| serde_json::from_str(line).expect("a JSON result line"))
            .collect();
        Run {
            log: read("gpu-check.log"),
            results,
            calls: std::fs::read_to_string(&calls).unwrap_or_default(),
            stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
            success: output.status.success(),
        }
    }
}

/// What one run of run.sh left.
struct Run {
    log: String,
    results: Vec<Value>,
    /// One line per call of a stand-in: the check, NCCL_SOCKET_IFNAME, and for the binary the
    /// files in the first directory of LD_LIBRARY_PATH (FIRST_DIR) and LD_LIBRARY_PATH itself.
    calls: String,
    stdout: String,
    success: bool,
}

impl Run {
    fn libraries(&self) -> &Value {
        self.results
            .iter()
            .find(|r| r["check"] == "libraries")
            .unwrap_or_else(|| panic!("no libraries line in {:?}\n{}", self.results, self.log))
    }

    /// The checks the stand-ins were called for, in order.
    fn checks(&self) -> Vec<&str> {
        self.calls
            .lines()
            .filter_map(|l| l.split(' ').next())
            .collect()
    }

    /// The stand-in binary's record of `check`.
    fn call(&self, check: &str) -> &str {
        self.calls
            .lines()
            .find(|l| l.starts_with(&format!("{check} ")))
            .unwrap_or_else(|| panic!("{check} was not run: {}", self.calls))
    }

    /// The LD_LIBRARY_PATH the binary's `check` saw.
    fn ld_library_path(&self, check: &str) -> Vec<&str> {
        let line = self.call(check);
        line.split(" LD_LIBRARY_PATH=")
            .nth(1)
            .unwrap()
            .split(':')
            .collect()
    }

    /// The files in the first directory of the LD_LIBRARY_PATH that `check` saw.
    fn first_dir(&self, check: &str) -> Vec<&str> {
        let line = self.call(check);
        let listed = line.split(" FIRST_DIR=").nth(1).unwrap();
        let listed = listed.split(" LD_LIBRARY_PATH=").next().unwrap();
        listed.split(',').filter(|f| !f.is_empty()).collect()
    }

    /// The limits of the checks run ("NAME (at most N s)" in the log), in seconds.
    fn limits(&self) -> Vec<(String, u64)> {
        self.log
            .lines()
            .filter_map(|l| {
                let rest = l.strip_prefix("run.sh: ")?;
                let (name, rest) = rest.split_once(" (at most ")?;
                let seconds = rest.split_once(" s)")?.0.parse().ok()?;
                Some((name.to_string(), seconds))
            })
            .collect()
    }
}

#[test]
fn the_toolkits_nvrtc_is_found_through_a_symlinked_lib64() {
    let machine = Machine::new();
    let toolkit = machine.dir.path().join("cuda-13.0");
    let run = machine.run("core", &[("CUDA_PATH", toolkit.to_str().unwrap())]);
    let libraries = run.libraries();
    assert_eq!(libraries["status"], "pass", "{}", run.log);
    assert_eq!(
        libraries["libnvrtc"],
        machine.resolved("cuda-13.0/targets/x86_64-linux/lib/libnvrtc.so.13.0.88"),
        "run.sh must take the toolkit's NVRTC, not the wheel's:\n{}",
        run.log
    );
    assert_eq!(
        libraries["libnccl"],
        machine
            .dir
            .path()
            .join("site/nvidia/nccl/lib/libnccl.so.2")
            .display()
            .to_string()
    );
    assert_eq!(libraries["nvrtc_version"], "13.0");
    assert_eq!(libraries["driver_version"], "13.0");
    assert!(
        run.log.contains("versions: NVRTC 13.0 (") && run.log.contains("driver's CUDA 13.0"),
        "the log names both versions:\n{}",
        run.log
    );
    // The binary sees libnccl.so and libnvrtc.so (and NVRTC's builtins) in run.sh's own
    // directory first, then the libraries' directories: the toolkit's, not the stubs.
    assert_eq!(
        run.first_dir("kernels"),
        ["libnccl.so", "libnvrtc-builtins.so.13.0", "libnvrtc.so"]
    );
    let path = run.ld_library_path("kernels");
    assert!(
        path.contains(&toolkit.join("lib64").to_str().unwrap()),
        "{path:?}"
    );
    assert!(!path.iter().any(|d| d.contains("stubs")), "{path:?}");
    // CUDA 13's CCCL headers under include/cccl/ are found, so nothing is said about them.
    assert!(!run.log.contains("not found under"), "{}", run.log);
}

#[test]
fn without_a_toolkit_the_wheels_nvrtc_and_headers_are_used() {
    let machine = Machine::new();
    let run = machine.run("libraries", &[]);
    let libraries = run.libraries();
    assert_eq!(libraries["status"], "pass", "{}", run.log);
    assert_eq!(
        libraries["libnvrtc"],
        machine.resolved("site/nvidia/cu13/lib/libnvrtc.so.13")
    );
    let cuda_path = libraries["cuda_path"].as_str().unwrap();
    assert!(cuda_path.ends_with("/cuda"), "{cuda_path}");
    assert!(!run.log.contains("not found under"), "{}", run.log);
    // The `libraries` suite runs nothing but the look-up (and `versions`).
    assert_eq!(run.checks(), ["versions"]);
}

#[test]
fn nvrtc_newer_than_the_driver_stops_the_kernel_checks_with_one_line() {
    let machine = Machine::new();
    let run = machine.run("core", &[("FAKE_NVRTC_VERSION", "13.2")]);
    let libraries = run.libraries();
    assert_eq!(libraries["status"], "fail");
    let error = libraries["error"].as_str().unwrap();
    assert!(
        error.starts_with("NVRTC 13.2 (")
            && error.contains("is newer than the driver's CUDA 13.0")
            && error.contains("CUDA_ERROR_UNSUPPORTED_PTX_VERSION"),
        "{error}"
    );
    // NCCL and PyTorch need no NVRTC; every check that compiles kernels is left out.
    assert_eq!(
        run.checks(),
        ["versions", "nccl-w1", "fused_adamw_torch.py"],
        "{}",
        run.log
    );
    // The same versions pass when NVRTC is older than the driver.
    let older = machine.run("libraries", &[("FAKE_NVRTC_VERSION", "12.9")]);
    assert_eq!(older.libraries()["status"], "pass", "{}", older.log);
}

#[test]
fn a_libcuda_stub_first_on_ld_library_path_stops_every_check() {
    let machine = Machine::new();
    let stubs = machine.dir.path().join("cuda-13.0/lib64/stubs");
    let run = machine.run("core", &[("LD_LIBRARY_PATH", stubs.to_str().unwrap())]);
    let libraries = run.libraries();
    assert_eq!(libraries["status"], "fail");
    let error = libraries["error"].as_str().unwrap();
    assert!(
        error.contains("is the CUDA toolkit's stub") && error.contains(stubs.to_str().unwrap()),
        "{error}"
    );
    assert_eq!(run.checks(), ["versions"], "{}", run.log);
    // The binary's own finding (cuDriverGetVersion: CUDA_ERROR_STUB_LIBRARY) stops them too.
    let found = machine.run("core", &[("FAKE_DRIVER_VERSION", "stub")]);
    assert_eq!(found.libraries()["status"], "fail");
    assert!(
        found.libraries()["error"]
            .as_str()
            .unwrap()
            .contains("CUDA_ERROR_STUB_LIBRARY")
    );
    assert_eq!(found.checks(), ["versions"], "{}", found.log);
}

#[test]
fn a_library_directory_holding_a_libcuda_stub_is_not_put_first() {
    let machine = Machine::new();
    // A wheel directory with a libcuda.so linked to a stub beside NVRTC.
    machine.file("site/nvidia/cu13/lib/stubs/libcuda.so");
    symlink(
        "stubs/libcuda.so",
        machine.dir.path().join("site/nvidia/cu13/lib/libcuda.so"),
    )
    .unwrap();
    let run = machine.run("core", &[]);
    assert_eq!(run.libraries()["status"], "pass", "{}", run.log);
    let wheel_lib = machine.dir.path().join("site/nvidia/cu13/lib");
    let path = run.ld_library_path("kernels");
    assert!(!path.contains(&wheel_lib.to_str().unwrap()), "{path:?}");
    assert!(
        run.log.contains(&format!(
            "not putting {} on LD_LIBRARY_PATH",
            wheel_lib.display()
        )),
        "{}",
        run.log
    );
}

/// The names of the checks run.sh started, in order (its "NAME (at most N s)" lines).
fn names(run: &Run) -> Vec<String> {
    run.limits().into_iter().map(|(name, _)| name).collect()
}

#[test]
fn each_suite_runs_its_checks_in_order_within_one_deadline() {
    let machine = Machine::new();
    // The first run of a session (the default): PyTorch's reference, the timed DDP step, GPT-2
    // on the stack users train with, two and three ranks on one GPU, then bf16, the other
    // stack and where the time goes.
    let first = machine.run_suites(&[], &[]);
    assert_eq!(
        names(&first),
        [
            "torch-gpt",
            "ddp-timed",
            "gpt-fusion-f32",
            "ranks",
            "gpt-fusion-bf16",
            "gpt-cube-bf16",
            "torch-profile",
            "gpt-profile"
        ],
        "{}",
        first.log
    );
    assert!(
        first
            .call("gpt-fusion-f32")
            .contains("ARGS=[gpt --stack fusion --precision f32 --out "),
        "{}",
        first.calls
    );
    assert!(first.call("ddp-timed").contains("ARGS=[ddp-timed --out "));
    let core = machine.run("core", &[]);
    assert_eq!(
        core.checks(),
        [
            "versions",
            "nccl-w1",
            "kernels",
            "fused-step",
            "ddp-step",
            "fused_adamw_torch.py"
        ],
        "{}",
        core.log
    );
    let gpt = machine.run("gpt", &[]);
    assert_eq!(
        names(&gpt),
        [
            "torch-gpt",
            "gpt-fusion-f32",
            "gpt-fusion-bf16",
            "gpt-cube-f32",
            "gpt-cube-bf16"
        ]
    );
    // Issue 46's line: GPT-2 bf16 at ZeRO-3, the state on the GPU, then offloaded.
    let offload = machine.run("offload", &[]);
    assert_eq!(names(&offload), ["gpt-zero3-bf16", "gpt-offload-bf16"]);
    assert!(
        offload.call("gpt-offload-bf16").contains(
            "ARGS=[gpt --stack fusion --precision bf16 --zero-stage 3 --place offload --out "
        ),
        "{}",
        offload.calls
    );
    let six_b = machine.run("offload-6b", &[]);
    assert_eq!(names(&six_b), ["gpt-6b-device", "gpt-6b-offload"]);
    assert!(
        six_b.call("gpt-6b-device").contains(
            "ARGS=[gpt --stack fusion --precision bf16 --zero-stage 3 --model gpt-6b --expect \
             device-memory-error --out "
        ),
        "{}",
        six_b.calls
    );
    // Suites and checks named together run in the order given, into one folder.
    let mixed = machine.run_suites(&["device", "ranks", "torch-gpt"], &[]);
    assert_eq!(names(&mixed), ["device-path", "ranks", "torch-gpt"]);
    for run in [&first, &core, &gpt, &offload, &six_b, &mixed] {
        // Each check under the smaller of its cap and what the deadline leaves: with a second
        // per check, no limit passes what is left, and every check's limit is at least 1.
        for (elapsed, (name, limit)) in run.limits().into_iter().enumerate() {
            let elapsed = elapsed as u64;
            assert!(
                limit + elapsed <= DEADLINE_S - RESERVE_S,
                "{name}: a limit of {limit} s after {elapsed} s"
            );
        }
        // Every line passed (the stand-ins', the libraries line): run.sh exits 0.
        assert!(run.success, "{}\n{}", run.stdout, run.log);
    }
    // The libraries line, the kernel pack's (the first run's cache) and the binary's four
    // stand-in lines (PyTorch's writes none).
    assert!(
        core.stdout.contains("6 of 6 results passed."),
        "{}",
        core.stdout
    );
    let unknown = machine.run_suites(&["core", "gpt-fusion-f16"], &[]);
    assert!(!unknown.success);
    assert!(unknown.checks().is_empty(), "{}", unknown.calls);
}

/// One deadline for the whole run: what a check leaves goes to the next, a check gets the
/// smaller of its cap and what is left, and one that would get less than the least it needs is
/// not run, with a line that says so (it informs; the run does not fail for it).
#[test]
fn the_deadline_shrinks_the_later_limits_and_skips_what_cannot_fit() {
    let machine = Machine::new();
    let run = machine.run_suites(
        &["e2e"],
        &[
            ("DEADLINE_S", "300"),
            ("FAKE_SECONDS_torch_gpt", "20"),
            ("FAKE_SECONDS_ddp_timed", "150"),
            ("FAKE_SECONDS_gpt_fusion_f32", "100"),
        ],
    );
    // 300 s less the 15 s reserve: torch-gpt its cap (60), ddp-timed its cap (150) after 20 s,
    // gpt-fusion-f32 the 115 s left after 170; then 15 s are left, less than ranks' 60.
    assert_eq!(
        run.limits(),
        [
            ("torch-gpt".to_string(), 60),
            ("ddp-timed".to_string(), 150),
            ("gpt-fusion-f32".to_string(), 115),
        ],
        "{}",
        run.log
    );
    // The binary is told its limit, to plan its steps within it.
    assert!(
        run.call("gpt-fusion-f32").contains("--seconds 115]"),
        "{}",
        run.calls
    );
    let skipped: Vec<&str> = run
        .results
        .iter()
        .filter(|r| r["status"] == "skip" && r["check"] != "kernel-pack")
        .map(|r| r["check"].as_str().unwrap())
        .collect();
    assert_eq!(
        skipped,
        [
            "ranks",
            "gpt-fusion-bf16",
            "gpt-cube-bf16",
            "torch-profile",
            "gpt-profile"
        ]
    );
    let ranks = run.results.iter().find(|r| r["check"] == "ranks").unwrap();
    assert!(
        ranks["error"].as_str().unwrap().contains(
            "15 s were left before the deadline (DEADLINE_S=300), and it needs at least 60 s"
        ),
        "{ranks}"
    );
    assert!(run.success, "{}", run.stdout);
}

#[test]
fn nccl_uses_the_loopback_unless_told_otherwise() {
    let machine = Machine::new();
    let run = machine.run("core", &[]);
    for check in ["nccl-w1", "ddp-step", "fused_adamw_torch.py"] {
        let call = run.call(check);
        assert!(
            call.contains("NCCL_SOCKET_IFNAME=lo ") || call.ends_with("NCCL_SOCKET_IFNAME=lo"),
            "{call}"
        );
    }
    let told = machine.run("core", &[("NCCL_SOCKET_IFNAME", "eth7")]);
    assert!(
        told.call("nccl-w1").contains(" NCCL_SOCKET_IFNAME=eth7 "),
        "{}",
        told.calls
    );
}

/// Every file under `out`, as (path relative to it, size).
fn returned_files(out: &Path) -> Vec<(String, u64)> {
    fn walk(dir: &Path, out: &Path, files: &mut Vec<(String, u64)>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out, files);
            } else {
                let size = std::fs::metadata(&path).unwrap().len();
                let relative = path.strip_prefix(out).unwrap().display().to_string();
                files.push((relative, size));
            }
        }
    }
    let mut files = Vec::new();
    walk(out, out, &mut files);
    files.sort();
    files
}

/// What the device tool brings back: at most 8 files, at most 2 folders down, named in
/// letters, digits, '.', '_' and '-'.
fn assert_returnable(out: &Path, part_bytes: u64) {
    let files = returned_files(out);
    assert!(files.len() <= 8, "{} files: {files:?}", files.len());
    for (path, size) in &files {
        assert!(path.matches('/').count() <= 2, "{path} is too deep");
        assert!(
            path.chars()
                .all(|c| c.is_ascii_alphanumeric() || "._-/".contains(c)),
            "{path}"
        );
        assert!(*size <= part_bytes, "{path}: {size} bytes");
    }
}

/// `both` runs core, then device, in one call (one machine start) and one folder, and the
/// later checks of the binary share cubecl's kernel cache and the driver's.
#[test]
fn both_runs_core_then_device_into_one_folder_sharing_the_kernel_cache() {
    let machine = Machine::new();
    let both = machine.run("both", &[]);
    assert!(both.success, "{}", both.stdout);
    assert_eq!(
        both.checks(),
        [
            "versions",
            "nccl-w1",
            "kernels",
            "fused-step",
            "ddp-step",
            "fused_adamw_torch.py",
            "device-path"
        ],
        "{}",
        both.calls
    );
    // The libraries line, the kernel pack's, one per binary check (PyTorch's stand-in writes
    // none).
    assert_eq!(both.results.len(), 7, "{:?}", both.results);
    let cache = machine.path("cache");
    for check in ["kernels", "fused-step", "ddp-step", "device-path"] {
        assert!(
            both.call(check)
                .contains(&format!("--cache {}", cache.display())),
            "{check}: {}",
            both.call(check)
        );
    }
    let seen = both.call("device-path");
    for kernel in [
        "compilation:kernel-kernels",
        "autotune:kernel-ddp-step",
        "driver:kernel-fused-step",
    ] {
        assert!(seen.contains(kernel), "{kernel}: {seen}");
    }
    assert_returnable(&machine.path("out"), 15 << 20);
}

/// The TAG of a returned pack, as key=value pairs.
fn tag(pack: &Path) -> std::collections::BTreeMap<String, String> {
    std::fs::read_to_string(pack.join("TAG"))
        .unwrap_or_else(|e| panic!("{}: {e}", pack.join("TAG").display()))
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A copy of the last run's pack, where a later call finds it (as if committed), and a fresh
/// machine's empty cache.
fn carry_pack(machine: &Machine) -> PathBuf {
    let carried = machine.path("carried-pack");
    let _ = std::fs::remove_dir_all(&carried);
    std::fs::create_dir_all(&carried).unwrap();
    for entry in std::fs::read_dir(machine.path("out/kernel-pack")).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, carried.join(path.file_name().unwrap())).unwrap();
    }
    let _ = std::fs::remove_dir_all(machine.path("cache"));
    carried
}

fn pack_line(run: &Run) -> &Value {
    run.results
        .iter()
        .find(|r| r["check"] == "kernel-pack")
        .unwrap_or_else(|| panic!("no kernel-pack line: {:?}", run.results))
}

/// Each run packs cubecl's compiled kernels, its autotune results and the driver's cache into
/// $OUT/kernel-pack with a tag of what they were built from, and a later call on a fresh
/// machine that finds the pack starts with all of them.
#[test]
fn the_kernel_pack_is_tagged_and_warms_the_next_call() {
    let machine = Machine::new();
    let first = machine.run("core", &[]);
    assert!(
        first.call("kernels").contains(" CACHE_SEEN= "),
        "the first call starts cold: {}",
        first.calls
    );
    assert_eq!(pack_line(&first)["status"], "skip");
    let pack = machine.path("out/kernel-pack");
    let tagged = tag(&pack);
    assert_eq!(tagged["kernels"], "k1");
    assert_eq!(tagged["lock"], "l1");
    assert_eq!(tagged["cc"], "9.0");
    assert_eq!(tagged["contents"], "autotune compilation driver");
    assert_eq!(tagged["parts"], "1");
    let part = std::fs::read(pack.join("part-00")).unwrap();
    let listed = Command::new("tar")
        .arg("-tzf")
        .arg(pack.join("part-00"))
        .output()
        .expect("tar lists the pack");
    let listed = String::from_utf8_lossy(&listed.stdout);
    for kernel in [
        "compilation/kernel-kernels",
        "autotune/kernel-ddp-step",
        "driver/kernel-fused-step",
    ] {
        assert!(listed.contains(kernel), "{kernel}: {listed}");
    }
    assert!(!part.is_empty());

    let carried = carry_pack(&machine);
    let carried = carried.to_str().unwrap();
    let next = machine.run("device", &[("GPU_CHECK_PACK", carried)]);
    let seen = next.call("device-path");
    for kernel in [
        "compilation:kernel-kernels",
        "autotune:kernel-ddp-step",
        "driver:kernel-fused-step",
    ] {
        assert!(
            seen.contains(kernel),
            "{kernel} was not there before the first check: {seen}"
        );
    }
    let line = pack_line(&next);
    assert_eq!(line["status"], "pass");
    assert_eq!(line["used"], "driver autotune compilation");
    assert_eq!(line["dropped"], "nothing");
    // A call on the same warm machine keeps the kernels it already has.
    let warm = machine.run("device", &[("GPU_CHECK_PACK", carried)]);
    assert!(
        pack_line(&warm)["used"]
            .as_str()
            .unwrap()
            .contains("an earlier call on this machine")
    );
}

/// cubecl keys a compiled kernel by its name, not its source: a pack from other kernel sources
/// loses its compiled kernels, one from another Cargo.lock or GPU its autotune results too; the
/// driver's cache, keyed by the PTX itself, is always kept.
#[test]
fn a_pack_from_another_build_or_gpu_keeps_only_what_stays_valid() {
    let machine = Machine::new();
    machine.run("core", &[]);
    let carried = carry_pack(&machine);
    let carried = carried.to_str().unwrap();
    let with_tag = |build_tag: Option<&str>, cc: &str| {
        let tag_file = machine.path("bin/build-tag");
        match build_tag {
            Some(text) => std::fs::write(&tag_file, text).unwrap(),
            None => std::fs::remove_file(&tag_file).unwrap(),
        }
        let _ = std::fs::remove_dir_all(machine.path("cache"));
        machine.run(
            "device",
            &[("GPU_CHECK_PACK", carried), ("GPU_CHECK_CC", cc)],
        )
    };
    let cases = [
        (
            Some("kernels=k2\nlock=l1\n"),
            "9.0",
            "driver autotune",
            "compilation",
            "kernels=k1",
        ),
        (
            Some("kernels=k1\nlock=l2\n"),
            "9.0",
            "driver",
            "autotune compilation",
            "lock=l1",
        ),
        (
            Some("kernels=k1\nlock=l1\n"),
            "8.0",
            "driver",
            "autotune compilation",
            "cc=9.0",
        ),
        // A binary without its tag: nothing it can be matched with.
        (
            None,
            "9.0",
            "driver",
            "autotune compilation",
            "lock=unknown",
        ),
    ];
    for (build_tag, cc, used, dropped, reason) in cases {
        let run = with_tag(build_tag, cc);
        let line = pack_line(&run);
        assert_eq!(line["used"], used, "{build_tag:?} {cc}: {line}");
        assert_eq!(line["dropped"], dropped, "{build_tag:?} {cc}: {line}");
        assert!(line["reason"].as_str().unwrap().contains(reason), "{line}");
        let seen = run.call("device-path");
        assert!(seen.contains("driver:kernel-kernels"), "{seen}");
        assert_eq!(
            seen.contains("autotune:"),
            used.contains("autotune"),
            "{seen}"
        );
        assert_eq!(
            seen.contains("compilation:"),
            used.contains("compilation"),
            "{seen}"
        );
    }
}

/// A pack whose parts do not match its TAG is not unpacked: the run says so and starts cold.
#[test]
fn a_damaged_pack_is_refused_and_the_run_starts_cold() {
    let machine = Machine::new();
    machine.run("core", &[]);
    let carried = carry_pack(&machine);
    let part = carried.join("part-00");
    let mut bytes = std::fs::read(&part).unwrap();
    bytes.truncate(bytes.len() / 2);
    std::fs::write(&part, bytes).unwrap();
    let run = machine.run("device", &[("GPU_CHECK_PACK", carried.to_str().unwrap())]);
    let line = pack_line(&run);
    assert_eq!(line["status"], "fail");
    assert!(
        line["error"].as_str().unwrap().contains("damaged"),
        "{line}"
    );
    assert!(
        run.call("device-path").contains(" CACHE_SEEN= "),
        "{}",
        run.calls
    );
}

/// The pack takes only what the device tool brings back: parts of at most GPU_CHECK_PART_BYTES
/// in the room the other files leave among 8; when the whole cache does not fit, the driver's
/// cache goes first, then cubecl's PTX.
#[test]
fn the_pack_fits_in_what_the_device_tool_returns() {
    let machine = Machine::new();
    // Three kernel checks, 3000 random bytes each in each of the three parts of the cache:
    // 27 KB in all, 18 KB without the driver's, 9 KB of autotune results; room for 4 parts of
    // 4 KiB.
    let run = machine.run(
        "core",
        &[
            ("GPU_CHECK_PART_BYTES", "4096"),
            ("FAKE_KERNEL_BYTES", "3000"),
        ],
    );
    assert!(run.success, "{}\n{}", run.stdout, run.log);
    let out = machine.path("out");
    assert_returnable(&out, 15 << 20);
    let tagged = tag(&out.join("kernel-pack"));
    assert_eq!(tagged["contents"], "autotune", "{}", run.log);
    let parts: u64 = tagged["parts"].parse().unwrap();
    assert_eq!(parts, 3, "9 KB in parts of 4 KiB");
    for (path, size) in returned_files(&out) {
        if path.contains("part-") {
            assert!(size <= 4096, "{path}: {size} bytes");
        }
    }
    assert!(
        run.log
            .contains("kernel pack: autotune compilation driver is"),
        "{}",
        run.log
    );
    // What a call carries binds too: the pack must leave room for the binary (the stand-in's
    // 1.4 KB) and 8 MiB more; 13.6 KB are left, the autotune results' 9 KB fit, 18 KB do not.
    let carried = machine.run(
        "core",
        &[
            ("GPU_CHECK_CARRY_BYTES", &((8 << 20) + 15_000).to_string()),
            ("FAKE_KERNEL_BYTES", "3000"),
        ],
    );
    assert_eq!(
        tag(&out.join("kernel-pack"))["contents"],
        "autotune",
        "{}",
        carried.log
    );
    assert!(carried.log.contains("beside the"), "{}", carried.log);
    // The sanitizer's four files leave no room: nothing is packed, and it says so.
    let toolkit = machine.dir.path().join("cuda-13.0");
    machine.executable(
        "cuda-13.0/bin/compute-sanitizer",
        "#!/usr/bin/env bash\nshift 4\n\"$@\"\necho '========= ERROR SUMMARY: 0 errors'\n",
    );
    let sanitized = machine.run("sanitize", &[("CUDA_PATH", toolkit.to_str().unwrap())]);
    assert!(sanitized.log.contains("leave no room"), "{}", sanitized.log);
    assert_returnable(&out, 15 << 20);
}

/// A run stopped from outside (the device tool's limit) still packs what it compiled and writes
/// its report of the lines it finished.
#[test]
fn a_run_stopped_by_a_signal_packs_and_reports_what_it_finished() {
    let machine = Machine::new();
    let run = machine.run("core", &[("FAKE_STOP_AT", "kernels")]);
    assert!(!run.success);
    assert_eq!(
        run.checks(),
        ["versions", "nccl-w1", "kernels"],
        "{}",
        run.calls
    );
    assert!(run.log.contains("stopped by a signal"), "{}", run.log);
    let out = machine.path("out");
    let report = std::fs::read_to_string(out.join("gpu-check.md")).unwrap();
    assert!(report.contains("kernels/stand-in"), "{report}");
    let listed = Command::new("tar")
        .arg("-tzf")
        .arg(out.join("kernel-pack/part-00"))
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&listed.stdout).contains("compilation/kernel-kernels"));
}

/// The binary runs with the library directory run.sh builds first on LD_LIBRARY_PATH;
/// PyTorch's scripts with the machine's own, untouched (a toolkit's lib64 ahead of the wheels'
/// libraries breaks `import torch` with a newer wheel), and without one when it had none.
#[test]
fn pytorch_runs_with_the_machines_own_library_path() {
    let machine = Machine::new();
    let own = machine.path("machine-lib");
    std::fs::create_dir_all(&own).unwrap();
    let own = own.display().to_string();
    let run = machine.run("core", &[("LD_LIBRARY_PATH", &own)]);
    let binary = run.ld_library_path("ddp-step");
    assert!(
        binary.len() > 1 && binary.last() == Some(&own.as_str()),
        "{binary:?}"
    );
    assert!(
        run.call("fused_adamw_torch.py")
            .ends_with(&format!(" LD_LIBRARY_PATH={own}")),
        "{}",
        run.calls
    );
    let none = machine.run_removing(&["core"], &[], &["LD_LIBRARY_PATH"]);
    assert!(
        none.call("fused_adamw_torch.py")
            .ends_with(" LD_LIBRARY_PATH=unset"),
        "{}",
        none.calls
    );
}

/// `run.sh sanitize` runs the kernels check under the toolkit's compute-sanitizer, racecheck
/// then memcheck, and reports what it found without failing the run; without the tool it says
/// so in one line and exits 0 all the same.
#[test]
fn the_sanitizer_reports_and_never_blocks() {
    let machine = Machine::new();
    let toolkit = machine.dir.path().join("cuda-13.0");
    let cuda_path = [("CUDA_PATH", toolkit.to_str().unwrap())];
    let absent = machine.run("sanitize", &cuda_path);
    assert!(absent.success, "{}\n{}", absent.stdout, absent.log);
    let skipped: Vec<&Value> = absent
        .results
        .iter()
        .filter(|r| r["check"] == "sanitize/tool")
        .collect();
    assert_eq!(skipped.len(), 1, "{:?}", absent.results);
    assert_eq!(skipped[0]["status"], "skip");

    // A sanitizer that finds errors in racecheck (exit code 99, as run.sh asks) and none in
    // memcheck; it records its calls and runs the binary it was given.
    machine.executable(
        "cuda-13.0/bin/compute-sanitizer",
        r#"#!/usr/bin/env bash
tool="$2"
echo "compute-sanitizer $tool" >>"$FAKE_CALLS"
shift 4
"$@"
if [ "$tool" = racecheck ]; then
    echo "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)"
    exit 99
fi
echo "========= ERROR SUMMARY: 0 errors"
"#,
    );
    let run = machine.run("sanitize", &cuda_path);
    assert!(
        run.success,
        "a report must not fail the run\n{}\n{}",
        run.stdout, run.log
    );
    assert_eq!(
        run.checks(),
        [
            "versions",
            "compute-sanitizer",
            "kernels",
            "compute-sanitizer",
            "kernels"
        ],
        "{}",
        run.calls
    );
    let line = |check: &str| {
        run.results
            .iter()
            .find(|r| r["check"] == check)
            .unwrap_or_else(|| panic!("no {check} line in {:?}", run.results))
    };
    assert_eq!(line("sanitize/racecheck")["status"], "report");
    assert!(
        line("sanitize/racecheck")["error"]
            .as_str()
            .unwrap()
            .contains("1 hazard"),
        "{:?}",
        line("sanitize/racecheck")
    );
    assert_eq!(line("sanitize/memcheck")["status"], "pass");
    assert!(
        run.stdout.contains("2 reported without a verdict"),
        "{}",
        run.stdout
    );
}
