"""PyTorch's CPU AdamW step, timed as `host-step-bench` times burn-dist's host step.

Run by `cargo xtask bench-host-step` (never by CI), which installs torch from PyPI into a venv
when there is none and prints the ratios beside our figures (docs/perf/host-step.md).

usage: adamw_cpu.py [--sizes N,N,...] [--threads T,T,...] [--reps R]

One flat f32 parameter of N elements (the shape of a ZeroAdam shard), with its gradient.
Prints one line per (variant, size, threads): `torch <variant> <elements> <threads> <median ms>
<min ms>`, where the variant is
- `foreach`: `torch.optim.AdamW(foreach=True).step()`;
- `fused`: `torch.optim.AdamW(fused=True).step()` (skipped when this torch has no CPU kernel);
- `foreach_clip`: `clip_grad_norm_(foreach=True)` + the foreach step;
- `fused_clip`: `clip_grad_norm_(foreach=True)` + the fused step.
Threads 0 means all cores (`os.cpu_count()`), set with `torch.set_num_threads`.
"""

import argparse
import os
import statistics
import sys
import time

import torch

WARMUP = 3
LR, BETAS, EPS, WEIGHT_DECAY, MAX_NORM = 1e-3, (0.9, 0.999), 1e-8, 0.1, 1.0


def counts(text):
    return [int(x) for x in text.split(",")]


def make_step(n, variant):
    """The parameter and a function running one step of `variant` on it."""
    gen = torch.Generator().manual_seed(42)
    param = torch.nn.Parameter((torch.rand(n, generator=gen) - 0.5) * 0.4)
    param.grad = (torch.rand(n, generator=gen) - 0.5) * 2e-2
    kind = "fused" if variant.startswith("fused") else "foreach"
    opt = torch.optim.AdamW(
        [param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, **{kind: True}
    )
    if variant.endswith("_clip"):

        def step():
            torch.nn.utils.clip_grad_norm_([param], MAX_NORM, foreach=True)
            opt.step()

    else:
        step = opt.step
    return step


def fused_supported():
    try:
        make_step(8, "fused")()
        return True
    except (RuntimeError, NotImplementedError) as e:
        print(f"# torch {torch.__version__}: no fused CPU AdamW ({e})", file=sys.stderr)
        return False


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=counts, default=[1 << 20, 16 << 20])
    parser.add_argument("--threads", type=counts, default=[1, 0])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    variants = ["foreach", "foreach_clip"]
    if fused_supported():
        variants += ["fused", "fused_clip"]
    print(
        f"# torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}",
        file=sys.stderr,
    )
    with torch.no_grad():
        for n in args.sizes:
            for threads in args.threads:
                threads = threads or os.cpu_count()
                torch.set_num_threads(threads)
                for variant in variants:
                    step = make_step(n, variant)
                    times = []
                    for i in range(WARMUP + args.reps):
                        start = time.perf_counter()
                        step()
                        if i >= WARMUP:
                            times.append((time.perf_counter() - start) * 1e3)
                    median = statistics.median(times)
                    print(f"torch {variant} {n} {threads} {median:.4f} {min(times):.4f}", flush=True)
                    del step


if __name__ == "__main__":
    main()
