#!/usr/bin/env bash
# The burn-dist device check, on the GPU machine. `cargo xtask gpu-check` copies this script,
# the binary, fused_adamw_torch.py and gpt2_torch.py into target-gpu/; run it from anywhere:
#
#     bash target-gpu/run.sh both       # core, then device, in one device call (the first run)
#     bash target-gpu/run.sh            # the core checks (NCCL, kernels, fused step, DDP step)
#     bash target-gpu/run.sh device     # Burn's Cuda (fusion on) on the device path, ZeroAdam's step
#     bash target-gpu/run.sh gpt        # the end-to-end GPT-2 124M comparison with PyTorch
#     bash target-gpu/run.sh libraries  # only the library look-up and the version check
#     bash target-gpu/run.sh sanitize   # the kernels check under compute-sanitizer, if present
#
# A suite's limits add up to at most SUITE_LIMIT_S, `both`'s to BOTH_LIMIT_S (below), so that
# `both` fits one device call of at most 10 minutes and a machine start each call saves.
# `both` writes $OUT/core/ and $OUT/device/, each with the three files below. The script finds libnccl and libnvrtc
# (the toolkit's, else the Python environment's nvidia-* packages), checks that NVRTC is not
# newer than the driver and that no libcuda stub shadows the driver, runs each check under its
# own timeout, and writes
#   $OUT/results.jsonl   one JSON line per result, written as soon as it is known
#   $OUT/gpu-check.md    a dated table of the results
#   $OUT/gpu-check.log   everything the checks printed, the library paths and versions
# OUT defaults to target-gpu/out. Exit code: 0 when every result passed.
#
# Environment: PYTHON (default python3, the one with torch and the nvidia-* packages),
# ELEMENTS (fused-step size, default 268435456 = 2^28), DEVICE (default 0), CUDA_PATH (a CUDA
# toolkit; default: the first of CUDA_ROOTS, "/usr/local/cuda /opt/cuda" and nvcc's, with
# include/cuda_runtime.h), NCCL_SOCKET_IFNAME (default lo: world size 1 needs no network),
# NCCL_DEBUG (default WARN). For the rehearsal without a GPU (tests/run_sh.rs): GPU_CHECK_BIN
# (the binary; default beside this script).
set -uo pipefail
SUITE="${1:-core}"
case "$SUITE" in both | core | gpt | device | libraries | sanitize) ;; *) echo "usage: run.sh [both|core|gpt|device|libraries|sanitize]" >&2; exit 2 ;; esac
# What one suite's limits may add up to: a 7-minute device call, less about 90 s for the
# machine's start and the transfers, less about 20 s for this script's own set-up and report.
SUITE_LIMIT_S=300
# core and device in one call of at most 600 s: their limits, each suite's set-up and report
# (about 20 s each) and the kill margins fit.
BOTH_LIMIT_S=540

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"
if [ "$SUITE" = both ]; then
    OUT="$OUT/core" bash "${BASH_SOURCE[0]}" core
    core=$?
    OUT="$OUT/device" bash "${BASH_SOURCE[0]}" device
    device=$?
    exit $((core > device ? core : device))
fi
# The checks' binary shares compiled kernels and autotune results through this directory
# (`--cache`): within one device call the later checks do not compile them again. It lives
# outside this folder: each device call that carries target-gpu/ replaces the folder, and a
# second call on the same warm machine would find its cache gone (2026-12-04: the gpt suite,
# called again at once, compiled cold a second time).
CACHE="${GPU_CHECK_CACHE:-/tmp/burn-dist-gpu-check-cache}"
# Across calls and sessions they survive only if they come back: each suite packs the cache
# into $OUT (below), and an earlier call's pack put beside this script (docs/gpu.md) is
# unpacked into an empty cache before the first check. On the first H200 run the cold
# compilation of the device suite's fused kernels took 166 s of its 245.
CARRIED_CACHE="${GPU_CHECK_CARRIED_CACHE:-$HERE/cubecl-cache.tar.gz}"
# PyTorch's scripts run with the LD_LIBRARY_PATH the machine gave: the one built below puts
# the toolkit's lib64 ahead of the wheels' CUDA libraries, and a newer torch wheel then fails
# at `import torch`. Only the binary needs it.
ORIGINAL_LD_LIBRARY_PATH="${LD_LIBRARY_PATH-unset}"
# The interpreter with torch and the nvidia-* wheels: $PYTHON, else the first that imports
# torch (the workplace's image: a plain python3, /opt/torch/.venv/bin/python3).
PY=""
for candidate in ${PYTHON:-} python3 python /opt/torch/.venv/bin/python3 /opt/conda/bin/python; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import torch' >/dev/null 2>&1; then
        PY="$candidate"
        break
    fi
done
PY="${PY:-${PYTHON:-python3}}"
# 2^28: 10 GB moved per fused step, far past the caches, while the host-side set-up (random
# state tiled to this length, then uploaded) stays a few seconds; at 2^30 it took most of the
# check's limit and left no time for Burn's AdamW line.
ELEMENTS="${ELEMENTS:-268435456}"
DEVICE="${DEVICE:-0}"
BIN="${GPU_CHECK_BIN:-$HERE/burn-dist-gpu-check}"
mkdir -p "$OUT"
RESULTS="$OUT/results.jsonl"
LOG="$OUT/gpu-check.log"
: >"$RESULTS"
: >"$LOG"
STARTED="$(date -u +%Y-%m-%dT%H:%M:%SZ)"

note() { echo "run.sh: $*" | tee -a "$LOG"; }

# An earlier call's cache, carried here, warms this one (only into an empty cache: a cache this
# call already filled is newer).
if [ -f "$CARRIED_CACHE" ] && [ ! -e "$CACHE" ]; then
    mkdir -p "$CACHE"
    if tar -xzf "$CARRIED_CACHE" -C "$CACHE" 2>>"$LOG"; then
        note "cubecl cache: unpacked $CARRIED_CACHE into $CACHE"
    else
        note "cubecl cache: $CARRIED_CACHE could not be unpacked; the checks compile cold"
    fi
fi

# A result line written by this script (the checks write their own).
result() { # check status error [key=value...] (an empty error is left out)
    "$PY" -c 'import json, sys, time
line = {"check": sys.argv[1], "status": sys.argv[2], "unix_time": int(time.time())}
if sys.argv[3]:
    line["error"] = sys.argv[3]
line.update(arg.split("=", 1) for arg in sys.argv[4:])
print(json.dumps(line))' \
        "$@" | tee -a "$LOG" >>"$RESULTS"
}

# --- Libraries -----------------------------------------------------------------------------
# cudarc opens libnccl.so or libnccl.so.<CUDA major> (13 here), never libnccl.so.2, which is
# all the nvidia-nccl-cu13 wheel ships: link libnccl.so to it in a directory of our own.
# libnvrtc (cubecl-cuda compiles its kernels at run time) comes from the toolkit, else from
# nvidia-cuda-nvrtc; NVRTC opens libnvrtc-builtins by itself, so it is linked beside it.
LIBDIR="$(mktemp -d)"
NVIDIA_DIRS="$("$PY" -c 'import os, nvidia
print("\n".join(os.path.abspath(p) for p in nvidia.__path__))' 2>>"$LOG")"
if [ -z "$NVIDIA_DIRS" ]; then
    for site in $("$PY" -c 'import site; print(" ".join(site.getsitepackages()))' 2>>"$LOG"); do
        [ -d "$site/nvidia" ] && NVIDIA_DIRS="$NVIDIA_DIRS $site/nvidia"
    done
fi
# The first file or link named like $2 directly in the directories $1 (a symlinked directory is
# followed: -H; `find DIR` alone does not descend a DIR that is a link), never in a stubs/
# directory (the toolkit's link-time stand-ins, which cannot run anything).
first_in() { # dirs pattern [maxdepth]
    # shellcheck disable=SC2086 # $1 is a list of directories
    find -H $1 ${3:+-maxdepth "$3"} -name "$2" \( -type f -o -type l \) -not -path '*/stubs/*' 2>/dev/null | sort | head -n 1
}
find_lib() { # pattern: the first match under the nvidia packages, else the system's
    local found=""
    [ -n "$NVIDIA_DIRS" ] && found="$(first_in "$NVIDIA_DIRS" "$1")"
    [ -z "$found" ] && found="$(ldconfig -p 2>/dev/null | awk -v p="${1%\*}" '$1 ~ "^"p && $NF !~ "/stubs/" {print $NF; exit}')"
    echo "$found"
}
# cubecl-cuda compiles its kernels with NVRTC at run time and needs CUDA's headers
# (cuda_runtime.h, cuda_fp16.h, cuda_bf16.h, mma.h; CCCL's cuda/pipeline under include/ or,
# as CUDA 13 keeps it, include/cccl/, which cubecl-cuda also puts on NVRTC's include path): it
# looks in $CUDA_PATH, /usr/local/cuda, /opt/cuda, or beside /usr/bin/nvcc, and panics when
# none exists. Prefer a toolkit (the image's nvcc), whose NVRTC also matches the driver; else
# assemble the headers of the nvidia-* wheels into one include directory.
if [ -z "${CUDA_PATH:-}" ]; then
    NVCC="$(command -v nvcc 2>/dev/null || true)"
    for root in ${CUDA_ROOTS:-/usr/local/cuda /opt/cuda ${NVCC:+"$(dirname "$(dirname "$NVCC")")"}}; do
        if [ -f "$root/include/cuda_runtime.h" ]; then export CUDA_PATH="$root"; break; fi
    done
fi
if [ -z "${CUDA_PATH:-}" ] && [ -n "$NVIDIA_DIRS" ]; then
    mkdir -p "$LIBDIR/cuda/include"
    # shellcheck disable=SC2086
    for inc in $(find $NVIDIA_DIRS -maxdepth 3 -type d -name include 2>/dev/null); do
        ln -sf "$inc"/* "$LIBDIR/cuda/include/" 2>/dev/null
    done
    export CUDA_PATH="$LIBDIR/cuda"
fi
for header in cuda_runtime.h cuda_fp16.h cuda_bf16.h mma.h cuda/pipeline; do
    include="${CUDA_PATH:-/nonexistent}/include"
    [ -e "$include/$header" ] || [ -e "$include/cccl/$header" ] ||
        note "CUDA header $header not found under ${CUDA_PATH:-no CUDA_PATH}/include nor include/cccl"
done
note "CUDA_PATH=${CUDA_PATH:-none} (nvcc: $(command -v nvcc 2>/dev/null || echo none))"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# World size 1 needs no network; in a VM NCCL's interface search can pick an interface that
# does not work, or fail on none: the loopback always exists.
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}"
note "NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME NCCL_DEBUG=$NCCL_DEBUG${NCCL_CUMEM_ENABLE:+ NCCL_CUMEM_ENABLE=$NCCL_CUMEM_ENABLE}"

NCCL="$(find_lib 'libnccl.so*')"
# NVRTC: the toolkit's first (it matches the driver's PTX version), else the wheel's.
NVRTC="$(first_in "${CUDA_PATH:-/nonexistent}/lib64 ${CUDA_PATH:-/nonexistent}/lib" 'libnvrtc.so*' 1)"
[ -z "$NVRTC" ] && NVRTC="$(find_lib 'libnvrtc.so*')"

# A libcuda.so in DIR that is the toolkit's stub (in, or linked into, a stubs/ directory):
# first on LD_LIBRARY_PATH it shadows the driver's, and every CUDA call then fails with
# CUDA_ERROR_STUB_LIBRARY.
stub_libcuda() { # dir: prints the stub's path, if DIR holds one
    local lib
    for lib in "$1"/libcuda.so "$1"/libcuda.so.*; do
        [ -e "$lib" ] || continue
        case "$1/ $(readlink -f "$lib")" in
            */stubs/*) echo "$lib -> $(readlink -f "$lib")"; return ;;
        esac
    done
}
EXTRA=""
add_dir() { # dir: put it on LD_LIBRARY_PATH after $LIBDIR, unless it holds a libcuda stub
    local stub
    stub="$(stub_libcuda "$1")"
    if [ -n "$stub" ]; then
        note "not putting $1 on LD_LIBRARY_PATH: its libcuda ($stub) is the toolkit's stub, which would shadow the driver's"
    else
        EXTRA="$EXTRA:$1"
    fi
}
if [ -n "$NCCL" ]; then
    ln -sf "$NCCL" "$LIBDIR/libnccl.so"
    add_dir "$(dirname "$NCCL")"
else
    note "no libnccl found under the Python nvidia packages ($NVIDIA_DIRS) nor by ldconfig"
fi
if [ -n "$NVRTC" ]; then
    ln -sf "$NVRTC" "$LIBDIR/libnvrtc.so"
    for builtins in "$(dirname "$NVRTC")"/libnvrtc-builtins.so*; do
        [ -e "$builtins" ] && ln -sf "$builtins" "$LIBDIR/"
    done
    add_dir "$(dirname "$NVRTC")"
else
    note "no libnvrtc found under ${CUDA_PATH:-no CUDA_PATH}/lib64, the Python nvidia packages ($NVIDIA_DIRS) nor by ldconfig"
fi
export LD_LIBRARY_PATH="$LIBDIR$EXTRA${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
note "libnccl: ${NCCL:-none} (resolved: $([ -n "$NCCL" ] && readlink -f "$NCCL" || echo none))"
note "libnvrtc: ${NVRTC:-none} (resolved: $([ -n "$NVRTC" ] && readlink -f "$NVRTC" || echo none))"
note "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
GPU="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>>"$LOG" | head -n 1)"
note "GPU: ${GPU:-nvidia-smi gave nothing}"

# What stops every check before it starts, in one line (empty: nothing).
BLOCKED=""
# The libcuda that cudarc opens first (libcuda.so) on LD_LIBRARY_PATH, if any is there (else
# the loader's cache, the driver's).
IFS=: read -ra SEARCH <<<"$LD_LIBRARY_PATH"
for dir in "${SEARCH[@]}"; do
    [ -e "$dir/libcuda.so" ] || continue
    stub="$(stub_libcuda "$dir")"
    if [ -n "$stub" ]; then
        BLOCKED="libcuda.so on LD_LIBRARY_PATH ($stub) is the CUDA toolkit's stub, which shadows the driver's libcuda: remove $dir from LD_LIBRARY_PATH"
    fi
    note "libcuda: $dir/libcuda.so (first on LD_LIBRARY_PATH)"
    break
done
# NVRTC's and the driver's CUDA versions, as the binary loads them (`versions`: one line
# "nvrtc=13.0 driver=13.0"; "none" for a library that does not load, "stub" for the stub).
VERSIONS=""
[ -f "$BIN" ] && chmod +x "$BIN" 2>/dev/null
[ -x "$BIN" ] && VERSIONS="$(timeout 30 "$BIN" versions 2>>"$LOG" | tail -n 1)"
version_of() { # name: the value of name= in $VERSIONS, or "unknown"
    local v
    v="$(echo "$VERSIONS" | tr ' ' '\n' | sed -n "s/^$1=//p")"
    echo "${v:-unknown}"
}
NVRTC_VERSION="$(version_of nvrtc)"
DRIVER_VERSION="$(version_of driver)"
note "versions: NVRTC $NVRTC_VERSION ($([ -n "$NVRTC" ] && readlink -f "$NVRTC" || echo none)), driver's CUDA $DRIVER_VERSION"
as_number() { # "13.0" -> 13000, as cuDriverGetVersion counts; empty when not a version
    case "$1" in
        [0-9]*.[0-9]*) echo $((${1%%.*} * 1000 + ${1#*.} * 10)) ;;
    esac
}
if [ "$DRIVER_VERSION" = stub ] && [ -z "$BLOCKED" ]; then
    BLOCKED="the libcuda the binary loads is the CUDA toolkit's stub (cuDriverGetVersion: CUDA_ERROR_STUB_LIBRARY): put the driver's libcuda first on LD_LIBRARY_PATH"
fi
NVRTC_CODE="$(as_number "$NVRTC_VERSION")"
DRIVER_CODE="$(as_number "$DRIVER_VERSION")"
# A newer NVRTC writes PTX the driver cannot load: every kernel would fail with
# CUDA_ERROR_UNSUPPORTED_PTX_VERSION. Only the checks that compile kernels are stopped.
NVRTC_BLOCKED=""
if [ -n "$NVRTC_CODE" ] && [ -n "$DRIVER_CODE" ] && [ "$NVRTC_CODE" -gt "$DRIVER_CODE" ]; then
    NVRTC_BLOCKED="NVRTC $NVRTC_VERSION ($(readlink -f "$NVRTC")) is newer than the driver's CUDA $DRIVER_VERSION: its PTX would not load (CUDA_ERROR_UNSUPPORTED_PTX_VERSION); set CUDA_PATH to a toolkit of CUDA $DRIVER_VERSION or install nvidia-cuda-nvrtc $DRIVER_VERSION.*"
fi
# One line with what was found, first in the table: fail with the reason when it stops checks.
PROBLEM="${BLOCKED:-$NVRTC_BLOCKED}"
[ -z "$PROBLEM" ] && [ -z "$NCCL" ] && PROBLEM="no libnccl found (nccl-w1, ddp-step and gpt will fail)"
[ -z "$PROBLEM" ] && [ -z "$NVRTC" ] && PROBLEM="no libnvrtc found (every check that compiles kernels will fail)"
result libraries "$([ -n "$PROBLEM" ] && echo fail || echo pass)" "$PROBLEM" \
    "libnccl=${NCCL:-none}" "libnvrtc=$([ -n "$NVRTC" ] && readlink -f "$NVRTC" || echo none)" \
    "nvrtc_version=$NVRTC_VERSION" "driver_version=$DRIVER_VERSION" "cuda_path=${CUDA_PATH:-none}"

# --- Checks --------------------------------------------------------------------------------
# check NAME SECONDS COMMAND...: runs COMMAND under its own timeout; a crash or a timeout
# becomes a "fail" line naming it (what the check wrote before stays).
check() {
    local name="$1" limit="$2"
    shift 2
    note "$name (at most ${limit} s): $*"
    local start=$SECONDS
    timeout --kill-after=5 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    note "$name: exit code $rc after $((SECONDS - start)) s"
    case $rc in
        0 | 1) ;; # 1: the check wrote its failures itself
        124 | 137) result "$name" fail "killed after its ${limit} s timeout; the lines before are what it finished" ;;
        *) result "$name" fail "exited with code $rc (a crash: see gpu-check.log)" ;;
    esac
}
# A check of the binary that compiles kernels with NVRTC: not run when NVRTC cannot work.
kernel_check() { # name seconds args...
    if [ -n "$NVRTC_BLOCKED" ]; then
        note "$1: not run: NVRTC is newer than the driver (the libraries line)"
    else
        check "$1" "$2" "$BIN" "${@:3}" --cache "$CACHE"
    fi
}
# A PyTorch script, under the machine's own LD_LIBRARY_PATH.
torch_check() { # name seconds script args...
    if [ "$ORIGINAL_LD_LIBRARY_PATH" = unset ]; then
        check "$1" "$2" env -u LD_LIBRARY_PATH "$PY" "$HERE/$3" "${@:4}"
    else
        check "$1" "$2" env LD_LIBRARY_PATH="$ORIGINAL_LD_LIBRARY_PATH" "$PY" "$HERE/$3" "${@:4}"
    fi
}

# The suites, in order, with their limits (seconds; SUITE_LIMIT_S in all at most). Core: the
# library lines and NCCL first (seconds), then the kernels (NVRTC's cold compilation), the
# fused step, the DDP step (a transformer's kernels compiled and autotuned cold), PyTorch last.
# Gpt: one check per precision, each with its own limit, then PyTorch's reference. Device: Burn's
# `Cuda` (fusion on) on the device path, and ZeroAdam's in-place step (issue 14).
if [ "$SUITE" = libraries ]; then
    :
elif [ ! -x "$BIN" ]; then
    result setup fail "$BIN is missing: build it with cargo xtask gpu-check"
elif [ -n "$BLOCKED" ]; then
    note "no check run: $BLOCKED"
elif [ "$SUITE" = core ]; then
    # Measured on the first H200 run (2026-12-04, docs/perf/gpu-check.md): nccl-w1 2 s, kernels
    # 4 s, fused-step 18 s, torch-adamw 10 s; ddp-step did not finish in 125 s (its transformer's
    # kernels compiled and autotuned cold), so it gets what the others do not need.
    check nccl-w1 15 "$BIN" nccl-w1 --out "$RESULTS" --device "$DEVICE"
    kernel_check kernels 25 kernels --out "$RESULTS" --device "$DEVICE"
    kernel_check fused-step 45 fused-step --out "$RESULTS" --device "$DEVICE" --elements "$ELEMENTS"
    kernel_check ddp-step 190 ddp-step --out "$RESULTS" --device "$DEVICE"
    torch_check torch-adamw 20 fused_adamw_torch.py --out "$RESULTS" --device "$DEVICE" --elements "$ELEMENTS"
elif [ "$SUITE" = sanitize ]; then
    # Lavapipe cannot show a read past shared memory or a race between a cube's units (two
    # kernel mutants survive there): compute-sanitizer can. It reports, it never blocks: its
    # lines are `sanitize/racecheck` and `sanitize/memcheck`, and run.sh's exit code ignores
    # them.
    SANITIZER="$(command -v compute-sanitizer 2>/dev/null || true)"
    [ -z "$SANITIZER" ] && [ -x "${CUDA_PATH:-/nonexistent}/bin/compute-sanitizer" ] && SANITIZER="$CUDA_PATH/bin/compute-sanitizer"
    if [ -z "$SANITIZER" ]; then
        result sanitize/tool skip "no compute-sanitizer on PATH nor in ${CUDA_PATH:-no CUDA_PATH}/bin"
    elif [ -n "$NVRTC_BLOCKED" ]; then
        note "sanitize: not run: NVRTC is newer than the driver (the libraries line)"
    else
        for tool in racecheck memcheck; do
            note "sanitize/$tool (at most 120 s): $SANITIZER --tool $tool $BIN kernels"
            report="$OUT/sanitize-$tool.txt"
            timeout --kill-after=5 120 "$SANITIZER" --tool "$tool" --error-exitcode 99 \
                "$BIN" kernels --out "$OUT/sanitize-$tool.jsonl" --device "$DEVICE" --cache "$CACHE" \
                >"$report" 2>&1
            rc=$?
            summary="$(grep -m 1 -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$report" | tr -d '=' | sed 's/^ *//')"
            case $rc in
                0 | 1) result "sanitize/$tool" pass "" "summary=${summary:-none}" ;;
                99) result "sanitize/$tool" report "${summary:-errors found}: see sanitize-$tool.txt" ;;
                *) result "sanitize/$tool" report "exit code $rc (timeout or crash): see sanitize-$tool.txt" ;;
            esac
        done
    fi
elif [ "$SUITE" = device ]; then
    # All that `both` leaves after core's 295 s: fusion's autotune and 30 transformer steps.
    kernel_check device-path 245 device-path --out "$RESULTS" --device "$DEVICE"
else
    # 2026-12-04: PyTorch's reference took 10-14 s; neither of ours logged a step within 115 s
    # cold (docs/perf/gpu-check.md), so they get what PyTorch does not need.
    kernel_check gpt-f32 135 gpt-f32 --out "$RESULTS" --device "$DEVICE"
    kernel_check gpt-bf16 135 gpt-bf16 --out "$RESULTS" --device "$DEVICE"
    torch_check torch-gpt 30 gpt2_torch.py --out "$RESULTS" --device "$DEVICE"
fi
rm -rf "$LIBDIR"

# --- The cache, packed to come back ----------------------------------------------------------
# The device tool brings back files of at most 16 MiB: a larger pack is left out, and said so.
if [ "$SUITE" != libraries ] && [ -d "$CACHE" ]; then
    pack="$OUT/cubecl-cache.tar.gz"
    if tar -czf "$pack" -C "$CACHE" . 2>>"$LOG"; then
        size="$(stat -c %s "$pack")"
        if [ "$size" -gt $((16 << 20)) ]; then
            rm -f "$pack"
            note "cubecl cache: $size bytes packed, over the 16 MiB that come back: not kept"
        else
            note "cubecl cache: packed into $pack ($size bytes); put it beside run.sh for the next call"
        fi
    else
        note "cubecl cache: packing $CACHE failed"
    fi
fi

# --- Report --------------------------------------------------------------------------------
"$PY" - "$RESULTS" "$OUT/gpu-check.md" "$STARTED" "$GPU" "$NCCL" "$NVRTC" "$NVRTC_VERSION" "$DRIVER_VERSION" <<'EOF'
import json, sys
results, md, started, gpu, nccl, nvrtc, nvrtc_version, driver_version = sys.argv[1:9]
lines = []
for raw in open(results):
    raw = raw.strip()
    if raw:
        try:
            lines.append(json.loads(raw))
        except ValueError:
            lines.append({"check": "?", "status": "fail", "error": f"unreadable line {raw[:80]!r}"})

def summary(r):
    if "error" in r:
        return str(r["error"]).replace("|", "/").replace("\n", " ")[:300]
    if "ms_median" in r:
        return (f"{r['elements']:,} elements: {r['ms_median']:.3f} ms median "
                f"(min {r['ms_min']:.3f}), {r['effective_gbps']:.0f} GB/s effective "
                f"({r['bytes_per_element']} B/element) = {r['fraction_of_copy']:.2f} of copy "
                f"({r['copy_gbps']:.0f} GB/s)")
    keep = {k: v for k, v in r.items() if k not in ("check", "status", "unix_time")}
    return ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in keep.items())

# `skip` and `report` (the sanitizer's lines) inform, they do not fail the run.
informs = ("skip", "report")
failed = sum(1 for r in lines if r.get("status") not in ("pass",) + informs)
informed = sum(1 for r in lines if r.get("status") in informs)
out = [f"# burn-dist GPU check, {started}", "",
       f"GPU: {gpu or 'unknown'}; libnccl: {nccl or 'none'}; libnvrtc: {nvrtc or 'none'} "
       f"(NVRTC {nvrtc_version}, driver's CUDA {driver_version})", "",
       f"{len(lines) - failed - informed} of {len(lines)} results passed"
       + (f", {informed} reported without a verdict." if informed else "."), "",
       "| check | status | result |", "|---|---|---|"]
out += [f"| {r.get('check')} | {r.get('status')} | {summary(r)} |" for r in lines]
text = "\n".join(out) + "\n"
open(md, "w").write(text)
print(text)
sys.exit(1 if failed or not lines else 0)
EOF
