"""CPU benchmark: the Python cost of the activation-offload hooks, per saved tensor.

A 12-layer pre-norm transformer stack (small, so that per-tensor overhead is visible next to the compute)
runs forward + backward on the CPU, in one process, under each of:

    none            no hooks at all                                            (baseline)
    identity_hooks  saved_tensors_hooks(lambda t: t, lambda t: t)              (PyTorch's own hook cost)
    save_on_cpu     torch.autograd.graph.save_on_cpu(pin_memory=False)         (no copy on CPU: hook cost only)
    save_on_cpu_cp  torch.autograd.graph.save_on_cpu(pin_memory=True)          (copies every saved tensor here)
    ours_k0         offload_layers(num_layers=0): eligibility + accounting, no copy
    ours_skip       offload_layers(num_layers=11, min_tensor_size=huge): every tensor judged, none copied
    ours_k11        offload_layers(num_layers=11, min_tensor_size=1024): 11 of 12 layers really copied

and reports the median step time, the number of saved tensors per step, the overhead per saved tensor
against ``none``, and ratios against ``save_on_cpu``. On CPU a "copy to host" is a memcpy within RAM, so
only the Python/hook part is meaningful; transfer costs need the GPU script. Run:

    .venv/bin/python benchmarks/cpu_activation.py            # about 30 s on 2 cores
    .venv/bin/python benchmarks/cpu_activation.py --quick    # seconds; a smoke test
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
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(1, os.path.join(os.path.dirname(__file__), "..", "offload"))  # this checkout's runtime package
from benchmarks.doc_fragment import DOCS, table, write_section
from mbridge_offload_runtime.activation.layers import offload_layers

DOC = DOCS / "benchmarks-activation.md"

LAYERS = 12


class Layer(nn.Module):
    """Pre-norm attention + MLP block, the shape of a GPT layer."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / (h // self.heads) ** 0.5
        attn = torch.softmax(scores, dim=-1) @ v
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))


def make_model(hidden: int, heads: int) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(Layer(hidden, heads) for _ in range(LAYERS))


def step(layers: nn.ModuleList, x: torch.Tensor) -> None:
    for layer in layers:
        x = layer(x)
    x.float().pow(2).mean().backward()


def count_saved(layers: nn.ModuleList, x: torch.Tensor) -> int:
    n = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        n[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(layers, x)
    return n[0]


@contextlib.contextmanager
def installed(layers: nn.ModuleList, **kw: object) -> Iterator[None]:
    handle = offload_layers(layers, **kw)
    try:
        yield
    finally:
        handle.remove()


def variants(layers: nn.ModuleList) -> dict[str, Callable[[], contextlib.AbstractContextManager]]:
    def identity() -> contextlib.AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)

    return {
        "none": contextlib.nullcontext,
        "identity_hooks": identity,
        "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=False),
        "save_on_cpu_cp": lambda: torch.autograd.graph.save_on_cpu(pin_memory=True),
        "ours_k0": lambda: installed(layers, num_layers=0),
        "ours_skip": lambda: installed(layers, num_layers=LAYERS - 1, min_tensor_size=1 << 40),
        "ours_k11": lambda: installed(layers, num_layers=LAYERS - 1, min_tensor_size=1024),
    }


def measure(layers: nn.ModuleList, x: torch.Tensor, repeats: int, warmup: int) -> dict[str, float]:
    """Median seconds per step for every variant, interleaved round-robin so drift hits all alike."""
    times: dict[str, list[float]] = {}
    factories = variants(layers)
    for name, factory in factories.items():  # warm up
        with factory():
            for _ in range(warmup):
                step(layers, x)
        times[name] = []
    for _ in range(repeats):
        for name, factory in factories.items():
            with factory():
                start = time.perf_counter()
                step(layers, x)
                times[name].append(time.perf_counter() - start)
            layers.zero_grad(set_to_none=True)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few repeats; a smoke test")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 keeps timings stable)")
    parser.add_argument("--json", help="also write the results as JSON here")
    parser.add_argument(
        "--write-docs",
        nargs="?",
        const=str(DOC),
        default=None,
        metavar="FILE",
        help=f"write this run's section of the fragment (default {DOC.relative_to(DOC.parents[1])})",
    )
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="Offloading num_layers == model_layers - 1")
    torch.set_num_threads(args.threads)
    repeats, warmup = (5, 1) if args.quick else (200, 10)

    layers = make_model(args.hidden, args.heads)
    x = torch.randn(args.batch, args.seq, args.hidden, requires_grad=True)
    saved = count_saved(layers, x)
    handle = offload_layers(layers, num_layers=LAYERS - 1, min_tensor_size=1024)
    step(layers, x)
    stats = handle.stats
    handle.remove()
    medians = measure(layers, x, repeats, warmup)

    base = medians["none"]
    per_tensor = {name: (t - base) / saved * 1e6 for name, t in medians.items()}
    ref = per_tensor["save_on_cpu"]
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "threads": args.threads,
        "load_average_1min": round(os.getloadavg()[0], 2),  # other jobs on the machine make the timings noisy
        "shape": {"layers": LAYERS, "hidden": args.hidden, "seq": args.seq, "batch": args.batch},
        "repeats": repeats,
        "saved_tensors_per_step": saved,
        "ours_k11_offloaded": {
            "tensors": stats.tensors_offloaded,
            "copies": stats.copies_offloaded,
            "bytes": stats.bytes_offloaded,
            "skipped": dict(stats.skipped),
        },
        "median_step_ms": {k: round(v * 1e3, 3) for k, v in medians.items()},
        "overhead_us_per_saved_tensor": {k: round(v, 2) for k, v in per_tensor.items()},
        "step_time_vs_none": {k: round(v / base, 3) for k, v in medians.items()},
        "overhead_vs_save_on_cpu": {k: round(v / ref, 2) if ref > 0 else None for k, v in per_tensor.items()},
    }
    print(f"CPU activation-offload hook overhead ({result['machine']}, {args.threads} thread(s), {result['date']})")
    print(f"12-layer stack hidden={args.hidden} seq={args.seq} batch={args.batch}: {saved} saved tensors per step")
    print(f"{'variant':<16}{'step ms':>10}{'x none':>9}{'us/tensor':>11}{'x save_on_cpu':>15}")
    for name in medians:
        ratio = result["overhead_vs_save_on_cpu"][name]
        print(
            f"{name:<16}{result['median_step_ms'][name]:>10.3f}{result['step_time_vs_none'][name]:>9.3f}"
            f"{per_tensor[name]:>11.2f}{(f'{ratio:.2f}' if ratio is not None else '-'):>15}"
        )
    print("ours_k11 per step:", json.dumps(result["ours_k11_offloaded"]))
    if args.write_docs:
        write_section(Path(args.write_docs), "cpu_activation.py", render_docs(result, args.quick))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


WHAT = {
    "none": "no hooks",
    "identity_hooks": "`saved_tensors_hooks(lambda t: t, lambda t: t)` (PyTorch's own hook cost)",
    "save_on_cpu": "`save_on_cpu(pin_memory=False)`: on CPU `tensor.cpu()` is a no-op, so hook cost only",
    "save_on_cpu_cp": "`save_on_cpu(pin_memory=True)`: copies **every** saved tensor (weights included)",
    "ours_k0": "`offload_layers(num_layers=0)`: per-layer context, classification, accounting, no copy",
    "ours_skip": "`num_layers=11`, threshold above every tensor: every tensor classified, none copied",
    "ours_k11": "`num_layers=11, min_tensor_size=1024`: 11 of 12 layers copied out and back",
}


def render_docs(result: dict, quick: bool) -> str:
    """This run's section of ``docs/benchmarks-activation.md``: how it was measured, and the table."""
    shape, off = result["shape"], result["ours_k11_offloaded"]
    order = sorted(result["median_step_ms"], key=result["median_step_ms"].get)
    rows = [
        [f"`{name}`", WHAT.get(name, ""), f"{result['median_step_ms'][name]:.3f}",
         f"{result['step_time_vs_none'][name]:.3f}", f"{result['overhead_us_per_saved_tensor'][name]:.2f}",
         "–" if result["overhead_vs_save_on_cpu"][name] is None else f"{result['overhead_vs_save_on_cpu'][name]:.2f}"]
        for name in order
    ]  # fmt: skip
    lines = [
        "### CPU: hook overhead per saved tensor (CPU-measured; no device, no transfer)",
        "",
        f"**Measured on the CPU** ({result['machine']}, {result['threads']} torch thread(s), 1-minute load "
        f"average {result.get('load_average_1min', '?')} at the end of the run), {result['date']}, "
        f"by `benchmarks/cpu_activation.py --write-docs{' --quick' if quick else ''}` in the same run that wrote "
        f"this section. {'A --quick run: 5 repeats, a smoke test, not a measurement. ' if quick else ''}"
        f"Model: {shape['layers']}-layer pre-norm transformer stack (hidden {shape['hidden']}, seq {shape['seq']}, "
        f"batch {shape['batch']}); forward + backward; **{result['saved_tensors_per_step']} saved tensors per "
        f"step**; median of {result['repeats']} steps per variant, variants interleaved. Overhead per saved "
        "tensor = (variant step − `none` step) / saved tensors. On the CPU a copy to host is a memcpy inside RAM: "
        "these rows measure Python and hook costs, not PCIe transfers.",
        "",
        table(
            ["variant", "what it does", "step ms", "× none", "µs per saved tensor", "× `save_on_cpu`"], rows, "llrrrr"
        ),
        "",
        f"`ours_k11` per step: {off['tensors']} saved tensors answered from {off['copies']} host copies "
        f"({off['bytes']:,} bytes out and the same back); skipped: "
        + ", ".join(f"{n} {reason}" for reason, n in sorted(off["skipped"].items()))
        + ".",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
