"""The planner's one entry point: load → resolve → estimate or recommend → re-validate.

The CLI (``mbridge-offload estimate | recommend``) and the MCP tools (``estimate_memory``, ``recommend_mode``) pass
their arguments to :func:`plan_answer`; ``apply --mode recommended`` and ``diagnose --before/--after`` call
:func:`plan`, so every memory number comes from the same model with the same inputs, and each states its GPU, GPU
count and unit. Never imports torch.
"""

from __future__ import annotations

import contextlib
import copy
import shlex
from collections.abc import Iterator
from typing import Any, Literal

from mbridge_offload.config.errors import InputError
from mbridge_offload.config.schema import OffloadConfig
from mbridge_offload.plan.inputs.resolve import resolve
from mbridge_offload.plan.results import Estimate, Recommendation
from mbridge_offload.plan.search.planner import estimate, recommend

Kind = Literal["estimate", "recommend"]


def plan(
    kind: Kind,
    flags: dict[str, Any] | None = None,
    config: OffloadConfig | None = None,
    raw: dict[str, Any] | None = None,
    source: str | None = None,
    asked: dict[str, Any] | None = None,
) -> Estimate | Recommendation:
    """Answer ``estimate`` or ``recommend`` for a loaded config and/or planner inputs.

    Args:
        kind: ``estimate`` (memory and time of the settings as given) or ``recommend`` (the smallest offload).
        flags: ``PlanInputs`` values given directly (CLI flags, MCP parameters); None values are ignored.
        config: a loaded config (``sources.load(...).config``), or None.
        raw: the config's raw dict (which keys it sets).
        source: where the config came from (``LoadedConfig.source``; ``recipe:NAME`` marks a Bridge recipe).
        asked: planner inputs over ``flags`` that describe another run than the one the user's evidence measured
            (a plot's swept input): the evidence is moved to that run, never anchored at it.

    Returns:
        The ``Estimate`` or the ``Recommendation``, the latter re-validated by the rule catalogue.

    Raises:
        InputError / ValueError: inputs out of bounds or a setup Megatron rejects.
        KeyError: an unknown model or GPU preset.

    Example:
        >>> plan("recommend", {"model": "qwen3-30b-a3b", "gpu": "h100-80gb"}).mode
        'none'
    """
    r = resolve({**(flags or {}), **(asked or {})}, config, raw, source, asked=tuple(asked or ()))
    effective = r.effective.values if r.effective is not None else {}
    if kind == "estimate":
        est = estimate(r)
        est.effective = effective
        return est
    rec = recommend(r)
    rec.effective = effective
    revalidate(rec, config, raw, source)
    return rec


def revalidate(
    rec: Recommendation, config: OffloadConfig | None, raw: dict[str, Any] | None, source: str | None = None
) -> None:
    """Run the rule catalogue on the config with the recommended overrides; note the verdict in the rationale."""
    if config is None or not rec.overrides:
        return
    from mbridge_offload.config import sources
    from mbridge_offload.config.validate import validate

    edited = copy.deepcopy(raw if raw is not None else config.model_dump())
    try:
        sources.apply_overrides(edited, rec.overrides)
        report = validate(sources.build_config(edited, "<recommended>"), edited, source=source)
    except Exception as exc:  # never let the lint step hide the plan itself
        rec.rationale.append(f"could not re-validate the recommended overrides: {exc}")
        return
    errors = [f for f in report.findings if f.severity == "error"]
    warnings = [f for f in report.findings if f.severity == "warning"]
    if errors:
        rec.rationale.append(
            "the rule catalogue rejects the result: " + "; ".join(f"{f.rule}: {f.message}" for f in errors)
        )
    elif warnings:
        rec.rationale.append(
            "the recommended overrides pass the rule catalogue without errors; warnings the config already had: "
            + "; ".join(f"{f.rule}: {f.message}" for f in warnings)
        )
    else:
        rec.rationale.append("the recommended overrides pass the rule catalogue (mbridge_offload.config.validate)")


def recommend_for_inputs(
    config: OffloadConfig | None = None, raw: dict[str, Any] | None = None, source: str | None = None, **flags: Any
) -> Recommendation:
    """``recommend`` from a loaded config and/or inputs (``model``, ``gpu``, ``tp``, ...), re-validated."""
    rec = plan("recommend", flags, config, raw, source)
    assert isinstance(rec, Recommendation)
    return rec


def recommend_for_config(config: OffloadConfig, raw: dict[str, Any] | None = None, **flags: Any) -> Recommendation:
    """``recommend`` for a loaded config (``apply --mode recommended``)."""
    return recommend_for_inputs(config, raw, **flags)


def estimate_for_inputs(
    config: OffloadConfig | None = None, raw: dict[str, Any] | None = None, source: str | None = None, **flags: Any
) -> Estimate:
    """``estimate`` from a loaded config and/or inputs."""
    est = plan("estimate", flags, config, raw, source)
    assert isinstance(est, Estimate)
    return est


# ---------------------------------------------------------------------------------------------- a tool's arguments


@contextlib.contextmanager
def library_errors() -> Iterator[None]:
    """A ValueError or KeyError the library raises outside its own checks (an unknown preset, a setup Megatron
    rejects) is bad input; an InputError keeps its message and fix."""
    try:
        yield
    except InputError:
        raise
    except (ValueError, KeyError) as exc:
        raise InputError(str(exc).strip("'\"")) from None


def plan_source(v: dict[str, Any]) -> tuple[Any, Any, Any]:
    """Take ``config``, ``overrides`` and ``megatron_args`` out of a planner tool's arguments ``v`` (left holding the
    planner inputs) and read them: ``(config, raw, source)``, or Nones when only planner inputs were given."""
    from mbridge_offload.config.sources import load

    config, overrides, argv = v.pop("config"), v.pop("overrides") or [], v.pop("megatron_args")
    if config is None and argv is None and v.get("model") is None and v.get("num_layers") is None:
        raise InputError(
            "no model: pass model (a preset such as qwen3-30b-a3b or llama3-8b), config (a Bridge YAML path or "
            "text with the model section), or megatron_args"
        )
    if config is not None and argv is not None:
        raise InputError("pass either config or megatron_args, not both")
    if overrides and config is None and argv is None:
        raise InputError("overrides need a config to apply to; pass config (a path or YAML text) too")
    if config is None and argv is None:
        return None, None, None
    try:
        words = shlex.split(argv) if argv is not None else None
    except ValueError as exc:  # an unbalanced quote
        raise InputError(f"megatron_args: cannot read the command line: {exc}") from None
    with library_errors():
        loaded = load(argv=words, overrides=overrides) if words is not None else load(config, overrides)
    return loaded.config, loaded.raw, loaded.source


def plan_answer(kind: Kind, v: dict[str, Any]) -> Any:
    """``estimate`` / ``recommend`` as the CLI and the MCP tools take them: the config, its overrides or a
    Megatron-LM command line, and every planner input given (``v``, by the tools' parameter names)."""
    args = dict(v)
    if args.pop("confirm", False) and kind == "recommend":  # the trace is the tools' (trace.confirm)
        raise InputError("confirm is recommend's re-check by the trace: call trace.confirm.recommend_answer")
    cfg, raw, source = plan_source(args)
    with library_errors():
        return plan(kind, args, cfg, raw, source)
