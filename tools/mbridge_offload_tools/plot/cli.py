"""``mbridge-offload plot``: the planner's answers as an SVG or PNG (matplotlib is imported only when it draws).

Every planner input is taken as ``estimate`` takes it (the same generated flags, config and ``--megatron-args``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mbridge_offload_tools.common import EXIT_OK, UsageError, emit

DESCRIPTION = (
    "Draw the planner's answers. --sweep KEY=START:STOP:STEP (the stop included; or KEY=V1,V2,...): peak memory per "
    "pipeline stage and step time at each value of one planner input (each point is estimate at that value), with "
    "the GPU budget line; --kind phases: the phases of one step per stage (estimate's phases) and the one that sets "
    "the peak; --kind options: recommend's ranked options side by side (memory, step time, which fit). Every input "
    "of estimate is accepted. Writes --output (.svg or .png by its extension; default "
    "./mbridge-offload-KIND[-KEY].svg); an existing file only with --force (a backup is kept). --json prints the "
    "points and where the picture was written. Needs matplotlib: pip install 'mbridge-offload[plot]'."
)


def add_parsers(sub: Any) -> None:
    from mbridge_offload_tools.cli_plan import _add_common  # estimate's flags: one generated list

    p = sub.add_parser(
        "plot", help="draw a sweep of one input, the phases of a step, or recommend's options", description=DESCRIPTION
    )
    _add_common(p)
    p.add_argument("config", nargs="?", metavar="CONFIG", help="Bridge YAML/JSON (same as --model-config)")
    g = p.add_argument_group("picture")
    g.add_argument(
        "--kind", choices=("sweep", "phases", "options"), help="what to draw (default: sweep when --sweep is given)"
    )
    g.add_argument(
        "--sweep",
        metavar="KEY=START:STOP:STEP",
        help="the input to vary and its values, e.g. optimizer_offload_fraction=0:1:0.25, "
        "activation_offload_layers=0:32:4, micro_batch_size=1,2,4 (any numeric planner input)",
    )
    g.add_argument("--output", metavar="FILE", help="the picture's file: .svg or .png (default: see above)")
    g.add_argument("--format", choices=("svg", "png"), help="svg (default) or png; the --output extension decides")
    g.add_argument("--force", action="store_true", help="replace an existing --output (a .bak backup is kept)")
    g.add_argument("--allowed-root", metavar="DIR", help="an extra directory --output may point into")
    p.set_defaults(handler=run_plot)


def _kind(args: argparse.Namespace) -> str:
    kind = args.kind or ("sweep" if args.sweep else None)
    if kind is None:
        raise UsageError(
            "plot: say what to draw",
            "pass --sweep KEY=START:STOP:STEP (e.g. optimizer_offload_fraction=0:1:0.25), --kind phases or "
            "--kind options",
        )
    return kind


def run_plot(args: argparse.Namespace) -> int:
    from mbridge_offload.actions.apply_write import default_roots
    from mbridge_offload.plan.inputs.fields import FIELDS
    from mbridge_offload_tools.cli_plan import _load
    from mbridge_offload_tools.plot import output, sweep
    from mbridge_offload_tools.plot.points import Source
    from mbridge_offload_tools.plot.run import make_plot

    kind = _kind(args)
    fmt = output.choose_format(args.output, args.format, "svg")
    key = sweep.parse(args.sweep)[0] if args.sweep and kind == "sweep" else None
    target = args.output or output.default_name(kind, key, fmt)
    config_path = args.model_config or args.config
    roots = default_roots(Path(config_path) if config_path and config_path != "-" else None, args.allowed_root)
    loaded = _load(args)
    flags = {name: getattr(args, name) for name in FIELDS}
    src = Source(flags, *((loaded.config, loaded.raw, loaded.source) if loaded else ()))
    result, _ = make_plot(kind, src, args.sweep, fmt, target, args.force, roots)
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
