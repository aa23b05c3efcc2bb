"""One picture, the same way for the CLI and the MCP tool: check where it goes, compute its points, draw, write.

The order is the safety: the output path and matplotlib are checked before any point is computed, and nothing is
written until the picture is drawn, so a bad input leaves no file behind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mbridge_offload.config.errors import InputError
from mbridge_offload_tools.plot import figures, output, points
from mbridge_offload_tools.plot.result import PlotResult


def plot_answer(
    v: dict[str, Any], roots: list[Path], *, default_format: str, default_file: bool
) -> tuple[PlotResult, bytes]:
    """``plot``: one body for the CLI and the MCP tool, which differ only where a picture goes when no output is named
    (``default_file``: the CLI's ``./mbridge-offload-KIND[-KEY].svg``; the MCP tool returns the image only)."""
    from mbridge_offload.plan.service import plan_source
    from mbridge_offload_tools.plot import sweep

    args = dict(v)
    kind, spec = args.pop("kind"), args.pop("sweep")
    target, consent, fmt = args.pop("output"), args.pop("overwrite"), args.pop("format")
    kind = kind or ("sweep" if spec else None)
    if kind is None:
        raise InputError(
            "plot: say what to draw",
            "pass --sweep KEY=START:STOP:STEP (e.g. optimizer_offload_fraction=0:1:0.25), --kind phases or --kind "
            "options (MCP: sweep, kind)",
        )
    fmt = output.choose_format(target, fmt, default_format)
    if target is None and default_file:
        target = output.default_name(kind, sweep.parse(spec)[0] if spec and kind == "sweep" else None, fmt)
    loaded = plan_source(args)  # takes config, overrides and megatron_args out: the rest are planner inputs
    return make_plot(kind, points.Source(args, *loaded), spec, fmt, target, consent, roots)


def make_plot(
    kind: str,
    src: points.Source,
    sweep: str | None,
    fmt: str,
    target: str | None,
    consent: bool,
    roots: list[Path],
) -> tuple[PlotResult, bytes]:
    """Picture ``kind`` of the planner's answers for ``src``, and its bytes; written to ``target`` (inside ``roots``;
    an existing file only with ``consent``) when given. A bad input leaves no file behind."""
    path = output.check_target(target, roots, consent) if target is not None else None
    figures.matplotlib_or_fail()
    result = points.compute(kind, src, sweep, fmt)
    data = figures.render(result, fmt)
    if path is not None:
        result.written, result.backup, rewritten = output.write(path, data, consent)
        if not rewritten:
            result.notes.append(f"{target} already holds this picture: not rewritten")
    return result, data
