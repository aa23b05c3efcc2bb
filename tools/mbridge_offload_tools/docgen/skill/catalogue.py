"""The tables of SKILL.md that restate a catalogue: constraints (rules), failure modes (diagnose), MCP tools.

Each renderer reads the live object, so the skill cannot drift from the code.
"""

from __future__ import annotations

import asyncio
from typing import Any

# MCP tool → the CLI command that does the same (a contract: docs/mcp.md documents both sides).
CLI_EQUIVALENTS: dict[str, str] = {
    "validate_config": "mbridge-offload validate CONFIG [--set KEY=VALUE ...]",
    "estimate_memory": "mbridge-offload estimate [CONFIG] [--model NAME --gpu PRESET --num-gpus N ...]",
    "recommend_mode": "mbridge-offload recommend [CONFIG] [--model NAME --gpu PRESET --levers L,... ...]",
    "apply_offload": "mbridge-offload apply CONFIG [--mode MODE | --option N] [--output FILE [--force] | --in-place]",
    "run_unit_tests": "mbridge-offload test [-k EXPR] [--suite SUITE] [--bridge-repo PATH]",
    "diagnose_failure": (
        "mbridge-offload diagnose --error TEXT | --log FILE|TEXT | --symptom ID [--config FILE] [--gpu G ...]"
    ),
    "trace_memory": "mbridge-offload trace [CONFIG] [--model NAME --megatron-core X.Y ...]",
    "plot_offload": "mbridge-offload plot [CONFIG] --sweep KEY=START:STOP:STEP | --kind phases|options [--output FILE]",
}


def _cell(text: Any) -> str:
    """One Markdown table cell: no newlines, no bare pipes."""
    return " ".join(str(text).split()).replace("|", "\\|")


def render_constraints(docs: str = "docs/") -> str:
    """Every rule of the catalogue as one table row, in catalogue order (``docs``: the path to ``docs/``)."""
    from mbridge_offload.config.rules.catalogue import all_rules

    lines = ["| rule | severity | origin | keys | constraint | fix |", "|---|---|---|---|---|---|"]
    for rule in all_rules():
        keys = ", ".join(f"`{k}`" for k in rule.keys)
        fix = ", ".join(f"`{f}`" for f in rule.fix) if rule.fix else "—"
        lines.append(
            f"| [`{rule.id}`]({docs}rules.md#{rule.id.lower()}) | {rule.severity} | {rule.origin} | {keys} | "
            f"{_cell(rule.summary)} | {_cell(fix)} |"
        )
    return "\n".join(lines)


def render_constraint_summary() -> str:
    """SKILL.md's short form: the offloading rules upstream enforces (severity error), one line each; the general
    refusals (megatron-core's ``MC-*`` that stay rules: layout, recompute and fine-grained checks the planner vets;
    Bridge's ConfigContainer and Megatron-LM's front end, ``CFG-*``) and the warnings are counted."""
    from mbridge_offload.config.rules.catalogue import all_rules

    rules = list(all_rules())
    general = [r for r in rules if r.id.startswith(("MC-", "CFG-"))]
    errors = [r for r in rules if r.severity == "error" and r not in general]
    lines = ["| rule | origin | constraint |", "|---|---|---|"]
    lines += [f"| `{r.id}` | {r.origin} | {_cell(r.summary)} |" for r in errors]
    rest = len(rules) - len(errors) - len(general)
    lines += [
        "",
        f"Plus {len(general)} general refusals (`MC-*` megatron-core checks the planner vets without torch; `CFG-*` "
        f"Bridge and Megatron-LM; megatron-core's other checks come from its own run) and {rest} warnings and notes "
        f"(it runs, but does nothing or surprises). All {len(rules)} rules with keys and fixes: "
        "[references/constraints.md](references/constraints.md).",
    ]
    return "\n".join(lines)


def server_tools() -> list[Any]:
    """The tools the MCP server registers, listed in-process (no transport)."""
    from mbridge_offload_tools.server.app import mcp

    return list(asyncio.run(mcp.list_tools()))


def render_tools() -> str:
    """SKILL.md's short table: each tool, whether it writes, and its CLI command (titles and parameters are in
    references/tools.md: the skill's body keeps to its budget)."""
    lines = ["| MCP tool | writes? | CLI equivalent |", "|---|---|---|"]
    for tool in server_tools():
        hints = tool.annotations
        read_only = bool(hints and hints.read_only_hint)
        cli = CLI_EQUIVALENTS.get(tool.name, "(none)")
        lines.append(f"| `{tool.name}` | {'no' if read_only else 'yes'} | `{_cell(cli)}` |")
    return "\n".join(lines)


def failure_modes() -> list[Any]:
    """The diagnosis catalogue (``mbridge_offload.actions.diagnose.diagnose.KNOWN``)."""
    from mbridge_offload.actions.diagnose.failures.catalogue import KNOWN

    return list(KNOWN)


SKILL_FIXES_SHOWN = 2  # SKILL.md's body stays under 20k characters; references/failures.md lists every fix


def _short_fix(fix: tuple[str, ...]) -> str:
    """The first overrides of a fix, and how many more references/failures.md lists."""
    n = SKILL_FIXES_SHOWN
    shown = ", ".join(f"`{f}`" for f in fix[:n])
    return shown + (f", … (+{len(fix) - n})" if len(fix) > n else "")


def render_diagnosis_summary() -> str:
    """SKILL.md's short failure table: id, what you see, the fix; cause and how to confirm are in references/."""
    from mbridge_offload.actions.diagnose.sizing import SIZED

    lines = ["| failure | what you see | fix |", "|---|---|---|"]
    for mode in failure_modes():
        fix = _short_fix(mode.fix) if isinstance(mode.fix, tuple) else "from the config"
        fix = "the planner's options for the config" if mode.id in SIZED else fix
        lines.append(f"| `{mode.id}` | {_cell(mode.title)} | {_cell(fix or '—')} |")
    lines += [
        "",
        "Cause, how to confirm, the full fix: [references/failures.md](references/failures.md). Every upstream "
        "error message of the rule catalogue is also matched to its rule and fix. No message: `--symptom ID`.",
    ]
    return "\n".join(lines)


def render_diagnosis() -> str:
    from mbridge_offload.actions.diagnose.sizing import sized_fix_text

    lines = ["| failure | what you see | cause | confirm | fix |", "|---|---|---|---|---|"]
    for mode in failure_modes():
        fix = ", ".join(f"`{f}`" for f in mode.fix) if isinstance(mode.fix, tuple) else "computed from the config"
        fix = sized_fix_text(mode.id) or fix
        # No override resolves it: the first step is the remedy (an upgrade, an environment change).
        fix = fix or (f"not a config key: {mode.actions[0]}" if mode.actions else "")
        lines.append(
            f"| `{mode.id}` | {_cell(mode.title)} | {_cell(mode.cause)} | {_cell(mode.confirm)} | {_cell(fix or '—')} |"
        )
    lines += [
        "",
        "Besides these, every upstream error message of the rule catalogue is matched back to its rule, "
        "and its fix returned.",
    ]
    return "\n".join(lines)
