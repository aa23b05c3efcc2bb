"""CLI subcommands ``apply``, ``test``, ``diagnose`` and ``serve`` (the agent-facing half of ``mbridge-offload``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mbridge_offload_tools.cli.common import EXIT_BAD_INPUT, EXIT_FINDINGS, EXIT_OK, UsageError, emit
from mbridge_offload_tools.interface.build import add_command, values


def add_parsers(sub: Any) -> None:
    add_command(sub, "apply_offload", cmd_apply)
    add_command(sub, "run_unit_tests", cmd_test)
    add_command(sub, "diagnose_failure", cmd_diagnose)
    p = sub.add_parser(
        "serve",
        help="run the MCP server",
        description="Run the MCP server (the same as mbridge-offload-mcp): the tools of docs/mcp.md over stdio or "
        "streamable HTTP; what it may read, write and run comes from these flags, never from a tool argument.",
    )
    from mbridge_offload_tools.server.guard import add_server_flags

    add_server_flags(p)
    p.set_defaults(handler=cmd_serve, json=False)


# ---------------------------------------------------------------------------------------------- apply


def _human_apply(d: dict[str, Any]) -> str:
    lines = []
    for c in d["changes"]:
        lines.append(f"{c['key']}: {c['old']!r} -> {c['new']!r}  ({c['why']})")
    if not d["changes"]:
        lines += d.get("notes", [])
    for f in d["findings"]:
        lines.append(f"{f['severity']}: {f['rule']}: {f['message']}")
    if d.get("diff"):
        lines += ["", d["diff"].rstrip("\n")]
    if d.get("refused"):
        lines.append(d["refused"])
    if d["written"]:
        lines.append(f"written: {d['written']}")
    elif not d.get("refused"):
        lines.append("dry run: nothing written (pass --output FILE or --in-place)")
    return "\n".join(lines)


def cmd_apply(args: argparse.Namespace) -> int:
    from mbridge_offload_tools.interface.calls import apply_answer

    result = apply_answer(values(args, "apply_offload"), allowed_root=args.allowed_root)  # the MCP tool's body
    data = result.to_dict()
    if args.format == "overrides" and not args.json:
        sys.stdout.write("".join(o + "\n" for o in result.overrides))
    else:
        emit(data, args.json, _human_apply)
    return EXIT_OK if result.ok and not result.refused else EXIT_FINDINGS


# ---------------------------------------------------------------------------------------------- test


_OUTCOMES = frozenset({"passed", "failed", "skipped", "error", "xfailed", "xpassed"})


def _human_test(d: dict[str, Any], streamed: frozenset[str] = frozenset()) -> str:
    """The human summary; the ``streamed`` node ids were already shown one per line as they ran (stderr), so they
    are not listed again: a terminal shows each test once."""
    lines = [f"{t['outcome']:8} {t['nodeid']}" for t in d["tests"] if t["nodeid"] not in streamed]
    for f in d["failures"]:
        lines += [f"--- {f['nodeid']}", f["message"] or ""]
    lines += d["notes"]
    if d.get("coverage"):
        lines.append(d["coverage"])
    lines += _under_test_lines(d.get("under_test"))
    lines.append(
        f"{d['passed']} passed, {d['failed']} failed, {d['skipped']} skipped, {d['errors']} errors "
        f"in {d['duration_s']:.1f} s"
    )
    return "\n".join(lines)


def _under_test_lines(under: dict[str, Any] | None) -> list[str]:
    """For parity, how to check megatron-core's own optimizer on a GPU cluster (whose code ran is in coverage)."""
    lines: list[str] = []
    recipe = (under or {}).get("cluster_recipe")
    if recipe:
        lines.append(f"on a GPU cluster, to check {recipe['what']}:")
        lines.append(f"  unit tests: {recipe['unit_tests']}")
        lines += [f"  run {run}" for run in recipe["runs"]]
        lines += [f"  compare {c}" for c in recipe["compare"]]
    return lines


def cmd_test(args: argparse.Namespace) -> int:
    from mbridge_offload.actions.testing.result import TestSuiteError
    from mbridge_offload.actions.testing.suite import run_tests

    streamed: set[str] = set()  # node ids a progress line already showed ("<outcome>: <nodeid>")

    def progress(done: int, total: int | None, message: str) -> None:
        if not args.json:
            sys.stderr.write(f"[{done}/{total if total is not None else '?'}] {message}\n")
            outcome, sep, nodeid = message.partition(": ")
            if sep and outcome in _OUTCOMES:
                streamed.add(nodeid)

    try:
        result = run_tests(**values(args, "run_unit_tests"), on_progress=progress)
    except TestSuiteError as exc:
        raise UsageError(str(exc)) from None
    emit(result.to_dict(), args.json, lambda d: _human_test(d, frozenset(streamed)))
    return EXIT_OK if result.ok else EXIT_FINDINGS


# ---------------------------------------------------------------------------------------------- diagnose


def _human_diagnose(d: dict[str, Any]) -> str:
    lines = []
    for m in d["matches"]:
        lines += [f"{m['failure']}: {m['title']}", f"  cause:   {m['cause']}", f"  confirm: {m['confirm']}"]
        if m.get("confirm_overrides"):  # the experiment's overrides: a check, never to keep
            lines.append(f"  check:   {' '.join(m['confirm_overrides'])}  (to confirm only; not a fix)")
        if m["fix"]:
            lines.append(f"  fix:     {' '.join(m['fix'])}")
        elif m["actions"] and not d.get("needs"):
            lines.append("  fix:     not a config key; the steps below")
        lines += [f"  also:    {a}" for a in m["actions"]]
    lines += [f"to decide, pass: {n}" for n in d.get("needs", [])]
    if d.get("options"):
        from mbridge_offload_tools.cli.plan import option_lines

        lines.append(
            "options (the planner's, ranked by step time x (1 + risk) among those that fit; apply --option N writes "
            "one):"
        )
        lines += option_lines(d["options"])
    lines += _planner_lines(d)
    for f in d["findings"]:
        lines.append(f"{f['severity']}: {f['rule']}: {f['message']}")
    if d.get("comparison"):
        for c in d["comparison"]["changed"]:
            lines.append(f"changed {c['key']}: {c['before']!r} -> {c['after']!r}")
        c = d["comparison"]
        mem = c.get("memory_gb")
        if mem and mem.get("delta_total") is not None:
            where = f" on {c['num_gpus']['before']} x {c['gpu']['before']}" if c.get("gpu") else ""
            lines.append(
                f"predicted per-GPU peak (worst stage){where}: {mem['before']['total']:.2f} -> "
                f"{mem['after']['total']:.2f} GB (decimal, 10^9 bytes), {mem['delta_total']:+.2f} GB"
            )
        if d["comparison"].get("memory_note"):
            lines.append(d["comparison"]["memory_note"])
    lines += d["notes"]
    return "\n".join(lines) or "no known failure matched"


def _planner_lines(d: dict[str, Any]) -> list[str]:
    """The GPU, GPU count and evidence the planner used, with their sources (every input: --json assumptions)."""
    said = {a["name"]: a for a in d.get("assumptions", [])}
    if "gpu" not in said or "num_gpus" not in said:
        return []
    gpu, count = said["gpu"], said["num_gpus"]
    lines = [
        f"sized on {count['value']} x {gpu['value']} (GPU count: {count['source']}, GPU: {gpu['source']}); every "
        "input with its source is in --json assumptions"
    ]
    lines += [f"evidence: {n}" for n in (d.get("calibration") or {}).get("notes", [])]
    return lines


def cmd_diagnose(args: argparse.Namespace) -> int:
    from mbridge_offload_tools.interface.calls import diagnose_answer

    report = diagnose_answer(values(args, "diagnose_failure"))  # the MCP tool's body
    emit(report.model_dump(mode="json"), args.json, _human_diagnose)
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    from mbridge_offload_tools.server.app import run

    try:
        run(args.transport, args.host, args.port, args.roots, args.bridge_repos, args.allow_bridge_venv)
    except OSError as exc:  # port in use
        sys.stderr.write(f"mbridge-offload serve: {exc}\n")
        return EXIT_BAD_INPUT
    return EXIT_OK
