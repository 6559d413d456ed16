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

/// What one suite's limits may add up to (run.sh's SUITE_LIMIT_S): a 7-minute device call,
/// less the machine's start and the transfers.
const SUITE_LIMIT_S: u64 = 300;
/// What `both`'s limits may add up to (run.sh's BOTH_LIMIT_S): one device call of at most 600 s
/// (the device tool's limit per command), less each suite's set-up and report.
const BOTH_LIMIT_S: u64 = 540;

const STAND_IN_BIN: &str = r#"#!/usr/bin/env bash
first="${LD_LIBRARY_PATH%%:*}"
# As cubecl does with `--cache DIR`: what the cache holds is read, and this check's kernel added.
cache=""; previous=""
for arg in "$@"; do [ "$previous" = --cache ] && cache="$arg"; previous="$arg"; done
seen=""
if [ -n "$cache" ]; then seen="$(ls "$cache" 2>/dev/null | tr '\n' ,)"; mkdir -p "$cache"; echo "$1" >"$cache/kernel-$1"; fi
echo "$1 ARGS=[$*] CACHE_SEEN=$seen NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-} FIRST_DIR=$(ls "$first" | tr '\n' ,) LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}" >>"$FAKE_CALLS"
case "$1" in
    versions) echo "nvrtc=$FAKE_NVRTC_VERSION driver=$FAKE_DRIVER_VERSION" ;;
    *) echo "{\"check\": \"$1/stand-in\", \"status\": \"pass\", \"unix_time\": 0}" >>"$3" ;;
esac
"#;

/// python3 without site-packages (-S: a real `nvidia` package there would join the namespace),
/// except that PyTorch's scripts are only recorded.
const STAND_IN_PYTHON: &str = r#"#!/usr/bin/env bash
case "${1:-}" in
    *_torch.py) echo "$(basename "$1") NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-} LD_LIBRARY_PATH=${LD_LIBRARY_PATH-unset}" >>"$FAKE_CALLS"; exit 0 ;;
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
        machine
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
        self.run_removing(suite, env, &[])
    }

    /// [`Machine::run`] with the variables `removed` taken out of the environment.
    fn run_removing(&self, suite: &str, env: &[(&str, &str)], removed: &[&str]) -> Run {
        let run_sh = Path::new(env!("CARGO_MANIFEST_DIR")).join("run.sh");
        let out = self.dir.path().join("out");
        let calls = self.dir.path().join("calls.txt");
        let _ = std::fs::remove_file(&calls);
        let mut command = Command::new("bash");
        command
            .arg(&run_sh)
            .arg(suite)
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
        command.env("GPU_CHECK_CACHE", self.dir.path().join("cache"));
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

#[test]
fn each_suite_runs_its_checks_in_order_within_one_device_call() {
    let machine = Machine::new();
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
        gpt.checks(),
        ["versions", "gpt-f32", "gpt-bf16", "gpt2_torch.py"],
        "{}",
        gpt.log
    );
    let device = machine.run("device", &[]);
    assert_eq!(
        device.checks(),
        ["versions", "device-path"],
        "{}",
        device.log
    );
    for run in [&core, &gpt, &device] {
        let limits = run.limits();
        assert_eq!(limits.len(), run.checks().len() - 1, "{limits:?}");
        let total: u64 = limits.iter().map(|(_, s)| s).sum();
        assert!(total <= SUITE_LIMIT_S, "{limits:?} add up to {total} s");
        // Every line passed (the stand-ins' and the libraries line): run.sh exits 0.
        assert!(run.success, "{}\n{}", run.stdout, run.log);
    }
    assert!(
        core.stdout.contains("5 of 5 results passed"),
        "{}",
        core.stdout
    );
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

/// `both` runs core, then device, in one call (one machine start), each suite writing its own
/// folder, and its limits fit one device call; the later checks of the binary share cubecl's
/// kernel cache.
#[test]
fn both_suites_run_in_one_call_into_two_folders_sharing_the_kernel_cache() {
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
            "versions",
            "device-path"
        ],
        "{}",
        both.calls
    );
    let out = machine.path("out");
    let mut total = 0;
    // The libraries line and one per binary check (the PyTorch stand-in writes none).
    for (suite, lines) in [("core", 5), ("device", 2)] {
        let log = std::fs::read_to_string(out.join(suite).join("gpu-check.log")).unwrap();
        let results = std::fs::read_to_string(out.join(suite).join("results.jsonl")).unwrap();
        assert_eq!(results.lines().count(), lines, "{suite}: {results}");
        assert!(out.join(suite).join("gpu-check.md").exists(), "{suite}");
        total += Run {
            log,
            results: Vec::new(),
            calls: String::new(),
            stdout: String::new(),
            success: true,
        }
        .limits()
        .iter()
        .map(|(_, s)| s)
        .sum::<u64>();
    }
    assert!(
        total <= BOTH_LIMIT_S,
        "both suites' limits add up to {total} s"
    );
    for check in ["kernels", "fused-step", "ddp-step", "device-path"] {
        let cache = machine.path("cache");
        assert!(
            both.call(check)
                .contains(&format!("--cache {}", cache.display())),
            "{check}: {}",
            both.call(check)
        );
    }
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
    let none = machine.run_removing("core", &[], &["LD_LIBRARY_PATH"]);
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
        run.stdout.contains("1 reported without a verdict"),
        "{}",
        run.stdout
    );
}

/// The kernel cache outlives the machine: each suite packs it into its results folder, and a
/// pack carried beside run.sh is unpacked into an empty cache before the first check, so that
/// the next call's checks find the kernels an earlier call compiled.
#[test]
fn the_kernel_cache_is_packed_and_a_carried_pack_warms_the_next_call() {
    let machine = Machine::new();
    let carried = machine.path("carried/cubecl-cache.tar.gz");
    let first = machine.run(
        "core",
        &[("GPU_CHECK_CARRIED_CACHE", carried.to_str().unwrap())],
    );
    assert!(
        first.call("kernels").contains(" CACHE_SEEN= "),
        "the first call starts cold: {}",
        first.calls
    );
    let pack = machine.path("out/cubecl-cache.tar.gz");
    let listed = Command::new("tar")
        .arg("-tzf")
        .arg(&pack)
        .output()
        .expect("tar lists the pack");
    let listed = String::from_utf8_lossy(&listed.stdout);
    assert!(
        listed.contains("kernel-kernels") && listed.contains("kernel-ddp-step"),
        "the pack holds what the checks compiled: {listed}\n{}",
        first.log
    );
    assert!(
        first.log.contains("cubecl cache: packed into"),
        "{}",
        first.log
    );

    // The next call, on a fresh machine: the cache folder is gone, the pack was carried.
    std::fs::create_dir_all(carried.parent().unwrap()).unwrap();
    std::fs::copy(&pack, &carried).unwrap();
    std::fs::remove_dir_all(machine.path("cache")).unwrap();
    let next = machine.run(
        "device",
        &[("GPU_CHECK_CARRIED_CACHE", carried.to_str().unwrap())],
    );
    let seen = next.call("device-path");
    assert!(
        seen.contains("kernel-kernels") && seen.contains("kernel-ddp-step"),
        "the carried kernels are there before the first check: {seen}\n{}",
        next.log
    );
    assert!(next.log.contains("cubecl cache: unpacked"), "{}", next.log);
}
