"""What the CLI and the MCP server both do with a tool's arguments: one body per tool where the two were twins.

Each function takes the tool's arguments by their declared names (``interface.tools``) and raises
:class:`~mbridge_offload.config.errors.InputError` on bad input: the CLI turns it into exit 2 and one JSON error,
the MCP guard into ``isError`` with the same text. ``validate`` and the planner (``estimate``, ``recommend``) run
here entirely; ``environment`` and ``log_text`` read two inputs that ``validate`` and ``diagnose`` take on both
sides.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

from mbridge_offload.config.errors import InputError


def environment(env: list[str] | None, te_version: str | None) -> dict[str, str]:
    """The training environment's facts from ``env`` (``KEY=VALUE`` items) and ``te_version``.

    ``te_version=X.Y`` inside ``env`` is the older spelling of ``te_version``; both given must agree.

    Raises:
        InputError: an item without ``=``, a Transformer Engine version that is no release number, or two
            different versions.
    """
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
    """A log argument's text: ``log`` is a file path (read through the bounded reader, its end kept) or the text.

    Several lines are the text. One line is a path when it is an existing file or has a path's shape (no spaces,
    and a folder or a file suffix: ``train.log``, ``logs/rank0``); any other line is the text itself (an error
    message). A path outside the server's roots, missing, or not a regular file is refused.

    Raises:
        InputError: a path that cannot be read.
    """
    from mbridge_offload.config.reading import max_bytes, read_text_file

    if "\n" not in log and len(log) <= 4096 and (_PATH_SHAPE.fullmatch(log.strip()) or _is_file(log)):
        return read_text_file(Path(log.strip()).expanduser(), what="log", tail=True)
    return log[-max_bytes() :]  # like a file's: the end of a huge text, where the failure is


def _is_file(text: str) -> bool:
    try:
        return Path(text).expanduser().is_file()
    except (OSError, ValueError):  # a name too long, a NUL byte
        return False


def check_diagnose(v: dict[str, Any]) -> None:
    """``diagnose`` needs something to read, and before/after come as a pair.

    Raises:
        InputError: nothing given, or one of before/after alone.
    """
    if not any(v.get(k) for k in ("error", "log", "config", "before", "after")):
        raise InputError(
            "nothing to diagnose: pass error (the message), log (a file or an excerpt), and/or config, or before and "
            "after configs (CLI: --error, --log, --config, --before/--after)"
        )
    if (v.get("before") is None) != (v.get("after") is None):
        raise InputError("pass both before and after (two configs around the change; CLI --before/--after), or neither")


# ---------------------------------------------------------------------------------------------- validate

EXACT_MARGIN_S = 15  # reading the config and building the report around the exact subprocess


def validate_seconds(v: dict[str, Any]) -> float:
    """The time one validate call may take: the call deadline, or exact's own deadline and a margin when longer."""
    from mbridge_offload.config.reading import deadline_s

    seconds = float(deadline_s())
    if v.get("exact"):
        seconds = max(seconds, float(v.get("deadline") or 120.0) + EXACT_MARGIN_S)
    return seconds


def validate_answer(v: dict[str, Any]) -> Any:
    """``validate`` / ``validate_config``: the rule catalogue's report on one config, recipe or command line."""
    from mbridge_offload.config.rules.base import parse_target
    from mbridge_offload.config.sources import ConfigError, load
    from mbridge_offload.config.validate import validate

    config, recipe, argv = v["config"], v["recipe"], v["megatron_args"]
    if sum(x is not None for x in (config, recipe, argv)) != 1:
        raise InputError(
            "give exactly one of config (a Bridge YAML/JSON path or text; on the CLI the positional CONFIG, '-' for "
            'stdin), recipe (--recipe NAME) or megatron_args (--megatron-args "...", a Megatron-LM command line)'
        )
    try:
        target = parse_target(v["target"])
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
    report = validate(loaded.config, loaded.raw, target=target, source=loaded.source)
    report.source = loaded.source
    if v["exact"]:
        from mbridge_offload_tools.exact import ExactUnavailable, exact_report

        try:
            report = exact_report(report, loaded.raw, v["deadline"], loaded.config)
        except ExactUnavailable as exc:
            raise InputError(str(exc)) from None
    if argv is not None:  # fixes as the flags to edit on that command line
        from mbridge_offload.config.mlm_fixes import megatron_lm_fixes

        report = megatron_lm_fixes(report)
    return report


# ---------------------------------------------------------------------------------------------- the planner


def plan_answer(kind: str, v: dict[str, Any]) -> Any:
    """``estimate`` / ``recommend`` (``estimate_memory`` / ``recommend_mode``): one path through the planner.

    A config, its overrides or a Megatron-LM command line, then every planner input given (``plan.service.plan``).
    """
    from mbridge_offload.config.sources import load
    from mbridge_offload.plan.service import plan

    args = dict(v)
    config, overrides, argv = args.pop("config"), args.pop("overrides") or [], args.pop("megatron_args")
    if config is None and argv is None and args.get("model") is None and args.get("num_layers") is None:
        raise InputError(
            "no model: pass model (a preset such as qwen3-30b-a3b or llama3-8b), config (a Bridge YAML path or "
            "text with the model section), or megatron_args"
        )
    if config is not None and argv is not None:
        raise InputError("pass either config or megatron_args, not both")
    if overrides and config is None and argv is None:
        raise InputError("overrides need a config to apply to; pass config (a path or YAML text) too")
    try:
        loaded = (
            load(argv=shlex.split(argv), overrides=overrides)
            if argv is not None
            else load(config, overrides)
            if config is not None
            else None
        )
        cfg, raw, source = (loaded.config, loaded.raw, loaded.source) if loaded else (None, None, None)
        return plan(kind, args, cfg, raw, source)  # type: ignore[arg-type]
    except InputError:  # a config that cannot be read, an input out of bounds: its message and fix as they are
        raise
    except (ValueError, KeyError) as exc:  # an unknown preset, a setup Megatron rejects, an unbalanced quote
        raise InputError(str(exc).strip("'\"")) from None
