"""The planner: ``estimate`` of a setting as given, and ``recommend``: one search over every lever, one ranking.

``recommend`` (NVIDIA skill ``nemo-mbridge-perf-cpu-offloading``'s "Quick Decision", made one search):

- the run already fits with the headroom → no change (offloading always adds step time);
- otherwise every lever the run can use is swept once (``sweeps.py``: offloads, recompute by module or full, the
  switches, layout steps, and two levers stacked where one alone does not reach), the least setting of each that
  fits found by one bisection, inside what the rule catalogue accepts and the node's host RAM holds;
- the candidates are ranked by one sort key (``options.sort_key``: allowed first, fitting first, step time grown by
  risk, ``risks.py``), and option 0 is the recommendation: ``mode``, ``overrides`` and the figures describe it;
- nothing fits → option 0 is the closest the allowed levers get inside those limits, and ``suggestions`` say what
  would fit (more PP, full recompute, more GPUs), each with its predicted memory.

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
from mbridge_offload.plan.model.run import Setup, hdo_fails_at_first_step
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
from mbridge_offload.plan.search import advice, levers, options, sweeps
from mbridge_offload.plan.search.anchor import Plan, prepare
from mbridge_offload.plan.time.step import TimeEstimate, estimate_time

FRACTION_STEP = sweeps.FRACTION_STEP
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
        **{k: getattr(s, k) for k in ("num_gpus", "tp", "pp", "vpp", "cp", "ep")},
        "etp": s.resolved_etp(m),
        "dp": s.dp,
        "expert_dp": s.expert_dp(m) if m.is_moe else None,
        "sequence_parallel": s.sp,
        "distributed_optimizer": s.distributed_optimizer,
        "precision_aware_optimizer": s.precision_aware_optimizer,
    }


def _time_breakdown(t: TimeEstimate) -> TimeBreakdown:
    """``TimeBreakdown`` from the step-time model: each of its seconds is the estimate's ``<name>_s`` (rounded)."""
    seconds = [k for k in TimeBreakdown.model_fields if k not in ("efficiency", "assumptions")]
    return TimeBreakdown(
        **{k: round(getattr(t, f"{k}_s"), 4) for k in seconds},
        efficiency=round(t.efficiency, 4),
        assumptions=list(t.assumptions),
    )


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
        budget_gb=round(p.usable_bytes(s) / GB, 3),
        budget_gib=round(p.usable_bytes(s) / GiB, 3),
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
        time_s=_time_breakdown(t),
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
    start = replace(p.r.setup, optimizer_offload_fraction=0.0)
    ok = lambda e: p.keeps_margin(e)  # noqa: E731
    found = None if start.use_megatron_fsdp else sweeps.first_fit(p, sweeps.fractions(start), ok)
    if found is None:
        return "no optimizer offload fraction fits with that; `recommend` says what would (more PP, recompute, GPUs)"
    return (
        f"with that, optimizer_offload_fraction={found.setup.optimizer_offload_fraction:g} would fit "
        f"({p.total_gib(found):.1f} GiB of {p.budget_bytes() / GiB:.1f} GiB allocatable)"
    )


# ------------------------------------------------------------------------------------------- search


def _facts(p: Plan, before: MemoryEstimate, rationale: list[str]) -> None:
    """What upstream allows here and what dominates the memory (the skill's decision table, as facts: the ranking
    then weighs every lever on the same key)."""
    s, w = before.setup, before.worst
    rationale.extend(p.r.constraints.activation_blockers(s, p.r.model.num_layers))
    if s.use_megatron_fsdp:  # upstream refuses optimizer offload under Megatron-FSDP: never proposed
        rationale.append(MFSDP_OPTIMIZER_OFFLOAD.replace("; the numbers here ignore the requested fraction", ""))
    if p.keeps_margin(before):
        rationale.append("it fits: offloading only adds step time, so none is recommended")
        return
    if p.fits(before):
        rationale.append(f"it fits the device, but with less than the {p.margin:.0%} margin free")
    big, small = (
        ("activations", "optimizer state") if w.activations > w.optimizer else ("optimizer state", "activations")
    )
    sizes = {"activations": w.activations, "optimizer state": w.optimizer}
    rationale.append(
        f"{big} ({sizes[big] / GB:.1f} GB) dominate the {small} ({sizes[small] / GB:.1f} GB) on the worst stage "
        "without offload"
    )


def _suggest(p: Plan, s: Setup) -> list[str]:
    """What would make the run fit, each with its predicted worst-stage memory."""
    m, out = p.r.model, []
    # no optimizer offload under Megatron-FSDP (upstream refuses it) nor where megatron-core's HDO cannot step
    no_hdo = s.use_megatron_fsdp or bool(hdo_fails_at_first_step(s))
    full = replace(s, optimizer_offload_fraction=0.0 if no_hdo else 1.0, activation_offload_layers=0)
    with_opt = "" if no_hdo else " with optimizer offload fraction 1.0"
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


def _explain(p: Plan, before: MemoryEstimate, after: MemoryEstimate, t: TimeEstimate, first: Option) -> list[str]:
    """What option 0 (the recommendation) does, in words: each figure is option 0's (or the run without offload's)."""
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
    if first.levers:
        out.append(
            f"predicted step time {first.step_time_s:.2f} s: ×{first.step_time_factor:.2f} of the config as given, "
            f"×{first.step_time_factor_vs_no_levers:.2f} of the run with no lever"
        )
        out.extend(t.notes)
    if first.risks:
        out.append("option 0 risks: " + "; ".join(first.risks))
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
        levers.check_usable(allowed, r, base, sweeps.frag_gib(p))
    p.vet = advice.Vetter(r.raw_config, r.model.num_layers, r.constraints.model_keys(), source=r.source, base=base)
    before = estimate_memory(r.model, base, r.gpu.host_ram_gb)
    rationale = [p.budget_sentence(before), *p.notes()]
    given = _as_given(r, before, rationale)
    given_t = estimate_time(given, r.gpu, overlap=r.overlap, **p.time_kwargs)
    as_given_s = given_t.step_s  # every step_time_factor of this answer divides by it: 1.0 = the config as given
    _facts(p, before, rationale)
    found = options.candidates(p, base, before, allowed) or [options.Candidate(before, "no change: nothing reaches")]
    ranked = options.rank(p, base, found, allowed, _overlap, as_given_s)
    after, first = ranked[0][0].est, ranked[0][1]
    mode = advice.mode_of(after.setup)
    suggestions = [] if first.fits and not first.alternative else _suggest(p, base)
    rationale += [f"not proposed ({m}): {'; '.join(why)}" for m, why in p.vet.rejected.items()]
    rationale += [f"not offered ({m}): {why}" for m, why in p.host_refused.items()]
    overlap = _overlap(r, after.setup)
    t = estimate_time(after, r.gpu, overlap=overlap, **p.time_kwargs)
    opts = [o for _, o in ranked]
    rationale += _explain(p, before, after, t, first) + _verdict(opts, allowed)
    pulled = bool(set(first.levers) - _OFFLOADS)
    sentence = advice.advice_sentence(
        r.setup, mode, given_t.step_time_factor if given is not before else None, first.why if pulled else None
    )
    return Recommendation(
        mode=mode,
        overrides=first.overrides,
        memory_gb=_before_after(p, given, after, before, gib=False),
        memory_gib=_before_after(p, given, after, before, gib=True),
        fits=first.fits,
        step_time_factor=first.step_time_factor,
        step_time_factor_vs_no_levers=first.step_time_factor_vs_no_levers,
        rationale=rationale + ([sentence] if sentence else []),
        budget_gb=round(p.budget_bytes(after.setup) / GB, 3),
        budget_gib=first.budget_gib,
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
        fallback=options.fallback(p, before, _overlap, as_given_s) if mode == "none" and not pulled else None,
        options=opts,
        ranking=options.RANKING,
        levers=list(allowed),
        headroom_gib=round(options.headroom_gib(p), 3),
        phases=stage_phases(after, p.shift),
        peak_phase=after.worst.peak_phase,
    )


def _before_after(
    p: Plan, given: MemoryEstimate, after: MemoryEstimate, before: MemoryEstimate, gib: bool
) -> BeforeAfter:
    """The config as given, the recommendation, and the config without any offload, in GB or GiB."""
    return BeforeAfter(
        before=p.breakdown(given, gib=gib),
        after=p.breakdown(after, gib=gib),
        without_offload=p.breakdown(before, gib=gib),
    )


_OFFLOADS = frozenset(levers.OFFLOAD_LEVERS)


def _verdict(ranked: list[Option], allowed: tuple[str, ...]) -> list[str]:
    """The ranking in words: what option 0 is, and when no offload or recompute is the better answer."""
    first = ranked[0]
    if not first.fits or first.alternative:
        best = next((o for o in ranked if o.fits), None)
        closest = (
            f"no allowed lever ({', '.join(allowed)}) fits: option 0 is the closest within the answer's limits "
            f"({first.memory_gib.total:.1f} GiB peak, budget {first.budget_gib:.1f} GiB)"
        )
        if best is None:
            return [closest + "; no alternative fits either"]
        return [
            closest + f"; the best alternative: {best.why} (option {best.rank}, pulls {', '.join(best.levers)}: "
            "allow it with --levers)"
        ]
    out = [f"option 0 of {len(ranked)} (first by the ranking: step time grown by risk): {first.why}"]
    if not first.levers:
        out.append("no offload is the better answer: the run fits as it is, and every lever costs step time")
    elif "recompute" in first.levers and not _OFFLOADS & set(first.levers):
        offload = next((o for o in ranked if o.fits and not o.alternative and set(o.levers) <= _OFFLOADS), None)
        than = f" (the first offload: option {offload.rank}, ×{offload.step_time_factor:.2f})" if offload else ""
        out.append(f"recompute is the better answer here: ×{first.step_time_factor:.2f}{than}")
    comfortable = next((o for o in ranked if o.comfortable and o.fits and not o.alternative), None)
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
