"""``mbridge-offload plot``: the planner's answers as an SVG or PNG (matplotlib is imported only when it draws)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mbridge_offload_tools.cli.common import EXIT_OK, emit
from mbridge_offload_tools.interface.build import add_command, values


def add_parsers(sub: Any) -> None:
    add_command(sub, "plot_offload", run_plot)


def run_plot(args: argparse.Namespace) -> int:
    from mbridge_offload.actions.apply.write import default_roots
    from mbridge_offload_tools.plot.run import plot_answer

    config = args.config
    roots = default_roots(Path(config) if config and config != "-" else None, args.allowed_root)
    result, _ = plot_answer(values(args, "plot_offload"), roots, default_format="svg", default_file=True)
    emit(result.model_dump(mode="json"), args.json, _human)
    return EXIT_OK


def _rows(d: dict[str, Any]) -> list[str]:
    if d["kind"] == "sweep":
        lines = [f"  {d['sweep_key']:>24}  peak GiB (stages)            step s   factor  fits"]
        for p in d["points"]:
            stages = " ".join(f"{s['total_gib']:.1f}" for s in p["stages_gib"])
            lines.append(
                f"  {p['value']:>24}  {p['memory_gib']['total']:7.2f} ({stages})".ljust(58)
                + f"{p['step_time_s']:7.3f}  x{p['step_time_factor']:.2f}   {'yes' if p['fits'] else 'NO'}"
            )
        return lines
    if d["kind"] == "phases":
        return [
            f"  stage {p['stage']}  {p['phase']:<18} {p['memory_gib']:8.2f} GiB{'  <- peak' if p['peak'] else ''}"
            for p in d["points"]
        ]
    lines = [f"  as given  {d['given_gib']:7.2f} GiB  {d['given_step_s']:.3f} s"]
    for p in d["points"]:
        mark = ("fits" if p["fits"] else "DOES NOT FIT") + (", alternative" if p["alternative"] else "")
        lines.append(
            f"  #{p['rank']:<7} {p['memory_gib']:7.2f} GiB  {p['step_time_s']:.3f} s  x{p['step_time_factor']:.2f}  "
            f"{mark}: {' '.join(p['overrides'])}"
        )
    return lines


def _human(d: dict[str, Any]) -> str:
    where = f"wrote {d['written']} ({d['format']})" + (f"; backup {d['backup']}" if d.get("backup") else "")
    budget = f"budget {d['budget_gib']:.2f} GiB per GPU"
    lines = [d["title"], budget, *_rows(d), *(f"note: {n}" for n in d["notes"]), where]
    return "\n".join([*lines, f"unit: {d['unit']}"])
