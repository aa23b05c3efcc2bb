"""Explain a failed or disappointing offload run: match an error or log against the known failure modes.

Two sources of knowledge:
- every upstream error message in the rule catalogue (``config/rules/``): a log line that quotes one is
  matched back to its rule, and the rule's fix is returned as overrides;
- the failures that have no single message — OOM with activation offload, OOM at partial optimizer offload, a
  >4x slowdown, a loss jump after resume, ``weights_only`` load failures, pinned-memory / memlock limits, the
  Transformer Engine ``get_cpu_offload_context`` TypeError, checkpoint-save assertions — each with a cause, a way
  to confirm it and a fix; the catalogue is data in :mod:`mbridge_offload.actions.diagnose.failures.catalogue`.

Only statements count as symptoms (:mod:`mbridge_offload.actions.diagnose.text_scope`): argument and config dumps,
metric
records and traceback frames name settings, metrics and code, and a symptom word counts for the quantity it
describes. With the config, matches are narrowed (an OOM with ``cpu_offloading`` on is the activation-offload OOM)
and the validator's findings are added; without one, the offload settings the text states decide. An OOM's,
a slowdown's or a host OOM's fix is sized by the planner (:mod:`mbridge_offload.actions.diagnose.sizing`): one of
``recommend``'s ranked options for the config, with the text as evidence; without a config none is guessed. With
two configs, :func:`compare_configs` lists the offload-related keys that changed and the planner's predicted
per-GPU memory before and after, on the GPU and GPU count given.

Example:
    >>> report = diagnose(error="Currently there is no support for Pipeline parallelism with CPU offloading")
    >>> report.matches[0].fix
    ['model.cpu_offloading=false', 'optimizer.optimizer_cpu_offload=true', ...]

Plain Python: no torch.
"""

from __future__ import annotations

import re
import string
from functools import cache, lru_cache
from typing import Any

from pydantic import BaseModel, Field

from mbridge_offload.actions.diagnose import sizing
from mbridge_offload.actions.diagnose.failures.base import FailureMode
from mbridge_offload.actions.diagnose.failures.catalogue import EXPLAINS_RULES, KNOWN
from mbridge_offload.actions.diagnose.failures.concepts import CONCEPTS
from mbridge_offload.actions.diagnose.failures.memory import OOM_UNATTRIBUTED
from mbridge_offload.actions.diagnose.text_scope import (
    Scoped,
    Stated,
    attached,
    numeric_changes,
    scope,
    stated,
    verdict,
)
from mbridge_offload.config import effective as effective_config
from mbridge_offload.config import parallel_sizes
from mbridge_offload.config.effective import EffectiveValue
from mbridge_offload.config.schema import OFFLOAD_KEYS, RELATED_KEYS, OffloadConfig
from mbridge_offload.config.sources import LoadedConfig
from mbridge_offload.plan.inputs.resolve import Assumption
from mbridge_offload.plan.results import Anchor, Option

# A config to diagnose: loaded (raw dict and source known: the same reading as every other tool), or only typed.
AnyConfig = OffloadConfig | LoadedConfig

# Ideas that say how a symptom looks, not which mechanism causes it: sharing only these with a failure mode's
# phrasing ("at step 2 it jumps": a step, an increase) makes no mode a candidate for ``closest``.
_INCIDENTAL = frozenset(
    {"time", "increase", "decrease", "negation", "early_step", "differ", "sizes", "state", "failure", "args"}
)


def _whole(text: str) -> re.Match[str]:
    """What a fix function gets for a reading by meaning: a match over the whole text, with no groups."""
    hit = re.match(r"(?s).*", text)
    assert hit is not None  # ".*" matches every string
    return hit


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
    source: str = Field("known", description="known (pattern), meaning (a phrasing), or rule:ID")
    references: list[str] = []


class Closest(BaseModel):
    """A failure mode the text resembles without matching: how many of a phrasing's ideas it shows."""

    failure: str
    title: str
    score: float = Field(description="share of the best phrasing's ideas found in the text (0..1)")
    phrasing: str


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
    closest: list[Closest] = Field([], description="when nothing matched: the nearest failure modes")
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


def _evidence_line(hit: re.Match[str], scoped: Scoped) -> str:
    """The line of a pattern's hit as the user wrote it (the fields blanked for matching are shown again)."""
    return _line_around(scoped.text if hit.string is scoped.evidence else hit.string, hit.start(), hit.end())


def _template_regex(template: str) -> str:
    """A rule's ``str.format`` message template → a regex with one named group per field."""
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


def _from_rules(scoped: Scoped, covered: set[str]) -> list[Diagnosis]:
    found: list[Diagnosis] = []
    seen: set[str] = set(covered)
    flat = _normalise(scoped.evidence)
    for rule, regex in _rule_modes():
        if rule.id in seen:
            continue
        hit = regex.search(scoped.evidence) or regex.search(flat)
        if not hit:
            continue
        seen.add(rule.id)
        evidence = _evidence_line(hit, scoped)
        found.append(
            Diagnosis(
                failure=rule.id,
                title=rule.summary,
                cause=rule.why,
                confirm=f"check {', '.join(rule.keys)} in the effective config (`mbridge-offload validate CONFIG`)",
                fix=_format_fix(rule.fix, {k: v for k, v in hit.groupdict().items() if v is not None}),
                evidence=evidence,
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


# ---------------------------------------------------------------------------------------------- meaning


@lru_cache(maxsize=1)
def _concept_regexes() -> dict[str, re.Pattern[str]]:
    return {name: re.compile(pattern, re.IGNORECASE) for name, pattern in CONCEPTS.items()}


def concepts(text: str) -> frozenset[str]:
    """The ideas (``failures.CONCEPTS``) a text expresses, whatever its wording (and a change told in numbers,
    "from 1.2 s to 5.1 s", as an increase or a decrease)."""
    flat = _normalise(text.replace("’", "'"))
    words = {name for name, regex in _concept_regexes().items() if regex.search(flat)}
    return frozenset(words | {idea for _a, _b, idea in numeric_changes(flat)})


@cache
def _phrasing_concepts(phrasing: str) -> frozenset[str]:
    return concepts(phrasing)


def exclusion(mode: FailureMode, config: OffloadConfig | None) -> str | None:
    """Why ``config`` excludes ``mode`` (its key and value), or None when the mode is still possible."""
    if config is None:
        return None
    if mode.rules_out is not None and (reason := mode.rules_out(config)):
        return reason
    if mode.when is not None and not mode.when(config):
        return f"the config does not show the conditions of {mode.title!r}"
    return None


def _offered(mode: FailureMode, config: OffloadConfig | None, ideas: frozenset[str], said: Stated | None) -> bool:
    """Whether ``mode`` is a reading at all: with a config its conditions decide (``exclusion``); without one the
    settings the text states decide (``text_scope.verdict``), else the text must show the mechanism
    (``FailureMode.shows``), never only the symptom."""
    if config is not None:
        return True
    stated_verdict = verdict(mode.id, said) if said is not None else None
    if stated_verdict is not None:
        return True  # offered, or shown and then ruled out by the stated settings (``_excluded``)
    return mode.without_config and set(mode.shows) <= ideas


def _excluded(mode: FailureMode, config: OffloadConfig | None, said: Stated | None) -> str | None:
    """Why the config, or without one the settings the text states, exclude ``mode`` (None: still possible)."""
    if config is not None:
        return exclusion(mode, config)
    found = verdict(mode.id, said) if said is not None else None
    return found[1] if found is not None and not found[0] else None


def _ideas(scoped: Scoped, said: Stated | None) -> frozenset[str]:
    """The ideas the statements express, and the mechanisms the stated settings switch on."""
    return concepts(scoped.statement) | (said.ideas if said is not None else frozenset())


def _by_meaning(
    scoped: Scoped,
    ideas: frozenset[str],
    config: OffloadConfig | None,
    found: set[str],
    out_ruled: dict[str, RuledOut],
    said: Stated | None,
) -> list[Diagnosis]:
    """Failure modes one of whose phrasings the text expresses (all of its ideas, ``_ideas``, present)."""
    out = []
    for mode in KNOWN:
        if mode.id in found or mode.id in out_ruled or not mode.phrasings:
            continue
        if not _offered(mode, config, ideas, said):
            continue
        phrasing = next((p for p in mode.phrasings if _phrasing_concepts(p) <= ideas), None)
        if phrasing is None or not attached(mode.id, scoped):
            continue
        if reason := _excluded(mode, config, said):
            out_ruled[mode.id] = RuledOut(failure=mode.id, title=mode.title, reason=reason)
            continue
        fix = list(mode.fix(config, _whole(scoped.text)) if callable(mode.fix) else mode.fix)
        out.append(_diagnosis(mode, fix, f"reads as: {phrasing!r}", "meaning", config))
    return out


def closest_modes(text: str, n: int = 3) -> list[Closest]:
    """The ``n`` failure modes whose phrasings share the most ideas with the text, counting only phrasings that
    share at least one idea of the mechanism (not only incidental words such as "step" or "jump")."""
    ideas = concepts(scope(text).statement)
    scored = []
    for mode in KNOWN:
        best = max(
            (
                (len(_phrasing_concepts(p) & ideas) / len(_phrasing_concepts(p)), p)
                for p in mode.phrasings
                if (_phrasing_concepts(p) & ideas) - _INCIDENTAL
            ),
            default=(0.0, ""),
        )
        if best[0] > 0:
            scored.append(Closest(failure=mode.id, title=mode.title, score=round(best[0], 2), phrasing=best[1]))
    return sorted(scored, key=lambda c: -c.score)[:n]


def _pattern_hit(mode: FailureMode, scoped: Scoped, flat: str) -> re.Match[str] | None:
    """The first hit of a pattern outside the text's fields whose symptom is about the mode's quantity."""
    for pattern in mode.patterns:
        for hit in re.finditer(pattern, scoped.evidence, re.IGNORECASE):
            if attached(mode.id, scoped, hit.span()):
                return hit
        wrapped = re.search(pattern, flat, re.IGNORECASE)  # a message wrapped over lines
        if wrapped and attached(mode.id, scoped):
            return wrapped
    return None


def _supersede(matches: list[Diagnosis], ruled: dict[str, RuledOut]) -> list[Diagnosis]:
    """Drop the modes a more specific match explains better (``FailureMode.supersedes``), with its reason."""
    by_id = {mode.id: mode for mode in KNOWN}
    found = {m.failure for m in matches}
    for failure in list(found):
        for other, reason in getattr(by_id.get(failure), "supersedes", ()):
            if other in found:
                ruled[other] = RuledOut(failure=other, title=by_id[other].title, reason=reason)
    return [m for m in matches if m.failure not in ruled]


def match_and_exclude(text: str, config: OffloadConfig | None = None) -> tuple[list[Diagnosis], list[RuledOut]]:
    """The known failure modes the text shows (most specific first), and those the config rules out."""
    scoped = scope(text or "")
    flat = _normalise(scoped.evidence)
    said = stated(scoped) if config is None else None
    matches: list[Diagnosis] = []
    ruled: dict[str, RuledOut] = {}
    covered: set[str] = set()
    ideas = _ideas(scoped, said)
    for mode in KNOWN:
        if not _offered(mode, config, ideas, said):
            continue
        hit = _pattern_hit(mode, scoped, flat)
        if hit is None:
            continue
        if reason := _excluded(mode, config, said):
            ruled[mode.id] = RuledOut(failure=mode.id, title=mode.title, reason=reason)
            continue
        fix = list(mode.fix(config, hit)) if callable(mode.fix) else list(mode.fix)
        covered.update(EXPLAINS_RULES.get(mode.id, ()))
        matches.append(_diagnosis(mode, fix, _evidence_line(hit, scoped), "known", config))
    matches += _from_rules(scoped, covered)
    matches += _by_meaning(scoped, ideas, config, {m.failure for m in matches}, ruled, said)
    matches = _supersede(matches, ruled)
    matches += _unattributed_oom(scoped, ideas, flat, config, matches)
    # A config error explains a crash better than the generic symptoms that may also match its log.
    specific = [m for m in matches if not m.failure.startswith(("oom_", "slowdown", "host_oom", "no_saving"))]
    generic = [m for m in matches if m not in specific]
    return specific + generic, list(ruled.values())


def _unattributed_oom(
    scoped: Scoped, ideas: frozenset[str], flat: str, config: OffloadConfig | None, matches: list[Diagnosis]
) -> list[Diagnosis]:
    """A GPU OOM no reading could take (no config, no mechanism in the text, or the readings the text showed are
    ruled out by the settings it states): say so, and guess no fix."""
    if config is not None or any(m.failure.startswith(("oom_", "host_oom")) for m in matches):
        return []
    hit = _pattern_hit(OOM_UNATTRIBUTED, scoped, flat)
    if "oom" not in ideas and hit is None:
        return []
    evidence = _evidence_line(hit, scoped) if hit else None
    return [_diagnosis(OOM_UNATTRIBUTED, [], evidence, "known" if hit else "meaning")]


def match_text(text: str, config: OffloadConfig | None = None) -> list[Diagnosis]:
    """Every known failure mode the text shows, most specific first (those the config rules out are left out)."""
    return match_and_exclude(text, config)[0]


# ---------------------------------------------------------------------------------------------- before / after


def _parts(config: AnyConfig) -> tuple[OffloadConfig, dict[str, Any] | None, str | None]:
    if isinstance(config, LoadedConfig):
        return config.config, config.raw, config.source
    return config, None, None


def _memory(config: AnyConfig, planner: dict[str, Any] | None = None) -> dict[str, Any]:
    """The planner's per-GPU memory estimate for a config (worst pipeline stage), host memory and step time, on
    the caller's GPU and GPU count (``planner``: diagnose's planner inputs).

    Raises:
        ValueError / KeyError: the config lacks the model sizes the estimator needs.
    """
    est = sizing.estimate(sizing.Failing(*_parts(config)), planner or {})  # `estimate`'s own path: the same GiB
    return {
        "memory_gb": est.memory_gb.model_dump(),
        "memory_gib": est.memory_gib.model_dump(),
        "host_gb": est.host_gb,
        "step_time_factor": est.step_time_factor,
        "gpu": est.gpu,
        "num_gpus": est.num_gpus,
        "unit": est.unit,
        "assumptions": est.assumptions,
    }


def _effective(config: AnyConfig) -> effective_config.Effective:
    typed, raw, source = _parts(config)
    return effective_config.resolve(typed, raw, source=source)


def compare_configs(before: AnyConfig, after: AnyConfig, planner: dict[str, Any] | None = None) -> dict[str, Any]:
    """The offload-related keys whose effective values differ, and the predicted per-GPU memory change.

    Pass :class:`LoadedConfig` objects (``sources.load``) so that keys a file does not write take the same defaults
    as in ``estimate``; a bare ``OffloadConfig`` counts every value as written. ``planner`` holds the GPU, the GPU
    count and the other planner inputs both sides are sized with (as ``estimate`` takes them).
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
    tb = mem_before.get("memory_gb", {}).get("total")
    ta = mem_after.get("memory_gb", {}).get("total")
    out["memory_gb"] = {"before": mem_before.get("memory_gb"), "after": mem_after.get("memory_gb")}
    out["memory_gib"] = {"before": mem_before["memory_gib"], "after": mem_after["memory_gib"]}
    # Which GPU and how many each side assumed (the same planner as `estimate`), and the unit of the figures.
    out["gpu"] = {"before": mem_before["gpu"], "after": mem_after["gpu"]}
    out["num_gpus"] = {"before": mem_before["num_gpus"], "after": mem_after["num_gpus"]}
    out["unit"] = mem_before["unit"]
    if tb is not None and ta is not None:
        out["memory_gb"]["delta_total"] = round(ta - tb, 3)
    out["host_gb"] = {"before": mem_before.get("host_gb"), "after": mem_after.get("host_gb")}
    out["step_time_factor"] = {"before": mem_before.get("step_time_factor"), "after": mem_after.get("step_time_factor")}
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
) -> DiagnoseReport:
    """Match an error message and/or a log excerpt against the known failure modes.

    Args:
        error: the error text (one line or a traceback).
        log: a log excerpt.
        config: the config of the failing run; narrows matches and adds the validator's findings.
        raw: the raw dict of ``config`` (for rules that read unknown keys).
        before, after: two configs around a change; adds ``comparison`` (offload diff, predicted memory). Pass them
            as ``sources.load`` results so that they are read as ``estimate`` reads the files.
        source: where ``config`` came from (``LoadedConfig.source``).
        planner: planner inputs (``diagnose_plan.input_names``: gpu, num_gpus, measured_log, ooms, ...): the
            sized fixes and the comparison use them, as ``estimate`` and ``recommend`` do.

    Returns:
        DiagnoseReport; ``matches`` is empty when nothing known matched (the notes say so).

    Raises:
        ParallelSizeError: a config with a parallel size of 0 or below (``config.parallel_sizes``).
        InputError: a planner input out of its bounds, an unknown preset, an unreadable measured log.
    """
    inputs = sizing.check_inputs(planner)
    for label, given in (("config", raw), ("before", before), ("after", after)):
        # a run that cannot start is bad input here as everywhere (estimate, recommend, apply refuse it too)
        parallel_sizes.check(given if given is None or isinstance(given, dict) else _parts(given)[1], label)
    text = "\n".join(t for t in (error, log) if t)
    typed_before = _parts(before)[0] if before is not None else None
    typed_after = _parts(after)[0] if after is not None else None
    matches, ruled = match_and_exclude(text, config or typed_after) if text else ([], [])
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
        if not text:
            smaller = _got_smaller(typed_before, typed_after)
            report.matches = match_text("out of memory", typed_after) if smaller else []
    failing = sizing.Failing(config, raw, source) if config is not None else None
    if failing is None and after is not None:
        failing = sizing.Failing(*_parts(after))
    _size(report, failing, inputs, text)
    report.needs = [*_needs(report.matches, config or typed_after), *report.needs]
    if text and not report.matches:
        report.closest = closest_modes(text)
        report.notes.append(_nothing_matched(report.closest))
        if config is None:
            report.needs = list(_NEEDS_WHEN_UNMATCHED)
    return report


def _size(report: DiagnoseReport, failing: sizing.Failing | None, inputs: dict[str, Any], text: str) -> None:
    """The sized readings' fixes from the planner (``diagnose_plan``); without a config none is guessed."""
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
    oom_line = (oom.evidence or oom.title) if oom is not None and text else None
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
    """What the matched modes ask for to decide further: only without a config, or where no fix was found."""
    by_id = {mode.id: mode for mode in (*KNOWN, OOM_UNATTRIBUTED)}
    out: list[str] = []
    for m in matches:
        mode = by_id.get(m.failure)
        if mode is not None and (config is None or not m.fix):
            out += [n for n in mode.needs if n not in out and not (config is not None and "config" in n)]
    return out


def _nothing_matched(closest: list[Closest]) -> str:
    """The note when no failure mode matched: the near ones if any, else what would help; never an empty list."""
    ask = "pass the config and the log around the first error, or run `mbridge-offload validate CONFIG`"
    if not closest:
        return f"no known offload failure matched this text, and none is close: {ask}."
    nearest = ", ".join(f"{c.failure} ({c.score:.0%} of '{c.phrasing}')" for c in closest)
    return f"no known offload failure matched; the closest failure modes are {nearest}. For a firmer answer, {ask}."


def _got_smaller(before: OffloadConfig, after: OffloadConfig) -> bool:
    """Did the change offload less than before (the usual reason a commit brings an OOM)?"""
    b, a = before, after
    less_opt = (b.optimizer.optimizer_cpu_offload and b.optimizer.optimizer_offload_fraction) > (
        a.optimizer.optimizer_cpu_offload and a.optimizer.optimizer_offload_fraction
    )
    less_act = (b.model.cpu_offloading and b.model.cpu_offloading_num_layers) > (
        a.model.cpu_offloading and a.model.cpu_offloading_num_layers
    )
    return bool(less_opt or less_act)
