#!/usr/bin/env bash
# The burn-dist device check, on the GPU machine. `cargo xtask gpu-check` copies this script,
# the binary (with its build-tag), fused_adamw_torch.py and gpt2_torch.py into target-gpu/;
# run it from anywhere:
#
#     bash target-gpu/run.sh                # = e2e: GPT-2 end to end, the first run of a session
#     bash target-gpu/run.sh e2e            # torch-gpt, ddp-timed, gpt-fusion-f32, ranks, gpt-fusion-bf16, ...
#     bash target-gpu/run.sh core device    # NCCL, kernels, fused step, DDP step; the device path
#     bash target-gpu/run.sh gpt            # every GPT-2 variant of ours beside PyTorch's
#     bash target-gpu/run.sh offload        # GPT-2 bf16 at ZeRO-3, state on the GPU, then offloaded
#     bash target-gpu/run.sh offload-6b     # a 6 B GPT: refused on the GPU for memory, trained offloaded
#     bash target-gpu/run.sh ddp-timed ranks   # any checks by name, in the order given
#     bash target-gpu/run.sh libraries      # only the library look-up and the version check
#     bash target-gpu/run.sh sanitize       # the kernels check under compute-sanitizer, if present
#
# One deadline for the whole run (DEADLINE_S, default 570 s: a device call of 600 s less the
# report and the kill margins): each check runs under the smaller of its own cap and what is
# left before the deadline, and a check that would get less than the least it needs is not run
# and says so. Everything goes into one folder, $OUT (default target-gpu/out):
#   results.jsonl   one JSON line per result, written as soon as it is known
#   gpu-check.md    a dated table of the results
#   gpu-check.log   everything the checks printed, the library paths and versions, each phase
#   kernel-pack/    cubecl's compiled kernels, its autotune results and the driver's own cache
#                   (CUDA_CACHE_PATH), tagged, in parts of at most 15 MiB: packed after every
#                   check and on exit, so a run cut short still returns what it compiled
# The device tool returns at most 8 files of at most 16 MiB, at most 2 folders down: the pack
# takes what the other files leave (docs/gpu.md, "The kernel pack"). Exit code: 0 when every
# result passed (lines that only inform, `skip` and `report`, do not count).
#
# Environment: PYTHON (default python3, the one with torch and the nvidia-* packages),
# ELEMENTS (fused-step size, default 268435456 = 2^28), DEVICE (default 0), CUDA_PATH (a CUDA
# toolkit; default: the first of CUDA_ROOTS, "/usr/local/cuda /opt/cuda" and nvcc's, with
# include/cuda_runtime.h), NCCL_SOCKET_IFNAME (default lo: world size 1 needs no network),
# NCCL_DEBUG (default WARN), DEADLINE_S, GPU_CHECK_PACK (the pack to start from; default the
# one committed in the checkout, crates/burn-dist-gpu-check/kernel-pack). For the rehearsal
# without a GPU (tests/run_sh.rs): GPU_CHECK_BIN (the binary; default beside this script),
# GPU_CHECK_CC (the compute capability; default nvidia-smi's), GPU_CHECK_CLOCK (a file holding
# the time in seconds, read instead of the clock), GPU_CHECK_PART_BYTES (the pack's part size).
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"
# The whole run ends by DEADLINE_S after its start; RESERVE_S of it is kept for the last pack
# and the report, and each check's timeout may take KILL_S more to kill it.
DEADLINE_S="${DEADLINE_S:-570}"
RESERVE_S=15
KILL_S=5

# --- Which checks, in which order ----------------------------------------------------------
# One check per line: name, cap (seconds), the least it needs to be worth starting, kind
# (bin: the binary; kernel: the binary, compiling kernels with NVRTC; torch: a PyTorch
# script), and its arguments. Caps come from the runs of 2026-12-04 (docs/perf/gpu-check.md):
# nccl-w1 2 s, kernels 4 s, fused-step 18 s, torch-adamw 10 s, torch-gpt 10-14 s; ddp-step and
# the gpt checks did not finish cold in 125 s and 115 s, so they get what the deadline leaves.
CHECKS='
nccl-w1          15  5 bin    nccl-w1
kernels          25 10 kernel kernels
fused-step       45 20 kernel fused-step --elements ELEMENTS
ddp-step        190 60 kernel ddp-step
ddp-timed       150 40 kernel ddp-timed
device-path     245 90 kernel device-path
ranks           200 60 kernel ranks
gpt-fusion-f32  300 60 kernel gpt --stack fusion --precision f32
gpt-fusion-bf16 300 60 kernel gpt --stack fusion --precision bf16
gpt-cube-f32    300 60 kernel gpt --stack cube --precision f32
gpt-cube-bf16   300 60 kernel gpt --stack cube --precision bf16
gpt-profile     150 60 kernel gpt-profile --stack fusion --precision bf16
gpt-zero3-bf16  300 60 kernel gpt --stack fusion --precision bf16 --zero-stage 3
gpt-offload-bf16 300 60 kernel gpt --stack fusion --precision bf16 --zero-stage 3 --place offload
gpt-6b-device   120 30 kernel gpt --stack fusion --precision bf16 --zero-stage 3 --model gpt-6b --expect device-memory-error
gpt-6b-offload  400 120 kernel gpt --stack fusion --precision bf16 --zero-stage 3 --place offload --model gpt-6b
torch-adamw      20 10 torch  fused_adamw_torch.py --elements ELEMENTS
torch-gpt        60 20 torch  gpt2_torch.py
torch-profile    60 20 torch  gpt2_torch.py --profile
'
# The suites. e2e is the first run of a session (issue 44): PyTorch's reference, the timed DDP
# step, GPT-2 on the stack users train with, two and three ranks on one GPU, then bf16, the
# other stack and where the time goes, as the deadline allows.
suite() { # name: its checks, or nothing when NAME is no suite
    case "$1" in
        e2e) echo "torch-gpt ddp-timed gpt-fusion-f32 ranks gpt-fusion-bf16 gpt-cube-bf16 torch-profile gpt-profile" ;;
        core) echo "nccl-w1 kernels fused-step ddp-step torch-adamw" ;;
        device) echo "device-path" ;;
        both) echo "nccl-w1 kernels fused-step ddp-step torch-adamw device-path" ;;
        gpt) echo "torch-gpt gpt-fusion-f32 gpt-fusion-bf16 gpt-cube-f32 gpt-cube-bf16" ;;
        offload) echo "gpt-zero3-bf16 gpt-offload-bf16" ;;
        offload-6b) echo "gpt-6b-device gpt-6b-offload" ;;
        libraries) echo "-" ;;
        sanitize) echo "sanitize" ;;
    esac
}
spec() { # name: its line of CHECKS, or nothing
    echo "$CHECKS" | awk -v n="$1" '$1 == n'
}
usage() {
    echo "usage: run.sh [SUITE | CHECK]...   suites: e2e (default), core, device, both, gpt, offload, offload-6b, libraries, sanitize; checks: $(echo "$CHECKS" | awk 'NF {printf "%s ", $1}')" >&2
    exit 2
}
PLAN=""
[ $# -eq 0 ] && set -- e2e
for word in "$@"; do
    checks="$(suite "$word")"
    if [ -n "$checks" ]; then
        [ "$checks" = - ] || PLAN="$PLAN $checks"
    elif [ -n "$(spec "$word")" ]; then
        PLAN="$PLAN $word"
    else
        echo "run.sh: unknown suite or check $word" >&2
        usage
    fi
done

# The time, in whole seconds (a file's content in the rehearsal, so that its tests need no
# clock and no sleep).
now() {
    if [ -n "${GPU_CHECK_CLOCK:-}" ]; then cat "$GPU_CHECK_CLOCK"; else date +%s; fi
}
START="$(now)"
left() { # seconds left before the deadline, less the reserve
    echo $((START + DEADLINE_S - RESERVE_S - $(now)))
}

# The checks' binary shares compiled kernels and autotune results through this directory
# (`--cache`), and the driver keeps what it compiled from PTX in its driver/ (CUDA_CACHE_PATH):
# within one device call a later check does not compile a kernel again. It lives outside this
# folder: each device call that carries target-gpu/ replaces the folder, and a second call on
# the same warm machine would find its cache gone (2026-12-04: the gpt suite, called again at
# once, compiled cold a second time).
CACHE="${GPU_CHECK_CACHE:-/tmp/burn-dist-gpu-check-cache}"
export CUDA_CACHE_PATH="$CACHE/driver"
# The driver's default limit (256 MiB) could evict what an earlier check of the call compiled.
export CUDA_CACHE_MAXSIZE="${CUDA_CACHE_MAXSIZE:-4294967296}"
# The pack this run starts from: the one committed in the checkout (the device tool sends the
# checkout with every call), unless told otherwise.
PACK="${GPU_CHECK_PACK:-$HERE/../crates/burn-dist-gpu-check/kernel-pack}"
# What the device tool brings back: files of at most 16 MiB, so parts of 15.
PART_BYTES="${GPU_CHECK_PART_BYTES:-15728640}"
RETURNED_FILES=8
# What a device call carries, the committed pack included: the pack must leave room for the
# binary and 8 MiB of the rest of the checkout, or the next call could not carry it.
CARRY_BYTES="${GPU_CHECK_CARRY_BYTES:-67108864}"
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
# What the binary was built from (`cargo xtask gpu-check` writes it beside the binary): the
# kernels' sources and Cargo.lock, each as a hash.
BUILD_TAG="$(cat "$(dirname "$BIN")/build-tag" 2>/dev/null | tr '\n' ' ')"
mkdir -p "$OUT"
# $OUT holds this run's files only (an earlier run's pack would take the room of this one's).
rm -rf "$OUT/kernel-pack" "$OUT"/sanitize-*
RESULTS="$OUT/results.jsonl"
LOG="$OUT/gpu-check.log"
: >"$RESULTS"
: >"$LOG"
STARTED="$(date -u +%Y-%m-%dT%H:%M:%SZ)"

note() { echo "run.sh: $*" | tee -a "$LOG"; }
note "plan:$PLAN (deadline ${DEADLINE_S} s after the start)"

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


# --- The kernel pack -------------------------------------------------------------------------
# cubecl keys a compiled kernel by its type's name and launch settings, not by its source
# (cubecl-runtime `id.rs`): PTX packed from an older burn-dist-kernels would load in place of
# the new code. So the pack is tagged with what it was built from, and this run takes from it
# only what its own build and GPU make valid:
# - driver/ (the driver's cache, CUDA_CACHE_PATH), always: the driver keys it by the PTX itself
#   and by the driver's version, so a stale entry is never used for other code;
# - autotune/, when Cargo.lock (the versions of Burn's and cubecl's kernels) and the compute
#   capability match: a tuning result names one of Burn's kernels for one shape on one GPU;
# - compilation/ (cubecl's PTX), only when the kernels' sources match as well.
# An unknown value never matches.
CC="${GPU_CHECK_CC:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader -i "$DEVICE" 2>/dev/null | head -n 1 | tr -d ' ')}"
CC="${CC:-unknown}"
tag_of() { # key text: the value of key= in "k=v k=v" text
    echo "$2" | tr ' ' '\n' | sed -n "s/^$1=//p" | head -n 1
}
same() { # a b: both known and equal
    [ -n "$1" ] && [ "$1" != unknown ] && [ "$1" = "$2" ]
}
BUILT_KERNELS="$(tag_of kernels "$BUILD_TAG")"
BUILT_LOCK="$(tag_of lock "$BUILD_TAG")"
note "build: kernels=${BUILT_KERNELS:-unknown} lock=${BUILT_LOCK:-unknown}; compute capability $CC"

unpack_pack() {
    if [ -e "$CACHE" ]; then
        note "kernel pack: $CACHE already holds kernels compiled on this machine (an earlier call): kept, the pack is not unpacked"
        result kernel-pack pass "" "used=the cache of an earlier call on this machine"
        return
    fi
    if [ ! -f "$PACK/TAG" ]; then
        note "kernel pack: none at $PACK: the checks compile cold"
        result kernel-pack skip "no kernel pack at $PACK: the checks compile cold"
        return
    fi
    local tag parts sha tmp keep="driver" dropped="" reason=""
    tag="$(tr '\n' ' ' <"$PACK/TAG")"
    parts=("$PACK"/part-*)
    sha="$(cat "${parts[@]}" 2>/dev/null | sha256sum | cut -d ' ' -f 1)"
    if [ ! -e "${parts[0]}" ] || [ "${#parts[@]}" != "$(tag_of parts "$tag")" ] || [ "$sha" != "$(tag_of sha256 "$tag")" ]; then
        note "kernel pack: $PACK is damaged (${#parts[@]} parts, sha256 $sha; its TAG says $(tag_of parts "$tag") and $(tag_of sha256 "$tag")): the checks compile cold"
        result kernel-pack fail "the kernel pack at $PACK is damaged: its parts do not match its TAG (parts, sha256)"
        return
    fi
    tmp="$(mktemp -d)"
    if ! cat "${parts[@]}" | tar -xzf - -C "$tmp" 2>>"$LOG"; then
        rm -rf "$tmp"
        result kernel-pack fail "the kernel pack at $PACK could not be unpacked"
        return
    fi
    if ! same "$BUILT_LOCK" "$(tag_of lock "$tag")" || ! same "$CC" "$(tag_of cc "$tag")"; then
        dropped="autotune compilation"
        reason="packed for lock=$(tag_of lock "$tag") cc=$(tag_of cc "$tag"), this run has lock=${BUILT_LOCK:-unknown} cc=$CC"
    elif ! same "$BUILT_KERNELS" "$(tag_of kernels "$tag")"; then
        keep="$keep autotune"
        dropped="compilation"
        reason="packed for kernels=$(tag_of kernels "$tag"), this binary was built from kernels=${BUILT_KERNELS:-unknown}"
    else
        keep="$keep autotune compilation"
    fi
    mkdir -p "$CACHE"
    local part
    for part in $keep; do
        [ -d "$tmp/$part" ] && mv "$tmp/$part" "$CACHE/$part"
    done
    rm -rf "$tmp"
    note "kernel pack: unpacked $keep from $PACK (made $(tag_of made "$tag"))${dropped:+; dropped $dropped: $reason}"
    result kernel-pack pass "" "used=$keep" "dropped=${dropped:-nothing}" ${reason:+"reason=$reason"} "made=$(tag_of made "$tag")"
}

# Packs the cache into $OUT/kernel-pack: TAG and part-00, part-01, ... of one .tar.gz. The
# parts fill what the other files of $OUT leave of the RETURNED_FILES; when the whole cache
# does not fit, the driver's cache goes first, then cubecl's PTX (the autotune results save
# the most: each tuned shape compiles and times some 29 candidates).
pack_cache() {
    [ -d "$CACHE" ] || return 0
    local others room tmp contents present size n sha
    others="$(find "$OUT" -type f -not -path "$OUT/kernel-pack/*" | wc -l)"
    # The report (gpu-check.md) is written after the last pack.
    [ -e "$OUT/gpu-check.md" ] || others=$((others + 1))
    room=$((RETURNED_FILES - others - 1))
    [ "$room" -gt 4 ] && room=4
    if [ "$room" -lt 1 ]; then
        note "kernel pack: not packed: the $others other files of $OUT leave no room among the $RETURNED_FILES that come back"
        return 0
    fi
    local binary limit
    binary="$(stat -c %s "$BIN" 2>/dev/null || echo 0)"
    limit=$((room * PART_BYTES))
    [ $((CARRY_BYTES - binary - (8 << 20))) -lt "$limit" ] && limit=$((CARRY_BYTES - binary - (8 << 20)))
    tmp="$(mktemp -d)"
    for contents in "autotune compilation driver" "autotune compilation" "autotune"; do
        present=""
        for part in $contents; do [ -d "$CACHE/$part" ] && present="$present $part"; done
        [ -z "$present" ] && continue
        # shellcheck disable=SC2086 # $present is a list of folders
        if ! tar -C "$CACHE" -cf - $present 2>>"$LOG" | gzip -1 >"$tmp/pack.tar.gz"; then
            note "kernel pack: packing$present failed"
            continue
        fi
        size="$(stat -c %s "$tmp/pack.tar.gz")"
        if [ "$size" -gt "$limit" ]; then
            note "kernel pack:$present is $size bytes, more than the $limit that fit ($room parts of $PART_BYTES returned, and beside the $binary-byte binary in the $CARRY_BYTES a call carries)"
            continue
        fi
        (cd "$tmp" && split -b "$PART_BYTES" -d -a 2 pack.tar.gz part-)
        sha="$(sha256sum <"$tmp/pack.tar.gz" | cut -d ' ' -f 1)"
        rm "$tmp/pack.tar.gz"
        n="$(find "$tmp" -name 'part-*' | wc -l)"
        {
            echo "kernels=${BUILT_KERNELS:-unknown}"
            echo "lock=${BUILT_LOCK:-unknown}"
            echo "cc=$CC"
            echo "contents=${present# }"
            echo "parts=$n"
            echo "sha256=$sha"
            echo "made=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
            echo "gpu=${GPU:-unknown}"
        } >"$tmp/TAG"
        rm -rf "$OUT/kernel-pack"
        mv "$tmp" "$OUT/kernel-pack"
        note "kernel pack:$present packed into $OUT/kernel-pack ($size bytes, $n parts)"
        return 0
    done
    rm -rf "$tmp"
    note "kernel pack: nothing packed (see the lines above)"
}

# --- Checks --------------------------------------------------------------------------------
# check NAME SECONDS COMMAND...: runs COMMAND under its own timeout; a crash or a timeout
# becomes a "fail" line naming it (what the check wrote before stays).
check() {
    local name="$1" limit="$2"
    shift 2
    note "$name (at most ${limit} s): $*"
    local start=$SECONDS
    GPU_CHECK_NAME="$name" timeout --kill-after="$KILL_S" "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    note "$name: exit code $rc after $((SECONDS - start)) s"
    case $rc in
        0 | 1) ;; # 1: the check wrote its failures itself
        124 | 137) result "$name" fail "killed after its ${limit} s timeout; the lines before are what it finished" ;;
        *) result "$name" fail "exited with code $rc (a crash: see gpu-check.log)" ;;
    esac
}
# A PyTorch script, under the machine's own LD_LIBRARY_PATH.
torch_check() { # name seconds script args...
    if [ "$ORIGINAL_LD_LIBRARY_PATH" = unset ]; then
        check "$1" "$2" env -u LD_LIBRARY_PATH "$PY" "$HERE/$3" "${@:4}"
    else
        check "$1" "$2" env LD_LIBRARY_PATH="$ORIGINAL_LD_LIBRARY_PATH" "$PY" "$HERE/$3" "${@:4}"
    fi
}
# Runs check NAME of CHECKS under the smaller of its cap and what the deadline leaves, or says
# why it is not run; then packs the cache, so that a run cut later keeps what this compiled.
run_check() { # name
    local name cap least kind args available limit
    read -r name cap least kind args <<<"$(spec "$1")"
    args="${args//ELEMENTS/$ELEMENTS}"
    available="$(left)"
    limit=$((cap < available ? cap : available))
    if [ "$limit" -lt "$least" ]; then
        note "$name: not run: $available s left before the deadline, it needs at least $least s"
        result "$name" skip "not run: $available s were left before the deadline (DEADLINE_S=$DEADLINE_S), and it needs at least $least s"
        return
    fi
    # shellcheck disable=SC2086 # $args is a list of arguments
    case "$kind" in
        bin) check "$name" "$limit" "$BIN" $args --out "$RESULTS" --device "$DEVICE" ;;
        kernel)
            if [ -n "$NVRTC_BLOCKED" ]; then
                note "$name: not run: NVRTC is newer than the driver (the libraries line)"
                return
            fi
            check "$name" "$limit" "$BIN" $args --out "$RESULTS" --device "$DEVICE" --cache "$CACHE" --seconds "$limit"
            ;;
        torch) torch_check "$name" "$limit" $args --out "$RESULTS" --device "$DEVICE" ;;
    esac
    pack_cache
}
# Lavapipe cannot show a read past shared memory or a race between a cube's units (two kernel
# mutants survive there): compute-sanitizer can. It reports, it never blocks: its lines are
# `sanitize/racecheck` and `sanitize/memcheck`, and run.sh's exit code ignores them.
sanitize() {
    local sanitizer tool report rc summary
    sanitizer="$(command -v compute-sanitizer 2>/dev/null || true)"
    [ -z "$sanitizer" ] && [ -x "${CUDA_PATH:-/nonexistent}/bin/compute-sanitizer" ] && sanitizer="$CUDA_PATH/bin/compute-sanitizer"
    if [ -z "$sanitizer" ]; then
        result sanitize/tool skip "no compute-sanitizer on PATH nor in ${CUDA_PATH:-no CUDA_PATH}/bin"
        return
    elif [ -n "$NVRTC_BLOCKED" ]; then
        note "sanitize: not run: NVRTC is newer than the driver (the libraries line)"
        return
    fi
    for tool in racecheck memcheck; do
        note "sanitize/$tool (at most 120 s): $sanitizer --tool $tool $BIN kernels"
        report="$OUT/sanitize-$tool.txt"
        timeout --kill-after="$KILL_S" 120 "$sanitizer" --tool "$tool" --error-exitcode 99 \
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
}

# --- The end: pack, the log's size, the report -------------------------------------------------
# Run once, at the end or when the run is stopped (the device tool's limit sends a signal):
# what was compiled and measured until then comes back.
FINISHED=""
REPORT_RC=1
finish() {
    [ -n "$FINISHED" ] && return
    FINISHED=1
    rm -rf "${LIBDIR:-/nonexistent-libdir}"
    [ -n "$PLAN" ] && pack_cache
    # A returned file is at most 16 MiB: keep the log's first 5 and its last 10.
    if [ "$(stat -c %s "$LOG")" -gt $((15 << 20)) ]; then
        { head -c $((5 << 20)) "$LOG"; echo; echo "run.sh: [... the middle of the log was cut: it passed 15 MiB ...]"; tail -c $((10 << 20)) "$LOG"; } >"$LOG.cut"
        mv "$LOG.cut" "$LOG"
    fi
    report
    REPORT_RC=$?
}
trap finish EXIT
trap 'note "stopped by a signal"; finish; exit 143' TERM INT

report() {
"$PY" - "$RESULTS" "$OUT/gpu-check.md" "$STARTED" "${GPU:-}" "${NCCL:-}" "${NVRTC:-}" "${NVRTC_VERSION:-}" "${DRIVER_VERSION:-}" <<'PYEOF'
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
    return ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in keep.items())[:600]

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
PYEOF
}

if [ -z "$PLAN" ]; then
    :
elif [ ! -x "$BIN" ]; then
    result setup fail "$BIN is missing: build it with cargo xtask gpu-check"
elif [ -n "$BLOCKED" ]; then
    note "no check run: $BLOCKED"
else
    unpack_pack
    for name in $PLAN; do
        if [ "$name" = sanitize ]; then sanitize; else run_check "$name"; fi
    done
fi
finish
exit "$REPORT_RC"
