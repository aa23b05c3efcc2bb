"""The pictures under ``docs/img/``: drawn from the current model, with the numbers they show committed beside them.

A stale picture is caught without comparing pixels (font rendering differs between machines): ``docs/img/plots.json``
holds every number the pictures plot (:func:`plot_values`, generated like any doc), and each PNG carries the SHA-256
of the values it was drawn from (:func:`drawn_from`). ``memory_vs_offload``: Qwen3-30B-A3B as the upstream card ran it
against ``optimizer_offload_fraction`` with the card's peaks, and Llama-3-8B against ``cpu_offloading_num_layers``;
``predicted_vs_measured``: every published point with the targets' bands; ``plot_*``: one picture of each kind
``mbridge-offload plot`` draws, on the commands ``docs/planner.md`` shows (``PLOT_EXAMPLES``).
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from pathlib import Path
from typing import Any

IMAGES = ("memory_vs_offload", "predicted_vs_measured", "plot_sweep", "plot_phases", "plot_options")
VALUES = "docs/img/plots.json"
PARTS = ("weights", "gradients", "optimizer", "activations", "other")
COLORS = ("#4c72b0", "#55a868", "#c44e52", "#8172b2", "#999999")
MARKERS = {"qwen3-30b-a3b-card": "o", "qwen3-0.6b-nemo-rl": "s"}
_LLAMA = {"model": "llama3-8b", "num_gpus": 8, "seq_length": 8192, "micro_batch_size": 2}
# `mbridge-offload plot` on these inputs draws the docs' pictures of its three kinds: (kind, planner inputs, sweep).
PLOT_EXAMPLES: dict[str, tuple[str, dict[str, Any], str | None]] = {
    "plot_sweep": ("sweep", {"model": "qwen3-30b-a3b"}, "optimizer_offload_fraction=0:1:0.25"),
    "plot_phases": ("phases", {"model": "qwen3-30b-a3b", "optimizer_offload_fraction": 0.5}, None),
    "plot_options": ("options", {"model": "llama3-8b", "seq_length": 16384}, None),
}


def _r(value: float) -> float:
    return round(float(value), 3)


def _sweep(flags: dict[str, Any], key: str, xs: list[Any]) -> dict[str, Any]:
    from mbridge_offload.plan.inputs.resolve import resolve
    from mbridge_offload.plan.search.planner import estimate

    rows = [estimate(resolve({**flags, key: x})) for x in xs]
    return {
        "x": xs,
        "budget_gib": _r(rows[0].budget_gib),
        "parts_gib": {p: [_r(getattr(e.memory_gib, p)) for e in rows] for p in PARTS},
    }


def _memory_vs_offload() -> dict[str, Any]:
    from mbridge_offload_tools.evidence import published

    qwen = _sweep({"model": "qwen3-30b-a3b"}, "optimizer_offload_fraction", [i / 10 for i in range(11)])
    card = [p for p in published.accuracy() if p.run == "qwen3-30b-a3b-card" and not p.oom and "overlap" not in p.label]
    # The card's sweep ran fractions 0, 0.25, 0.5, 0.75, 1.0 in that order (fewer points if fewer were published).
    fractions = [0.0, 0.25, 0.5, 0.75, 1.0][: len(card)]
    qwen["measured"] = [[x, _r(p.measured_memory or 0.0)] for x, p in zip(fractions, card, strict=True)]
    return {"qwen3_30b_a3b": qwen, "llama3_8b": _sweep(_LLAMA, "activation_offload_layers", list(range(0, 32, 4)))}


def _predicted_vs_measured() -> dict[str, Any]:
    from mbridge_offload_tools.evidence import published

    points = published.accuracy()
    memory = [
        {"label": p.label, "run": p.run, "measured": _r(p.measured_memory), "predicted": _r(p.predicted_memory),
         "expressible": p.memory_expressible}
        for p in points
        if p.measured_memory is not None and not p.oom and p.measured_memory > 0
    ]  # fmt: skip
    step = [
        {"label": p.label, "run": p.run, "measured": _r(p.measured_factor), "predicted": _r(p.predicted_factor)}
        for p in points
        if p.measured_factor is not None
    ]
    return {"memory": memory, "step": step}


def _plot_picture(kind: str, flags: dict[str, Any], sweep: str | None) -> dict[str, Any]:
    """What ``plot`` draws for these inputs (``PlotResult.picture``)."""
    from mbridge_offload.config.errors import InputError
    from mbridge_offload_tools.plot.points import Source, compute

    try:
        return compute(kind, Source(dict(flags)), sweep, "png").picture()
    except InputError:
        if kind != "phases":
            raise
        # A planner whose estimate carries no phases: the picture says so until it does.
        return {"kind": kind, "title": "phases of one step", "budget_gib": 0.0, "points": []}


def plot_values() -> dict[str, Any]:
    """Every number the pictures show, by picture (what ``docs/img/plots.json`` holds)."""
    plots = {name: _plot_picture(*example) for name, example in PLOT_EXAMPLES.items()}
    return {"memory_vs_offload": _memory_vs_offload(), "predicted_vs_measured": _predicted_vs_measured(), **plots}


def render_values() -> str:
    return json.dumps(plot_values(), indent=1, sort_keys=True) + "\n"


def digest(values: dict[str, Any]) -> str:
    """The fingerprint a picture carries of the values it was drawn from."""
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()


def drawn_from(png: Path) -> str | None:
    """The values fingerprint written into ``png`` by :func:`draw` (its ``Description`` text chunk), else None."""
    try:
        data = png.read_bytes()
    except OSError:
        return None
    pos = 8  # after the PNG signature
    while pos + 8 <= len(data):
        (length,), kind = struct.unpack(">I", data[pos : pos + 4]), data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"tEXt" and body.startswith(b"Description\0"):
            return body.split(b"\0", 1)[1].decode("latin-1").removeprefix("values sha256 ")
        if kind == b"zTXt" and body.startswith(b"Description\0"):
            return zlib.decompress(body.split(b"\0", 1)[1][1:]).decode("latin-1").removeprefix("values sha256 ")
        pos += 12 + length
    return None


def draw(name: str, values: dict[str, Any], path: Path) -> None:
    """Draw picture ``name`` from ``values`` (its entry of :func:`plot_values`) into ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # No Software stamp (it names the matplotlib release); the Description ties the PNG to its values.
    metadata = {"Software": None, "Description": f"values sha256 {digest(values)}"}
    if name in PLOT_EXAMPLES:  # drawn by plot's own drawing, from the values plot's --json gives
        from mbridge_offload_tools.plot.figures import figure
        from mbridge_offload_tools.plot.result import Picture

        figure(Picture.model_validate(values)).savefig(path, dpi=120, metadata=metadata)
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = {"memory_vs_offload": _draw_memory, "predicted_vs_measured": _draw_accuracy}[name](plt, values)
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata=metadata)
    plt.close(fig)


def _stack(ax: Any, sweep: dict[str, Any], width: float) -> None:
    bottom = [0.0] * len(sweep["x"])
    for part, color in zip(PARTS, COLORS, strict=True):
        values = sweep["parts_gib"][part]
        ax.bar(sweep["x"], values, width, bottom=bottom, color=color, label=part)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]


def _draw_memory(plt: Any, values: dict[str, Any]) -> Any:
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    qwen, llama = values["qwen3_30b_a3b"], values["llama3_8b"]
    _stack(left, qwen, 0.07)
    measured = qwen["measured"]
    left.plot(
        [m[0] for m in measured], [m[1] for m in measured], "k^", ms=9, label="measured (upstream card, 16 x H100)"
    )
    budget = qwen["budget_gib"]
    left.axhline(budget, color="k", ls="--", lw=1, label=f"usable on H100 ({budget:.1f} GiB)")
    left.set_xlabel("optimizer_offload_fraction")
    left.set_ylabel("peak allocated per GPU, GiB (worst stage)")
    left.set_title("Qwen3-30B-A3B, TP2 PP2 EP4, full recompute (the card's recipe)")
    left.legend(fontsize=8)
    _stack(right, llama, 3)
    right.axhline(
        llama["budget_gib"], color="k", ls="--", lw=1, label=f"usable on H100 ({llama['budget_gib']:.1f} GiB)"
    )
    right.set_xlabel("cpu_offloading_num_layers")
    right.set_ylabel("peak allocated per GPU, GiB")
    right.set_title("Llama-3-8B, 8 x H100, seq 8192, mbs 2 (predicted only)")
    right.legend(fontsize=8)
    return fig


def _diagonal(ax: Any, points: list[dict[str, Any]], band: float) -> None:
    lo, hi = 0.0, max(max(p["measured"], p["predicted"]) for p in points) * 1.1
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    ax.fill_between([lo, hi], [lo * (1 - band), hi * (1 - band)], [lo * (1 + band), hi * (1 + band)], color="#dddddd")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)


def _draw_accuracy(plt: Any, values: dict[str, Any]) -> Any:
    fig, (mem, step) = plt.subplots(1, 2, figsize=(12, 5.5))
    for ax, points, band, color in ((mem, values["memory"], 0.05, "#c44e52"), (step, values["step"], 0.10, "#4c72b0")):
        _diagonal(ax, points, band)
        for p in points:
            ax.plot(
                p["measured"],
                p["predicted"],
                MARKERS[p["run"]] if p.get("expressible", True) else "x",
                color=color,
                ms=7,
            )
            ax.annotate(
                p["label"], (p["measured"], p["predicted"]), fontsize=7, xytext=(4, -10), textcoords="offset points"
            )
        ax.plot([], [], "o", color="gray", label="Qwen3-30B-A3B, upstream card (16 x H100)")
        ax.plot([], [], "s", color="gray", label="Qwen3-0.6B, NeMo-RL PR #3628 (1 GPU)")
        ax.legend(fontsize=8, loc="upper left")
    mem.set_xlabel("measured peak allocated, GiB (published GPU runs; NeMo-RL: saving vs no offload)")
    mem.set_ylabel("predicted, GiB")
    mem.set_title("Peak memory: predicted vs measured (band ±5 %; x = not expressible)")
    step.set_xlabel("measured step factor (step time / measured baseline; published GPU runs)")
    step.set_ylabel("predicted step factor")
    step.set_title("Step time: predicted vs measured (band ±10 %)")
    return fig


def stale_images(root: Path, values: dict[str, Any] | None = None) -> list[str]:
    """``docs/img/<name>.png`` for every picture missing or not drawn from the current values."""
    values = plot_values() if values is None else values
    return [
        f"docs/img/{name}.png"
        for name in IMAGES
        if drawn_from(root / "docs" / "img" / f"{name}.png") != digest(values[name])
    ]


def redraw(root: Path) -> list[str]:
    """Draw every stale picture again; returns the ones drawn."""
    values = plot_values()
    out = stale_images(root, values)
    for rel in out:
        name = Path(rel).stem
        draw(name, values[name], root / rel)
    return out
