"""The points of a picture, from the planner's one entry point (``plan.service.plan``): nothing is modelled here."""

from __future__ import annotations

from typing import Any

from mbridge_offload.config.errors import InputError
from mbridge_offload.config.schema import OffloadConfig
from mbridge_offload.plan.inputs.fields import flag_name
from mbridge_offload.plan.inputs.resolve import Assumption
from mbridge_offload.plan.results import Estimate, Recommendation, StageGib
from mbridge_offload.plan.service import Kind as PlanKind
from mbridge_offload.plan.service import plan
from mbridge_offload_tools.plot import sweep as sweeps
from mbridge_offload_tools.plot.result import (
    KINDS,
    MIME_TYPES,
    OptionPoint,
    PhasePoint,
    PlotResult,
    SweepPoint,
)


class Source:
    """A loaded config (or none) and the planner inputs given beside it: what every planner call of a picture reads."""

    def __init__(
        self,
        flags: dict[str, Any],
        config: OffloadConfig | None = None,
        raw: dict[str, Any] | None = None,
        source: str | None = None,
    ) -> None:
        self.flags, self.config, self.raw, self.source = flags, config, raw, source

    def plan(self, kind: PlanKind, at: dict[str, Any] | None = None, where: str = "") -> Any:
        """``plan(kind, ...)`` with ``at`` over the given inputs; the planner's refusals as one input error."""
        try:
            # ``at`` asks for another run than the one a measured log describes: the log moves with it
            return plan(kind, self.flags, self.config, self.raw, self.source, asked=at)
        except (KeyError, ValueError) as exc:  # an unknown preset, a setup Megatron rejects, a bound
            raise InputError(where + str(exc).strip("'\"")) from None


def _setting(est: Estimate) -> str:
    p = est.parallel
    layout = f"TP{p['tp']} PP{p['pp']}" + (f" VPP{p['vpp']}" if p.get("vpp") else "") + f" CP{p['cp']}"
    layout += f" EP{p['ep']}" if p.get("ep", 1) > 1 else ""
    return f"{est.model} on {est.num_gpus} x {est.gpu} ({layout}, DP{p['dp']})"


def _sweep_point(value: int | float, est: Estimate) -> SweepPoint:
    """``estimate``'s answer at ``value``: the same numbers."""
    same = est.model_dump(include={"memory_gib", "memory_gb", "worst_stage", "step_time_factor", "fits"})
    same |= est.model_dump(include={"budget_gib", "host_gb"})
    stages = [StageGib.model_validate(s, from_attributes=True) for s in est.stages]
    return SweepPoint(value=value, stages_gib=stages, step_time_s=est.time_s.step, **same)


def _base(est: Estimate | Recommendation, model: str, kind: str, title: str, fmt: str, **fields: Any) -> PlotResult:
    return PlotResult(
        kind=kind,
        title=title,
        model=model,
        gpu=est.gpu,
        num_gpus=est.num_gpus,
        format=fmt,
        mime_type=MIME_TYPES[fmt],
        assumptions=list(est.assumptions),
        effective=dict(est.effective),
        **fields,
    )


def sweep_result(src: Source, spec: str, fmt: str) -> PlotResult:
    """Peak memory per stage and step time at each value of one input: ``estimate`` at every point."""
    key, values = sweeps.parse(spec)
    if src.flags.get(key) is not None:
        raise InputError(
            f"the sweep varies {key}, which is also given ({flag_name(key)} {src.flags[key]})",
            f"drop {flag_name(key)}: the sweep sets it at each point",
        )
    answers = [src.plan("estimate", {key: v}, where=f"sweep {key}={v}: ") for v in values]
    first = answers[0]
    result = _base(
        first,
        first.model,
        "sweep",
        f"{_setting(first)}: {key}",
        fmt,
        sweep_key=key,
        budget_gib=first.budget_gib,
        points=[_sweep_point(v, e) for v, e in zip(values, answers, strict=True)],
    )
    # The swept input is no single value: its assumption says what it took.
    result.assumptions = [a for a in result.assumptions if a.name != key]
    result.assumptions.append(Assumption(name=key, value=values, source="sweep", note="one estimate per value"))
    return result


def phases_picture(est: Estimate, fmt: str) -> PlotResult:
    """The picture of ``est``'s phases: one point per phase and stage, the stage's peak phase marked."""
    points = [
        PhasePoint(
            stage=sp.stage,
            phase=ph.name,
            memory_gib=ph.memory_gib,
            memory_gb=ph.memory_gb,
            what=ph.what,
            peak=ph.name == sp.peak_phase,
        )
        for sp in est.phases
        for ph in sp.phases
    ]
    if not points:
        raise InputError(
            "this estimate carries no phases (estimate's phases is empty): nothing to draw",
            "plot --kind sweep or --kind options instead",
        )
    title = f"{_setting(est)}: phases of one step" + (f", peak in {est.peak_phase}" if est.peak_phase else "")
    return _base(
        est, est.model, "phases", title, fmt, budget_gib=est.budget_gib, points=points, peak_phase=est.peak_phase
    )


def option_point(o: Any) -> OptionPoint:
    """One of ``recommend``'s options as a point (the same numbers; ``memory_gib`` its total)."""
    return OptionPoint(**{**o.model_dump(include=set(OptionPoint.model_fields)), "memory_gib": o.memory_gib.total})


def options_result(src: Source, fmt: str) -> PlotResult:
    """``recommend``'s ranked options beside the config as given (its ``estimate``)."""
    rec: Recommendation = src.plan("recommend")
    given: Estimate = src.plan("estimate")
    result = _base(
        rec,
        given.model,
        "options",
        f"{_setting(given)}: recommend's options (mode {rec.mode})",
        fmt,
        budget_gib=rec.budget_gib,
        given_gib=rec.memory_gib.before.total,
        given_step_s=given.time_s.step,
        points=[option_point(o) for o in rec.options],
    )
    if not rec.options:
        result.notes.append("recommend offers no option for this run: only the config as given is drawn")
    return result


def compute(kind: str, src: Source, sweep: str | None, fmt: str) -> PlotResult:
    """The points of picture ``kind`` (no image yet)."""
    if kind not in KINDS:
        raise InputError(f"kind {kind!r} is not one of {', '.join(KINDS)}", "draw a sweep, the phases or the options")
    if kind == "sweep":
        if not sweep:
            raise InputError("kind sweep needs a sweep (CLI --sweep, MCP sweep)", f"pass {sweeps.SYNTAX}")
        return sweep_result(src, sweep, fmt)
    if sweep:
        raise InputError(f"a sweep is for kind sweep, not {kind}", "drop the sweep, or ask for kind sweep")
    return phases_picture(src.plan("estimate"), fmt) if kind == "phases" else options_result(src, fmt)
