#!/usr/bin/env bash
# The burn-dist device check, on the GPU machine. `cargo xtask gpu-check` copies this script,
# the binary and fused_adamw_torch.py into target-gpu/; run it from anywhere:
#
#     bash target-gpu/run.sh        # the core checks (NCCL, kernels, fused step, DDP step)
#     bash target-gpu/run.sh gpt    # the end-to-end GPT-2 124M comparison with PyTorch
#
# The two suites are separate device calls, each under 5 minutes: run the core one first.
# It finds libnccl and libnvrtc in the Python environment's nvidia-* packages, runs each check
# under its own timeout (5 minutes in all: 300 s of limits), and writes
#   $OUT/results.jsonl   one JSON line per result, written as soon as it is known
#   $OUT/gpu-check.md    a dated table of the results
#   $OUT/gpu-check.log   everything the checks printed
# OUT defaults to target-gpu/out. Exit code: 0 when every result passed.
#
# The gpt suite: `gpt` (our stack, gpt-pretrain's model) and gpt2_torch.py (PyTorch eager, bf16
# autocast, fused AdamW, SDPA), same shape, batch and sequence length: 260 + 80 s of limits.
#
# Environment: PYTHON (default python3, the one with torch and the nvidia-* packages),
# ELEMENTS (fused-step size, default 1073741824), DEVICE (default 0).
set -uo pipefail
SUITE="${1:-core}"
case "$SUITE" in core | gpt) ;; *) echo "usage: run.sh [core|gpt]" >&2; exit 2 ;; esac

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$HERE/out}"
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
ELEMENTS="${ELEMENTS:-1073741824}"
DEVICE="${DEVICE:-0}"
BIN="$HERE/burn-dist-gpu-check"
mkdir -p "$OUT"
RESULTS="$OUT/results.jsonl"
LOG="$OUT/gpu-check.log"
: >"$RESULTS"
: >"$LOG"
STARTED="$(date -u +%Y-%m-%dT%H:%M:%SZ)"

note() { echo "run.sh: $*" | tee -a "$LOG"; }

# A result line written by this script (the checks write their own).
result() { # check status error
    "$PY" -c 'import json, sys, time
print(json.dumps({"check": sys.argv[1], "status": sys.argv[2], "unix_time": int(time.time()), "error": sys.argv[3]}))' \
        "$1" "$2" "$3" | tee -a "$LOG" >>"$RESULTS"
}

# --- Libraries -----------------------------------------------------------------------------
# cudarc opens libnccl.so or libnccl.so.<CUDA major> (13 here), never libnccl.so.2, which is
# all the nvidia-nccl-cu13 wheel ships: link libnccl.so to it in a directory of our own.
# libnvrtc (cubecl-cuda compiles its kernels at run time) comes from nvidia-cuda-nvrtc; its
# directory also holds libnvrtc-builtins, which NVRTC opens by itself.
LIBDIR="$(mktemp -d)"
NVIDIA_DIRS="$("$PY" -c 'import os, nvidia
print("\n".join(os.path.abspath(p) for p in nvidia.__path__))' 2>>"$LOG")"
if [ -z "$NVIDIA_DIRS" ]; then
    for site in $("$PY" -c 'import site; print(" ".join(site.getsitepackages()))' 2>>"$LOG"); do
        [ -d "$site/nvidia" ] && NVIDIA_DIRS="$NVIDIA_DIRS $site/nvidia"
    done
fi
find_lib() { # name pattern: the first match under the nvidia packages, else the system's
    local found=""
    [ -n "$NVIDIA_DIRS" ] && found="$(find $NVIDIA_DIRS -name "$1" \( -type f -o -type l \) 2>/dev/null | sort | head -n 1)"
    [ -z "$found" ] && found="$(ldconfig -p 2>/dev/null | awk -v p="${1%\*}" '$1 ~ "^"p {print $NF; exit}')"
    echo "$found"
}
# cubecl-cuda compiles its kernels with NVRTC at run time and needs CUDA's headers
# (cuda_runtime.h, cuda_fp16.h, cuda_bf16.h, mma.h): it looks in $CUDA_PATH, /usr/local/cuda,
# /opt/cuda, or beside /usr/bin/nvcc, and panics when none exists. Prefer a toolkit (the
# image's nvcc), whose NVRTC also matches the driver; else assemble the headers of the nvidia-*
# wheels into one include directory.
if [ -z "${CUDA_PATH:-}" ]; then
    NVCC="$(command -v nvcc 2>/dev/null || true)"
    for root in /usr/local/cuda /opt/cuda ${NVCC:+"$(dirname "$(dirname "$NVCC")")"}; do
        if [ -f "$root/include/cuda_runtime.h" ]; then export CUDA_PATH="$root"; break; fi
    done
fi
if [ -z "${CUDA_PATH:-}" ] && [ -n "$NVIDIA_DIRS" ]; then
    mkdir -p "$LIBDIR/cuda/include"
    for inc in $(find $NVIDIA_DIRS -maxdepth 3 -type d -name include 2>/dev/null); do
        ln -sf "$inc"/* "$LIBDIR/cuda/include/" 2>/dev/null
    done
    export CUDA_PATH="$LIBDIR/cuda"
fi
for header in cuda_runtime.h cuda_fp16.h cuda_bf16.h mma.h cuda/pipeline; do
    [ -e "${CUDA_PATH:-/nonexistent}/include/$header" ] || note "CUDA header $header not found under ${CUDA_PATH:-no CUDA_PATH}"
done
note "CUDA_PATH=${CUDA_PATH:-none} (nvcc: $(command -v nvcc 2>/dev/null || echo none))"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"

NCCL="$(find_lib 'libnccl.so*')"
# NVRTC: the toolkit's first (it matches the driver's PTX version), else the wheel's.
NVRTC="$(find "${CUDA_PATH:-/nonexistent}/lib64" "${CUDA_PATH:-/nonexistent}/lib" -maxdepth 1 -name 'libnvrtc.so*' \( -type f -o -type l \) 2>/dev/null | sort | head -n 1)"
[ -z "$NVRTC" ] && NVRTC="$(find_lib 'libnvrtc.so*')"
EXTRA=""
if [ -n "$NCCL" ]; then
    ln -sf "$NCCL" "$LIBDIR/libnccl.so"
    EXTRA="$EXTRA:$(dirname "$NCCL")"
else
    note "no libnccl found under the Python nvidia packages ($NVIDIA_DIRS) nor by ldconfig"
fi
if [ -n "$NVRTC" ]; then
    ln -sf "$NVRTC" "$LIBDIR/libnvrtc.so"
    EXTRA="$EXTRA:$(dirname "$NVRTC")"
else
    note "no libnvrtc found under the Python nvidia packages ($NVIDIA_DIRS) nor by ldconfig"
fi
export LD_LIBRARY_PATH="$LIBDIR$EXTRA${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
note "libnccl: ${NCCL:-none}; libnvrtc: ${NVRTC:-none}"
note "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
GPU="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>>"$LOG" | head -n 1)"
note "GPU: ${GPU:-nvidia-smi gave nothing}"

# --- Checks --------------------------------------------------------------------------------
# check NAME SECONDS COMMAND...: runs COMMAND under its own timeout; a crash or a timeout
# becomes a "fail" line naming it (what the check wrote before stays).
check() {
    local name="$1" limit="$2"
    shift 2
    note "$name (at most ${limit} s): $*"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    note "$name: exit code $rc after $((SECONDS - start)) s"
    case $rc in
        0 | 1) ;; # 1: the check wrote its failures itself
        124 | 137) result "$name" fail "killed after its ${limit} s timeout; the lines before are what it finished" ;;
        *) result "$name" fail "exited with code $rc (a crash: see gpu-check.log)" ;;
    esac
}

[ -f "$BIN" ] && chmod +x "$BIN" 2>/dev/null
if [ ! -x "$BIN" ]; then
    result setup fail "$BIN is missing: build it with cargo xtask gpu-check"
elif [ "$SUITE" = core ]; then
    check nccl-w1 40 "$BIN" nccl-w1 --out "$RESULTS" --device "$DEVICE"
    check kernels 65 "$BIN" kernels --out "$RESULTS" --device "$DEVICE"
    check fused-step 80 "$BIN" fused-step --out "$RESULTS" --device "$DEVICE" --elements "$ELEMENTS"
    check ddp-step 75 "$BIN" ddp-step --out "$RESULTS" --device "$DEVICE"
else
    check gpt 260 "$BIN" gpt --out "$RESULTS" --device "$DEVICE"
fi
if [ "$SUITE" = core ]; then
    check torch-adamw 40 "$PY" "$HERE/fused_adamw_torch.py" --out "$RESULTS" --device "$DEVICE" --elements "$ELEMENTS"
else
    check torch-gpt 80 "$PY" "$HERE/gpt2_torch.py" --out "$RESULTS" --device "$DEVICE"
fi
rm -rf "$LIBDIR"

# --- Report --------------------------------------------------------------------------------
"$PY" - "$RESULTS" "$OUT/gpu-check.md" "$STARTED" "$GPU" "$NCCL" "$NVRTC" <<'EOF'
import json, sys
results, md, started, gpu, nccl, nvrtc = sys.argv[1:7]
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

failed = sum(1 for r in lines if r.get("status") != "pass")
out = [f"# burn-dist GPU check, {started}", "",
       f"GPU: {gpu or 'unknown'}; libnccl: {nccl or 'none'}; libnvrtc: {nvrtc or 'none'}", "",
       f"{len(lines) - failed} of {len(lines)} results passed.", "",
       "| check | status | result |", "|---|---|---|"]
out += [f"| {r.get('check')} | {r.get('status')} | {summary(r)} |" for r in lines]
text = "\n".join(out) + "\n"
open(md, "w").write(text)
print(text)
sys.exit(1 if failed or not lines else 0)
EOF
