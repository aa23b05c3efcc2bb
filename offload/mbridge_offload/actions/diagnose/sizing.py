"""The sized fix of an OOM, a slowdown or a host OOM: one of ``recommend``'s options for the failing config.

The catalogue says what failed; how much to offload, recompute or reshard is a sizing, and only the planner sizes.
It runs once with the caller's planner inputs and the text as the measured log (a GPU OOM in it sets ``ooms``).
A GPU OOM takes the first option that fits, a slowdown the first that is also faster, a host OOM the first that
also needs less host memory. Without a sizable config no fraction is guessed: ``needs`` says what would size it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mbridge_offload.config.errors import InputError

if TYPE_CHECKING:  # annotations only: the CLI's parser reads input_names() and stays light
    from mbridge_offload.config.schema import OffloadConfig
    from mbridge_offload.plan.inputs.resolve import Assumption
    from mbridge_offload.plan.results import Anchor, Estimate, Option

# The GPU OOM readings; their fix is always the planner's (a generic fraction can leave the run far over budget).
GPU_OOM = (
    "oom_activation_offload",
    "oom_partial_optimizer_offload",
    "oom_full_optimizer_offload",
    "oom_no_offload",
    "oom_unattributed",
)
# Readings whose fix is a sizing: with a config the planner's option replaces the catalogue's fix.
SIZED = (*GPU_OOM, "slowdown", "host_oom")
# The planner input groups diagnose takes besides the model preset and the GPU count: the run itself is the config.
_GROUPS = ("hardware", "time", "decision", "measured")
# Shorter than this relative gain is no gain: the step-time model is first-order (the planner ranks near-ties by
# risk, plan/search/risks.py).
_FASTER = 0.97

SIZING_NEED = (
    "the failing run's config (--config FILE, MCP config) and its GPU and GPU count (--gpu, --num-gpus): the fix is "
    "then the planner's ranked options for that config, sized with this text as evidence"
)

SIZES_NEED = (
    "the model's sizes, to size the fix: a model section with num_layers, hidden_size, num_attention_heads and "
    "vocab_size, or a model preset (--model NAME, MCP model)"
)


def sized_fix_text(mode_id: str) -> str | None:
    """How a sized reading's fix is found, in words (the generated failure tables); None for other modes."""
    if mode_id in GPU_OOM:
        return "with a config: the planner's first option that fits (options[]); without: none guessed (needs)"
    if mode_id == "slowdown":
        return "with a config: the planner's first option that fits and is faster; without: a lower fraction"
    if mode_id == "host_oom":
        return "with a config: the planner's first option that fits with less host memory; without: a lower fraction"
    return None


def input_names() -> tuple[str, ...]:
    """The planner inputs diagnose takes: ``model`` (fills a partial config's sizes), ``num_gpus``, and _GROUPS."""
    from mbridge_offload.plan.inputs.fields import PlanInputs, group_of

    return tuple(n for n in PlanInputs.model_fields if n in ("model", "num_gpus") or group_of(n) in _GROUPS)


def check_inputs(planner: dict[str, Any] | None) -> dict[str, Any]:
    """The given planner inputs, checked (InputError) before any config is read: a bad input is the caller's to
    fix (exit 2), whereas a config the planner cannot size still gets its diagnosis."""
    from mbridge_offload.plan.evidence.read import read_evidence
    from mbridge_offload.plan.inputs.hardware import gpu_preset
    from mbridge_offload.plan.inputs.presets import model_preset
    from mbridge_offload.plan.inputs.resolve import validate_inputs
    from mbridge_offload.plan.search.levers import parse
    from mbridge_offload.plan.time import host_profile

    given = {k: v for k, v in (planner or {}).items() if v is not None}
    unknown = sorted(set(given) - set(input_names()))
    if unknown:
        raise InputError(
            f"diagnose does not take {', '.join(unknown)}",
            "the run itself comes from the config; diagnose takes " + ", ".join(input_names()),
        )
    validate_inputs(given)
    try:
        for name, lookup in (("gpu", gpu_preset), ("model", model_preset)):
            if name in given:
                lookup(given[name])
    except KeyError as exc:
        raise InputError(str(exc).strip("'\"")) from None
    parse(given.get("levers"))
    if "measured_log" in given:  # the caller's own log must hold a figure, as for estimate and recommend
        read_evidence(given["measured_log"])
    for name in ("host_profile", "calibration"):
        if name in given:
            host_profile.load(given[name])
    return given


@dataclass
class Sizing:
    """The planner's answer for the failing run, and the fix each sized reading takes from it."""

    options: list[Option] = field(default_factory=list)
    assumptions: list[Assumption] = field(default_factory=list)
    calibration: Anchor | None = None
    fixes: dict[str, list[str]] = field(default_factory=dict)  # reading -> the overrides of its option
    notes: list[str] = field(default_factory=list)
    needs: list[str] = field(default_factory=list)


@dataclass
class Failing:
    """The failing run's config as the planner reads it (the same reading as ``estimate``)."""

    config: OffloadConfig
    raw: dict[str, Any] | None
    source: str | None


def _evidence(planner: dict[str, Any], text: str, oom_line: str | None) -> tuple[dict[str, Any], list[Assumption]]:
    from mbridge_offload.plan.evidence.read import parse_log
    from mbridge_offload.plan.inputs.resolve import Assumption

    flags: dict[str, Any] = dict(planner)
    said: list[Assumption] = []
    if text.strip() and flags.get("measured_log") is None and not parse_log(text).empty:
        # Only text that holds a figure (an OOM's sizes, a memory report, step times) is evidence; a trailing newline
        # keeps one line of it from being read as a file name (measured_log takes both).
        flags["measured_log"] = text.rstrip("\n") + "\n"
        said.append(
            Assumption(
                name="measured_log",
                value="the error/log text given to diagnose",
                source="diagnose text",
                note="read as the planner's measured log: its memory report, OOM message and step times anchor "
                "the sizing",
            )
        )
    if oom_line is not None and flags.get("ooms") is None:
        flags["ooms"] = True
        said.append(
            Assumption(
                name="ooms",
                value=True,
                source="diagnose text",
                note=f"these settings ran out of GPU memory: {oom_line[:200]}",
            )
        )
    return flags, said


def _merge(planner_said: list[Assumption], ours: list[Assumption]) -> list[Assumption]:
    mine = {a.name for a in ours}
    return [a for a in planner_said if a.name not in mine] + ours


def _faster(o: Option, given: Estimate) -> bool:
    return o.step_time_s < given.time_s.step * _FASTER


def _pick(reading: str, options: list[Option], given: Estimate | None) -> Option | None:
    fitting = [o for o in options if o.fits and o.changes]
    if reading == "slowdown" and given is not None:
        fitting = [o for o in fitting if _faster(o, given)]
    if reading == "host_oom" and given is not None:
        fitting = [o for o in fitting if o.host_gb < given.host_peak_gb]
    return next((o for o in fitting if not o.alternative), fitting[0] if fitting else None)


def _why_none(reading: str, given: Estimate | None) -> str:
    if reading == "slowdown" and given is not None:
        return f"no setting the planner considers is faster than the config as given ({given.time_s.step:.2f} s)"
    if reading == "host_oom" and given is not None:
        return f"no setting that fits needs less host memory than the config as given ({given.host_peak_gb:.0f} GB)"
    return "no setting the planner considers fits"


def size(readings: list[str], failing: Failing, planner: dict[str, Any], text: str, oom_line: str | None) -> Sizing:
    """Run the planner once for the failing config and give each sized reading its option (:data:`SIZED`)."""
    from mbridge_offload.plan.service import estimate_for_inputs, recommend_for_inputs

    out = Sizing()
    flags, said = _evidence(planner, text, oom_line)
    try:
        rec = recommend_for_inputs(failing.config, failing.raw, failing.source, **flags)
        given = None
        predicted = oom_line is None and bool(set(GPU_OOM) & set(readings))  # no OOM reported: is there one?
        if predicted or {"slowdown", "host_oom"} & set(readings):  # the run as given, on the same evidence
            given = estimate_for_inputs(failing.config, failing.raw, failing.source, **flags)
    except (InputError, ValueError, KeyError) as exc:  # the config cannot be sized (no model sizes, a bad layout)
        out.notes.append(f"the fix cannot be sized: {str(exc).strip(chr(39))}")
        out.needs.append(SIZES_NEED)
        # No OOM fix is guessed; a slowdown's or host OOM's catalogue step (less offload) stays, unsized.
        out.fixes = {r: [] for r in readings if r in GPU_OOM}
        return out
    out.options, out.calibration = list(rec.options), rec.calibration
    out.assumptions = _merge(rec.assumptions, said)
    where = f"{rec.num_gpus} x {rec.gpu}"
    for reading in readings:
        if predicted and reading in GPU_OOM and given is not None and given.fits:
            out.fixes[reading] = []
            out.notes.append(
                f"{reading}: the planner predicts the config as given fits on {where} ({given.memory_gib.total:.1f} "
                f"GiB of {given.budget_gib:.1f} GiB allocatable): nothing to change for memory"
            )
            continue
        chosen = _pick(reading, out.options, given)
        out.fixes[reading] = list(chosen.overrides) if chosen is not None else []
        if chosen is None:
            out.notes.append(f"{reading}: {_why_none(reading, given)} on {where}")
            if reading in GPU_OOM:
                hints = [f"what would fit: {s}" for s in rec.suggestions]
                out.notes += [h for h in hints if h not in out.notes]
        else:
            out.notes.append(
                f"{reading}: the fix is the planner's option {chosen.rank} on {where} ({chosen.why}); options[] "
                "lists every way it found, ranked (apply CONFIG --option N with the same inputs writes option N)"
            )
    return out


def estimate(failing: Failing, planner: dict[str, Any]) -> Estimate:
    """``estimate`` with the caller's inputs minus the evidence (before/after predict, not anchor)."""
    from mbridge_offload.plan.service import estimate_for_inputs

    evidence = ("measured_log", "measured_peak_gib", "measured_step_s", "ooms")  # of the failing run, not these
    flags = {k: v for k, v in planner.items() if k not in evidence}
    return estimate_for_inputs(failing.config, failing.raw, failing.source, **flags)
