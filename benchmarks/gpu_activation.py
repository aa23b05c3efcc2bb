"""GPU benchmark: peak memory and step time of layer-level activation offload vs k.

A GPT-like stack of about 1.1 B parameters (20 layers, hidden 2048, 16 heads, MLP 4x, vocab 32000, bf16,
SDPA attention) at sequence length 4096, micro-batch 1, forward + backward per step, under:

    none          no offload
    ours k=...    offload_layers(model.layers, num_layers=k)   for k in --ks (default 0 4 8 12 16 18)
    save_on_cpu   torch.autograd.graph.save_on_cpu(pin_memory=True) around the whole stack

For each: peak allocated device memory over the timed steps (torch.cuda.max_memory_allocated), median step
time, bytes offloaded per step (ours), and whether the loss equals the no-offload loss bitwise. Budget: under
5 minutes on one H100/H200 (about 20 s per variant). Run:

    .venv/bin/python benchmarks/gpu_activation.py                    # GPU machine
    .venv/bin/python benchmarks/gpu_activation.py --json out.json    # also write the results

Without CUDA it falls back to a tiny CPU configuration (2 steps per variant, a smoke test of the script;
its numbers mean nothing) and says so.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from mbridge_offload.runtime import device
from mbridge_offload.runtime.activation import offload_layers


@dataclass(frozen=True)
class Shape:
    layers: int = 20
    hidden: int = 2048
    heads: int = 16
    vocab: int = 32000
    seq: int = 4096
    batch: int = 1


TINY = Shape(layers=4, hidden=64, heads=4, vocab=128, seq=64, batch=2)


class Layer(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.heads = s.heads
        self.norm1 = nn.LayerNorm(s.hidden)
        self.qkv = nn.Linear(s.hidden, 3 * s.hidden, bias=False)
        self.proj = nn.Linear(s.hidden, s.hidden, bias=False)
        self.norm2 = nn.LayerNorm(s.hidden)
        self.fc1 = nn.Linear(s.hidden, 4 * s.hidden, bias=False)
        self.fc2 = nn.Linear(4 * s.hidden, s.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, n, h))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(Layer(s) for _ in range(s.layers))
        self.norm = nn.LayerNorm(s.hidden)
        self.head = nn.Linear(s.hidden, s.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, wrap: Callable[[], contextlib.AbstractContextManager]) -> torch.Tensor:
        x = self.embed(tokens)
        with wrap():
            for layer in self.layers:
                x = layer(x)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), tokens.view(-1))


@contextlib.contextmanager
def ours(model: GPT, k: int, sink: list) -> Iterator[Callable[[], contextlib.AbstractContextManager]]:
    # TE's default threshold on the GPU; the tiny CPU smoke configuration needs a small one to offload anything.
    min_size = 256 * 1024 if device.has_cuda() else 1024
    handle = offload_layers(model.layers, num_layers=k, min_tensor_size=min_size)
    try:
        yield contextlib.nullcontext
    finally:
        sink.append(handle.stats)
        handle.remove()


def run_variant(model: GPT, tokens: torch.Tensor, setup: contextlib.AbstractContextManager, steps: int) -> dict:
    with setup as wrap:
        loss = None
        times = []
        for i in range(steps + 1):  # the first step warms up (allocator, pinned pool, kernels)
            if i == 1:
                device.synchronize()
                device.reset_peak()
            start = time.perf_counter()
            loss = model(tokens, wrap)
            loss.backward()
            device.synchronize()
            if i:
                times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    return {
        "step_ms": round(statistics.median(times) * 1e3, 2),
        "peak_gib": round(device.memory_counters().max_allocated / 2**30, 3),
        "loss": loss.item(),
        "_loss": loss.detach(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", type=int, nargs="*", default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--json", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="Offloading num_layers == model_layers - 1")

    cuda = device.has_cuda()
    shape = Shape() if cuda else TINY
    steps = args.steps or (5 if cuda else 2)
    ks = args.ks if args.ks is not None else ([0, 4, 8, 12, 16, 18] if cuda else [0, 1, 3])
    if not cuda:
        print("No CUDA device: running the tiny CPU configuration as a smoke test; the numbers mean nothing.")
    dev = device.compute_device()
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    model = GPT(shape).to(device=dev, dtype=dtype)
    params = sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, shape.vocab, (shape.batch, shape.seq), device=dev)

    rows: dict[str, dict] = {}
    rows["none"] = run_variant(model, tokens, contextlib.nullcontext(contextlib.nullcontext), steps)
    for k in ks:
        sink: list = []
        rows[f"ours k={k}"] = run_variant(model, tokens, ours(model, k, sink), steps)
        stats = sink[-1]
        rows[f"ours k={k}"]["offloaded_bytes"] = stats.bytes_offloaded if stats else 0
        rows[f"ours k={k}"]["offloaded_gib"] = round(stats.bytes_offloaded / 2**30, 3) if stats else 0.0
        rows[f"ours k={k}"]["peak_resident_layers"] = stats.peak_resident_layers if stats else None

    def soc() -> contextlib.AbstractContextManager:
        return torch.autograd.graph.save_on_cpu(pin_memory=True)

    rows["save_on_cpu"] = run_variant(model, tokens, contextlib.nullcontext(soc), steps)

    base = rows["none"]
    base_loss = base["_loss"]
    for row in rows.values():
        row["time_vs_none"] = round(row["step_ms"] / base["step_ms"], 3)
        row["memory_vs_none"] = round(row["peak_gib"] / base["peak_gib"], 3) if base["peak_gib"] else None
        row["loss_bitwise_equal"] = bool(torch.equal(row.pop("_loss"), base_loss))
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name() if cuda else f"CPU ({platform.machine()}, {os.cpu_count()} cores)",
        "torch": torch.__version__,
        "shape": asdict(shape),
        "params_b": round(params / 1e9, 3),
        "steps": steps,
        "rows": rows,
    }
    print(f"{result['device']}, torch {result['torch']}, {result['params_b']} B params, {asdict(shape)}")
    print(f"{'variant':<14}{'step ms':>10}{'x none':>8}{'peak GiB':>10}{'x none':>8}{'offl GiB':>10}{'loss ==':>9}")
    for name, row in rows.items():
        print(
            f"{name:<14}{row['step_ms']:>10.1f}{row['time_vs_none']:>8.3f}{row['peak_gib']:>10.3f}"
            f"{(row['memory_vs_none'] or 0):>8.3f}{row.get('offloaded_gib', 0):>10.3f}{row['loss_bitwise_equal']!s:>9}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
