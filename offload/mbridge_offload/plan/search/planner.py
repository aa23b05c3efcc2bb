"""The planner: the skill's decision table made executable, then a search for the smallest offload that fits.

Decision table (NVIDIA skill ``nemo-mbridge-perf-cpu-offloading``, "Quick Decision"):

- the run already fits → no offload (offloading always adds step time);
- activation offload is possible only with PP = 1, no activation recompute, CUDA graphs off (or
  ``full_iteration``) and no fine-grained activation offloading — the upstream checks; otherwise optimizer offload;
- activations dominate and activation offload is possible → activation offload, smallest layer count that fits;
- otherwise → optimizer offload, the smallest fraction (on a 0.05 grid, realised by HybridDeviceOptimizer's greedy
  whole-tensor split) that brings the worst pipeline stage under the budget; both when neither alone suffices;
- nothing fits → say what would: more PP, full recompute, more GPUs, each with its predicted memory.

"Fits" compares the predicted peak *allocated* memory, grown by the caching allocator's overhead, with what the
device exposes minus the CUDA context and the margin. A measurement from the user's own run (peak, step time, or
"it ran out of memory") anchors the predictions (``anchor.py``). Results are pydantic models (``results.py``) used
by the library, the CLI's JSON and the MCP tools alike. Never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from mbridge_offload.plan.inputs.resolve import Assumption, Resolved
from mbridge_offload.plan.memory.stage import MFSDP_OPTIMIZER_OFFLOAD, MemoryEstimate, StageMemory, estimate_memory
from mbridge_offload.plan.model.architecture import GB, GiB
from mbridge_offload.plan.model.run import Setup
from mbridge_offload.plan.results import (
    BeforeAfter,
    Estimate,
    Option,
    Phase,
    Recommendation,
    StagePhases,
    StageTotal,
    TimeBreakdown,
)
from mbridge_offload.plan.search import advice, levers, options
from mbridge_offload.plan.search import fine_grained_plan as fg
from mbridge_offload.plan.search.anchor import Plan, prepare
from mbridge_offload.plan.time.step import TimeEstimate, estimate_time

FRACTION_STEP = options.FRACTION_STEP
__all__ = [
    "FRACTION_STEP",
    "estimate",
    "estimate_result",
    "recommend",
]


# ------------------------------------------------------------------------------------------- estimate


def _parallel(r: Resolved) -> dict[str, Any]:
    m, s = r.model, r.setup
    return {
        "num_gpus": s.num_gpus,
        "tp": s.tp,
        "pp": s.pp,
        "vpp": s.vpp,
        "cp": s.cp,
        "ep": s.ep,
        "etp": s.resolved_etp(m),
        "dp": s.dp,
        "expert_dp": s.expert_dp(m) if m.is_moe else None,
        "sequence_parallel": s.sp,
        "distributed_optimizer": s.use_distributed_optimizer,
        "precision_aware_optimizer": s.use_precision_aware_optimizer,
    }


def time_terms(t: TimeEstimate) -> dict[str, Any]:
    """The step-time model's terms of ``TimeBreakdown`` (seconds, rounded)."""
    names = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "moe_overhead", "dp_comm", "bubble")
    out: dict[str, Any] = {k: round(getattr(t, f"{k}_s"), 4) for k in names}
    out.update(step=round(t.step_s, 4), without_offload=round(t.without_offload_s, 4))
    return {**out, "efficiency": round(t.efficiency, 4), "assumptions": list(t.assumptions)}


def stage_phases(est: MemoryEstimate, shift: Callable[[StageMemory], float] | float = 0.0) -> list[StagePhases]:
    """Every stage's phases (``plan/memory/phases.py``) in GiB and GB; ``shift`` (a calibration: bytes, or bytes per
    stage, ``Plan.shift``) is in each phase's total, as in the breakdowns, so the worst stage's peak phase equals
    ``memory_gib.total``."""
    return [
        StagePhases(
            stage=st.stage,
            phases=[
                Phase(
                    name=ph.name,
                    memory_gib=round((ph.total + offset) / GiB, 3),
                    memory_gb=round((ph.total + offset) / GB, 3),
                    what=ph.what,
                )
                for ph in st.phases
            ],
            peak_phase=st.peak_phase,
        )
        for st in est.stages
        for offset in [shift(st) if callable(shift) else shift]
    ]


def estimate_result(p: Plan, est: MemoryEstimate, t: TimeEstimate) -> Estimate:
    """The ``Estimate`` of one memory and time estimate under the plan's yardstick."""
    r, s = p.r, est.setup
    return Estimate(
        memory_gb=p.breakdown(est),
        memory_gib=p.breakdown(est, gib=True),
        host_gb=round(est.host_gb, 3),
        offloaded_fraction=round(est.offloaded_fraction, 4),
        step_time_factor=round(t.step_time_factor, 3),
        step_time_factor_vs_no_levers=round(t.step_time_factor_vs_no_levers, 3),
        fits=p.fits(est),  # the verdict on this config: no margin, so its budget is the allocatable peak
        budget_gb=round(p.usable_bytes / GB, 3),
        budget_gib=round(p.usable_bytes / GiB, 3),
        gpu_memory_gb=round(r.gpu.capacity_bytes / GB, 3),
        gpu_memory_gib=round(r.gpu.capacity_bytes / GiB, 3),
        worst_stage=est.worst.stage,
        stages=[
            StageTotal(
                stage=st.stage,
                total_gb=round(st.total / GB, 3),
                params=st.params,
                total_gib=round((st.total + p.shift(st)) / GiB, 3),
                peak_phase=st.peak_phase,
            )
            for st in est.stages
        ],
        host_peak_gb=round(est.host_peak_gb, 3),
        time_s=TimeBreakdown(
            baseline=round(t.baseline_s, 4),
            d2h=round(t.d2h_s, 4),
            cpu_adam=round(t.cpu_adam_s, 4),
            h2d=round(t.h2d_s, 4),
            optimizer_extra=round(t.optimizer_extra_s, 4),
            activation_extra=round(t.activation_extra_s, 4),
            **time_terms(t),
        ),
        model=r.model.name,
        gpu=r.gpu.name,
        num_gpus=s.num_gpus,
        parallel=_parallel(r),
        optimizer_offload_fraction=s.optimizer_offload_fraction,
        activation_offload_layers=s.activation_offload_layers,
        offload_modules=list(s.offload_modules),
        warnings=est.warnings + t.notes + ([edge] if (edge := p.edge_note(est)) else []),
        notes=p.notes(),
        assumptions=p.assumptions,
        calibration=p.anchor,
        phases=stage_phases(est, p.shift),
        peak_phase=est.worst.peak_phase,
    )


def estimate(r: Resolved) -> Estimate:
    """Per-GPU memory (worst stage), host memory and step time of the resolved settings as given.

    Raises:
        ValueError: a setup Megatron rejects.
    """
    p = prepare(r)
    est = estimate_memory(r.model, r.setup, r.gpu.host_ram_gb)
    t = estimate_time(est, r.gpu, overlap=r.overlap, **p.time_kwargs)
    result = estimate_result(p, est, t)
    if p.ooms:  # the ooms input, or an out-of-memory message in the measured log
        result.notes.append(_what_would_fit(p))
    return result


def _what_would_fit(p: Plan) -> str:
    """After a reported OOM: the smallest optimizer offload fraction that fits with the anchored memory."""
    found = _smallest_fraction(p, replace(p.r.setup, optimizer_offload_fraction=0.0))
    if found is None:
        return "no optimizer offload fraction fits with that; `recommend` says what would (more PP, recompute, GPUs)"
    return (
        f"with that, optimizer_offload_fraction={found.setup.optimizer_offload_fraction:g} would fit "
        f"({p.total_gib(found):.1f} GiB of {p.budget_bytes / GiB:.1f} GiB allocatable)"
    )


# ------------------------------------------------------------------------------------------- search


def _first_fit(p: Plan, setups: list[Setup]) -> MemoryEstimate | None:
    """The first of ``setups`` (ordered by growing offload) that fits with the margin, that the node's host RAM
    holds and that the rule catalogue accepts (``options.first_fit``: a binary search)."""
    return options.first_fit(p, setups, p.keeps_margin)


def _smallest_fraction(p: Plan, s: Setup) -> MemoryEstimate | None:
    steps = round(1 / FRACTION_STEP)
    return _first_fit(
        p, [replace(s, optimizer_offload_fraction=round(i * FRACTION_STEP, 2)) for i in range(1, steps + 1)]
    )


def _smallest_layers(p: Plan, s: Setup) -> MemoryEstimate | None:
    return _first_fit(p, [replace(s, activation_offload_layers=k) for k in range(1, p.r.model.num_layers)])


def _order(p: Plan, before: MemoryEstimate, rationale: list[str]) -> tuple[str, ...]:
    """Which mechanism to try first (the skill's table), given what upstream allows."""
    blockers = p.r.constraints.activation_blockers(before.setup, p.r.model.num_layers)
    rationale.extend(blockers)
    w = before.worst
    if before.setup.use_megatron_fsdp:  # upstream refuses optimizer offload under Megatron-FSDP: never proposed
        rationale.append(MFSDP_OPTIMIZER_OFFLOAD.replace("; the numbers here ignore the requested fraction", ""))
        if not blockers:
            return ("activation",)
        return (fg.MODE,) if fg.useful_sets(p.r.model, before.setup, p.r.constraints.model_config()) else ()
    if blockers:
        if not fg.useful_sets(p.r.model, before.setup, p.r.constraints.model_config()):
            return ("optimizer",)
        if w.activations > w.optimizer:
            rationale.append(
                f"activations ({w.activations / GB:.1f} GB) dominate the optimizer state ({w.optimizer / GB:.1f} GB) "
                "and layer-level offload is refused or does nothing here: fine-grained activation offloading first "
                "(works with PP > 1, recompute and TE CUDA graphs)"
            )
            return (fg.MODE, "optimizer")
        return ("optimizer", fg.MODE)
    if w.activations > w.optimizer:
        rationale.append(
            f"activations ({w.activations / GB:.1f} GB) dominate the optimizer state "
            f"({w.optimizer / GB:.1f} GB) and PP=1: activation offloading first"
        )
        return ("activation", "optimizer")
    rationale.append(
        f"optimizer state ({w.optimizer / GB:.1f} GB) dominates activations ({w.activations / GB:.1f} GB): "
        "optimizer offloading first"
    )
    return ("optimizer", "activation")


def _most_layers(p: Plan, s: Setup) -> int:
    """The most layers whose activations the rule catalogue lets us offload without an error or a new warning
    (TE warns at num_layers − 1: nothing left to overlap with)."""
    for k in range(p.r.model.num_layers - 1, 0, -1):
        candidate = replace(s, activation_offload_layers=k)
        if p.vet is None or p.vet.clean(candidate):
            return k
        p.vet.rejected.setdefault(f"activation, {k} layers", p.vet.problems(candidate))
    return 0


def _search(p: Plan, base: Setup, order: tuple[str, ...]) -> tuple[str, MemoryEstimate | None]:
    m, cfg = p.r.model, p.r.constraints.model_config()
    for mode in order:
        if mode == fg.MODE:
            found = fg.smallest(m, base, cfg, lambda setups: _first_fit(p, setups))
        else:
            found = (_smallest_layers if mode == "activation" else _smallest_fraction)(p, base)
        if found is not None:
            return mode, found
    most = fg.largest(m, base, cfg) if fg.MODE in order and "optimizer" in order else None
    if most is not None:  # the most fine-grained offload allowed, then the smallest fraction on top
        found = _smallest_fraction(p, most)
        if found is not None:  # then the fewest modules at that fraction
            at = replace(base, optimizer_offload_fraction=found.setup.optimizer_offload_fraction)
            found = fg.smallest(m, at, cfg, lambda setups: _first_fit(p, setups)) or found
        return fg.MODE_WITH_OPTIMIZER, found
    if "activation" in order and "optimizer" in order:
        # Both: the most activation offload allowed, the smallest fraction, then back off the layers.
        found = _smallest_fraction(p, replace(base, activation_offload_layers=_most_layers(p, base)))
        if found is not None:
            with_fraction = replace(base, optimizer_offload_fraction=found.setup.optimizer_offload_fraction)
            return "both", _smallest_layers(p, with_fraction) or found
    if "optimizer" not in order:
        return ("activation" if order else "none"), None
    return ("both" if "activation" in order else "optimizer"), None


def _suggest(p: Plan, s: Setup) -> list[str]:
    """What would make the run fit, each with its predicted worst-stage memory."""
    m, out = p.r.model, []
    fraction = 0.0 if s.use_megatron_fsdp else 1.0  # no optimizer offload under Megatron-FSDP
    full = replace(s, optimizer_offload_fraction=fraction, activation_offload_layers=0)
    with_opt = "" if s.use_megatron_fsdp else " with optimizer offload fraction 1.0"
    pp = s.pp * 2
    while pp <= m.num_layers and s.num_gpus % (s.tp * pp * s.cp) == 0:
        try:
            est = estimate_memory(m, replace(full, pp=pp, vpp=None))
        except ValueError:
            break
        if p.keeps_margin(est):
            out.append(f"PP={pp}{with_opt}: {p.total_gib(est):.1f} GiB per GPU")
            break
        pp *= 2
    if s.recompute_granularity != "full":
        recompute = replace(full, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        est = estimate_memory(m, recompute)
        verdict = "fits" if p.keeps_margin(est) else "still does not fit"
        out.append(
            f"model.recompute_granularity=full (uniform, 1 layer){with_opt}: "
            f"{p.total_gib(est):.1f} GiB per GPU, {verdict}"
        )
    for mult in (2, 4, 8, 16):
        try:
            est = estimate_memory(m, replace(s, num_gpus=s.num_gpus * mult))
        except ValueError:
            continue
        if p.keeps_margin(est):
            out.append(f"{s.num_gpus * mult} GPUs (DP ×{mult}) without offload: {p.total_gib(est):.1f} GiB per GPU")
            break
    else:
        out.append("more GPUs alone do not help: weights, gradients and activations are not sharded by DP")
    return out


# ------------------------------------------------------------------------------------------- recommend


def _explain(
    p: Plan, before: MemoryEstimate, after: MemoryEstimate, t: TimeEstimate, mode: str, as_given_s: float
) -> list[str]:
    w, s, out = before.worst, after.setup, []
    if s.optimizer_offload_fraction:
        out.append(
            f"optimizer offload fraction {s.optimizer_offload_fraction:g} puts {after.offloaded_fraction:.1%} of "
            f"the optimizer shards on the CPU (HDO splits whole tensors): saves "
            f"{(w.optimizer - after.worst.optimizer) / GiB:.1f} GiB; CPU AdamW {t.cpu_adam_s:.2f} s, copies "
            f"{t.d2h_s:.2f} s each way per step"
        )
    if s.activation_offload_layers:
        out.append(
            f"offloading {s.activation_offload_layers} of {p.r.model.num_layers} layers' activations saves "
            f"{(w.activations - after.worst.activations) / GiB:.1f} GiB"
        )
    if s.offload_modules:
        out.append(
            f"fine-grained offloading of {', '.join(s.offload_modules)} saves "
            f"{(w.activations - after.worst.activations) / GiB:.1f} GiB of activations on the worst stage "
            f"(ours, simulated from megatron-core 0.19.2's offload points); {after.host_gb:.1f} GB pinned host memory"
        )
    if mode != "none":
        out.append(
            f"predicted step time {t.step_s:.2f} s: ×{t.step_s / as_given_s:.2f} of the config as given "
            f"({as_given_s:.2f} s), ×{t.step_time_factor_vs_no_levers:.2f} of the run with no lever "
            f"({t.baseline_s:.2f} s)"
        )
        out.extend(t.notes)
    return out + after.warnings


def recommend(r: Resolved) -> Recommendation:
    """Pick the smallest offload that brings the worst pipeline stage under the usable GPU memory.

    Args:
        r: resolved inputs (``resolve``); their offload settings are the measured point, not the start.

    Returns:
        mode (none, optimizer, activation, both), overrides, memory before/after (GB and GiB), fits, step-time
        factor, rationale, assumptions.

    Raises:
        ValueError: a setup Megatron rejects.

    Example:
        >>> rec = recommend(resolve({"model": "qwen3-30b-a3b", "gpu": "h100-80gb"}))
        >>> rec.mode
        'none'
    """
    p = prepare(r)
    base = replace(r.setup, optimizer_offload_fraction=0.0, activation_offload_layers=0, offload_modules=())
    allowed, explicit = levers.parse(r.inputs.levers)
    if explicit:
        levers.check_usable(allowed, r, base)
    p.vet = advice.Vetter(r.raw_config, r.model.num_layers, r.constraints.model_keys(), source=r.source, base=base)
    before = estimate_memory(r.model, base, r.gpu.host_ram_gb)
    rationale = [p.budget_sentence(before), *p.notes()]
    given = _as_given(r, before, rationale)
    given_t = estimate_time(given, r.gpu, overlap=r.overlap, **p.time_kwargs)
    as_given_s = given_t.step_s  # every step_time_factor of this answer divides by it: 1.0 = the config as given
    mode, after, suggestions, found = _offload_search(p, base, before, rationale, allowed)
    ranked, top = _ranked(p, base, before, after, found, allowed, as_given_s)
    if top is not None and top[0].est.setup != after.setup:
        after, mode, suggestions = top[0].est, advice.mode_of(top[0].est.setup), []
    rationale += [f"not proposed ({m}): {'; '.join(why)}" for m, why in p.vet.rejected.items()]
    rationale += [f"not offered ({m}): {why}" for m, why in p.host_refused.items()]
    overlap = _overlap(r, after.setup)
    t = estimate_time(after, r.gpu, overlap=overlap and mode != "none", **p.time_kwargs)
    rationale += _explain(p, before, after, t, mode, as_given_s) + _verdict(base, [o for _, o in ranked], allowed)
    pulled = top is not None and bool(set(top[1].levers) - _OFFLOADS)
    sentence = advice.advice_sentence(
        r.setup, mode, given_t.step_time_factor if given is not before else None, top[1].why if top and pulled else None
    )
    return Recommendation(
        mode=mode,
        overrides=options.overrides_for(r.setup, base, after.setup, overlap),
        memory_gb=_before_after(p, given, after, before, gib=False),
        memory_gib=_before_after(p, given, after, before, gib=True),
        fits=p.fits(after),
        **_factors(top[1] if top is not None and pulled else None, t, as_given_s),
        rationale=rationale + ([sentence] if sentence else []),
        budget_gb=round(p.budget_bytes / GB, 3),
        budget_gib=round(p.budget_bytes / GiB, 3),
        optimizer_offload_fraction=after.setup.optimizer_offload_fraction,
        offloaded_fraction=round(after.offloaded_fraction, 4),
        activation_offload_layers=after.setup.activation_offload_layers,
        offload_modules=list(after.setup.offload_modules),
        host_gb=round(after.host_gb, 3),
        host_peak_gb=round(after.host_peak_gb, 3),
        suggestions=suggestions,
        warnings=after.warnings,
        assumptions=p.assumptions + _host_assumptions(p),
        calibration=p.anchor,
        gpu=r.gpu.name,
        num_gpus=r.setup.num_gpus,
        given_mode=advice.mode_of(r.setup),
        advice=sentence,
        fallback=advice.fallback(p, before, _overlap, FRACTION_STEP, as_given_s)
        if mode == "none" and not pulled
        else None,
        options=[o for _, o in ranked],
        levers=list(allowed),
        headroom_gib=round(options.headroom_gib(p), 3),
        phases=stage_phases(after, p.shift),
        peak_phase=after.worst.peak_phase,
    )


def _ranked(
    p: Plan,
    base: Setup,
    before: MemoryEstimate,
    after: MemoryEstimate,
    found: bool,
    allowed: tuple[str, ...],
    as_given_s: float,
) -> tuple[list[tuple[options.Candidate, Option]], tuple[options.Candidate, Option] | None]:
    """The ranked options and the first one when it is allowed and fits. Option 0 is the recommendation, also when
    it does not fit: then the decision table's most offload leads."""
    found_options = options.candidates(p, base, before, after if found else None)
    ranked = options.rank(p, base, found_options, allowed, _overlap, as_given_s)
    top = ranked[0] if ranked and ranked[0][1].fits and not ranked[0][1].alternative else None
    if top is None and not found:
        ranked = options.rank(
            p, base, [*found_options, options.most_offload(base, after)], allowed, _overlap, as_given_s
        )
    return ranked, top


def _before_after(
    p: Plan, given: MemoryEstimate, after: MemoryEstimate, before: MemoryEstimate, gib: bool
) -> BeforeAfter:
    """The config as given, the recommendation, and the config without any offload, in GB or GiB."""
    return BeforeAfter(
        before=p.breakdown(given, gib=gib),
        after=p.breakdown(after, gib=gib),
        without_offload=p.breakdown(before, gib=gib),
    )


def _factors(option: Option | None, t: TimeEstimate, as_given_s: float) -> dict[str, float]:
    """The recommendation's step-time factors: over the config as given (the card's definition, as every option's),
    and over the run with no lever; an option that pulls recompute or a layout lever carries its own."""
    if option is not None:
        return {
            "step_time_factor": option.step_time_factor,
            "step_time_factor_vs_no_levers": option.step_time_factor_vs_no_levers,
        }
    return {
        "step_time_factor": round(t.step_s / as_given_s, 3),
        "step_time_factor_vs_no_levers": round(t.step_time_factor_vs_no_levers, 3),
    }


_MODE_LEVER = {"optimizer": "optimizer", "activation": "activation", fg.MODE: "fine-grained"}


def _offload_search(
    p: Plan, base: Setup, before: MemoryEstimate, rationale: list[str], allowed: tuple[str, ...]
) -> tuple[str, MemoryEstimate, list[str], bool]:
    """The skill's decision table over the offloads the caller allows: (mode, the estimate with it, what would fit
    otherwise, whether it fits)."""
    r = p.r
    if p.keeps_margin(before):
        rationale.append("it fits: offloading only adds step time, so none is recommended")
        return "none", before, [], True
    if p.fits(before):
        rationale.append(
            f"it fits the device, but with less than the {p.margin:.0%} margin free: the offload below keeps it"
        )
    order = tuple(mode for mode in _order(p, before, rationale) if _MODE_LEVER[mode] in allowed)
    if not order:
        return "none", before, _suggest(p, base), False
    mode, found = _search(p, base, order)
    if found is not None:
        return mode, found, [], True
    most = _most_layers(p, base) if mode in ("both", "activation") else 0
    fraction = 0.0 if base.use_megatron_fsdp else 1.0
    after = estimate_memory(r.model, replace(base, optimizer_offload_fraction=fraction, activation_offload_layers=most))
    if mode == fg.MODE_WITH_OPTIMIZER:
        widest = fg.largest(r.model, base, r.constraints.model_config())
        after = estimate_memory(r.model, replace(widest or base, optimizer_offload_fraction=1.0))
    rationale.append(f"even the most offload allowed leaves {p.total_gib(after):.1f} GiB: no offload alone fits")
    return mode, after, _suggest(p, base), False


_OFFLOADS = {"activation", "optimizer", "fine-grained"}


def _verdict(base: Setup, ranked: list[Option], allowed: tuple[str, ...]) -> list[str]:
    """The ranking in words: what the first option is, and when no offload or recompute is the better answer."""
    if not ranked:
        return ["no option fits: none of the levers (" + ", ".join(levers.LEVERS) + ") alone makes it fit"]
    first = ranked[0]
    if not first.fits or first.alternative:
        best = next((o for o in ranked if o.fits), None)
        if best is None:
            return [f"no option fits: none of the allowed levers ({', '.join(allowed)}) and no alternative"]
        return [
            f"none of the allowed levers ({', '.join(allowed)}) fits; the best alternative: {best.why} "
            f"(option {best.rank}, pulls {', '.join(best.levers)}: allow it with --levers)"
        ]
    out = [f"option 0 of {len(ranked)} (fastest that fits): {first.why}"]
    if not first.levers:
        out.append("no offload is the better answer: the run fits as it is, and every lever costs step time")
    elif "recompute" in first.levers and not _OFFLOADS & set(first.levers):
        offload = next((o for o in ranked if o.fits and not o.alternative and set(o.levers) <= _OFFLOADS), None)
        than = f" (the fastest offload: ×{offload.step_time_factor:.2f})" if offload else ""
        out.append(f"recompute is the better answer here: ×{first.step_time_factor:.2f}{than}")
    comfortable = next((o for o in ranked if o.comfortable and not o.alternative), None)
    if comfortable is not None and comfortable.rank != first.rank:
        out.append(f"with more headroom (option {comfortable.rank}): {comfortable.why}")
    return out


def _host_assumptions(p: Plan) -> list[Assumption]:
    """The share of the node's host RAM offload may take (the node's RAM and GPUs: ``anchor.prepare``)."""
    from mbridge_offload.plan.inputs.hardware import PINNED_HOST_SHARE

    return [
        Assumption(
            name="pinned_host_share",
            value=PINNED_HOST_SHARE,
            source="default",
            note="share of a node's host RAM the offload buffers of all its GPUs may take (assumption: the largest "
            "share a published recipe runs with, Bridge 0.6.2 Llama 3 70B GB200 FP8 at 70.5 %, rounded up); the rest "
            "is the OS, page cache, data loader, NCCL/CUDA host buffers and checkpoint staging; offload beyond it is "
            "never offered",
        ),
    ]


def _as_given(r: Resolved, without: MemoryEstimate, rationale: list[str]) -> MemoryEstimate:
    """The estimate of the config as given, its offload included (``before``); the one without if Megatron
    would reject that offload."""
    if r.setup == without.setup:
        return without
    try:
        return estimate_memory(r.model, r.setup, r.gpu.host_ram_gb)
    except ValueError as exc:
        rationale.append(f"the offload of the config as given is rejected ({exc}): 'before' is without it")
        return without


def _overlap(r: Resolved, s: Setup) -> bool:
    """``overlap_cpu_optimizer_d2h_h2d`` for a proposal: one rule with ``apply`` and OPT-OVERLAP: on from
    OPT-OVERLAP's threshold (``overlap_advised``: fraction >= 0.75) whatever the config says, as apply writes it;
    below it, the user's setting when given, else off (megatron-core's default)."""
    from mbridge_offload.config.rules.optimizer.offload import overlap_advised

    if overlap_advised(s.optimizer_offload_fraction):
        return True
    return bool(r.inputs.overlap) if r.sources.get("overlap") in ("flag", "config", "argv") else False
