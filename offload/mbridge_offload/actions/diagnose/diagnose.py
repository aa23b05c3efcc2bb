"""Explain a failed or disappointing offload run from upstream's own messages, never from prose.

A log line that quotes a rule's upstream message (``config/rules/``) is matched back to its rule and fix; the
failure catalogue (:mod:`.failures.catalogue`) recognises PyTorch's, TE's and megatron-core's messages; a failure
that prints nothing (a slowdown, a loss jump after resume) is named by the caller (``symptom``), since the client
reads the user's words and this module does not. A config (or, without one, the settings the log states,
:mod:`.stated`) narrows the readings; OOM, slowdown and host-OOM fixes are sized by the planner (:mod:`.sizing`).
Plain Python: no torch.
"""

from __future__ import annotations

import re
import string
from typing import Any

from pydantic import BaseModel, Field

from mbridge_offload.actions.diagnose import sizing
from mbridge_offload.actions.diagnose.failures.base import FailureMode
from mbridge_offload.actions.diagnose.failures.catalogue import EXPLAINS_RULES, KNOWN
from mbridge_offload.actions.diagnose.failures.memory import OOM_UNATTRIBUTED
from mbridge_offload.actions.diagnose.stated import Stated, stated, verdict
from mbridge_offload.config import effective as effective_config
from mbridge_offload.config import parallel_sizes
from mbridge_offload.config.effective import EffectiveValue
from mbridge_offload.config.schema import OFFLOAD_KEYS, RELATED_KEYS, OffloadConfig
from mbridge_offload.config.sources import LoadedConfig
from mbridge_offload.plan.inputs.resolve import Assumption
from mbridge_offload.plan.results import Anchor, Option

AnyConfig = OffloadConfig | LoadedConfig

# ``oom``: a GPU out-of-memory whose reading the config (or the log's settings) decides.
OOM_SYMPTOM = "oom"
SYMPTOMS: tuple[str, ...] = (OOM_SYMPTOM, *(mode.id for mode in KNOWN))
_OOM_READINGS = sizing.GPU_OOM


class Diagnosis(BaseModel):
    """One failure mode that the text (or the config change) shows."""

    failure: str = Field(description="failure-mode id")
    title: str
    cause: str
    confirm: str = Field(description="how to confirm this is the cause (a check, not a fix)")
    confirm_overrides: list[str] = Field(
        [], description="overrides of the confirming experiment: they show the cause and are never a fix"
    )
    fix: list[str] = Field(description="overrides that fix it (may be empty when the fix is not a config key)")
    actions: list[str] = Field([], description="other steps: upgrades, environment changes, alternatives")
    evidence: str | None = None
    source: str = Field(
        "known",
        description="known (an upstream message of the failure catalogue), symptom (named by the caller), rule:ID "
        "(an upstream message of the rule catalogue), or predicted (before/after: the change offloads less)",
    )
    references: list[str] = []


class RuledOut(BaseModel):
    """A failure mode the text shows but the config excludes, with the config's reason."""

    failure: str
    title: str
    reason: str = Field(description="the key and value of the config that exclude it")


class DiagnoseReport(BaseModel):
    """``diagnose``: the library's result, the CLI's ``--json`` and the MCP tool's structured output."""

    matches: list[Diagnosis]
    ruled_out: list[RuledOut] = Field([], description="with a config: modes the text shows that the config excludes")
    findings: list[dict[str, Any]] = []
    comparison: dict[str, Any] | None = Field(
        None, description="with before/after: changed offload keys and predicted per-GPU memory"
    )
    needs: list[str] = Field(
        [], description="what to pass for a firmer diagnosis (config, log, command line) when the text cannot decide"
    )
    notes: list[str] = []
    effective: dict[str, EffectiveValue] = Field(
        default_factory=dict,
        description="the one effective config of config (else of after): dotted key → {value, source}, identical "
        "to validate's and estimate's for the same file",
    )
    options: list[Option] = Field(
        [],
        description="with a config and an OOM, slowdown or host-OOM reading: recommend's ranked options for that "
        "config, sized with the text as evidence; each sized reading's fix is one of them",
    )
    assumptions: list[Assumption] = Field(
        [], description="every input the planner used (GPU, GPU count, evidence...) with its source"
    )
    calibration: Anchor | None = Field(None, description="how the text's measurements anchored the planner")


# ---------------------------------------------------------------------------------------------- matching


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _line_around(text: str, start: int, end: int) -> str:
    left = text.rfind("\n", 0, start) + 1
    right = text.find("\n", end)
    return text[left : right if right != -1 else len(text)].strip()[:300]


def _evidence_line(hit: re.Match[str], text: str) -> str:
    return _line_around(hit.string if hit.string is not text else text, hit.start(), hit.end())


def _template_regex(template: str) -> str:
    parts: list[str] = []
    seen: set[str] = set()
    for literal, name, _spec, _conv in string.Formatter().parse(template):
        parts.append(re.escape(_normalise(literal)))
        if name is not None:
            group = re.sub(r"\W", "_", name) or "value"
            parts.append(f"(?P<{group}>.+?)" if group not in seen and group[0].isalpha() else ".+?")
            seen.add(group)
    regex = "".join(parts).rstrip("\\.")
    return regex.replace(r"\ ", r"\s+")


def _rule_modes() -> list[tuple[Any, re.Pattern[str]]]:
    try:
        from mbridge_offload.config.rules.catalogue import all_rules
    except ImportError:
        return []
    out = []
    for rule in all_rules():
        if not rule.upstream or rule.severity != "error":
            continue
        for text in {t for t in (rule.message, rule.upstream_text) if t is not None}:
            try:
                out.append((rule, re.compile(_template_regex(text), re.IGNORECASE)))
            except re.error:  # pragma: no cover - a template we cannot turn into a regex
                continue
    return out


def _format_fix(templates: tuple[str, ...] | None, values: dict[str, Any]) -> list[str]:
    fixes = []
    for template in templates or ():
        try:
            fixes.append(template.format(**values))
        except (KeyError, IndexError, ValueError):
            continue  # needs a value only the config has; validate(config) gives the concrete one
    return fixes


def _from_rules(text: str, covered: set[str]) -> list[Diagnosis]:
    found: list[Diagnosis] = []
    seen: set[str] = set(covered)
    flat = _normalise(text)
    for rule, regex in _rule_modes():
        if rule.id in seen:
            continue
        hit = regex.search(text) or regex.search(flat)
        if not hit:
            continue
        seen.add(rule.id)
        found.append(
            Diagnosis(
                failure=rule.id,
                title=rule.summary,
                cause=rule.why,
                confirm=f"check {', '.join(rule.keys)} in the effective config (`mbridge-offload validate CONFIG`)",
                fix=_format_fix(rule.fix, {k: v for k, v in hit.groupdict().items() if v is not None}),
                evidence=_evidence_line(hit, text),
                source=f"rule:{rule.id}",
            )
        )
    return found


def _diagnosis(
    mode: FailureMode, fix: list[str], evidence: str | None, source: str, config: OffloadConfig | None = None
) -> Diagnosis:
    cause = mode.explain(config) if config is not None and mode.explain is not None else ""
    return Diagnosis(
        failure=mode.id,
        title=mode.title,
        cause=cause or mode.cause,
        confirm=mode.confirm,
        confirm_overrides=list(mode.confirm_with),
        fix=fix,
        actions=list(mode.actions),
        evidence=evidence,
        source=source,
        references=list(mode.references),
    )


# ---------------------------------------------------------------------------------------------- readings


def exclusion(mode: FailureMode, config: OffloadConfig | None) -> str | None:
    if config is None:
        return None
    if mode.rules_out is not None and (reason := mode.rules_out(config)):
        return reason
    if mode.when is not None and not mode.when(config):
        return f"the config does not show the conditions of {mode.title!r}"
    return None


def _offered(mode: FailureMode, config: OffloadConfig | None, said: Stated | None, named: bool) -> bool:
    """Without a config or a name, the settings the log states decide the OOM readings."""
    if config is not None or named:
        return True
    return (said is not None and verdict(mode.id, said) is not None) or mode.without_config


def _excluded(mode: FailureMode, config: OffloadConfig | None, said: Stated | None) -> str | None:
    if config is not None:
        return exclusion(mode, config)
    found = verdict(mode.id, said) if said is not None else None
    return found[1] if found is not None and not found[0] else None


def _pattern_hit(mode: FailureMode, text: str, flat: str) -> re.Match[str] | None:
    for pattern in mode.patterns:
        if hit := re.search(pattern, text, re.IGNORECASE) or re.search(pattern, flat, re.IGNORECASE):
            return hit
    return None


def _named(mode: FailureMode, symptoms: frozenset[str]) -> bool:
    return mode.id in symptoms or (OOM_SYMPTOM in symptoms and mode.id in _OOM_READINGS)


def _supersede(matches: list[Diagnosis], ruled: dict[str, RuledOut]) -> list[Diagnosis]:
    by_id = {mode.id: mode for mode in KNOWN}
    found = {m.failure for m in matches}
    for failure in list(found):
        for other, reason in getattr(by_id.get(failure), "supersedes", ()):
            if other in found:
                ruled[other] = RuledOut(failure=other, title=by_id[other].title, reason=reason)
    return [m for m in matches if m.failure not in ruled]


def check_symptoms(symptoms: list[str] | tuple[str, ...]) -> frozenset[str]:
    """Raises ValueError on an unknown symptom (the message lists the known ones)."""
    unknown = [s for s in symptoms if s not in SYMPTOMS]
    if unknown:
        raise ValueError(f"unknown symptom {', '.join(map(repr, unknown))}: one of {', '.join(SYMPTOMS)}")
    return frozenset(symptoms)


def match_and_exclude(
    text: str, config: OffloadConfig | None = None, symptoms: list[str] | tuple[str, ...] = ()
) -> tuple[list[Diagnosis], list[RuledOut]]:
    """The modes the text shows or the caller names (most specific first), and those the config rules out."""
    named = check_symptoms(symptoms)
    text = text or ""
    flat = _normalise(text)
    said = stated(text) if config is None else None
    matches: list[Diagnosis] = []
    ruled: dict[str, RuledOut] = {}
    covered: set[str] = set()
    for mode in KNOWN:
        hit = _pattern_hit(mode, text, flat)
        # ``oom`` stands for PyTorch's message: the config or the log's settings pick the reading; an id picks it.
        if (hit is None and not _named(mode, named)) or not _offered(mode, config, said, mode.id in named):
            continue
        if reason := _excluded(mode, config, said):
            ruled[mode.id] = RuledOut(failure=mode.id, title=mode.title, reason=reason)
            continue
        fix = list(mode.fix(config, hit)) if callable(mode.fix) else list(mode.fix)
        covered.update(EXPLAINS_RULES.get(mode.id, ()))
        evidence = _evidence_line(hit, text) if hit else f"named by the caller: symptom {mode.id}"
        matches.append(_diagnosis(mode, fix, evidence, "known" if hit else "symptom", config))
    matches += _from_rules(text, covered)
    matches = _supersede(matches, ruled)
    matches += _unattributed_oom(text, flat, config, matches, named)
    # A config error explains a crash better than the generic symptoms that may also match its log.
    specific = [m for m in matches if not m.failure.startswith(("oom_", "slowdown", "host_oom", "no_saving"))]
    generic = [m for m in matches if m not in specific]
    return specific + generic, list(ruled.values())


def _unattributed_oom(
    text: str, flat: str, config: OffloadConfig | None, matches: list[Diagnosis], named: frozenset[str]
) -> list[Diagnosis]:
    """A GPU OOM no reading could take: say so, and guess no fix."""
    if config is not None or any(m.failure.startswith(("oom_", "host_oom")) for m in matches):
        return []
    hit = _pattern_hit(OOM_UNATTRIBUTED, text, flat)
    if hit is None and OOM_SYMPTOM not in named and OOM_UNATTRIBUTED.id not in named:
        return []
    evidence = _evidence_line(hit, text) if hit else f"named by the caller: symptom {OOM_SYMPTOM}"
    return [_diagnosis(OOM_UNATTRIBUTED, [], evidence, "known" if hit else "symptom")]


def match_text(
    text: str, config: OffloadConfig | None = None, symptoms: list[str] | tuple[str, ...] = ()
) -> list[Diagnosis]:
    return match_and_exclude(text, config, symptoms)[0]


# ---------------------------------------------------------------------------------------------- before / after


def _parts(config: AnyConfig) -> tuple[OffloadConfig, dict[str, Any] | None, str | None]:
    if isinstance(config, LoadedConfig):
        return config.config, config.raw, config.source
    return config, None, None


def _memory(config: AnyConfig, planner: dict[str, Any] | None = None) -> dict[str, Any]:
    """``estimate``'s own figures for a config (ValueError / KeyError: it lacks the model sizes)."""
    est = sizing.estimate(sizing.Failing(*_parts(config)), planner or {})
    keys = ("host_gb", "step_time_factor", "gpu", "num_gpus", "unit", "assumptions")
    return {"memory_gb": est.memory_gb.model_dump(), "memory_gib": est.memory_gib.model_dump()} | {
        k: getattr(est, k) for k in keys
    }


def _effective(config: AnyConfig) -> effective_config.Effective:
    typed, raw, source = _parts(config)
    return effective_config.resolve(typed, raw, source=source)


def compare_configs(before: AnyConfig, after: AnyConfig, planner: dict[str, Any] | None = None) -> dict[str, Any]:
    """The offload-related keys whose effective values differ, and the predicted per-GPU memory change.

    Pass :class:`LoadedConfig` objects so that keys a file does not write take ``estimate``'s defaults.
    """
    old, new = _effective(before).values, _effective(after).values
    changed = [
        {"key": k, "before": old[k].value, "after": new[k].value}
        for k in (*OFFLOAD_KEYS, *RELATED_KEYS)
        if old[k].value != new[k].value
    ]
    out: dict[str, Any] = {"changed": changed}
    try:
        mem_before, mem_after = _memory(before, planner), _memory(after, planner)
    except (ValueError, KeyError, TypeError) as exc:  # e.g. no model sizes: say so, keep the diagnosis
        out["memory_note"] = f"memory prediction unavailable: {str(exc).strip(chr(39))}"
        return out
    for key in ("memory_gb", "memory_gib", "gpu", "num_gpus", "host_gb", "step_time_factor"):
        out[key] = {"before": mem_before[key], "after": mem_after[key]}
    tb, ta = mem_before["memory_gb"].get("total"), mem_after["memory_gb"].get("total")
    if tb is not None and ta is not None:
        out["memory_gb"]["delta_total"] = round(ta - tb, 3)
    out["unit"] = mem_before["unit"]
    out["assumptions"] = mem_after["assumptions"]  # the report lifts them out (``diagnose``)
    return out


def _findings(config: OffloadConfig, raw: dict[str, Any] | None, source: str | None) -> list[dict[str, Any]]:
    from mbridge_offload.config.validate import validate

    return list(validate(config, raw, source=source).to_dict().get("findings", []))


def diagnose(
    error: str | None = None,
    log: str | None = None,
    config: OffloadConfig | None = None,
    raw: dict[str, Any] | None = None,
    before: AnyConfig | None = None,
    after: AnyConfig | None = None,
    source: str | None = None,
    planner: dict[str, Any] | None = None,
    symptom: str | None = None,
) -> DiagnoseReport:
    """Match an error and/or log against the known failure modes, and the symptom named (:data:`SYMPTOMS`).

    ``config`` narrows the matches and adds the validator's findings; ``before``/``after`` (``sources.load``
    results) add ``comparison``; ``planner`` holds the planner inputs the sized fixes use, as ``estimate`` does.

    Raises:
        ParallelSizeError: a parallel size of 0 or below. InputError: a planner input out of bounds, an unknown
        preset, an unreadable measured log. ValueError: an unknown symptom.
    """
    named = (symptom,) if symptom else ()
    check_symptoms(named)
    inputs = sizing.check_inputs(planner)
    for label, given in (("config", raw), ("before", before), ("after", after)):
        # a run that cannot start is bad input here as everywhere (estimate, recommend, apply refuse it too)
        parallel_sizes.check(given if given is None or isinstance(given, dict) else _parts(given)[1], label)
    text = "\n".join(t for t in (error, log) if t)
    typed_before = _parts(before)[0] if before is not None else None
    typed_after = _parts(after)[0] if after is not None else None
    matches, ruled = match_and_exclude(text, config or typed_after, named) if text or named else ([], [])
    report = DiagnoseReport(matches=matches, ruled_out=ruled)
    for r in ruled:
        report.notes.append(f"ruled out by the config: {r.failure} ({r.title}): {r.reason}")
    if config is not None:
        report.findings = _findings(config, raw, source)
        report.effective = effective_config.resolve(config, raw, source=source).values
    elif after is not None:
        report.effective = _effective(after).values
    if before is not None and after is not None and typed_before is not None and typed_after is not None:
        report.comparison = compare_configs(before, after, inputs)
        report.assumptions = report.comparison.pop("assumptions", [])
        if not text and not named:  # no failure reported: does the change predict an OOM?
            smaller = _got_smaller(typed_before, typed_after)
            report.matches = match_text("", typed_after, (OOM_SYMPTOM,)) if smaller else []
            for m in report.matches:
                m.source, m.evidence = "predicted", "the change offloads less than before (comparison)"
    failing = sizing.Failing(config, raw, source) if config is not None else None
    if failing is None and after is not None:
        failing = sizing.Failing(*_parts(after))
    _size(report, failing, inputs, text)
    report.needs = [*_needs(report.matches, config or typed_after), *report.needs]
    if text and not report.matches:
        report.notes.append(_NOTHING_MATCHED)
        if config is None:
            report.needs = list(_NEEDS_WHEN_UNMATCHED)
    return report


def _size(report: DiagnoseReport, failing: sizing.Failing | None, inputs: dict[str, Any], text: str) -> None:
    readings = [m.failure for m in report.matches if m.failure in sizing.SIZED]
    if not readings:
        return
    oom = next((m for m in report.matches if m.failure in sizing.GPU_OOM), None)
    if failing is None:
        for m in report.matches:
            if m.failure in sizing.GPU_OOM:
                m.fix = []
        if oom is not None and oom.failure != "oom_unattributed":  # that one already asks for the config
            report.needs.append(sizing.SIZING_NEED)
        return
    # The text reports the failure (a prediction from before/after has no text): it is the evidence.
    oom_line = (oom.evidence or oom.title) if oom is not None and oom.source != "predicted" else None
    found = sizing.size(readings, failing, inputs, text, oom_line)
    for m in report.matches:
        if m.failure in found.fixes:
            m.fix = found.fixes[m.failure]
    report.options, report.calibration = found.options, found.calibration
    report.assumptions = found.assumptions or report.assumptions
    report.notes += found.notes
    report.needs += found.needs


_NEEDS_WHEN_UNMATCHED = (
    "the log around the first error (--log FILE, MCP log): the exception line and the traceback above it",
    "the failing run's config (--config FILE, MCP config), or check it with `mbridge-offload validate CONFIG`",
)


def _needs(matches: list[Diagnosis], config: OffloadConfig | None) -> list[str]:
    by_id = {mode.id: mode for mode in (*KNOWN, OOM_UNATTRIBUTED)}
    out: list[str] = []
    for m in matches:
        mode = by_id.get(m.failure)
        if mode is not None and (config is None or not m.fix):
            out += [n for n in mode.needs if n not in out and not (config is not None and "config" in n)]
    return out


_NOTHING_MATCHED = (
    "no upstream message of a known offload failure is in this text, and diagnose does not read prose: name the "
    "failure instead (symptom: " + ", ".join(SYMPTOMS) + "), or pass the config and the log around the first error, "
    "or run `mbridge-offload validate CONFIG`."
)


def _got_smaller(before: OffloadConfig, after: OffloadConfig) -> bool:
    """Did the change offload less (the usual reason a commit brings an OOM)?"""
    b, a = before, after
    less_opt = (b.optimizer.optimizer_cpu_offload and b.optimizer.optimizer_offload_fraction) > (
        a.optimizer.optimizer_cpu_offload and a.optimizer.optimizer_offload_fraction
    )
    less_act = (b.model.cpu_offloading and b.model.cpu_offloading_num_layers) > (
        a.model.cpu_offloading and a.model.cpu_offloading_num_layers
    )
    return bool(less_opt or less_act)
