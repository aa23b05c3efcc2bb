"""``recommend``'s ranked options: every lever's sweep (``sweeps.py``) searched once, then ranked by one sort key.

For each sweep the search finds the least setting that fits with the margin, and a "comfortable" one that also keeps
``headroom_gib`` free (default: a tenth of the allocatable budget); stacks add two levers together where one alone
does not reach. A candidate is offered only if the rule catalogue accepts it (``advice.Vetter``: no error, no new
warning) and the node's host RAM holds the offload buffers of all its GPUs within the share the answer states
(``anchor.Plan.host_ok``). When no allowed lever fits, each allowed sweep's most (within host RAM and the catalogue)
is listed, not fitting, so option 0 is still inside the answer's own limits.

The sort key (``sort_key``, stated in every answer as ``ranking``): allowed levers before alternatives; fitting
before not; among fitting options the predicted step time grown by the option's risk (``risks.py``: host RAM share,
number of changes, known upstream bugs, a thin margin), then fewer changes; among options that do not fit, the
lowest peak first. Option 0 is the recommendation by construction: ``mode`` and ``overrides`` describe it.
Each option's ``step_time_factor`` is its step over the step of the config as given (1.0 = no change: the card's
definition); ``step_time_factor_vs_no_levers`` over the step of ``timing.no_lever_setup(base)``. Never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mbridge_offload.config.sources import override_value
from mbridge_offload.plan.memory.stage import MemoryEstimate, estimate_memory
from mbridge_offload.plan.model.architecture import GB, GiB
from mbridge_offload.plan.model.run import Setup
from mbridge_offload.plan.results import Change, Fallback, Option, StageGib
from mbridge_offload.plan.search import advice, levers, risks, sweeps
from mbridge_offload.plan.search.anchor import Plan
from mbridge_offload.plan.time.step import estimate_time, no_lever_setup

FRACTION_STEP = sweeps.FRACTION_STEP
Fit = Callable[[MemoryEstimate], bool]
RANKING = risks.RANKING_WORDS


@dataclass
class Candidate:
    est: MemoryEstimate
    label: str


def headroom_gib(p: Plan) -> float:
    """The free memory a comfortable option keeps: the fallback's headroom (``advice.headroom_bytes``: asked for
    with ``--headroom-gib``, else a tenth of the allocatable budget), one figure for both."""
    return advice.headroom_bytes(p.r.inputs.headroom_gib, p.budget_bytes())[0] / GiB


# ------------------------------------------------------------------------------------------- candidates


def candidates(p: Plan, base: Setup, before: MemoryEstimate, allowed: tuple[str, ...]) -> list[Candidate]:
    """Every sweep's least setting that fits with the margin, and the least that keeps the headroom free; when no
    allowed one fits, each allowed sweep's most within host RAM and the catalogue (the closest it gets)."""
    out: list[Candidate] = []
    room = headroom_gib(p)
    tight: Fit = lambda est: p.keeps_margin(est)  # noqa: E731
    comfortable: Fit = lambda est: p.keeps_margin(est) and p.free_gib(est) >= room  # noqa: E731
    if p.keeps_margin(before):
        out.append(Candidate(before, "no change"))
        if comfortable(before):
            return out  # nothing to gain: every lever costs step time (the fallback covers more headroom)
    all_sweeps = sweeps.sweeps(p, base)
    for ok in (comfortable,) if p.keeps_margin(before) else (tight, comfortable):
        fitting = len(out)
        for sw in all_sweeps:
            found = sweeps.first_fit(p, sw.setups, ok)
            if found is not None:
                out.append(Candidate(found, label(base, found.setup)))
        out += [Candidate(est, label(base, est.setup)) for est in sweeps.stacks(p, base, ok)]
        if len(out) == fitting:
            break  # nothing fits with the margin: nothing keeps the headroom either
    if not any(set(levers.used(base, c.est.setup)) <= set(allowed) for c in out):
        for sw in all_sweeps:
            if sw.name in allowed and (est := sweeps.most(p, sw.setups)) is not None:
                out.append(Candidate(est, "the most this lever reaches within the limits: " + label(base, est.setup)))
        for est in sweeps.closest_stacks(p, base):
            if set(levers.used(base, est.setup)) <= set(allowed):
                out.append(Candidate(est, "the most these levers reach within the limits: " + label(base, est.setup)))
    return out


def label(base: Setup, s: Setup) -> str:
    """What ``s`` changes from ``base``, in words."""
    used, parts = levers.used(base, s), []
    if "recompute" in used and s.recompute_granularity == "selective":
        parts.append(f"selective recompute ({', '.join(s.recompute_modules)})")
    elif "recompute" in used:
        parts.append(f"full recompute ({s.recompute_method}, recompute_num_layers={s.recompute_num_layers})")
    if s.activation_offload_layers:
        parts.append(f"activation offload of {s.activation_offload_layers} layers")
    if s.offload_modules:
        parts.append(f"fine-grained offload of {', '.join(s.offload_modules)}")
    if s.optimizer_offload_fraction:
        parts.append(f"optimizer offload fraction {s.optimizer_offload_fraction:g}")
    shown = {
        "tp": f"TP {s.tp} with SP",
        "cp": f"CP {s.cp}",
        "mbs": f"micro-batch {s.micro_batch_size}",
        "vpp": f"VPP {s.vpp}" if s.vpp else "no interleaving (VPP off)",
        "grad-reduce": "bf16 gradient reduction (grad_reduce_in_fp32 off)",
        "ce-fusion": "Transformer Engine's fused cross entropy",
        "expandable-segments": "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    }
    parts += [shown[lever] for lever in used if lever in shown]
    return " + ".join(parts) or "no change"


# ------------------------------------------------------------------------------------------- options


def _changes(overrides: list[str], notation: str) -> list[Change]:
    """The overrides as ``{key, value}`` in the config's notation (Megatron-LM flags for argv input)."""
    out = []
    for text in overrides:
        key, _, value = text.partition("=")
        if notation == "megatron-lm":
            from mbridge_offload.config.megatron_lm.fixes import flag_edit

            edit = flag_edit(text)
            if edit is not None:
                adds, removes = edit
                for flag in adds:
                    name, _, rest = flag.partition(" ")
                    out.append(Change(key=name, value=rest if rest else True))
                out += [Change(key=flag, value=None) for flag in removes]
                continue
        out.append(Change(key=key, value=override_value(text) if value else None))
    return out


def _option(p: Plan, c: Candidate, ctx: dict[str, Any], overlap: Callable[[Any, Setup], bool]) -> Option:
    r, est, base = p.r, c.est, ctx["base"]
    s = est.setup
    t = estimate_time(est, r.gpu, overlap=overlap(r, s), **p.time_kwargs)
    used = levers.used(base, s)
    overrides = overrides_for(r.setup, base, s, overlap(r, s))
    free = p.free_gib(est)
    # Rounded once: the option's fields, its why and the rationale quote the same figure.
    factor = round(t.step_s / ctx["reference_s"] if ctx["reference_s"] > 0 else 1.0, 3)
    no_levers = round(t.step_s / ctx["no_lever_s"] if ctx["no_lever_s"] > 0 else 1.0, 3)
    free = round(free, 3)
    # No negative figure in an answer: an option over its budget has nothing free; its why says by how much it is over.
    room = f"{free:.1f} GiB free" if free >= 0 else f"{-free:.1f} GiB over the budget"
    comfortable = free >= ctx["headroom"]
    score, why_risky = risks.risk(used, len(overrides), est.host_peak_gb / p.host_budget_gb, comfortable)
    return Option(
        rank=0,
        changes=_changes(overrides, ctx["notation"]),
        notation=ctx["notation"],
        overrides=overrides,
        levers=used,
        memory_gib=p.breakdown(est, gib=True),
        peak_phase=est.worst.peak_phase,
        stages_gib=[
            StageGib(stage=st.stage, total_gib=round((st.total + p.shift(st)) / GiB, 3), peak_phase=st.peak_phase)
            for st in est.stages
        ],
        host_gb=round(est.host_peak_gb, 3),
        host_gb_per_node=round(est.host_peak_gb * r.gpu.gpus_per_node, 3),
        step_time_s=round(t.step_s, 4),
        step_time_factor=factor,
        step_time_factor_vs_no_levers=no_levers,
        fits=p.keeps_margin(est),
        margin_gib=max(0.0, free),
        budget_gib=round(p.budget_bytes(s) / GiB, 3),
        comfortable=comfortable,
        alternative=any(lever not in ctx["allowed"] for lever in used),
        changes_layout=any(lever in levers.LAYOUT_LEVERS or lever == "vpp" for lever in used),
        risk=round(score, 4),
        risks=why_risky,
        # The text quotes the figure the answer shows (rounded as memory_gib is), so 104.8504 reads 104.8 in both.
        why=f"{c.label}: {round(p.total_gib(est), 3):.1f} GiB peak per GPU, {room}, "
        f"{round(est.host_peak_gb, 3):.0f} GB host per GPU, step ×{factor:.2f}",
    )


def overrides_for(given: Setup, base: Setup, s: Setup, overlap: bool) -> list[str]:
    """Every override an option writes: switch off the given offloads it drops, its recompute and layout changes,
    then its offload keys."""
    return advice.switch_off_overrides(given, s) + levers.lever_overrides(base, s) + advice.overrides_for(s, overlap)


def sort_key(o: Option) -> tuple[bool, bool, float, int, float]:
    """The one order of every answer's options (``RANKING`` says it in words)."""
    if o.fits:
        return (o.alternative, False, o.step_time_s * (1 + o.risk), len(o.overrides), o.step_time_s)
    return (o.alternative, True, o.memory_gib.total, len(o.overrides), o.step_time_s)


def rank(
    p: Plan,
    base: Setup,
    found: list[Candidate],
    allowed: tuple[str, ...],
    overlap: Callable[[Any, Setup], bool],
    as_given_s: float,
) -> list[tuple[Candidate, Option]]:
    """The candidates as options, without duplicates, in ``sort_key`` order, numbered.

    ``as_given_s``: the step time of the config as given, which every option's ``step_time_factor`` divides by.
    """
    reference = estimate_memory(p.r.model, no_lever_setup(base))
    ctx = {
        "base": base,
        "allowed": allowed,
        "headroom": headroom_gib(p),
        "notation": "megatron-lm" if "argv" in p.r.sources.values() else "bridge",
        "reference_s": as_given_s,
        "no_lever_s": estimate_time(reference, p.r.gpu, overlap=False, **p.time_kwargs).step_s,
    }
    seen: dict[str, tuple[Candidate, Option]] = {}
    for c in found:
        key = repr(c.est.setup)
        if key not in seen:
            seen[key] = (c, _option(p, c, ctx, overlap))
    ordered = sorted(seen.values(), key=lambda e: sort_key(e[1]))
    for i, (_, option) in enumerate(ordered):
        option.rank = i
    return ordered


# ------------------------------------------------------------------------------------------- fallback


def fallback(
    p: Any,
    before: MemoryEstimate,
    overlap: Callable[[Any, Setup], bool],
    as_given_s: float | None = None,
) -> Fallback | None:
    """The cheapest offload (smallest step-time factor) that frees the headroom, for a run that already fits: per
    offload sweep (``sweeps.offload_sweeps``, the one builder) the least setting that frees it (``sweeps.first_fit``,
    the one bisection, with its host-RAM and catalogue checks), then the fastest of those.

    Args:
        p: the planner's ``anchor.Plan`` (budget, offset, vetter).
        before: the estimate without offload.
        overlap: ``(resolved, setup) → overlap_cpu_optimizer_d2h_h2d`` for a proposal.
        as_given_s: the step time of the config as given, which ``step_time_factor`` divides by (as the options');
            None: the step without offload.
    """
    r, base = p.r, before.setup
    need, source = advice.headroom_bytes(r.inputs.headroom_gib, p.budget_bytes())

    def timed(est: MemoryEstimate) -> Any:
        return estimate_time(est, r.gpu, overlap=overlap(r, est.setup), **p.time_kwargs)

    def factor(est: MemoryEstimate) -> float:
        t = timed(est)
        return t.step_s / as_given_s if as_given_s else t.step_time_factor

    found = []
    for sw in sweeps.offload_sweeps(p, base):
        if sw.name == "fine-grained":
            continue  # the fallback names one knob (a fraction or a layer count), as apply --mode takes it
        est = sweeps.first_fit(p, sw.setups, lambda e: p.total(before) - p.total(e) >= need)
        if est is not None:
            found.append((factor(est), sw.name, est))
    if not found:
        return None
    fastest, mode, est = min(found, key=lambda c: c[0])
    freed = p.total(before) - p.total(est)
    return Fallback(
        mode=mode,
        overrides=advice.overrides_for(est.setup, overlap(r, est.setup)),
        headroom_gib=round(need / GiB, 3),
        headroom_source=source,
        freed_gib=round(freed / GiB, 3),
        freed_gb=round(freed / GB, 3),
        memory_gib=round(p.total_gib(est), 3),
        step_time_factor=round(fastest, 3),
        step_time_factor_vs_no_levers=round(timed(est).step_time_factor_vs_no_levers, 3),
    )
