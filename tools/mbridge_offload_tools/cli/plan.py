"""``mbridge-offload estimate | recommend | calibrate`` — the memory/time planner on the command line.

``estimate`` and ``recommend`` never import torch; ``calibrate`` does (it times torch's fused CPU AdamW).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from mbridge_offload_tools.cli.common import EXIT_OK, UsageError, emit
from mbridge_offload_tools.interface.build import add_command, values


def add_parsers(sub: Any) -> None:
    add_command(sub, "estimate_memory", run_estimate)
    add_command(sub, "recommend_mode", run_recommend)
    cal = sub.add_parser(
        "calibrate",
        help="time torch's fused CPU AdamW here and store it as a named host profile",
        description="Time torch's fused CPU AdamW on this host and store the parameters-per-second figure as a "
        "named host profile (CPU model, threads, torch version, date, rate). estimate and recommend use it only "
        "when named: --host-profile NAME|FILE (MCP host_profile).",
    )
    cal.add_argument("--name", help="the profile's name (letters, digits, '._-'; default: this host's name)")
    cal.add_argument(
        "--output",
        metavar="PATH",
        help="where to store it (default: .mbridge-offload/host-profiles/NAME.json in the working directory)",
    )
    cal.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    cal.add_argument("--numel", type=int, default=32 * 1024 * 1024, help="elements updated per step")
    cal.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    cal.add_argument("--json", action="store_true", help="print exactly one JSON object")
    cal.set_defaults(handler=run_calibrate)


# ---------------------------------------------------------------------------------------------- human output


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _memory_rows(gb: dict[str, float], gib: dict[str, float], before: dict[str, float] | None = None):
    rows = []
    for key in ("weights", "gradients", "optimizer", "activations", "other", "total"):
        value = f"{gib[key]:8.2f} GiB {gb[key]:8.2f} GB"
        if before is not None:
            value = f"{before[key]:8.2f} GiB  ->{value}"
        rows.append((key, value))
    return rows


def _assumption_lines(d: dict[str, Any]) -> list[str]:
    lines = ["assumptions (value, source):"]
    for a in d["assumptions"]:
        note = f" - {a['note']}" if a.get("note") else ""
        lines.append(f"  {a['name']} = {a['value']} ({a['source']}){note}")
    return lines


def _human_estimate(d: dict[str, Any]) -> str:
    p = d["parallel"]
    head = (
        f"{d['model']} on {p['num_gpus']} x {d['gpu']} (TP{p['tp']} PP{p['pp']} CP{p['cp']} EP{p['ep']} ETP{p['etp']}, "
        f"DP{p['dp']}), worst stage {d['worst_stage']}, peak allocated per GPU:"
    )
    rows = _memory_rows(d["memory_gb"], d["memory_gib"])
    verdict = "fits" if d["fits"] else "DOES NOT FIT"
    rows += [
        *([("phases", phases)] if (phases := _phases_text(d)) else []),
        ("budget", f"{d['budget_gib']:8.2f} GiB of {d['gpu_memory_gib']:.2f} GiB exposed -> {verdict}"),
        ("host", f"{d['host_gb']:8.2f} GB (peak {d['host_peak_gb']:.2f} GB)"),
        (
            "offloaded",
            f"{d['offloaded_fraction']:.1%} of optimizer shards, {d['activation_offload_layers']} activation layers",
        ),
        ("step time", _step_time_text(d["step_time_factor"], d["step_time_factor_vs_no_levers"], d["time_s"])),
    ]
    lines = [head, _table(rows)] + [f"note: {n}" for n in d["notes"]] + [f"warning: {w}" for w in d["warnings"]]
    return "\n".join([*lines, f"unit: {d['unit']}", *_assumption_lines(d)])


def _phases_text(d: dict[str, Any]) -> str:
    """The worst stage's phases on one line, in step order, the one that sets the peak in capitals."""
    stage = next((st for st in d.get("phases") or [] if st["stage"] == d["worst_stage"]), None)
    if stage is None:
        return ""
    parts = [
        f"{ph['name'].upper() if ph['name'] == stage['peak_phase'] else ph['name']} {ph['memory_gib']:.2f}"
        for ph in stage["phases"]
    ]
    return f"{' | '.join(parts)} GiB (stage {stage['stage']}; the peak is the largest, phases never coexist)"


def _step_time_text(factor: float, no_levers: float, t: dict[str, Any]) -> str:
    """The step in seconds, its largest terms, the factor over the run without its offload (the card's), and the
    factor over the run without recompute or offload."""
    names = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "moe_overhead", "dp_comm", "bubble")
    terms = sorted(((t.get(k, 0.0), k) for k in names), reverse=True)
    shown = ", ".join(f"{k} {v:.3f}" for v, k in terms if v > 0)
    offload = t["optimizer_extra"] + t["activation_extra"]
    return (
        f"{t['step']:.3f} s ({shown}{f', offload {offload:.3f}' if offload else ''}); x{factor:.2f} over "
        f"{t['without_offload']:.3f} s without its offload, x{no_levers:.2f} over {t['baseline']:.3f} s without "
        "recompute or offload"
    )


def run_estimate(args: argparse.Namespace) -> int:
    from mbridge_offload.plan.service import plan_answer  # the MCP tool's body

    result = plan_answer("estimate", values(args, "estimate_memory"))
    emit(result.model_dump(mode="json"), args.json, _human_estimate)
    return EXIT_OK


def _human_recommend(d: dict[str, Any]) -> str:
    lines = [
        f"mode: {d['mode']}    fits: {'yes' if d['fits'] else 'NO'}    step time: x{d['step_time_factor']:.2f} of "
        f"the config as given (x{d['step_time_factor_vs_no_levers']:.2f} of the run with no lever)",
        *([f"advice: {d['advice']}"] if d.get("advice") else []),
        f"peak allocated per GPU (worst stage) on {d['num_gpus']} x {d['gpu']}, before (the config as given, "
        f"offload: {d['given_mode']}) -> after:",
        _table(_memory_rows(d["memory_gb"]["after"], d["memory_gib"]["after"], d["memory_gib"]["before"])),
    ]
    if d["overrides"]:
        lines.append("overrides:")
        lines += [f"  {o}" for o in d["overrides"]]
    lines.append("why:")
    lines += [f"  - {r}" for r in d["rationale"]]
    if d.get("suggestions"):
        lines.append("what would fit:")
        lines += [f"  - {r}" for r in d["suggestions"]]
    if d.get("options"):
        lines.append(
            f"options (ranked by step time x (1 + risk) among those that fit; x = step time over the config as given; "
            f"comfortable = at least {d['headroom_gib']:.1f} GiB free; apply --option N writes one):"
        )
        lines += option_lines(d["options"])
    if d.get("fallback"):
        f = d["fallback"]
        lines.append(
            f"if you need {f['headroom_gib']:.1f} GiB of headroom ({f['headroom_source']}): {f['mode']} offload frees "
            f"{f['freed_gib']:.1f} GiB ({f['memory_gib']:.1f} GiB left) at step time x{f['step_time_factor']:.2f}:"
        )
        lines += [f"  {o}" for o in f["overrides"]]
    if d.get("confirm"):  # recommend --confirm
        c = d["confirm"]
        lines.append(f"confirm (trace): {c['verdict'] if c['traced'] else 'not traced: ' + c['why']}")
    return "\n".join([*lines, f"unit: {d['unit']}", *_assumption_lines(d)])


def option_lines(options: list[dict[str, Any]]) -> list[str]:
    """The ranked options, one block each (recommend's and diagnose's human output)."""
    lines = []
    for o in options:
        flags = [f for f, on in (("alternative", o["alternative"]), ("changes layout", o["changes_layout"])) if on]
        mark = f" [{', '.join(flags)}]" if flags else ""
        lines.append(
            f"  {o['rank']}. x{o['step_time_factor']:.2f} ({o['step_time_s']:.2f} s), "
            f"{o['memory_gib']['total']:.1f} GiB, {o['margin_gib']:.1f} GiB free, "
            f"host {o['host_gb']:.0f} GB/GPU ({o['host_gb_per_node']:.0f} GB/node), "
            f"{'fits' if o['fits'] else 'DOES NOT FIT'}{' (comfortable)' if o['comfortable'] else ''}{mark}"
        )
        lines.append(f"     {o['why']}")
        lines += [f"     {c['key']}={json.dumps(c['value'])}" for c in o["changes"]]
    return lines


def run_recommend(args: argparse.Namespace) -> int:
    from mbridge_offload_tools.trace.confirm import recommend_answer  # the MCP tool's body: --confirm traces too

    rec = recommend_answer(values(args, "recommend_mode"))
    emit(rec.model_dump(mode="json"), args.json, _human_recommend)
    return EXIT_OK


# ---------------------------------------------------------------------------------------------- calibrate


def run_calibrate(args: argparse.Namespace) -> int:
    from mbridge_offload.actions.safe_write import atomic_write
    from mbridge_offload.plan.time import host_profile

    if args.numel < 1024 or args.steps < 1 or (args.threads is not None and args.threads < 1):
        raise UsageError("--numel must be at least 1024, --steps and --threads at least 1")
    name = args.name or _host_name()
    default = host_profile.default_path(name)  # a bad --name is refused before the timing starts
    target = Path(args.output).expanduser() if args.output else default
    try:
        from mbridge_offload_runtime.adam_throughput import measure

        measured = measure(numel=args.numel, steps=args.steps, threads=args.threads)
    except ImportError as exc:
        raise UsageError(f"calibrate needs torch ({exc}); install mbridge-offload[runtime]") from None
    profile = host_profile.make(name, measured, _cpu_model())
    target.parent.mkdir(parents=True, exist_ok=True)
    profile["path"] = str(atomic_write(target, json.dumps(profile, indent=2) + "\n"))
    emit(
        profile,
        args.json,
        lambda d: (
            f"fused CPU AdamW: {d['cpu_adam_params_per_s'] / 1e9:.2f}e9 params/s on {d['threads']} threads "
            f"({d['cpu_adam_params_per_s_per_core'] / 1e9:.2f}e9 per core); host profile {d['name']!r} stored in "
            f"{d['path']}; use it with --host-profile {d['name'] if not args.output else d['path']}"
        ),
    )
    return EXIT_OK


def _host_name() -> str:
    """This host's name as a profile name (characters a name may not hold become '-')."""
    import re
    import socket

    name = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname()).strip("-.")[:64]
    return name or "this-host"


def _cpu_model() -> str | None:
    """The CPU model as the kernel names it (Linux), else the platform's word for it."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:  # a fixed system file
            for line in info:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or None
