"""``mbridge-offload validate``: lint a config for CPU offloading, with upstream's own messages.

Exit codes: 0 no errors (warnings allowed), 1 errors found, 2 bad input.
"""

from __future__ import annotations

import argparse
from typing import Any

from mbridge_offload_tools.cli.common import EXIT_FINDINGS, EXIT_OK, emit
from mbridge_offload_tools.interface.build import add_command, values


def add_parsers(sub: Any) -> None:
    add_command(sub, "validate_config", run)


def run(args: argparse.Namespace) -> int:
    from mbridge_offload_tools.interface.calls import validate_answer

    report = validate_answer(values(args, "validate_config"))
    emit(report.to_dict(), args.json, render_human)
    return EXIT_OK if report.ok else EXIT_FINDINGS


def render_human(payload: dict[str, Any]) -> str:
    """A readable report: one block per finding, errors first, then a one-line verdict."""
    findings = payload["findings"]
    counts = {s: sum(1 for f in findings if f["severity"] == s) for s in ("error", "warning", "info")}
    lines = [f"{payload.get('source', '<config>')} — validated against {payload['target']}"]
    order = {"error": 0, "warning": 1, "info": 2}
    for f in sorted(findings, key=lambda f: order[f["severity"]]):
        lines.append("")
        lines.append(f"{f['severity'].upper():7} {f['rule']} [{f['origin']}]  {f['message']}")
        if f["keys"]:
            lines.append("        keys: " + ", ".join(f["keys"]))
        if f["fix"]:
            lines.append("        fix:  " + " ".join(f["fix"]))
        if f.get("fix_remove"):
            lines.append("        remove: " + " ".join(f["fix_remove"]))
        lines.append("        why:  " + f["why"])
    lines.append("")
    summary = ", ".join(f"{n} {s}{'s' if n != 1 else ''}" for s, n in counts.items())
    lines.append(("OK" if payload["ok"] else "FAILED") + f": {summary}")
    return "\n".join(lines)


__all__ = ["add_parsers", "render_human", "run"]
