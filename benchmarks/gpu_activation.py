"""GPU benchmark: peak memory and step time of layer-level activation offload vs k.

A GPT-like stack of about 1.1 B parameters (20 layers, hidden 2048, 16 heads, MLP 4x, vocab 32000, bf16,
SDPA attention) at sequence length 4096, micro-batch 1, forward + backward per step, under:

    none          no offload
    ours k=...    offload_layers(model.layers, num_layers=k)   for k in --ks (default 0 4 8 12 16 18)
    ours-te-shape our get_cpu_offload_context(True, k, L), entered per layer with sync_fn, as TE's is
    TE k=...      Transformer Engine's get_cpu_offload_context, the same way (where TE is installed)
    save_on_cpu   torch.autograd.graph.save_on_cpu(pin_memory=True) around the whole stack

For each: peak allocated device memory over the timed steps (torch.cuda.max_memory_allocated), median step
time, bytes offloaded per step (ours), and whether the loss equals the no-offload loss bitwise. Budget: under
5 minutes on one H100/H200 (about 20 s per variant). Run:

    .venv/bin/python benchmarks/gpu_activation.py                    # GPU machine
    .venv/bin/python benchmarks/gpu_activation.py --json out.json    # also write the results

With ``--write-docs`` it writes its section of ``docs/benchmarks-activation.md`` (labelled GPU-measured only
when it ran on a GPU). ``benchmarks/gpu_all.py`` runs it together with ``gpu_optimizer.py`` in one call.

Without CUDA it falls back to a tiny CPU configuration (2 steps per variant, a smoke test of the script;
its numbers mean nothing) and says so.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(1, os.path.join(os.path.dirname(__file__), "..", "offload"))  # this checkout's runtime package
from benchmarks.doc_fragment import DOCS, table, write_section
from mbridge_offload_runtime import device
from mbridge_offload_runtime.activation.layers import offload_layers

DOC = DOCS / "benchmarks-activation.md"


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
        pair = getattr(wrap, "context_and_sync", None)  # TE's call shape: enter per layer, sync each output
        with wrap():
            for layer in self.layers:
                if pair is None:
                    x = layer(x)
                    continue
                with pair[0]:
                    x = layer(x)
                x = pair[1](x)
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


class _LayerContext:
    """A ``wrap`` for GPT.forward that carries a ``(context, sync_fn)`` pair (TE's, or ours in TE's shape)."""

    def __init__(self, pair: tuple) -> None:
        self.context_and_sync = pair[:2]

    def __call__(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


@contextlib.contextmanager
def te_shape(model: GPT, k: int, factory: Callable, sink: list) -> Iterator[_LayerContext]:
    """``factory(True, k, L)`` — Transformer Engine's ``get_cpu_offload_context`` or ours — around each layer."""
    pair = factory(True, k, len(model.layers))
    try:
        yield _LayerContext(pair)
    finally:
        sink.append(getattr(pair[0], "stats", None))


def upstream_te() -> Callable | None:
    """Transformer Engine's ``get_cpu_offload_context`` where TE is installed (and a GPU is there), else None."""
    if not device.has_cuda():
        return None
    try:
        from transformer_engine.pytorch import get_cpu_offload_context as te_factory
    except Exception:  # TE missing or broken: the comparison is skipped and the table says so
        return None
    return te_factory


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


def measure_all(model: GPT, tokens: torch.Tensor, ks: list[int], steps: int) -> dict[str, dict]:
    """Every variant: no offload, ours (hooks and TE's call shape), upstream TE where installed, save_on_cpu."""
    from mbridge_offload_runtime.activation.context import get_cpu_offload_context as ours_factory

    min_size = 256 * 1024 if device.has_cuda() else 1024
    te_factory = upstream_te()
    rows: dict[str, dict] = {"none": run_variant(model, tokens, contextlib.nullcontext(contextlib.nullcontext), steps)}
    for k in ks:
        sink: list = []
        rows[f"ours k={k}"] = run_variant(model, tokens, ours(model, k, sink), steps)
        _add_stats(rows[f"ours k={k}"], sink[-1])
        if k == 0:
            continue  # TE's shape with k = 0 offloads nothing either; the hook variant covers it
        factory = functools.partial(ours_factory, min_tensor_size=min_size)
        sink = []
        rows[f"ours-te-shape k={k}"] = run_variant(model, tokens, te_shape(model, k, factory, sink), steps)
        _add_stats(rows[f"ours-te-shape k={k}"], sink[-1])
        if te_factory is not None:
            rows[f"TE k={k}"] = run_variant(model, tokens, te_shape(model, k, te_factory, []), steps)

    def soc() -> contextlib.AbstractContextManager:
        return torch.autograd.graph.save_on_cpu(pin_memory=True)

    rows["save_on_cpu"] = run_variant(model, tokens, contextlib.nullcontext(soc), steps)
    return rows


def _add_stats(row: dict, stats: object) -> None:
    row["offloaded_bytes"] = stats.bytes_offloaded if stats else 0
    row["offloaded_gib"] = round(stats.bytes_offloaded / 2**30, 3) if stats else 0.0
    row["peak_resident_layers"] = stats.peak_resident_layers if stats else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", type=int, nargs="*", default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--json", help="also write the results as JSON here")
    parser.add_argument(
        "--write-docs",
        nargs="?",
        const=str(DOC),
        default=None,
        metavar="FILE",
        help="write this run's section of docs/benchmarks-activation.md (or FILE)",
    )
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

    rows = measure_all(model, tokens, ks, steps)

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
    report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.write_docs:
        write_section(Path(args.write_docs), "gpu_activation.py", render_docs(result, cuda))
    return 0


def report(result: dict) -> None:
    print(f"{result['device']}, torch {result['torch']}, {result['params_b']} B params, {result['shape']}")
    print(f"{'variant':<22}{'step ms':>10}{'x none':>8}{'peak GiB':>10}{'x none':>8}{'offl GiB':>10}{'loss ==':>9}")
    for name, row in result["rows"].items():
        print(
            f"{name:<22}{row['step_ms']:>10.1f}{row['time_vs_none']:>8.3f}{row['peak_gib']:>10.3f}"
            f"{(row['memory_vs_none'] or 0):>8.3f}{row.get('offloaded_gib', 0):>10.3f}{row['loss_bitwise_equal']!s:>9}"
        )


def render_docs(result: dict, cuda: bool) -> str:
    """This run's section of ``docs/benchmarks-activation.md``, labelled GPU-measured only when it was."""
    label = f"GPU-measured on {result['device']}" if cuda else "CPU smoke run of the GPU script: NOT a measurement"
    rows = [
        [f"`{name}`", f"{r['step_ms']:.1f}", f"{r['time_vs_none']:.3f}", f"{r['peak_gib']:.3f}",
         "–" if r["memory_vs_none"] is None else f"{r['memory_vs_none']:.3f}", f"{r.get('offloaded_gib', 0):.3f}",
         "yes" if r["loss_bitwise_equal"] else "no"]
        for name, r in result["rows"].items()
    ]  # fmt: skip
    te = any(name.startswith("TE ") for name in result["rows"])
    return "\n".join(
        [
            f"### GPU: peak memory and step time vs k ({label})",
            "",
            f"**{label}**, torch {result['torch']}, {result['date']}, by `benchmarks/gpu_activation.py "
            f"--write-docs` (or `benchmarks/gpu_all.py`) in the same run that wrote this section. Model: GPT-like "
            f"stack, {result['params_b']} B parameters, {result['shape']}; median of {result['steps']} steps after "
            "one warm-up step; peak = `torch.cuda.max_memory_allocated` over the timed steps. `ours k` = "
            "`offload_layers`, `ours-te-shape k` = our `get_cpu_offload_context` entered per layer as TE's is, "
            + ("`TE k` = Transformer Engine's own `get_cpu_offload_context`." if te else
               "no `TE` rows: Transformer Engine was not installed on this machine."),
            "",
            table(["variant", "step ms", "× none", "peak GiB", "× none", "offloaded GiB", "loss bitwise = none"], rows),
        ]
    )  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
