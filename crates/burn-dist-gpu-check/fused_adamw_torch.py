#!/usr/bin/env python3
"""PyTorch's fused AdamW (`torch.optim.AdamW(fused=True)`) on one f32 parameter of the same
element count as `burn-dist-gpu-check fused-step`, next to a device copy, timed with CUDA
events (median of single steps after warm-up).

Writes one JSON line per result to --out, with the fields of the Rust check's lines:
elements, ms_median, ms_min, iters, bytes_per_element, effective_gbps, copy_gbps,
fraction_of_copy. AdamW must read p, g, m, v and write p, m, v: 28 bytes per element; the
copy reads and writes 4 bytes each.
"""

import argparse
import json
import statistics
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--elements", type=int, default=1 << 28)
    parser.add_argument("--out", default="gpu-check.jsonl")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()

    def emit(check, status, **fields):
        line = {"check": check, "status": status, "unix_time": int(time.time()), **fields}
        text = json.dumps(line)
        print(text, flush=True)
        with open(args.out, "a") as out:
            out.write(text + "\n")

    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure is the answer
        emit("fused-step/torch-adamw", "fail", error=f"import torch: {e}")
        return 1
    if not torch.cuda.is_available():
        emit("fused-step/torch-adamw", "fail", error="torch.cuda.is_available() is False")
        return 1

    device = torch.device("cuda", args.device)
    n = args.elements
    gen = torch.Generator(device=device)
    gen.manual_seed(int(time.time()))

    def nonzero(scale):
        # Uniform magnitudes in [0.5, 1.5) * scale with a random sign: never zero.
        x = torch.rand(n, device=device, generator=gen) + 0.5
        sign = torch.randint(0, 2, (n,), device=device, generator=gen) * 2 - 1
        return (x * sign * scale).float()

    def timed(step, warmup, iters):
        for _ in range(warmup):
            step()
        torch.cuda.synchronize(device)
        times = []
        for _ in range(iters):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return times

    def fields(times, bytes_per_element, copy_gbps):
        ms = statistics.median(times)
        effective = n * bytes_per_element / (ms * 1e-3) / 1e9
        return {
            "elements": n,
            "ms_median": ms,
            "ms_min": min(times),
            "iters": len(times),
            "bytes_per_element": bytes_per_element,
            "effective_gbps": effective,
            "copy_gbps": copy_gbps if copy_gbps else effective,
            "fraction_of_copy": effective / copy_gbps if copy_gbps else 1.0,
        }

    try:
        src = nonzero(1.0)
        dst = torch.empty_like(src)
        copy_times = timed(lambda: dst.copy_(src), 2, args.iters)
        copy = fields(copy_times, 8, None)
        emit("fused-step/torch-copy", "pass", **copy, torch_version=torch.__version__)
        copy_gbps = copy["effective_gbps"]
        del src, dst

        param = torch.nn.Parameter(nonzero(1.0))
        param.grad = nonzero(1e-3)
        opt = torch.optim.AdamW([param], lr=1e-4, weight_decay=0.01, fused=True)
        times = timed(opt.step, 3, args.iters)
        emit(
            "fused-step/torch-adamw",
            "pass",
            **fields(times, 28, copy_gbps),
            torch_version=torch.__version__,
            device_name=torch.cuda.get_device_name(device),
        )
    except Exception as e:  # noqa: BLE001 - report, do not crash without a line
        emit("fused-step/torch-adamw", "fail", error=f"{type(e).__name__}: {e}", elements=n)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
