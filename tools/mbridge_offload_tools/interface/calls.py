"""The body of each tool, one for the CLI and the MCP server: the tool's arguments by their declared names in,
:class:`~mbridge_offload.config.errors.InputError` on bad input (the CLI's exit 2, the MCP guard's ``isError``)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

from mbridge_offload.config.errors import InputError


def environment(env: list[str] | None, te_version: str | None) -> dict[str, str]:
    """The training environment's facts from ``env`` (``KEY=VALUE`` items) and ``te_version`` (``te_version=X.Y``
    in ``env`` is its older spelling; both given must agree)."""
    from mbridge_offload.config.validate import check_te_version

    facts: dict[str, str] = {}
    for item in env or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise InputError(f"env {item!r}: expected KEY=VALUE, e.g. NVTE_CPU_OFFLOAD_V1=1 (CLI: --env KEY=VALUE)")
        facts[key.strip()] = value.strip()
    given = [v for v in (facts.get("te_version"), te_version) if v is not None]
    try:
        checked = [check_te_version(v) for v in given]
    except ValueError as exc:
        raise InputError(str(exc)) from None
    if len(set(checked)) > 1:
        raise InputError(
            f"te_version is {checked[1]} but env says te_version={checked[0]}: give the release once "
            "(te_version; CLI --te-version)"
        )
    if checked:
        facts["te_version"] = checked[-1]
    return facts


# A log given as one line: a path when it has a path's shape (no spaces; a folder or a suffix), else the text.
_PATH_SHAPE = re.compile(r"\S*[/\\]\S*|\S+\.\w{1,8}")


def log_text(log: str) -> str:
    """A log argument's text: one line that is a file or has a path's shape (``train.log``, ``logs/rank0``) is read
    through the bounded reader (inside the roots, its end kept); anything else is the text itself."""
    from mbridge_offload.config.reading import max_bytes, read_text_file

    if "\n" not in log and len(log) <= 4096 and (_PATH_SHAPE.fullmatch(log.strip()) or _is_file(log)):
        return read_text_file(Path(log.strip()).expanduser(), what="log", tail=True)
    return log[-max_bytes() :]  # like a file's: the end of a huge text, where the failure is


def _is_file(text: str) -> bool:
    try:
        return Path(text).expanduser().is_file()
    except (OSError, ValueError):  # a name too long, a NUL byte
        return False


# ---------------------------------------------------------------------------------------------- validate

EXACT_MARGIN_S = 15  # reading the config and building the report around the exact subprocess


def validate_seconds(v: dict[str, Any]) -> float:
    """The time one validate call may take: the call deadline, or exact's own deadline and a margin when longer."""
    from mbridge_offload.config.reading import deadline_s

    seconds = float(deadline_s())
    if v.get("exact"):  # the default upstream run keeps to the call's deadline (_with_upstream)
        seconds = max(seconds, float(v.get("deadline") or 120.0) + EXACT_MARGIN_S)
    return seconds


def validate_answer(v: dict[str, Any]) -> Any:
    """``validate`` / ``validate_config``: the rule catalogue's report on one config, recipe or command line."""
    from mbridge_offload.config.rules.base import DEFAULT_TARGET, parse_target
    from mbridge_offload.config.sources import ConfigError, load
    from mbridge_offload.config.validate import validate

    config, recipe, argv = v["config"], v["recipe"], v["megatron_args"]
    if sum(x is not None for x in (config, recipe, argv)) != 1:
        raise InputError(
            "give exactly one of config (a Bridge YAML/JSON path or text; on the CLI the positional CONFIG, '-' for "
            'stdin), recipe (--recipe NAME) or megatron_args (--megatron-args "...", a Megatron-LM command line)'
        )
    try:
        target = parse_target(v["target"] or DEFAULT_TARGET)
    except ValueError as exc:  # only the target's own errors are "target" errors
        raise InputError(f"target {v['target']!r}: {exc}") from None
    env = environment(v["env"], v["te_version"])
    try:
        if argv is not None:
            loaded = load(None, v["overrides"], argv=shlex.split(argv))
        elif recipe is not None:  # imported once per process: a server's second call costs the build only
            loaded = load(None, v["overrides"], recipe=recipe)
        else:
            loaded = load(config, v["overrides"])
    except ConfigError as exc:
        raise (InputError(f"recipe: {exc.message}", exc.fix) if recipe is not None else exc) from None
    except InputError:  # a deadline: its own kind
        raise
    except ValueError as exc:  # shlex: an unbalanced quote
        raise InputError(f"megatron_args: cannot read the command line: {exc}") from None
    loaded.config.env.update(env)
    if recipe is not None and v["target"] is None:
        target = _bridges_release(target)
    report = validate(loaded.config, loaded.raw, target=target, source=loaded.source)
    report.source = loaded.source
    if v["upstream"] or v["exact"]:
        report = _with_upstream(report, loaded, v)
    else:
        from mbridge_offload.config.validate import rules_only_coverage

        why = "not run: upstream=false (CLI --no-upstream) asked for the rule catalogue only"
        report = report.model_copy(update={"coverage": rules_only_coverage(why)})
    if argv is not None:  # fixes as the flags to edit on that command line
        from mbridge_offload.config.megatron_lm.fixes import megatron_lm_fixes

        report = megatron_lm_fixes(report)
    return report


def _bridges_release(fallback: Any) -> Any:
    """The megatron-core release the Bridge that built a recipe imported (each Bridge release pins its own: 0.3.1
    builds 0.16's fields, 0.6.2 0.19's), when it is a supported target; else ``fallback``."""
    import sys

    from mbridge_offload.config.rules.base import parse_target

    core = sys.modules.get("megatron.core")
    try:
        return parse_target(str(getattr(core, "__version__", "")))
    except ValueError:
        return fallback


def _with_upstream(report: Any, loaded: Any, v: dict[str, Any]) -> Any:
    """``report`` with megatron-core's own answer (``exact.run``); without megatron-core here, the catalogue's
    report whose ``coverage`` says which checks did not run and why (``exact`` asks for an error instead)."""
    from mbridge_offload.config.reading import deadline_s
    from mbridge_offload.config.validate import rules_only_coverage
    from mbridge_offload_tools.exact.run import ExactUnavailable, exact_report

    # Asked for (exact), the run has its own deadline; by default it keeps within the call's, less a margin for the
    # rest of the answer, and a run that passes it leaves the catalogue's answer with coverage saying so.
    seconds = v["deadline"] if v["exact"] else min(v["deadline"], max(0.5, 0.8 * deadline_s() - 0.5))
    try:
        return exact_report(report, loaded.raw, seconds, loaded.config, notes=v["exact"])
    except ExactUnavailable as exc:
        if v["exact"]:
            raise InputError(str(exc)) from None
        return report.model_copy(update={"coverage": rules_only_coverage(f"not run: {exc}")})


# ---------------------------------------------------------------------------------------------- apply


def apply_answer(v: dict[str, Any], **where: Any) -> Any:
    """``apply``: the mode (or the planner's option) on one config, written only when asked, where ``where`` allows
    (``allowed_root``: the CLI's extra directory; ``write_roots``: the MCP server's roots)."""
    from mbridge_offload.actions.apply.apply import apply_offload
    from mbridge_offload.plan.service import library_errors
    from mbridge_offload_tools.interface.tools import APPLY_PLANNER

    planner = {name: v[name] for name in APPLY_PLANNER if v[name] is not None}
    if v["te_version"] is not None and v["mode"] == "recommended":  # one release for its rules and its sizing
        planner["te_version"] = v["te_version"]
    with library_errors():
        return apply_offload(
            v["config"],
            v["mode"],
            option=v["option"],
            fraction=v["fraction"],
            num_layers=v["num_layers"],
            modules=v["modules"],
            env=environment(None, v["te_version"]),
            overrides=v["overrides"],
            output=v["output"],
            in_place=v["in_place"],
            output_format=v["format"],
            overwrite=v["overwrite"],
            planner=planner or None,
            **where,
        )


# ---------------------------------------------------------------------------------------------- diagnose


def diagnose_answer(v: dict[str, Any]) -> Any:
    """``diagnose``: the failure catalogue on the text, the configs, and the planner's inputs to size a fix with."""
    from mbridge_offload.actions.diagnose.diagnose import diagnose
    from mbridge_offload.actions.diagnose.sizing import input_names
    from mbridge_offload.config.reading import max_bytes
    from mbridge_offload.config.sources import ConfigError, load

    if not any(v.get(k) for k in ("error", "log", "symptom", "config", "before", "after")):
        raise InputError(
            "nothing to diagnose: pass error (the message), log (a file or an excerpt), symptom (a failure that "
            "printed no message), and/or config, or before and after configs (CLI: --error, --log, --symptom, "
            "--config, --before/--after)"
        )
    if (v["before"] is None) != (v["after"] is None):
        raise InputError("pass both before and after (two configs around the change; CLI --before/--after), or neither")
    log = log_text(v["log"]) if v["log"] else None  # a file (inside the roots) or the text
    loaded: dict[str, Any] = {}
    for what in ("config", "before", "after"):  # loaded: raw dict and source kept
        try:
            loaded[what] = load(v[what]) if v[what] else None
        except ConfigError as exc:  # before/after say which config they mean
            raise (exc if what == "config" else InputError(f"{what}: {exc.message}", exc.fix)) from None
    cfg = loaded["config"]
    return diagnose(
        error=v["error"][-max_bytes() :] if v["error"] else None,  # the tail of a huge text, where the failure is
        log=log,
        config=cfg.config if cfg else None,
        raw=cfg.raw if cfg else None,
        before=loaded["before"],
        after=loaded["after"],
        source=cfg.source if cfg else None,
        planner={name: v[name] for name in input_names()},
        symptom=v["symptom"],
    )
