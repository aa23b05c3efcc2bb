"""``mbridge-offload validate``: lint a config for CPU offloading, with upstream's own messages.

Exit codes: 0 no errors (warnings allowed), 1 errors found, 2 bad input (unreadable config, wrong type,
bad ``--target``/``--env``). Never imports torch or megatron.
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from mbridge_offload_tools.common import EXIT_BAD_INPUT, EXIT_FINDINGS, EXIT_OK, emit, fail


def add_parsers(sub: Any) -> None:
    p = sub.add_parser(
        "validate",
        help="check a config's CPU-offloading settings (upstream messages, fixes)",
        description="Check a Megatron Bridge config (YAML/JSON file, '-' for stdin), a Bridge recipe or a "
        "Megatron-LM command line against the rule catalogue (docs/rules.md).",
    )
    p.add_argument("config", nargs="?", help="YAML/JSON file, or '-' for stdin")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Hydra-style override, e.g. optimizer.optimizer_offload_fraction=0.5 (repeatable)",
    )
    p.add_argument(
        "--target",
        default=None,
        metavar="megatron-core==X.Y",
        help="upstream release to validate against (default: megatron-core==0.19.2)",
    )
    p.add_argument(
        "--recipe",
        default=None,
        metavar="NAME",
        help="build a Megatron Bridge recipe's ConfigContainer (needs megatron-bridge importable)",
    )
    p.add_argument(
        "--megatron-args",
        default=None,
        metavar='"ARGS"',
        help='a Megatron-LM command line, e.g. "--optimizer-cpu-offload --num-layers 4"',
    )
    p.add_argument(
        "--env",
        dest="env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="facts about the training environment: NVTE_CPU_OFFLOAD_V1=1, te_version=2.18 (repeatable)",
    )
    p.add_argument(
        "--exact",
        action="store_true",
        help="also build the real TransformerConfig/OptimizerConfig/DDP config with the target's megatron-core "
        "(the environment's, or .mcore/<version> from scripts/setup; a subprocess, ~10-30 s) and report every "
        "error it raises, verbatim, and the release that ran",
    )
    p.add_argument(
        "--deadline", type=float, default=120.0, metavar="S", help="time limit for --exact in seconds (default 120)"
    )
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.set_defaults(handler=run)


def _parse_env(items: list[str], as_json: bool) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            fail(f"--env {item!r}: expected KEY=VALUE, e.g. NVTE_CPU_OFFLOAD_V1=1", as_json)
        if key.strip() == "te_version":  # the one fact the rules parse: a typo must not read as release 0.0.0
            from mbridge_offload.config.validate import check_te_version

            try:
                value = check_te_version(value)
            except ValueError as exc:
                fail(f"--env {exc}", as_json)
        env[key.strip()] = value.strip()
    return env


def run(args: argparse.Namespace) -> int:
    from mbridge_offload.config.errors import InputError
    from mbridge_offload.config.rules.base import DEFAULT_TARGET, parse_target
    from mbridge_offload.config.sources import load
    from mbridge_offload.config.validate import validate

    as_json = args.json
    given = [x for x in (args.config, args.recipe, args.megatron_args) if x is not None]
    if len(given) != 1:
        fail("validate: give exactly one of CONFIG (a file or '-'), --recipe NAME or --megatron-args \"...\"", as_json)
    try:
        target = parse_target(args.target or DEFAULT_TARGET)
    except ValueError as exc:
        fail(f"--target: {exc}", as_json)
    env = _parse_env(args.env, as_json)
    try:
        if args.megatron_args is not None:
            loaded = load(None, args.overrides, argv=shlex.split(args.megatron_args))
        elif args.recipe is not None:
            loaded = load(None, args.overrides, recipe=args.recipe)
        else:
            loaded = load(args.config, args.overrides)
    except InputError as exc:  # ConfigError, a deadline: the one error shape, fix and kind kept
        fail(exc, as_json)
    except ValueError as exc:  # e.g. an unbalanced quote in --megatron-args
        fail(f"cannot read the config: {exc}", as_json)
    loaded.config.env.update(env)
    report = validate(loaded.config, loaded.raw, target=target, source=loaded.source)
    report.source = loaded.source
    if args.exact:
        report = _exact(report, loaded.raw, args.deadline, as_json, loaded.config)
    if args.megatron_args is not None:  # fixes as the flags to edit on that command line
        from mbridge_offload.config.mlm_fixes import megatron_lm_fixes

        report = megatron_lm_fixes(report)
    emit(report.to_dict(), as_json, render_human)
    return EXIT_OK if report.ok else EXIT_FINDINGS


def _exact(report: Any, raw: dict[str, Any], deadline: float, as_json: bool, config: Any = None) -> Any:
    from mbridge_offload_tools.exact import ExactUnavailable, exact_report

    if not 0 < deadline <= 3600:
        fail(f"--deadline {deadline:g}: give a number of seconds in (0, 3600]", as_json)
    try:
        return exact_report(report, raw, deadline, config)
    except ExactUnavailable as exc:
        fail(str(exc), as_json)


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


__all__ = ["EXIT_BAD_INPUT", "add_parsers", "render_human", "run"]
