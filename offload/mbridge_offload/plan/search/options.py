"""``recommend``'s ranked options: every lever (``levers.py``) searched for the least of it that fits, then ranked.

For each lever the search finds the smallest setting that fits with the margin (a binary search over a growing
setting: layers, fraction, module sets, recompute blocks), and a "comfortable" one that also keeps ``headroom_gib``
free (default: a tenth of the GPU's memory). A candidate is offered only if the rule catalogue accepts it
(``advice.Vetter``: no error, no new warning) and the node's host RAM holds the offload buffers of all its GPUs
(``anchor.Plan.host_ok``). Options are ranked by predicted step time (``timing.estimate_time(...).step_s``) among
those that fit (within ``STEP_TIE`` the decision table's pick goes first); options that pull a lever the caller did
not allow come after (``alternative``). Each option's
``step_time_factor`` is its step over the step of the config as given (1.0 = no change: the card's definition);
``step_time_factor_vs_no_levers`` over the step of ``timing.no_lever_setup(base)``. Never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from mbridge_offload.config.sources import override_value
from mbridge_offload.plan.memory.stage import MemoryEstimate, estimate_memory
from mbridge_offload.plan.model.architecture import GiB
from mbridge_offload.plan.model.run import Setup
from mbridge_offload.plan.results import Change, Option, StageGib
from mbridge_offload.plan.search import advice, levers
from mbridge_offload.plan.search import fine_grained_plan as fg
from mbridge_offload.plan.search.anchor import Plan
from mbridge_offload.plan.time.step import estimate_time, no_lever_setup

FRACTION_STEP = 0.05
Fit = Callable[[MemoryEstimate], bool]


# Step times closer than this are a tie: the time model is first-order (plan/time/terms.py says which terms it
# has), so within it the skill's decision table (the mechanism that targets the dominant memory) decides, then fewer
# changes.
STEP_TIE = 0.03


@dataclass
class Candidate:
    est: MemoryEstimate
    label: str
    from_table: bool = False  # the decision table's pick (planner._search)


def first_fit(p: Plan, setups: list[Setup], ok: Fit) -> MemoryEstimate | None:
    """The first of ``setups`` (ordered by growing setting, so by shrinking GPU memory) that is ``ok``, that the
    node's host RAM holds and that the rule catalogue accepts: a binary search, so 1000 settings cost ten
    estimates. None when the least that is ``ok`` needs more host memory than the node allows (more needs more)."""
    m = p.r.model
    if not setups or not ok(estimate_memory(m, setups[-1])):
        return None
    lo, hi = 0, len(setups) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(estimate_memory(m, setups[mid])):
            hi = mid
        else:
            lo = mid + 1
    for s in setups[lo:]:  # more still fits; the catalogue only objects at the far end (k = L − 1)
        est = estimate_memory(m, s)
        if not p.host_ok(est):
            p.host_refused.setdefault(advice.mode_of(s), p.host_sentence(est))
            return None
        if p.vet is None or p.vet.clean(s):
            return est
        p.vet.rejected.setdefault(advice.mode_of(s), p.vet.problems(s))
    return None


def headroom_gib(p: Plan) -> float:
    """The free memory a comfortable option keeps: the fallback's headroom (``advice.headroom_bytes``: asked for
    with ``--headroom-gib``, else a tenth of the allocatable budget), one figure for both."""
    return advice.headroom_bytes(p.r.inputs.headroom_gib, p.budget_bytes)[0] / GiB


def _free_gib(p: Plan, est: MemoryEstimate) -> float:
    return (p.usable_bytes - p.total(est)) / GiB


# ------------------------------------------------------------------------------------------- candidates


def _offload_sweeps(p: Plan, s: Setup) -> list[tuple[str, list[Setup]]]:
    """Each offload lever's settings on ``s``, least first (the activation sweep only where upstream allows it)."""
    r, out = p.r, []
    if not r.constraints.activation_blockers(s, r.model.num_layers):
        out.append(("activation", [replace(s, activation_offload_layers=k) for k in range(1, r.model.num_layers)]))
    if not s.use_megatron_fsdp:
        steps = round(1 / FRACTION_STEP)
        out.append(
            (
                "optimizer",
                [replace(s, optimizer_offload_fraction=round(i * FRACTION_STEP, 2)) for i in range(1, steps + 1)],
            )
        )
    sets = fg.useful_sets(r.model, s, r.constraints.model_config())
    out.append(("fine-grained", [replace(s, offload_modules=mods) for mods in sets]))
    return out


def _recompute_sweeps(p: Plan, base: Setup) -> list[tuple[str, list[Setup]]]:
    variants = levers.recompute_variants(p.r.model, base)
    block = [s for label, s in variants if label.startswith("full block")]
    single = [(label, [s]) for label, s in variants if not label.startswith("full block")]
    return [*single, *([("full block", block)] if block else [])]


def _search(p: Plan, sweeps: list[tuple[str, list[Setup]]], ok: Fit, out: list[Candidate]) -> None:
    base = p.vet.base if p.vet is not None and p.vet.base is not None else p.r.setup
    for _, setups in sweeps:
        found = first_fit(p, setups, ok)
        if found is not None:
            out.append(Candidate(found, _label(base, found.setup)))


def candidates(p: Plan, base: Setup, before: MemoryEstimate, given: MemoryEstimate | None) -> list[Candidate]:
    """Every lever's least setting that fits with the margin, and the least that keeps the headroom free."""
    out: list[Candidate] = []
    room = headroom_gib(p)
    comfortable: Fit = lambda est: p.keeps_margin(est) and _free_gib(p, est) >= room  # noqa: E731
    if p.keeps_margin(before):
        out.append(Candidate(before, "no change"))
        if comfortable(before):
            return out  # nothing to gain: every lever costs step time (the fallback key covers more headroom)
    if given is not None and given.setup != base and p.keeps_margin(given):
        out.append(Candidate(given, "the offload the decision table picks: " + _label(base, given.setup), True))
    passes = ((False, comfortable),) if p.keeps_margin(before) else ((True, p.keeps_margin), (False, comfortable))
    for tight, ok in passes:
        _search(p, _offload_sweeps(p, base) + _recompute_sweeps(p, base), ok, out)
        for lever in levers.LAYOUT_LEVERS:
            variants = levers.layout_variants(lever, p.r.model, base)
            before_count = len(out)
            _search(p, [(lever, variants)], ok, out)
            if variants and len(out) == before_count and tight:
                # The layout change alone does not fit: its smallest step with the other levers on top.
                _search(p, _offload_sweeps(p, variants[0]) + _recompute_sweeps(p, variants[0]), ok, out)
    if not base.use_megatron_fsdp and base.recompute_granularity != "full":
        # Full recompute with the least optimizer offload on top: where recompute alone does not fit, or leaves
        # less than the headroom free.
        full = replace(base, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        alone = any(levers.used(base, c.est.setup) == ["recompute"] for c in out)
        for ok in (comfortable,) if alone else (p.keeps_margin, comfortable):
            _search(p, [sweep for sweep in _offload_sweeps(p, full) if sweep[0] == "optimizer"], ok, out)
    return out


def _label(base: Setup, s: Setup) -> str:
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
    shown = {"tp": f"TP {s.tp} with SP", "cp": f"CP {s.cp}", "mbs": f"micro-batch {s.micro_batch_size}"}
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


def _option(p: Plan, c: Candidate, ctx: dict[str, Any], overlap: Callable[[Any, Setup], bool]) -> tuple[float, Option]:
    r, est, base = p.r, c.est, ctx["base"]
    s = est.setup
    t = estimate_time(est, r.gpu, overlap=overlap(r, s), **p.time_kwargs)
    used = levers.used(base, s)
    overrides = overrides_for(r.setup, base, s, overlap(r, s))
    free = _free_gib(p, est)
    factor = t.step_s / ctx["reference_s"] if ctx["reference_s"] > 0 else 1.0
    no_levers = t.step_s / ctx["no_lever_s"] if ctx["no_lever_s"] > 0 else 1.0
    option = Option(
        rank=0,
        changes=_changes(overrides, ctx["notation"]),
        notation=ctx["notation"],
        overrides=overrides,
        levers=used,
        memory_gib=p.breakdown(est, gib=True),
        peak_phase=est.worst.peak_phase,
        stages_gib=[
            StageGib(stage=st.stage, total_gib=round((st.total + p.offset) / GiB, 3), peak_phase=st.peak_phase)
            for st in est.stages
        ],
        host_gb=round(est.host_peak_gb, 3),
        host_gb_per_node=round(est.host_peak_gb * r.gpu.gpus_per_node, 3),
        step_time_s=round(t.step_s, 4),
        step_time_factor=round(factor, 3),
        step_time_factor_vs_no_levers=round(no_levers, 3),
        fits=p.keeps_margin(est),
        margin_gib=round(free, 3),
        comfortable=free >= ctx["headroom"],
        alternative=any(lever not in ctx["allowed"] for lever in used),
        changes_layout=any(lever in levers.LAYOUT_LEVERS for lever in used),
        why=f"{c.label}: {p.total_gib(est):.1f} GiB peak per GPU, {free:.1f} GiB free, "
        f"{est.host_peak_gb:.0f} GB host per GPU, step ×{factor:.2f}",
    )
    return t.step_s, option


def most_offload(base: Setup, most: MemoryEstimate) -> Candidate:
    """The decision table's most offload, for when no allowed lever fits: it is then the recommendation (mode and
    overrides describe it), so it is listed, not fitting, as option 0."""
    label = "the most offload the decision table allows: " + _label(base, most.setup)
    return Candidate(most, label if most.setup != base else "no change: no allowed offload fits", True)


def overrides_for(given: Setup, base: Setup, s: Setup, overlap: bool) -> list[str]:
    """Every override an option writes: switch off the given offloads it drops, its recompute and layout changes,
    then its offload keys."""
    return advice.switch_off_overrides(given, s) + levers.lever_overrides(base, s) + advice.overrides_for(s, overlap)


def _prefer_table(ordered: list[tuple[float, Candidate, Option]]) -> list[tuple[float, Candidate, Option]]:
    """The decision table's pick first when it ties (``STEP_TIE``) with the fastest allowed option that fits, or when
    no allowed option fits (its most offload is then the recommendation: mode and overrides describe it)."""
    if not ordered:
        return ordered
    if ordered[0][2].alternative or not ordered[0][2].fits:
        table = next((i for i, (_, c, o) in enumerate(ordered) if c.from_table and not o.alternative), None)
        return ordered if table is None else [ordered[table], *ordered[:table], *ordered[table + 1 :]]
    fastest = ordered[0][0]
    for i, (step, c, option) in enumerate(ordered):
        if c.from_table and option.fits and not option.alternative and step <= fastest * (1 + STEP_TIE):
            return [ordered[i], *ordered[:i], *ordered[i + 1 :]]
    return ordered


def rank(
    p: Plan,
    base: Setup,
    found: list[Candidate],
    allowed: tuple[str, ...],
    overlap: Callable[[Any, Setup], bool],
    as_given_s: float,
) -> list[tuple[Candidate, Option]]:
    """The candidates as options, without duplicates, allowed ones first, then by step time and fewest changes.

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
    seen: dict[str, tuple[float, Candidate, Option]] = {}
    for c in found:
        key = repr(c.est.setup)
        if key not in seen:
            step, option = _option(p, c, ctx, overlap)
            seen[key] = (step, c, option)
    ordered = sorted(seen.values(), key=lambda e: (e[2].alternative, not e[2].fits, round(e[0], 6), len(e[2].changes)))
    ordered = _prefer_table(ordered)
    out = []
    for i, (_, c, option) in enumerate(ordered):
        option.rank = i
        out.append((c, option))
    return out
