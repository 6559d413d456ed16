#!/usr/bin/env python3
"""Where one rank's CPU time goes, from a `perf record --call-graph dwarf` profile of it.

Reads `perf script --no-inline -F tid,ip,sym,dso` on stdin and puts each sample in one category:

1. by what it runs under: ZeroAdam's step, burn-dist's reducer and gradient hooks, burn-dist's
   collectives (the caller side and its worker thread), evaluation, rayon's worker threads (the
   parallel kernels), Burn's backward pass, the model's forward pass, the rest of the training
   loop, and the rest of the program (startup);
2. by the innermost frame with an owner (allocator, memcpy and standard-library frames have
   none): Flex's kernels (burn_flex, gemm, macerator, libm), Burn's autodiff bookkeeping
   (burn_autodiff), Burn's tensor front end and modules, rayon's pool, the kernel.

Usage (see docs/perf/cpu-throughput.md):
    perf script -i rank0.data --no-inline -F tid,ip,sym,dso | python3 perf_categories.py
"""

import collections
import sys

# Outer owners, matched against every frame of a sample, first rule that matches wins.
PHASES = [
    ("burn-dist: ZeroAdam step", ("burn_dist_zero::", "burn_dist_kernels::")),
    ("burn-dist: reducer and hooks", ("burn_dist::reducer::", "burn_dist::backend::DistributedBackend<B>>::submit_gradient_sync",
                                       "burn_dist::ddp::CompleteGradients", "register_sync_parameters")),
    ("burn-dist: collectives", ("burn_dist_comm::",)),
    ("evaluation", ("Trainer<B>>::evaluate",)),
    # Parallel kernels run on rayon's worker threads, whose stacks do not reach the caller.
    ("Flex kernels on rayon's worker threads", ("rayon_core::registry::WorkerThread",)),
    ("backward (Burn autodiff + Flex)", ("burn_dist::ddp::Ddp::backward",)),
    ("forward (model + loss)", ("gpt_pretrain::model::",)),
    ("training loop, other (data, metrics, loss all-reduce)", ("Trainer<B>>::step", "Trainer<B>>::train")),
]

# Innermost owners: the first frame (leaf to root) that matches decides.
OWNERS = [
    ("Flex kernels", ("burn_flex::", "gemm_", "gemm::", "macerator::", "libm::", "__expf", "__logf", "erff", "pulp::")),
    ("Burn autodiff bookkeeping", ("burn_autodiff::",)),
    ("Burn tensor front end, modules, optimizer", ("burn_tensor::", "burn_backend::", "burn_nn::", "burn_core::", "burn_optim::", "burn_std::", "burn_ir::", "cubecl_zspace::")),
    ("burn-dist", ("burn_dist",)),
    ("rayon pool", ("rayon_core::", "rayon::")),
    ("gpt-pretrain", ("gpt_pretrain::",)),
]


def samples(lines):
    frames = []
    for line in lines:
        line = line.rstrip("\n")
        if not line.strip():
            if frames:
                yield frames
            frames = []
        elif line.startswith("\t") or line.startswith(" " * 8):
            frames.append(line.strip())
        # The header line (tid) starts a sample; nothing to keep from it.
    if frames:
        yield frames


def by_rule(frames, table):
    """The first rule of `table` that any frame matches."""
    for name, needles in table:
        if any(n in frame for frame in frames for n in needles):
            return name
    return None


def by_frame(frames, table):
    """The rule of the innermost frame that matches one."""
    for frame in frames:
        for name, needles in table:
            if any(n in frame for n in needles):
                return name
    return None


def main():
    phase = collections.Counter()
    owner = collections.Counter()
    total = 0
    for frames in samples(sys.stdin):
        total += 1
        phase[by_rule(frames, PHASES) or "outside the training loop (startup, threads)"] += 1
        kernel_only = all("[kernel.kallsyms]" in f or "[unknown]" in f for f in frames)
        found = by_frame(frames, OWNERS)
        owner[found or ("the kernel (system calls, page faults)" if kernel_only else "allocator, memcpy, std")] += 1
    print(f"{total} samples")
    for title, counter in (("by phase (what it runs under)", phase), ("by owner (innermost frame)", owner)):
        print(f"\n{title}:")
        for name, n in counter.most_common():
            print(f"  {100.0 * n / total:5.1f} %  {name}")


if __name__ == "__main__":
    main()
