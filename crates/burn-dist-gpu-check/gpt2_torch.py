#!/usr/bin/env python3
"""The PyTorch reference of the end-to-end GPT comparison: a GPT-2-style model of the same
shape as `gpt-pretrain --model gpt2-124m` (pre-LayerNorm blocks, GELU MLP, learned positions,
tied LM head), trained on random tokens with the same batch and sequence length, the way a
practitioner runs PyTorch eagerly on one GPU: bf16 autocast, fused AdamW, SDPA attention
(causal), TF32 matmuls, no torch.compile.

Writes one JSON line (check "gpt/torch") to --out with tokens_per_s and the MFU estimate of
gpt-pretrain's formula, (6·N + 12·L·d·T) · tokens/s / peak FLOP/s, N the parameters without
the position embedding, so the two lines compare directly, and one step split into forward,
backward and optimizer, each ended by a device sync, as gpt-pretrain splits one.

With --profile (check "gpt-profile/torch"): the same warm-up, then --profiled steps under
torch.profiler, and the CUDA kernels that took the most time, their share, and how much of
the steps' wall time the kernels fill, as the gpt-profile line of ours reports them.
"""

import argparse
import json
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="gpu-check.jsonl")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--n-head", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    # H200 SXM dense bf16 tensor-core peak, the figure MFU is usually quoted against.
    parser.add_argument("--peak-flops", type=float, default=989e12)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profiled", type=int, default=2)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    check = "gpt-profile/torch" if args.profile else "gpt/torch"

    def emit(status, **fields):
        line = {"check": check, "status": status, "unix_time": int(time.time()), **fields}
        text = json.dumps(line)
        print(text, flush=True)
        with open(args.out, "a") as out:
            out.write(text + "\n")

    try:
        import torch
        import torch.nn as nn
        import torch.nn.functional as F
    except Exception as e:  # noqa: BLE001 - any import failure is the answer
        emit("fail", error=f"import torch: {e}")
        return 1
    if not torch.cuda.is_available():
        emit("fail", error="torch.cuda.is_available() is False")
        return 1

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    device = torch.device("cuda", args.device)
    L, H, d, T, V = args.n_layer, args.n_head, args.d_model, args.context, args.vocab

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.fc = nn.Linear(d, 4 * d)
            self.out = nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
            q, k, v = (z.view(b, t, H, d // H).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class Gpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(V, d)
            self.pos = nn.Embedding(T, d)
            self.blocks = nn.ModuleList(Block() for _ in range(L))
            self.ln = nn.LayerNorm(d)

        def forward(self, idx, targets):
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.tok(idx) + self.pos(pos)
            for block in self.blocks:
                x = block(x)
            logits = self.ln(x) @ self.tok.weight.t()  # tied LM head
            return F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1))

    try:
        model = Gpt().to(device)

        def gpt2_init(module):
            # GPT-2's initialization, as gpt-pretrain uses: N(0, 0.02) weights, zero biases.
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

        model.apply(gpt2_init)
        params = sum(p.numel() for p in model.parameters()) - model.pos.weight.numel()
        # GPT-2's decay rule, as gpt-pretrain's default: only tensors of 2+ dimensions decay.
        groups = [
            {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ]
        opt = torch.optim.AdamW(groups, lr=3e-4, fused=True)
        gen = torch.Generator(device=device)
        gen.manual_seed(1)

        def step(split=None):
            """One training step; with a dict, each part's seconds, ended by a sync."""
            mark = time.perf_counter()

            def lap(name):
                nonlocal mark
                if split is not None:
                    torch.cuda.synchronize(device)
                    now = time.perf_counter()
                    split[name] = now - mark
                    mark = now

            idx = torch.randint(0, V, (args.batch, T + 1), device=device, generator=gen)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(idx[:, :-1], idx[:, 1:])
            lap("split_forward_s")
            loss.backward()
            lap("split_backward_s")
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            lap("split_optimizer_s")
            return loss

        for _ in range(args.warmup):
            step()
        torch.cuda.synchronize(device)
        split = {}
        step(split)
        if args.profile:
            emit("pass", **profiled(torch, step, device, args), **split)
            return 0
        start = time.perf_counter()
        for _ in range(args.steps):
            loss = step()
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        tokens_per_s = args.batch * T * args.steps / seconds
        flops_per_token = 6 * params + 12 * L * d * T
        emit(
            "pass",
            tokens_per_s=tokens_per_s,
            mfu=flops_per_token * tokens_per_s / args.peak_flops,
            step_ms=seconds / args.steps * 1e3,
            params=params,
            batch=args.batch,
            context=T,
            steps=args.steps,
            final_loss=float(loss),
            peak_flops=args.peak_flops,
            max_memory_gib=torch.cuda.max_memory_allocated(device) / 2**30,
            torch_version=torch.__version__,
            device_name=torch.cuda.get_device_name(device),
            **split,
        )
    except Exception as e:  # noqa: BLE001 - report, do not crash without a line
        emit("fail", error=f"{type(e).__name__}: {e}")
        return 1
    return 0


def profiled(torch, step, device, args):
    """--profiled steps under torch.profiler: the slowest CUDA kernels and their share."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.profiled):
            step()
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - start
    # Kernels only (the device-side entries of the averages), by name: what the GPU spent its
    # time on. Attribute names moved between torch versions (cuda_* became device_*).
    kernels = {}
    for avg in prof.key_averages():
        if "CUDA" not in str(getattr(avg, "device_type", "")):
            continue
        micros = getattr(avg, "self_device_time_total", None)
        if micros is None:
            micros = getattr(avg, "self_cuda_time_total", 0.0)
        kernels[avg.key] = (micros * 1e-6, avg.count)
    total = sum(s for s, _ in kernels.values())
    n = max(args.profiled, 1)
    slowest = sorted(kernels.items(), key=lambda kv: -kv[1][0])[: args.top]
    return {
        "profiled_steps": args.profiled,
        "kernels_found": len(kernels),
        "kernel_s_per_step": total / n,
        "wall_s_per_step": wall / n,
        "kernel_fraction_of_wall": total / wall if wall else None,
        "kernel_launches_per_step": sum(c for _, c in kernels.values()) / n,
        "slowest_kernels": [
            {
                "kernel": name[:120],
                "seconds_per_step": s / n,
                "launches_per_step": c / n,
                "share_of_kernel_time": s / total if total else None,
            }
            for name, (s, c) in slowest
        ],
        "torch_version": torch.__version__,
    }


if __name__ == "__main__":
    sys.exit(main())
