#!/usr/bin/env python3
"""The PyTorch reference of docs/perf/cpu-throughput.md: gpt-pretrain's default job in PyTorch.

The same GPT as `gpt-pretrain --model tiny` (vocabulary 64, context 64, 2 layers, 4 heads,
width 64, tied LM head, pre-LayerNorm blocks, exact GELU, no dropout, attention written as
matmul, causal mask, softmax, matmul like examples/gpt-pretrain/src/model.rs), the same step
(global batch 32 sequences split over the ranks, AdamW with betas 0.9/0.95, weight decay 0.1
on the tensors of 2+ dimensions, global-norm clipping at 1.0, a cosine learning rate, the mean loss averaged over ranks every
step), trained data-parallel with DistributedDataParallel over gloo on this host.

Each rank uses --threads intra-op threads (default: max(1, cores / ranks), the share that
burn-dist-run gives each rank). The time is wall clock over the whole training loop, first step
included, as gpt-pretrain's end-to-end line counts it. Rank 0 prints one JSON line:

    {"framework": "pytorch", "ranks": 2, "threads": 1, "steps": 300, "tokens": ..., "seconds": ...,
     "tokens_per_s": ...}

Usage: python torch_ddp_gpt.py --ranks 2 --steps 300
"""

import argparse
import json
import math
import os
import socket
import time


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="per rank; 0: cores / ranks")
    args = parser.parse_args()
    if args.threads == 0:
        args.threads = max(1, len(os.sched_getaffinity(0)) // args.ranks)
    if args.global_batch % args.ranks:
        parser.error(f"--global-batch {args.global_batch} is not divisible by --ranks {args.ranks}")
    return args


def build_model(torch, args):
    nn = torch.nn
    d, heads, ctx = args.d_model, args.n_head, args.context

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(d, 3 * d)
            self.c_proj = nn.Linear(d, d)
            self.register_buffer("future", torch.ones(ctx, ctx).triu(1).bool())

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.c_attn(x).split(d, dim=2)
            q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2) for z in (q, k, v))
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // heads))
            scores = scores.masked_fill(self.future[:t, :t], float("-inf"))
            y = scores.softmax(dim=-1) @ v
            return self.c_proj(y.transpose(1, 2).reshape(b, t, d))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.attn = nn.LayerNorm(d), Attention()
            self.ln_2 = nn.LayerNorm(d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class Gpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(args.vocab, d)
            self.wpe = nn.Embedding(ctx, d)
            self.h = nn.ModuleList(Block() for _ in range(args.n_layer))
            self.ln_f = nn.LayerNorm(d)

        def forward(self, tokens, targets):
            t = tokens.shape[1]
            x = self.wte(tokens) + self.wpe(torch.arange(t))
            for block in self.h:
                x = block(x)
            logits = self.ln_f(x) @ self.wte.weight.t()  # the tied LM head
            return nn.functional.cross_entropy(logits.reshape(-1, args.vocab), targets.reshape(-1))

    torch.manual_seed(42)
    return Gpt()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank, args, port):
    # Before torch starts its pools.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks
    )
    model = torch.nn.parallel.DistributedDataParallel(build_model(torch, args))
    # GPT-2's decay rule, as gpt-pretrain's default `--decay matrices`: only tensors of 2+ dims.
    groups = [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    optim = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    per_rank = args.global_batch // args.ranks
    generator = torch.Generator().manual_seed(1000 + rank)
    warmup, max_lr = 20, 3e-3

    def lr_at(step):
        if step < warmup:
            return max_lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return max_lr / 10 + 0.5 * (max_lr - max_lr / 10) * (1 + math.cos(math.pi * progress))

    dist.barrier()
    began = time.perf_counter()
    for step in range(args.steps):
        window = torch.randint(0, args.vocab, (per_rank, args.context + 1), generator=generator)
        for group in optim.param_groups:
            group["lr"] = lr_at(step)
        loss = model(window[:, :-1], window[:, 1:])
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= args.ranks
        mean.item()
    seconds = time.perf_counter() - began
    if rank == 0:
        tokens = args.steps * args.global_batch * args.context
        print(
            json.dumps(
                {
                    "framework": "pytorch",
                    "version": torch.__version__,
                    "ranks": args.ranks,
                    "threads": args.threads,
                    "steps": args.steps,
                    "tokens": tokens,
                    "seconds": seconds,
                    "tokens_per_s": tokens / seconds,
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()


def main():
    args = parse_args()
    import torch.multiprocessing as mp

    mp.spawn(rank_main, args=(args, free_port()), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
