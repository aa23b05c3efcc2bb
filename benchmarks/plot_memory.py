"""Plot the per-GPU memory breakdown against optimizer offload fraction and activation-offloaded layers.

Writes ``docs/img/memory_vs_offload.png``:
- left: Qwen3-30B-A3B pre-training, 16 x H100 80 GB, TP2 PP2 EP4 ETP1, distributed optimizer, worst stage, against
  ``optimizer_offload_fraction``, with the upstream measured savings (skill card) drawn on the predicted baseline;
- right: Llama-3-8B, 8 x H100, TP1 PP1, seq 8192, micro-batch 2, against ``cpu_offloading_num_layers``.

Run: ``python benchmarks/plot_memory.py [--output PATH]``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mbridge_offload.plan.hardware import gpu_preset  # noqa: E402
from mbridge_offload.plan.memory import Setup, estimate_memory  # noqa: E402
from mbridge_offload.plan.planner import budget_gb  # noqa: E402
from mbridge_offload.plan.presets import model_preset  # noqa: E402

PARTS = ("weights", "gradients", "optimizer", "activations", "other")
COLORS = ("#4c72b0", "#55a868", "#c44e52", "#8172b2", "#999999")
MEASURED_SAVED_GB = {0.25: 3.8, 0.5: 7.6, 0.75: 11.6, 1.0: 15.3}


def _stack(ax, xs, rows, width):
    bottom = [0.0] * len(xs)
    for part, color in zip(PARTS, COLORS, strict=True):
        values = [r[part] for r in rows]
        ax.bar(xs, values, width, bottom=bottom, color=color, label=part)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=str(ROOT / "docs/img/memory_vs_offload.png"))
    args = parser.parse_args(argv)
    gpu = gpu_preset("h100-80gb")
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))

    qwen = model_preset("qwen3-30b-a3b")
    setup = Setup(num_gpus=16, tp=2, pp=2, ep=4, etp=1, global_batch_size=8)
    fractions = [i / 10 for i in range(11)]
    rows = [estimate_memory(qwen, replace(setup, optimizer_offload_fraction=f)).breakdown_gb() for f in fractions]
    _stack(left, fractions, rows, 0.07)
    base = rows[0]["total"]
    left.plot(
        list(MEASURED_SAVED_GB),
        [base - v for v in MEASURED_SAVED_GB.values()],
        "k^",
        ms=8,
        label="baseline − measured saving (upstream)",
    )
    left.axhline(gpu.hbm_gb, color="k", lw=1, ls=":")
    left.set(
        title="Qwen3-30B-A3B, 16×H100, TP2 PP2 EP4 (worst stage)",
        xlabel="optimizer_offload_fraction",
        ylabel="GB per GPU",
        ylim=(0, 85),
    )
    left.legend(loc="upper right", fontsize=8, ncol=2)

    llama = model_preset("llama3-8b")
    setup = Setup(num_gpus=8, seq_length=8192, micro_batch_size=2)
    layers = list(range(0, llama.num_layers, 2))
    rows = [estimate_memory(llama, replace(setup, activation_offload_layers=k)).breakdown_gb() for k in layers]
    _stack(right, layers, rows, 1.4)
    right.axhline(gpu.hbm_gb, color="k", lw=1, ls=":", label="H100 80 GB")
    right.axhline(budget_gb(gpu), color="r", lw=1, ls="--", label="budget (5 % kept free)")
    right.set(title="Llama-3-8B, 8×H100, PP1, seq 8192, mbs 2", xlabel="cpu_offloading_num_layers", ylabel="GB per GPU")
    right.legend(loc="upper right", fontsize=8)

    fig.tight_layout()
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(out)
    return out


if __name__ == "__main__":
    main()
