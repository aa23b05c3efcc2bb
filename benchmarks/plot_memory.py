"""Plot the planner against published GPU measurements, and its memory breakdown against the offload settings.

Writes two pictures (no GPU needed: the measurements are published runs by others,
offload/mbridge_offload/plan/data/published.yaml):
- ``docs/img/predicted_vs_measured.png``: every published point, predicted against measured, for peak memory (GiB,
  the unit of Megatron's memory report; savings for runs whose absolute settings are unpublished) and for the step
  factor; the diagonal and the ±5 % / ±10 % bands of the targets;
- ``docs/img/memory_vs_offload.png``: left, Qwen3-30B-A3B as the upstream card ran it (the preset's recipe) against
  ``optimizer_offload_fraction``, with the card's measured peaks; right, Llama-3-8B (8 x H100, seq 8192,
  micro-batch 2) against ``cpu_offloading_num_layers`` (no measurement published: predictions only).

Run: ``python benchmarks/plot_memory.py [--output-dir DIR]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mbridge_offload.plan import published  # noqa: E402
from mbridge_offload.plan.planner import estimate  # noqa: E402
from mbridge_offload.plan.resolve import resolve  # noqa: E402

PARTS = ("weights", "gradients", "optimizer", "activations", "other")
COLORS = ("#4c72b0", "#55a868", "#c44e52", "#8172b2", "#999999")
MARKERS = {"qwen3-30b-a3b-card": "o", "qwen3-0.6b-nemo-rl": "s"}


def _diagonal(ax, values: list[float], band: float) -> None:
    lo, hi = 0.0, max(values) * 1.1
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    ax.fill_between([lo, hi], [lo * (1 - band), hi * (1 - band)], [lo * (1 + band), hi * (1 + band)], color="#dddddd")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)


def predicted_vs_measured(path: Path) -> None:
    points = published.accuracy()
    fig, (mem, step) = plt.subplots(1, 2, figsize=(12, 5.5))
    shown = [p for p in points if p.measured_memory is not None and not p.oom and p.measured_memory > 0]
    _diagonal(mem, [max(p.measured_memory, p.predicted_memory) for p in shown], 0.05)
    for p in shown:
        face = MARKERS[p.run] if p.memory_expressible else "x"
        mem.plot(p.measured_memory, p.predicted_memory, face, color="#c44e52", ms=7)
        mem.annotate(
            p.label, (p.measured_memory, p.predicted_memory), fontsize=7, xytext=(4, -10), textcoords="offset points"
        )
    mem.set_xlabel("measured peak allocated, GiB (published GPU runs; NeMo-RL: saving vs no offload)")
    mem.set_ylabel("predicted, GiB")
    mem.set_title("Peak memory: predicted vs measured (band ±5 %; x = not expressible)")
    timed = [p for p in points if p.measured_factor is not None]
    _diagonal(step, [max(p.measured_factor, p.predicted_factor) for p in timed], 0.10)
    for p in timed:
        step.plot(p.measured_factor, p.predicted_factor, MARKERS[p.run], color="#4c72b0", ms=7)
        step.annotate(
            p.label, (p.measured_factor, p.predicted_factor), fontsize=7, xytext=(4, -10), textcoords="offset points"
        )
    step.set_xlabel("measured step factor (step time / measured baseline; published GPU runs)")
    step.set_ylabel("predicted step factor")
    step.set_title("Step time: predicted vs measured (band ±10 %)")
    for ax in (mem, step):
        ax.plot([], [], "o", color="gray", label="Qwen3-30B-A3B, upstream card (16 x H100)")
        ax.plot([], [], "s", color="gray", label="Qwen3-0.6B, NeMo-RL PR #3628 (1 GPU)")
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _stack(ax, xs, rows, width) -> None:
    bottom = [0.0] * len(xs)
    for part, color in zip(PARTS, COLORS, strict=True):
        values = [getattr(r, part) for r in rows]
        ax.bar(xs, values, width, bottom=bottom, color=color, label=part)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]


def memory_vs_offload(path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    fractions = [i / 10 for i in range(11)]
    qwen = [estimate(resolve({"model": "qwen3-30b-a3b", "optimizer_offload_fraction": f})) for f in fractions]
    _stack(left, fractions, [e.memory_gib for e in qwen], 0.07)
    card = [p for p in published.accuracy() if p.run == "qwen3-30b-a3b-card" and not p.oom and "overlap" not in p.label]
    measured_x = [0.0, 0.25, 0.5, 0.75, 1.0][: len(card)]
    left.plot(measured_x, [p.measured_memory for p in card], "k^", ms=9, label="measured (upstream card, 16 x H100)")
    left.axhline(qwen[0].budget_gib, color="k", ls="--", lw=1, label=f"usable on H100 ({qwen[0].budget_gib:.1f} GiB)")
    left.set_xlabel("optimizer_offload_fraction")
    left.set_ylabel("peak allocated per GPU, GiB (worst stage)")
    left.set_title("Qwen3-30B-A3B, TP2 PP2 EP4, full recompute (the card's recipe)")
    left.legend(fontsize=8)
    layers = list(range(0, 32, 4))
    flags = {"model": "llama3-8b", "num_gpus": 8, "seq_length": 8192, "micro_batch_size": 2}
    llama = [estimate(resolve({**flags, "activation_offload_layers": k})) for k in layers]
    _stack(right, layers, [e.memory_gib for e in llama], 3)
    right.axhline(llama[0].budget_gib, color="k", ls="--", lw=1, label="usable on H100")
    right.set_xlabel("cpu_offloading_num_layers")
    right.set_ylabel("peak allocated per GPU, GiB")
    right.set_title("Llama-3-8B, 8 x H100, seq 8192, mbs 2 (predicted only)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default=str(ROOT / "docs/img"))
    args = parser.parse_args(argv)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "predicted_vs_measured.png", out / "memory_vs_offload.png"]
    predicted_vs_measured(paths[0])
    memory_vs_offload(paths[1])
    for path in paths:
        print(path)
    return paths


if __name__ == "__main__":
    main()
