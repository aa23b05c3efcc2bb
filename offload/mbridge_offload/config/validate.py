"""``validate``: run every rule of the catalogue on a config and return a :class:`Report`.

Validation is lint: each finding names the rule, the keys, upstream's own message (where upstream raises) and the
overrides that fix it. No torch, no megatron on this path.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field

from mbridge_offload.config import effective as effective_config
from mbridge_offload.config import parallel_sizes
from mbridge_offload.config.effective import EffectiveValue
from mbridge_offload.config.rules.base import (
    DEFAULT_TARGET,
    TE_VERSION_ASSUMED,
    Context,
    Match,
    Rule,
    nvte_cpu_offload_v1,
    parse_target,
)
from mbridge_offload.config.rules.catalogue import all_rules
from mbridge_offload.config.schema import OffloadConfig, effective_values


class Finding(BaseModel):
    """One hit of one rule (also the CLI's ``--json`` finding and the MCP tools' structured finding).

    ``message`` is upstream's text where upstream raises or warns (``upstream_message`` then holds the exact
    exception text, which differs only for bare asserts); ``why`` is our explanation.
    """

    model_config = ConfigDict(extra="forbid")

    rule: str = Field(description="stable rule id, e.g. ACT-PP")
    severity: Literal["error", "warning", "info"]
    origin: str = Field(description="who enforces it: mcore, te, bridge, megatron-lm or advisory")
    keys: list[str]
    message: str = Field(description="upstream's message verbatim where upstream raises one")
    fix: list[str] | None = Field(description="overrides that resolve it, or null")
    why: str | None = None
    stage: str | None = Field(None, description="where upstream enforces it")
    upstream_message: str | None = Field(None, description="the exact str(exception) upstream raises")
    exception: str | None = Field(None, description="the exception class upstream raises")
    fix_remove: list[str] | None = Field(
        default=None,
        description="Megatron-LM command line input only: the flags to delete (fix holds the flags to add)",
    )
    fix_overrides: list[str] | None = Field(
        default=None, description="Megatron-LM command line input only: the fix in Bridge notation (section.key=value)"
    )

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


# What the upstream run checks (``mbridge_offload_tools.exact``: megatron-core itself, in a warm subprocess), in the
# words ``coverage`` uses; an answer without the upstream run lists them under ``not_run``, never a silent gap.
UPSTREAM_CHECKS = (
    "megatron-core TransformerConfig / MLATransformerConfig.__post_init__",
    "megatron-core OptimizerConfig.__post_init__",
    "megatron-core DistributedDataParallelConfig.__post_init__",
    "megatron-core model build: every pipeline stage's and virtual chunk's layer split, and the first stage's "
    "GPTModel (one layer of each kind) built on the meta device under a fake process group",
)
NO_UPSTREAM = "not run: the rule catalogue only (no torch, no megatron-core)"


def rules_only_coverage(why: str = NO_UPSTREAM) -> dict[str, Any]:
    """``coverage`` of an answer without the upstream run: which of megatron-core's checks did not run, and why."""
    return {"upstream": why, "upstream_checks": [], "not_run": list(UPSTREAM_CHECKS)}


class Report(BaseModel):
    """The result of :func:`validate`. ``ok`` is True when no finding has severity ``error``.

    ``model_dump(mode="json")`` is the CLI's ``--json`` object: ``ok``, ``findings``, ``config``, ``target``, ``env``.
    """

    findings: list[Finding]
    config: dict[str, Any] = Field(description="effective values of the offload-related keys")
    effective: dict[str, EffectiveValue] = Field(
        default_factory=dict,
        description="the one effective config (mbridge_offload.config.effective): dotted key → {value, source}, "
        "the same block estimate, recommend, diagnose and apply print for the same input",
    )
    target: str = Field(description="the megatron-core release validated against, e.g. megatron-core==0.19.2")
    env: dict[str, str] = Field(default_factory=dict)
    source: str | None = Field(None, description="where the config came from (path, <text>, recipe:NAME, <argv>)")
    coverage: dict[str, Any] = Field(
        default_factory=rules_only_coverage,
        description="which checks ran: upstream (megatron-core's own run, or why not), upstream_checks (those it "
        "ran), not_run (those that did not, each named)",
    )
    fix_notation: Literal["bridge", "megatron-lm"] = Field(
        default="bridge",
        description="how each finding's fix is written: Bridge overrides (section.key=value), or Megatron-LM "
        "flags when the input was a Megatron-LM command line",
    )

    @computed_field(description="true when no finding is an error")  # type: ignore[prop-decorator]
    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    def by_rule(self, rule_id: str) -> list[Finding]:
        return [f for f in self.findings if f.rule == rule_id]

    def to_dict(self) -> dict[str, Any]:
        data = self.model_dump(mode="json")
        return {"ok": data.pop("ok"), **data}


def _finding(rule: Rule, match: Match) -> Finding:
    values = match.values
    message = match.message or rule.message.format(**values)
    if match.fix is not None:
        fix: list[str] | None = list(match.fix)
    elif rule.fix is not None:
        fix = [f.format(**values) for f in rule.fix]
    else:
        fix = None
    upstream_message = None
    if rule.upstream or rule.upstream_text is not None:
        upstream_message = rule.upstream_text.format(**values) if rule.upstream_text is not None else message
    return Finding(
        rule=rule.id,
        severity=rule.severity,
        origin=rule.origin,
        keys=list(match.keys if match.keys is not None else rule.keys),
        message=message,
        fix=fix,
        why=rule.why,
        stage=rule.stage,
        upstream_message=upstream_message,
        exception=match.exception or rule.exception,
    )


def validate(
    config: OffloadConfig, raw: dict[str, Any] | None = None, target: Any = DEFAULT_TARGET, source: str | None = None
) -> Report:
    """Run every rule that applies to ``target`` on ``config``; findings in catalogue order.

    ``raw`` enables the did-you-mean warnings; ``source`` ``recipe:NAME`` marks a Bridge recipe.

    Raises:
        ValueError: an unsupported ``target``. ParallelSizeError: a parallel size of 0 or below that
        megatron-core's dataclass does not refuse itself.
    """
    tgt = parse_target(target)
    eff = effective_config.resolve(config, raw if raw is not None else {}, tgt, source)
    findings = _run_rules(eff)
    covered = {key for f in findings if f.severity == "error" for key in f.keys}
    parallel_sizes.check(raw, "argv" if eff.frontend == "megatron-lm" else "config", covered)
    if raw:
        _drop_unsound_fixes(findings, config, raw, tgt, source)
    values = effective_values(config)
    shown = eff if raw is not None else effective_config.resolve(config, None, tgt, source)
    return Report(
        findings=findings, config=values, effective=shown.values, target=str(tgt), env=_env(config, raw or {})
    )


def check_te_version(text: str) -> str:
    """A Transformer Engine release as stated (``2.9``, ``2.10.0``, ``2.9.0+cu12``), stripped; else ValueError."""
    value = str(text).strip()
    if not re.fullmatch(r"v?\d+(\.\d+){0,2}([+.\-]\w[\w.+-]*)?", value):
        raise ValueError(
            f"te_version {text!r} is not a Transformer Engine release: give it as X.Y or X.Y.Z (e.g. 2.9 or "
            "2.10.0), as `pip show transformer-engine` prints it on the cluster"
        )
    return value


def _env(config: OffloadConfig, raw: dict[str, Any]) -> dict[str, str]:
    """The environment facts the verdict assumed: the caller's ``--env``, the Transformer Engine version (stated
    as an assumption when not given) and ``NVTE_CPU_OFFLOAD_V1`` as the job would see it (``env_vars`` included)."""
    env = dict(config.env)
    if "te_version" not in env:
        env["te_version"] = TE_VERSION_ASSUMED
        env["te_version_source"] = (
            "assumed: the release Megatron Bridge 0.6.2 pins; pass te_version (CLI: --te-version X.Y) for another"
        )
    env_vars = raw.get("env_vars")
    if "NVTE_CPU_OFFLOAD_V1" not in env and isinstance(env_vars, dict) and "NVTE_CPU_OFFLOAD_V1" in env_vars:
        env["NVTE_CPU_OFFLOAD_V1"] = nvte_cpu_offload_v1(config, raw)
        env["NVTE_CPU_OFFLOAD_V1_source"] = "the config's env_vars (Bridge sets it at start-up)"
    return env


def _run_rules(eff: effective_config.Effective) -> list[Finding]:
    # The catalogue judges the one effective config: after Bridge's mixed_precision block and finalize().
    ctx = Context(config=eff.config, raw=eff.raw, target=eff.target, normalized=eff.normalized, container=eff.container)
    hits: list[tuple[Rule, Finding]] = []
    for rule in all_rules():
        if not rule.applies(eff.target):
            continue
        hits.extend((rule, _finding(rule, match)) for match in rule.run(ctx))
    fired = {rule.id for rule, _ in hits}
    return [f for rule, f in hits if not fired.intersection(rule.shadowed_by)]


def _drop_unsound_fixes(
    findings: list[Finding], config: OffloadConfig, raw: dict[str, Any], tgt: Any, source: str | None
) -> None:
    """Every fix we propose must validate under the same rules: applied to the config, it must clear its own
    finding and bring no new error (e.g. never the distributed optimizer for an optimizer that cannot use it).
    A fix that fails this is withdrawn (``fix: null``) and the ``why`` says so."""
    import copy

    from mbridge_offload.config.sources import ConfigError, apply_overrides, build_config

    before = {f.rule for f in findings if f.severity == "error"}
    for finding in findings:
        if not finding.fix:
            continue
        try:
            fixed_raw = apply_overrides(copy.deepcopy(raw), list(finding.fix))
            fixed = build_config(fixed_raw)
        except ConfigError:
            fixed = None
        if fixed is not None:
            fixed.env.update(config.env)
            after = _run_rules(effective_config.resolve(fixed, fixed_raw, tgt, source))
            new_errors = {f.rule for f in after if f.severity == "error"} - before
            still = any(f.rule == finding.rule and f.message == finding.message for f in after)
            if not new_errors and not still:
                continue
            detail = f"it would raise {', '.join(sorted(new_errors))}" if new_errors else "it would not clear this"
        else:
            detail = "it does not type-check"
        finding.why = f"{finding.why or ''} (No fix offered: {' '.join(finding.fix)} — {detail}.)".strip()
        finding.fix = None


def first_error(report: Report, stage: str) -> Finding | None:
    """The first error a given upstream stage would raise (upstream stops at its first failing check)."""
    return next((f for f in report.errors if f.stage == stage), None)


def activation_offload_errors(model: dict[str, object]) -> list[tuple[str, str]]:
    """``(rule id, message)`` of every catalogue error layer-level activation offloading raises on ``model``.

    The one home of these constraints: the planner, the memory model and ``apply`` ask this instead of restating them.
    """
    return list(_activation_offload_errors(tuple(sorted(model.items(), key=lambda kv: kv[0]))))


@lru_cache(maxsize=512)
def _activation_offload_errors(items: tuple[tuple[str, object], ...]) -> tuple[tuple[str, str], ...]:
    model = dict(items)
    probe: dict[str, object] = {"cpu_offloading_num_layers": 1, **model, "cpu_offloading": True}
    if int(str(probe.get("pipeline_model_parallel_size") or 1)) > 1:
        probe.setdefault("pipeline_dtype", "bf16")  # Bridge fills it in; not what decides here
    raw = {"model": probe}
    report = validate(OffloadConfig.model_validate(raw), raw)
    offload_keys = ("model.cpu_offloading", "model.cpu_offloading_num_layers")
    return tuple((f.rule, f.message) for f in report.errors if any(k in f.keys for k in offload_keys))


def fine_grained_errors(model: dict[str, object]) -> list[tuple[str, str]]:
    """``(rule id, message)`` of every TransformerConfig catalogue error fine-grained offloading raises on ``model``.

    The one home of these constraints: the planner and ``apply`` ask this instead of restating them.
    """
    items = tuple(sorted((k, tuple(v) if isinstance(v, list | tuple) else v) for k, v in model.items()))
    return list(_fine_grained_errors(items))


@lru_cache(maxsize=512)
def _fine_grained_errors(items: tuple[tuple[str, object], ...]) -> tuple[tuple[str, str], ...]:
    from mbridge_offload.config.rules.base import STAGE_TRANSFORMER_CONFIG

    model = {k: list(v) if isinstance(v, tuple) else v for k, v in items}
    raw = {"model": {"num_layers": 1, **model, "fine_grained_activation_offloading": True}}
    report = validate(OffloadConfig.model_validate(raw), raw)
    keys = {f"model.{k}" for k in ("fine_grained_activation_offloading", "offload_modules")}
    keys |= {f"model.{k}" for k in ("min_offloaded_tensor_size", "activation_offload_fraction")}
    return tuple(
        (f.rule, f.message) for f in report.errors if f.stage == STAGE_TRANSFORMER_CONFIG and keys.intersection(f.keys)
    )


def model_errors(model: dict[str, object]) -> list[tuple[str, str]]:
    """``(rule id, message)`` of every ``TransformerConfig`` catalogue error on ``model`` (sizes and parallelism):
    the planner's layout checks ask this instead of restating them.
    """
    return list(_model_errors(tuple(sorted(model.items(), key=lambda kv: kv[0]))))


@lru_cache(maxsize=4096)
def _model_errors(items: tuple[tuple[str, object], ...]) -> tuple[tuple[str, str], ...]:
    from mbridge_offload.config.rules.base import STAGE_TRANSFORMER_CONFIG

    probe = dict(items)
    if int(str(probe.get("pipeline_model_parallel_size") or 1)) > 1:
        probe.setdefault("pipeline_dtype", "bf16")  # Bridge fills it in; not what decides here
    raw = {"model": probe}
    eff = effective_config.resolve(OffloadConfig.model_validate(raw), raw, parse_target(DEFAULT_TARGET), None)
    return tuple(
        (f.rule, f.message) for f in _run_rules(eff) if f.severity == "error" and f.stage == STAGE_TRANSFORMER_CONFIG
    )
