"""PyTorch's gloo collectives on 2 CPU processes of this host, the peer of burn-dist's
`benches/host_all_reduce.rs`: an all-reduce of 64 MiB of f32 and an all-gather of 32 MiB
per rank into 64 MiB, each the median of timed rounds that every rank starts together.

Prints one JSON object: seconds per collective and bus bandwidth in GiB/s (nccl-tests'
definition: all-reduce 2(n-1)/n x bytes / time, all-gather (n-1)/n x bytes / time).
Run by `cargo xtask bench-collectives` with the venv's python; never in CI.
"""

import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BYTES = 64 << 20
WORLD = 2


def timed(fn, rounds):
    """Median seconds of `fn` over `rounds`, after one untimed round; every round starts
    after a barrier, so both ranks time the same collective."""
    fn()
    samples = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def rank_main(rank, port, rounds, queue):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # One thread per rank, as burn-dist-run gives its ranks on this 2-core machine.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    elems = BYTES // 4
    # Sums of ones double every round: finite for far more rounds than are run.
    reduced = torch.ones(elems, dtype=torch.float32)
    all_reduce = timed(lambda: dist.all_reduce(reduced), rounds)
    shard = torch.full((elems // WORLD,), float(rank), dtype=torch.float32)
    gathered = torch.empty(elems, dtype=torch.float32)
    all_gather = timed(lambda: dist.all_gather_into_tensor(gathered, shard), rounds)
    expected = torch.arange(WORLD, dtype=torch.float32).repeat_interleave(elems // WORLD)
    if not torch.equal(gathered, expected):
        raise SystemExit(f"rank {rank}: gloo's all-gather returned other values")
    if rank == 0:
        queue.put({"all_reduce_s": all_reduce, "all_gather_s": all_gather})
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    context = mp.get_context("spawn")
    queue = context.Queue()
    mp.start_processes(
        rank_main,
        args=(free_port(), rounds, queue),
        nprocs=WORLD,
        join=True,
        start_method="spawn",
    )
    times = queue.get()
    gib = BYTES / (1 << 30)
    factor = (WORLD - 1) / WORLD
    times["all_reduce_busbw_gib_s"] = 2 * factor * gib / times["all_reduce_s"]
    times["all_gather_busbw_gib_s"] = factor * gib / times["all_gather_s"]
    times["torch"] = torch.__version__
    print(json.dumps(times))


if __name__ == "__main__":
    main()
