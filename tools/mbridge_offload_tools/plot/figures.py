"""Draw a ``Picture`` (a plot's points) with matplotlib: imported here only, when a picture is drawn, never at start-up.

matplotlib's object API, never ``pyplot``: two MCP calls drawing at once share no state. No date, no version and
salted SVG ids: the same points give the same bytes.
"""

from __future__ import annotations

import io
import textwrap
from typing import Any

from mbridge_offload.config.errors import InputError
from mbridge_offload_tools.plot.result import OptionPoint, PhasePoint, Picture, SweepPoint

INSTALL = "pip install 'mbridge-offload[plot]' (scripts/setup, the full set-up, installs it)"
PALETTE = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b2", "#937860", "#da8bc3", "#8c8c8c", "#ccb974")
FITS, NO_FIT, GIVEN = "#55a868", "#c44e52", "#8c8c8c"
PHASE_ORDER = ("forward_backward", "loss", "optimizer_step")  # results.Phase's canonical names, in step order
_METADATA: dict[str, dict[str, Any]] = {"svg": {"Date": None, "Creator": None}, "png": {"Software": None}}


def matplotlib_or_fail() -> Any:
    """matplotlib, ready to draw without a display (InputError with the install command when absent)."""
    try:
        import matplotlib
    except ImportError:
        raise InputError("plot needs matplotlib, which this Python does not have", INSTALL) from None
    matplotlib.rcParams["svg.hashsalt"] = "mbridge-offload"  # stable ids: the same points, the same SVG
    return matplotlib


def _new_figure(width: float, height: float, ncols: int, **kw: Any) -> tuple[Any, Any]:
    matplotlib_or_fail()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)  # the Agg canvas: PNG without a display (SVG uses its own backend on savefig)
    return fig, fig.subplots(1, ncols, **kw)


def figure(result: Picture) -> Any:
    """The matplotlib ``Figure`` of ``result`` (its kind decides the drawing)."""
    draw = {"sweep": _sweep, "phases": _phases, "options": _options}[result.kind]
    fig = draw(result)
    fig.suptitle(result.title, fontsize=10)
    return fig


def render(result: Picture, fmt: str) -> bytes:
    """The picture of ``result`` as SVG or PNG bytes."""
    fig = figure(result)
    out = io.BytesIO()
    fig.savefig(out, format=fmt, dpi=100, metadata=_METADATA[fmt])
    return out.getvalue()


# ---------------------------------------------------------------------------------------------- sweep


def _sweep(result: Picture) -> Any:
    points = [p for p in result.points if isinstance(p, SweepPoint)]
    fig, (mem, step) = _new_figure(11, 4.6, 2)
    xs = [p.value for p in points]
    stages = sorted({s.stage for p in points for s in p.stages_gib})
    for n, stage in enumerate(stages):
        ys = [next(s.total_gib for s in p.stages_gib if s.stage == stage) for p in points]
        label = f"stage {stage}" if len(stages) > 1 else "peak allocated"
        mem.plot(xs, ys, marker="o", ms=4, color=PALETTE[n % len(PALETTE)], label=label)
    budgets = [p.budget_gib for p in points]
    budget_label = f"budget ({budgets[0]:.1f} GiB)" if len(set(budgets)) == 1 else "budget"
    mem.plot(xs, budgets, "k--", lw=1, label=budget_label)
    over = [p for p in points if not p.fits]
    if over:
        mem.plot(
            [p.value for p in over],
            [p.memory_gib.total for p in over],
            "x",
            color=NO_FIT,
            ms=9,
            mew=2,
            label="does not fit",
        )
    mem.set_xlabel(result.sweep_key or "value")
    mem.set_ylabel("peak allocated per GPU, GiB")
    mem.set_ylim(bottom=0)
    mem.legend(fontsize=8)
    mem.grid(alpha=0.3)
    step.plot(xs, [p.step_time_s for p in points], marker="o", ms=4, color=PALETTE[1])
    for p in points:
        step.annotate(
            f"x{p.step_time_factor:.2f}",
            (p.value, p.step_time_s),
            fontsize=7,
            xytext=(0, 5),
            textcoords="offset points",
            ha="center",
        )
    step.set_xlabel(result.sweep_key or "value")
    step.set_ylabel("step time, s (x: step_time_factor)")
    step.set_ylim(bottom=0)
    step.grid(alpha=0.3)
    return fig


# ---------------------------------------------------------------------------------------------- phases


def _phases(result: Picture) -> Any:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    points = [p for p in result.points if isinstance(p, PhasePoint)]
    stages = sorted({p.stage for p in points})
    fig, ax = _new_figure(max(6.5, 1.4 * len(stages) + 4), 4.6, 1)
    if not points:
        ax.text(0.5, 0.5, "this estimate carries no phases", ha="center", va="center")
        ax.set_axis_off()
        return fig
    seen = list(dict.fromkeys(p.phase for p in points))  # the step's order first, then any other phase as met
    names = [n for n in PHASE_ORDER if n in seen] + [n for n in seen if n not in PHASE_ORDER]
    width = 0.8 / len(names)
    handles: list[Any] = []
    for j, name in enumerate(names):
        color = PALETTE[j % len(PALETTE)]
        mine = [p for p in points if p.phase == name]
        xs = [stages.index(p.stage) - 0.4 + width * (j + 0.5) for p in mine]
        bars = ax.bar(xs, [p.memory_gib for p in mine], width, color=color)
        for bar, p in zip(bars, mine, strict=True):
            if p.peak:  # the phase that sets the stage's peak
                bar.set_edgecolor("black")
                bar.set_linewidth(1.5)
                bar.set_hatch("//")
        handles.append(Patch(color=color, label=name))
    ax.axhline(result.budget_gib, color="k", ls="--", lw=1)
    handles += [
        Patch(facecolor="white", edgecolor="black", hatch="//", label="sets the stage's peak"),
        Line2D([], [], color="k", ls="--", lw=1, label=f"budget ({result.budget_gib:.1f} GiB)"),
    ]
    ax.set_xticks(range(len(stages)), [f"stage {s}" for s in stages])
    ax.set_ylabel("peak allocated per GPU, GiB")
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return fig


# ---------------------------------------------------------------------------------------------- options


def option_label(p: OptionPoint) -> str:
    """``#rank`` and the option's changes, switches left out when a number says more (wrapped for a tick label)."""
    pairs = [o.partition("=") for o in p.overrides]
    valued = [(k, s, v) for k, s, v in pairs if v not in ("true", "false")] or pairs
    text = f"#{p.rank} " + ", ".join(f"{k.rsplit('.', 1)[-1]}{s}{v}" for k, s, v in valued)
    return "\n".join(textwrap.wrap(text, 42, break_on_hyphens=False)) or f"#{p.rank}"


def _options(result: Picture) -> Any:
    points = [p for p in result.points if isinstance(p, OptionPoint)]
    labels = ["as given", *(option_label(p) for p in points)]
    memory = [result.given_gib or 0.0, *(p.memory_gib for p in points)]
    seconds = [result.given_step_s or 0.0, *(p.step_time_s for p in points)]
    colors = [GIVEN, *((FITS if p.fits else NO_FIT) for p in points)]
    hatches = ["", *(("//" if p.alternative else "") for p in points)]
    ys = list(range(len(labels)))[::-1]  # the config as given on top, then rank 0, 1, ...
    fig, (mem, step) = _new_figure(12, max(3.5, 0.62 * len(labels) + 1.6), 2, sharey=True)
    for ax, values in ((mem, memory), (step, seconds)):
        for y, v, c, h in zip(ys, values, colors, hatches, strict=True):
            ax.barh(y, v, color=c, hatch=h, edgecolor="white" if not h else "black", linewidth=0.5)
        ax.grid(axis="x", alpha=0.3)
    mem.axvline(result.budget_gib, color="k", ls="--", lw=1)
    mem.set_ylim(-0.7, len(labels) - 0.3)
    mem.set_yticks(ys, labels, fontsize=7)
    mem.set_xlabel(f"peak allocated per GPU, GiB (worst stage; dashed: budget {result.budget_gib:.1f} GiB)")
    for y, v, p in zip(ys[1:], seconds[1:], points, strict=True):
        step.annotate(
            f"x{p.step_time_factor:.2f}", (v, y), fontsize=7, xytext=(3, 0), textcoords="offset points", va="center"
        )
    step.set_xlabel("step time, s (x: step_time_factor)")
    from matplotlib.patches import Patch

    handles = [
        Patch(color=FITS, label="fits"),
        Patch(color=NO_FIT, label="does not fit"),
        Patch(color=GIVEN, label="the config as given"),
        Patch(facecolor="white", edgecolor="black", hatch="//", label="alternative (a lever not allowed)"),
    ]
    fig.legend(handles=handles, fontsize=8, loc="outside lower center", ncols=len(handles))
    return fig
