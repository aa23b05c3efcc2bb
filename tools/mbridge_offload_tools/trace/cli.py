"""``mbridge-offload trace``: the subcommand (its flags are ``interface.tools.TRACE``, the MCP tool's parameters)."""

from __future__ import annotations

import argparse
from typing import Any

from mbridge_offload_tools.cli.common import EXIT_OK, emit
from mbridge_offload_tools.interface.build import add_arguments, values


def add_parsers(sub: Any) -> None:
    parser = sub.add_parser(
        "trace",
        help="peak memory of megatron-core's own step for the worst rank, traced on fake tensors",
        description="Build megatron-core's own GPTModel, DDP buffers and optimizer for the worst rank role of the "
        "layout (the pipeline stage estimate finds worst), under a fake process group and fake tensors, run "
        "megatron-core's schedule with the micro-batches it keeps in flight, then one optimizer step, counting "
        "every allocation. Answers like estimate (memory_gib by category, total = the peak; phases; peak_phase; "
        "assumptions) plus by_module and under_test. Takes the config and planner inputs estimate takes. "
        "Simulated on CPU (docs/trace.md); ~10-120 s.",
    )
    add_arguments(parser, "trace_memory")
    parser.set_defaults(handler=run_trace)


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
