"""``mbridge-offload trace``: the subcommand (its flags are ``interface.tools.TRACE``, the MCP tool's parameters)."""

from __future__ import annotations

import argparse
from typing import Any

from mbridge_offload_tools.cli.common import EXIT_OK, emit
from mbridge_offload_tools.interface.build import add_command, values


def add_parsers(sub: Any) -> None:
    add_command(sub, "trace_memory", run_trace)


def _human(d: dict[str, Any]) -> str:
    m = d["memory_gib"]
    lines = [
        f"{d['model']}: stage {d['stage']} traced with megatron-core {d['under_test']['megatron_core']} "
        f"({d['under_test']['spec']}, {d['under_test']['schedule']}), peak allocated per GPU:",
        *(f"  {k:<12} {m[k]:8.3f} GiB" for k in (*m.keys(),)),
        "phases: "
        + " | ".join(f"{p['name']} {p['memory_gib']:.3f}" for p in d["phases"])
        + f" GiB (peak: {d['peak_phase']})",
        f"traced in {d['seconds']:.1f} s",
        *(f"note: {n}" for n in d["notes"]),
    ]
    return "\n".join(lines)


def run_trace(args: argparse.Namespace) -> int:
    from mbridge_offload_tools.trace.run import trace_answer

    emit(trace_answer(values(args, "trace_memory")), args.json, _human)
    return EXIT_OK
