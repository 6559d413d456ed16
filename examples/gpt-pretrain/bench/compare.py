#!/usr/bin/env python3
"""gpt-pretrain's default job against PyTorch DDP on this machine, in one run.

Runs, interleaved, --repeats times each:
  pytorch   1 rank and 2 ranks (torch_ddp_gpt.py: DDP over gloo, max(1, cores / ranks) threads
            per rank);
  before    1 and 2 ranks of --before-commit's gpt-pretrain and burn-dist-run (built here from
            `git archive`; default: the commit before the CPU-throughput work);
  after     1 and 2 ranks of this tree's, and 2 ranks with every rank's pools as large as the
            machine (RAYON_NUM_THREADS = OMP_NUM_THREADS = cores, what the launcher did before it
            shared the cores out), to separate the thread share from the rest.
burn-dist's figure is the global batch's tokens times the steps over the last record's
`elapsed_s` (the training loop's wall time, first step included; PyTorch's figure covers the
same span). It prints each configuration's median, spread and the load average it ran under,
the ratios to PyTorch, the launcher's thread-share line, and how far the tokens/s that
gpt-pretrain prints at the end and records for its plot are from that end-to-end figure.

PyTorch comes from PyPI into a virtual environment, created when absent: --venv, else
$TORCH_VENV, else /opt/torch-venv when it exists, else target/torch-venv. pip reads its index
from the usual places ($PIP_INDEX_URL), e.g. PyTorch's CPU-only wheels. Not part of CI.

Usage: python3 examples/gpt-pretrain/bench/compare.py [--steps 300] [--repeats 3]
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
TORCH_SCRIPT = HERE / "torch_ddp_gpt.py"
THREAD_VARS = ("RAYON_NUM_THREADS", "OMP_NUM_THREADS")
# The commit before the CPU-throughput work (issue 17).
BASE_COMMIT = "045f8f5"
TOKENS_PER_STEP = 32 * 64


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--venv", type=Path)
    parser.add_argument("--before-commit", default=BASE_COMMIT,
                        help="the 'before' build; 'none' to leave it out")
    parser.add_argument("--out", type=Path, help="also write every measurement here (JSON)")
    return parser.parse_args()


def venv_python(explicit):
    venv = explicit or os.environ.get("TORCH_VENV")
    if venv is None:
        venv = "/opt/torch-venv" if Path("/opt/torch-venv").exists() else ROOT / "target/torch-venv"
    venv = Path(venv)
    python = venv / "bin/python"
    if python.exists() and subprocess.run([python, "-c", "import torch"]).returncode == 0:
        return python
    print(f"installing PyTorch from PyPI into {venv}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([python, "-m", "pip", "install", "--upgrade", "pip"], check=True)
    subprocess.run([python, "-m", "pip", "install", "torch", "numpy"], check=True)
    return python


def target_dir():
    return Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))


def build(tree, target):
    # Builds run niced, so that they disturb whatever else the machine runs less; the measured
    # runs do not.
    nice = ["nice"] if shutil.which("nice") else []
    subprocess.run(
        nice + ["cargo", "build", "--release", "--locked", "-p", "burn-dist-run", "-p",
                "gpt-pretrain", "--bins"],
        cwd=tree,
        env={**os.environ, "CARGO_TARGET_DIR": str(target)},
        check=True,
    )
    return target / "release"


def build_before(commit, scratch):
    """--before-commit's two binaries, built from `git archive` in a target directory of their
    own (next to this tree's, seeded from it on first use so that only burn-dist's crates
    compile): the two trees' crates have the same names and relative paths, and cargo would take
    one's outputs for the other's in a shared one."""
    tree = scratch / "before-src"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", ROOT, "archive", commit], capture_output=True, check=True)
    # -m: the files get the current time, so cargo rebuilds the seeded crates from them.
    subprocess.run(["tar", "-x", "-m", "-C", tree], input=archive.stdout, check=True)
    target = target_dir().with_name(target_dir().name + "-before")
    if not target.exists() and (target_dir() / "release").exists():
        print(f"seeding {target} from {target_dir()}", flush=True)
        shutil.copytree(target_dir() / "release", target / "release", symlinks=True)
    return build(tree, target)


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    env.update(extra)
    return env


def run_torch(python, ranks, steps):
    command = [python, TORCH_SCRIPT, "--ranks", str(ranks), "--steps", str(steps)]
    for attempt in (1, 2):
        done = subprocess.run(command, env=clean_env(), capture_output=True, text=True)
        if done.returncode == 0:
            line = [l for l in done.stdout.splitlines() if l.startswith("{")][-1]
            return {"tokens_per_s": json.loads(line)["tokens_per_s"]}
        print(f"  pytorch {ranks} rank(s), attempt {attempt} failed:\n{done.stderr[-2000:]}")
    raise SystemExit("PyTorch failed twice")


def run_burn(bin_dir, ranks, steps, env, scratch):
    metrics = scratch / f"metrics-{ranks}.jsonl"
    command = [
        bin_dir / "burn-dist-run", "--nproc-per-node", str(ranks), "--master-port", "0", "--",
        bin_dir / "gpt-pretrain", "--steps", str(steps), "--eval-every", "0",
        "--eval-sequences", "32", "--no-plot", "--run-dir", scratch, "--metrics", metrics,
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"gpt-pretrain failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    records = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()]
    tokens = len(records) * TOKENS_PER_STEP
    result = {"tokens_per_s": tokens / records[-1]["elapsed_s"]}
    share = [l for l in done.stderr.splitlines() if "on this host share" in l]
    if share:
        result["share"] = share[0]
    printed = re.search(r"throughput: (\d+) tokens/s end to end", done.stdout)
    if printed:
        # What gpt-pretrain prints at the end, and what its plot integrates: every step's tokens
        # over the sum of the steps' times.
        result["printed_off_pct"] = 100.0 * (float(printed.group(1)) / result["tokens_per_s"] - 1)
        seconds = sum(TOKENS_PER_STEP / r["tokens_per_s"] for r in records)
        result["plotted_off_pct"] = 100.0 * (tokens / seconds / result["tokens_per_s"] - 1)
    return result


def main():
    args = parse_args()
    python = venv_python(args.venv)
    cores = len(os.sched_getaffinity(0))
    old_threads = clean_env(RAYON_NUM_THREADS=str(cores), OMP_NUM_THREADS=str(cores))
    results = {}
    with tempfile.TemporaryDirectory(prefix="burn-dist-compare-") as scratch:
        scratch = Path(scratch)
        configs = [
            ("pytorch, 1 rank", lambda: run_torch(python, 1, args.steps)),
            ("pytorch, 2 ranks", lambda: run_torch(python, 2, args.steps)),
        ]
        after = build(ROOT, target_dir())
        if args.before_commit != "none":
            before = build_before(args.before_commit, scratch)
            configs += [
                ("burn-dist before, 1 rank", lambda: run_burn(before, 1, args.steps, clean_env(), scratch)),
                ("burn-dist before, 2 ranks", lambda: run_burn(before, 2, args.steps, clean_env(), scratch)),
            ]
        configs += [
            ("burn-dist after, 1 rank", lambda: run_burn(after, 1, args.steps, clean_env(), scratch)),
            ("burn-dist after, 2 ranks, pools as large as the machine",
             lambda: run_burn(after, 2, args.steps, old_threads, scratch)),
            ("burn-dist after, 2 ranks", lambda: run_burn(after, 2, args.steps, clean_env(), scratch)),
        ]
        for repeat in range(args.repeats):
            for name, run in configs:
                load = os.getloadavg()[0]
                result = run()
                result["load"] = load
                results.setdefault(name, []).append(result)
                line = f"[{repeat + 1}/{args.repeats}] {name}: {result['tokens_per_s']:,.0f} tokens/s (load {load:.2f})"
                if "printed_off_pct" in result:
                    line += (f"; printed {result['printed_off_pct']:+.2f} %, plotted "
                             f"{result['plotted_off_pct']:+.2f} % from end to end")
                print(line, flush=True)

    print(f"\n{cores} cores, {args.steps} steps of {TOKENS_PER_STEP} tokens, {args.repeats} "
          "repeats: median and best tokens/s, spread = (max - min) / median, load average "
          "(1 min) before each run")
    medians, bests = {}, {}
    for name, runs in results.items():
        values = [r["tokens_per_s"] for r in runs]
        medians[name] = median = statistics.median(values)
        bests[name] = max(values)
        spread = 100.0 * (max(values) - min(values)) / median
        loads = [r["load"] for r in runs]
        print(f"  {name:<58} {median:>8,.0f}  best {max(values):>8,.0f}  spread {spread:5.1f} %  "
              f"load {min(loads):.1f}-{max(loads):.1f}")
    offs = [r[k] for runs in results.values() for r in runs for k in ("printed_off_pct", "plotted_off_pct") if k in r]
    if offs:
        print(f"  printed and plotted tokens/s vs end to end: worst {max(offs, key=abs):+.2f} %")
    shares = {r["share"] for runs in results.values() for r in runs if "share" in r}
    for share in sorted(shares):
        print(f"  launcher: {share}")
    print("\nratio to PyTorch DDP (burn-dist / pytorch): of the medians, of the bests")
    for name, value in medians.items():
        if name.startswith("burn-dist"):
            torch = "pytorch, 1 rank" if "1 rank" in name else "pytorch, 2 ranks"
            print(f"  {name:<58} {value / medians[torch]:.2f}x  {bests[name] / bests[torch]:.2f}x")
    if args.out:
        args.out.write_text(json.dumps({"cores": cores, "steps": args.steps, "runs": results}, indent=2))


if __name__ == "__main__":
    main()
