"""One picture, the same way for the CLI and the MCP tool: check where it goes, compute its points, draw, write.

The order is the safety: the output path and matplotlib are checked before any point is computed, and nothing is
written until the picture is drawn, so a bad input leaves no file behind.
"""

from __future__ import annotations

from pathlib import Path

from mbridge_offload_tools.plot import figures, output, points
from mbridge_offload_tools.plot.result import PlotResult


def make_plot(
    kind: str,
    src: points.Source,
    sweep: str | None,
    fmt: str,
    target: str | None,
    consent: bool,
    roots: list[Path],
) -> tuple[PlotResult, bytes]:
    """Picture ``kind`` of the planner's answers for ``src``, and its bytes; written to ``target`` when given.

    Args:
        kind: ``sweep``, ``phases`` or ``options``.
        src: the config and planner inputs.
        sweep: ``KEY=START:STOP:STEP`` (kind sweep).
        fmt: ``svg`` or ``png`` (``output.choose_format``).
        target: the file to write, or None (MCP without output).
        consent: replace an existing file (a backup is kept).
        roots: the directories the file may be written into.

    Raises:
        InputError: a bad target, no matplotlib, a bad sweep or kind, a refused planner input; nothing written.
    """
    path = output.check_target(target, roots, consent) if target is not None else None
    figures.matplotlib_or_fail()
    result = points.compute(kind, src, sweep, fmt)
    data = figures.render(result, fmt)
    if path is not None:
        result.written, result.backup, rewritten = output.write(path, data, consent)
        if not rewritten:
            result.notes.append(f"{target} already holds this picture: not rewritten")
    return result, data
