"""PyTorch FSDP2 training a GPT-2-shaped model on CPU, for `cargo xtask bench-zero3`.

Run under torchrun (never by CI):

    torchrun --nproc-per-node 4 benches/torch/fsdp2_gpt.py --layers 12 --width 768 --heads 12 \
        --vocab 50304 --context 64 --batch 1 --steps 5

The model is gpt-pretrain's shape (token and learned position embeddings, pre-LayerNorm
blocks of causal self-attention and a GELU MLP, a final LayerNorm and an LM head tied to the
token embedding), built as FSDP2's documentation advises for large models: on the meta
device, `fully_shard` on each block and then on the root, `to_empty`, then initialized
(GPT-2's normal(0.02) and scaled residual projections). AdamW (foreach), gloo, one thread per
rank. Every rank prints one line:

    fsdp2 rank R baseline_mib B peak_mib P peak_pss_mib Q baseline_pss_mib C step_s S1,S2,...

`baseline_mib`: resident memory once torch is imported and the process group is up, before
the model (the runtime's own cost); `peak_mib`: the high-water mark of resident memory (VmHWM)
at the end; `peak_pss_mib`: the most proportional set size (private memory plus this rank's
share of each shared page, such as torch's libraries, which the 4 ranks map alike), read by
the rule gpt-pretrain's `peak_pss_mib` follows (`examples/gpt-pretrain/src/memory.rs`: resident
memory polled every millisecond, PSS read when it is within a sixteenth (at least 32 MiB) of
its highest and has risen by a quarter of that since the step's last reading, and at the end
of each step); `baseline_pss_mib`: PSS at the baseline's moment; `step_s`: each step's wall
time.
"""

import argparse
import math
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard


PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20


def pss_bytes():
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def resident_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PssSampler:
    """gpt-pretrain's `PssSampler` (examples/gpt-pretrain/src/memory.rs), the same rule."""

    def __init__(self):
        self.peak = pss_bytes()
        self.step = 0
        self.stop = False
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        highest, read_at, step, next_reading = 0, 0, 0, 0.0
        while not self.stop:
            if self.step != step:
                step, read_at = self.step, 0
            resident = resident_bytes()
            highest = max(highest, resident)
            band = max(highest // 16, 32 * MIB)
            near_top = resident + band >= highest and resident >= read_at + band // 4
            if near_top and time.perf_counter() >= next_reading:
                started = time.perf_counter()
                self.peak = max(self.peak, pss_bytes())
                next_reading = time.perf_counter() + 2 * (time.perf_counter() - started)
                read_at = resident
            time.sleep(0.001)

    def next_step(self):
        self.step += 1

    def end_step(self):
        self.peak = max(self.peak, pss_bytes())


def status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.c_attn = nn.Linear(width, 3 * width)
        self.attn_proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.c_fc = nn.Linear(width, 4 * width)
        self.mlp_proj = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        shape = (b, t, self.heads, c // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class Gpt(nn.Module):
    def __init__(self, layers, width, heads, vocab, context):
        super().__init__()
        self.layers = layers
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def init_weights(self):
        residual = 0.02 / math.sqrt(2 * self.layers)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, std=residual)
            elif p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif "ln" in name and name.endswith("weight"):
                nn.init.ones_(p)
            else:
                nn.init.zeros_(p)

    def forward(self, tokens):
        t = tokens.shape[1]
        x = self.wte(tokens) + self.wpe(torch.arange(t, device=tokens.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def main():
    parser = argparse.ArgumentParser()
    for name, default in [
        ("layers", 12),
        ("width", 768),
        ("heads", 12),
        ("vocab", 50304),
        ("context", 64),
        ("batch", 1),
        ("steps", 5),
    ]:
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    baseline = status_kib("VmRSS:") / 1024
    baseline_pss = pss_bytes() / MIB
    sampler = PssSampler()

    with torch.device("meta"):
        model = Gpt(args.layers, args.width, args.heads, args.vocab, args.context)
    for block in model.h:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    model.init_weights()
    # GPT-2's decay rule, as gpt-pretrain's default `--decay matrices`: only tensors of 2+ dims.
    groups = [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    optim = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), foreach=True)

    gen = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(args.steps):
        tokens = torch.randint(args.vocab, (args.batch, args.context + 1), generator=gen)
        sampler.next_step()
        started = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        dist.barrier()
        times.append(time.perf_counter() - started)
        sampler.end_step()
    peak = status_kib("VmHWM:") / 1024
    sampler.stop = True
    peak_pss = sampler.peak / MIB
    steps = ",".join(f"{t:.3f}" for t in times)
    # One write per report: the ranks share torchrun's stdout.
    sys.stdout.write(
        f"fsdp2 rank {rank} baseline_mib {baseline:.0f} peak_mib {peak:.0f} "
        f"peak_pss_mib {peak_pss:.0f} baseline_pss_mib {baseline_pss:.0f} step_s {steps}\n"
    )
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
