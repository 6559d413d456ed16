#!/bin/bash
# CPU time (perf stat task-clock) and page faults of gpt-pretrain and the PyTorch reference, for
# 20 and 220 steps, 3 times, interleaved; a step's CPU time is (220-step run - 20-step run) / 200,
# so that start-up cancels out. The table of docs/perf/cpu-throughput.md.
#
# Usage: cpu_time.sh AFTER_RELEASE_DIR [BEFORE_RELEASE_DIR]
#   (release dirs holding gpt-pretrain and burn-dist-run; compare.py builds both; PYTHON defaults
#   to /opt/torch-venv/bin/python)
set -eu
after=$1
before=${2:-}
python=${PYTHON:-/opt/torch-venv/bin/python}
torch_script=$(dirname "$0")/torch_ddp_gpt.py
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
unset RAYON_NUM_THREADS OMP_NUM_THREADS
cpu() { perf stat -x, -e task-clock,page-faults -- "$@" 2>&1 >/dev/null | grep -E "task-clock|page-faults" | cut -d, -f1 | tr '\n' ' '; }
for repeat in 1 2 3; do
  for steps in 20 220; do
    args="--steps $steps --eval-every 0 --eval-sequences 32 --no-plot --log-every 0 --run-dir $scratch --metrics $scratch/m.jsonl"
    if [ -n "$before" ]; then
      echo "before-1rank $steps $(RAYON_NUM_THREADS=1 cpu "$before/gpt-pretrain" $args)"
    fi
    echo "after-1rank $steps $(RAYON_NUM_THREADS=1 cpu "$after/gpt-pretrain" $args)"
    echo "torch-1rank $steps $(cpu "$python" "$torch_script" --ranks 1 --threads 1 --steps "$steps")"
    echo "after-2ranks-2threads $steps $(RAYON_NUM_THREADS=2 OMP_NUM_THREADS=2 cpu "$after/burn-dist-run" --nproc-per-node 2 --master-port 0 -- "$after/gpt-pretrain" $args)"
    echo "after-2ranks-share $steps $(cpu "$after/burn-dist-run" --nproc-per-node 2 --master-port 0 -- "$after/gpt-pretrain" $args)"
    echo "torch-2ranks $steps $(cpu "$python" "$torch_script" --ranks 2 --threads 1 --steps "$steps")"
  done
done
