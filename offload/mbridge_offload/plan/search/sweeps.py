"""The one sweep builder and the one bisection behind ``recommend``: every lever's settings, least first.

A sweep is one lever's settings on one starting setup, ordered by growing setting so by shrinking GPU memory
(activation layers, an optimizer fraction on the 0.05 grid, fine-grained module sets, selective-recompute module sets,
full-recompute blocks, a layout step) or a single switch (bf16 gradient reduction, Transformer Engine's fused cross
entropy, another VPP). ``first_fit`` finds the least setting of a sweep that fits (a binary search: 1000 settings
cost ten estimates), then walks on past what the node's host RAM or the rule catalogue refuses. Stacks put one
lever's most (the most that host RAM and the catalogue allow) under another's sweep, then back the first one off:
the "both" and "fine-grained+optimizer" of the decision table, full recompute with optimizer offload, and a layout
step with the other levers on top. ``options.rank`` orders what they find with one sort key. Never imports torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from mbridge_offload.plan.memory.activations import layer_components
from mbridge_offload.plan.memory.stage import MemoryEstimate, estimate_memory
from mbridge_offload.plan.model.architecture import ModelSpec
from mbridge_offload.plan.model.params import stage_layers
from mbridge_offload.plan.model.run import Setup, hdo_fails_at_first_step
from mbridge_offload.plan.search import advice, levers
from mbridge_offload.plan.search import fine_grained_plan as fg
from mbridge_offload.plan.search.anchor import Plan

FRACTION_STEP = 0.05
# How far back from a sweep's far end ``most`` looks for a setting the catalogue accepts: its objections there are
# one or two settings wide (ACT-NO-OVERLAP at L − 1), and each step costs an estimate and a catalogue run.
MOST_WALK = 4
Fit = Callable[[MemoryEstimate], bool]

# Selective-recompute modules, cheapest to re-run per byte freed first (megatron-core TransformerConfig.
# recompute_modules): layernorm and moe_act use output-discarding checkpointing (a norm or an activation function
# re-run in backward, no GEMM); core_attn re-runs attention's softmax part only; mla_up_proj and shared_experts re-run
# one projection or a small MLP; mlp and moe re-run a layer's largest GEMMs (and moe its token dispatch).
RECOMPUTE_MODULE_ORDER = ("layernorm", "moe_act", "core_attn", "mla_up_proj", "shared_experts", "mlp", "moe")
# Under FP8, megatron-core 0.16/0.19 refuse moe_act and layernorm recompute with delayed scaling and need TE >= 2.6
# with the others (TransformerConfig.__post_init__): not proposed under FP8, rather than half-checked here.
FP8_NO_OUTPUT_DISCARD = ("layernorm", "moe_act")


@dataclass(frozen=True)
class Sweep:
    """One lever's settings on one starting setup, least first; ``name`` says which lever in words."""

    name: str
    setups: list[Setup]


@functools.lru_cache(maxsize=2048)
def estimate(m: ModelSpec, s: Setup) -> MemoryEstimate:
    """``estimate_memory`` once per (model, setup): the passes, stacks and ``most`` revisit the same settings, and
    at 1,024 layers one estimate costs a tenth of a second. Callers only read the result."""
    return estimate_memory(m, s)


def bisect(setups: list[Setup], ok: Callable[[Setup], bool]) -> int | None:
    """The index of the first of ``setups`` that is ``ok`` when ``ok`` only grows along them; None when the last
    is not ``ok`` (nothing is)."""
    if not setups or not ok(setups[-1]):
        return None
    lo, hi = 0, len(setups) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(setups[mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


def what(p: Plan, s: Setup) -> str:
    """The levers ``s`` pulls, in the words the rationale's refusal lines use."""
    base = p.vet.base if p.vet is not None and p.vet.base is not None else None
    used = levers.used(base, s) if base is not None else []
    return " + ".join(used) if used else advice.mode_of(s)


def allowed_est(p: Plan, s: Setup) -> MemoryEstimate | None:
    """The estimate of ``s`` when the node's host RAM holds it and the rule catalogue accepts it, else None (and
    the reason is kept for the answer's rationale)."""
    est = estimate(p.r.model, s)
    if not p.host_ok(est):
        p.host_refused.setdefault(what(p, s), p.host_sentence(est))
        return None
    if p.vet is not None and not p.vet.clean(s):
        p.vet.rejected.setdefault(what(p, s), p.vet.problems(s))
        return None
    return est


def first_fit(p: Plan, setups: list[Setup], ok: Fit) -> MemoryEstimate | None:
    """The first of ``setups`` (least first) that is ``ok``, that host RAM holds and that the catalogue accepts.
    More of a lever needs more host memory: past a host refusal nothing later is tried."""
    start = bisect(setups, lambda s: ok(estimate(p.r.model, s)))
    for s in setups[start:] if start is not None else []:  # the catalogue only objects at the far end (k = L − 1)
        est = allowed_est(p, s)
        if est is not None or not p.host_ok(estimate(p.r.model, s)):
            return est
    return None


def most(p: Plan, setups: list[Setup]) -> MemoryEstimate | None:
    """The most of a sweep that host RAM holds and the catalogue accepts (the least memory it can reach). Host
    memory only grows along a sweep, so the last setting it holds is found by the same bisection; the catalogue
    objects only at the far end (TE's warning at L − 1), so a few steps back from there are walked."""
    m = p.r.model
    over = bisect(setups, lambda s: not p.host_ok(estimate(m, s)))
    if over is not None:
        allowed_est(p, setups[over])  # keeps the host's refusal for the rationale
    end = len(setups) if over is None else over
    for s in reversed(setups[max(0, end - MOST_WALK) : end]):
        est = allowed_est(p, s)
        if est is not None:
            return est
    return None


# ------------------------------------------------------------------------------------------- the sweeps


def fractions(s: Setup) -> list[Setup]:
    """The optimizer offload fractions to try on ``s``: none where megatron-core's HDO cannot step at all."""
    if hdo_fails_at_first_step(s):
        return []
    steps = round(1 / FRACTION_STEP)
    return [replace(s, optimizer_offload_fraction=round(i * FRACTION_STEP, 2)) for i in range(1, steps + 1)]


def offload_sweeps(p: Plan, s: Setup) -> list[Sweep]:
    """Each offload lever on ``s``: activation layers where upstream allows them, the optimizer fraction except under
    Megatron-FSDP (upstream refuses it), fine-grained module sets that free something more each."""
    r, out = p.r, []
    if not r.constraints.activation_blockers(s, r.model.num_layers):
        out.append(Sweep("activation", [replace(s, activation_offload_layers=k) for k in range(1, r.model.num_layers)]))
    if not s.use_megatron_fsdp and fractions(s):
        out.append(Sweep("optimizer", fractions(s)))
    sets = _useful_sets(r.model, s, tuple(sorted(r.constraints.model_config().items(), key=str)))
    if sets:
        out.append(Sweep("fine-grained", [replace(s, offload_modules=mods) for mods in sets]))
    return out


@functools.lru_cache(maxsize=512)
def _useful_sets(m: ModelSpec, s: Setup, config: tuple[tuple[str, Any], ...]) -> list[tuple[str, ...]]:
    """``fine_grained_plan.useful_sets`` once per (model, setup, model facts): each step of it walks every layer."""
    return fg.useful_sets(m, s, dict(config))


@functools.lru_cache(maxsize=512)
def _saved(m: ModelSpec, s: Setup) -> int:
    """Bytes the layers of every stage save for backward, one micro-batch (what a recompute module shrinks)."""
    return sum(sum(layer_components(m, s, i).values()) for i in range(m.num_layers))


def selective(s: Setup, modules: tuple[str, ...]) -> Setup:
    """``s`` with selective recompute of ``modules``: megatron-core refuses a recompute method or layer count beside
    selective granularity, so both go."""
    return replace(
        s,
        recompute_granularity="selective",
        recompute_modules=modules,
        recompute_method=None,
        recompute_num_layers=None,
    )


def recompute_module_sets(
    m: ModelSpec, s: Setup, refused: Callable[[Setup], bool] | None = None
) -> list[tuple[str, ...]]:
    """Growing selective-recompute module sets beyond ``s``'s, each step one module that frees memory on this
    model's layer types: ``mlp`` on an all-MoE model, ``moe`` on a dense one, ``mla_up_proj`` without MLA free
    nothing (megatron-core recomputes only the modules a layer has) and are skipped, as is a module ``refused``
    (the rule catalogue: ``moe_act`` without grouped GEMM) so that it does not spoil every larger set."""
    if s.recompute_granularity == "full":
        return []
    have = tuple(s.recompute_modules) if s.recompute_granularity == "selective" else ()
    last = _saved(m, selective(s, have)) if have else _saved(m, s)
    out: list[tuple[str, ...]] = []
    acc = have
    for module in RECOMPUTE_MODULE_ORDER:
        if module in acc or (s.fp8_recipe and module in FP8_NO_OUTPUT_DISCARD):
            continue
        if module == "mla_up_proj" and m.mla is None:
            continue  # megatron-core refuses it without multi_latent_attention (TransformerConfig.__post_init__)
        trial = (*acc, module)
        saved = _saved(m, selective(s, trial))
        if saved < last and not (refused is not None and refused(selective(s, trial))):
            acc, last = trial, saved
            out.append(acc)
    return out


def recompute_sweeps(m: ModelSpec, s: Setup, refused: Callable[[Setup], bool] | None = None) -> list[Sweep]:
    """Two sweeps, least recompute first: selective recompute by growing module set; full ``block`` of N = 1 …
    layers of the first stage, then full ``uniform`` 1 (every layer). Two, because selective recompute of every
    module can keep less than full recompute of one block: memory shrinks along each, not along both."""
    sets = recompute_module_sets(m, s, refused)
    by_module = [selective(s, mods) for mods in sets]
    out: list[Setup] = []
    per_stage = len(stage_layers(m, s)[0])
    if s.recompute_granularity != "full" or s.recompute_method == "block":
        first = (s.recompute_num_layers or 0) + 1 if s.recompute_granularity == "full" else 1
        for n in range(first, per_stage):  # N = every layer of the stage is uniform 1's memory
            out.append(replace(s, recompute_granularity="full", recompute_method="block", recompute_num_layers=n))
    if (s.recompute_granularity, s.recompute_method, s.recompute_num_layers) != ("full", "uniform", 1):
        out.append(replace(s, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1))
    return [Sweep("recompute", sw) for sw in (by_module, out) if sw]


def switch_sweeps(p: Plan, s: Setup) -> list[Sweep]:
    """The one-change levers: bf16 gradient reduction, Transformer Engine's fused cross entropy, each other VPP, and
    expandable segments where the evidence shows fragmentation."""
    m, out = p.r.model, []
    for lever in ("grad-reduce", "ce-fusion", "vpp"):
        out += [Sweep(lever, [v]) for v in levers.switch_variants(lever, m, s)]
    if levers.expandable_evidence(frag_gib(p), s) is not None:
        out.append(Sweep("expandable-segments", [replace(s, expandable_segments=True)]))
    return out


def refuses(p: Plan) -> Callable[[Setup], bool] | None:
    """The rule catalogue's refusal of a setup, for sweeps that must step around it (None: no vetter)."""
    vet = p.vet
    if vet is None:
        return None
    return lambda s: not vet.clean(s)


def frag_gib(p: Plan) -> float | None:
    """The fragmentation the evidence shows: an OOM message's memory reserved but unallocated, GiB."""
    return p.anchor.expandable_segments_gib if p.anchor is not None else None


def sweeps(p: Plan, s: Setup) -> list[Sweep]:
    """Every lever's sweep on ``s``: offloads, recompute, the switches and each layout step."""
    out = [*offload_sweeps(p, s), *recompute_sweeps(p.r.model, s, refuses(p)), *switch_sweeps(p, s)]
    for lever in levers.LAYOUT_LEVERS:
        variants = levers.layout_variants(lever, p.r.model, s)
        if variants:
            out.append(Sweep(lever, variants))
    return out


def _partners(p: Plan, s: Setup) -> list[Sweep]:
    """The levers a stack puts under the optimizer sweep: activation layers, fine-grained modules, recompute (its
    most selective set, full uniform)."""
    partners = [sw for sw in offload_sweeps(p, s) if sw.name in ("activation", "fine-grained")]
    return partners + [Sweep("recompute", [sw.setups[-1]]) for sw in recompute_sweeps(p.r.model, s, refuses(p))]


def closest_stacks(p: Plan, s: Setup) -> list[MemoryEstimate]:
    """When nothing fits: each partner's most with the most optimizer fraction on top that host RAM and the catalogue
    allow (the least memory two levers reach inside the answer's limits)."""
    out: list[MemoryEstimate] = []
    if s.use_megatron_fsdp:
        return out
    for partner in _partners(p, s):
        top = most(p, partner.setups)
        found = most(p, fractions(top.setup)) if top is not None else None
        if found is not None:
            out.append(found)
    return out


def stacks(p: Plan, s: Setup, ok: Fit) -> list[MemoryEstimate]:
    """Two levers together, where one alone does not reach: the most of one lever (activation layers, fine-grained
    modules, recompute) with the least optimizer fraction that fits on top, then the first lever backed off to its
    least at that fraction; each numeric switch and a layout step with each offload and recompute sweep on top."""
    m = p.r.model
    out: list[MemoryEstimate] = []
    if not _reachable(p, estimate(m, s)):
        return _layout_stacks(p, s, ok)  # only a layout change moves the weights
    # Under Megatron-FSDP upstream refuses optimizer offload: no stack with a fraction on top.
    for partner in [] if s.use_megatron_fsdp else _partners(p, s):
        top = most(p, partner.setups)
        if top is None:
            continue
        found = first_fit(p, fractions(top.setup), ok)
        if found is None:
            continue
        fraction = found.setup.optimizer_offload_fraction
        backed = first_fit(p, [replace(x, optimizer_offload_fraction=fraction) for x in partner.setups], ok)
        out.append(backed or found)
    # Under each numeric switch (bf16 gradients, fused cross entropy), every offload and recompute sweep: each
    # switch frees a little (the gradients, the loss phase's logits) that the lever on top then need not.
    for sw in switch_sweeps(p, s):
        if sw.name in ("grad-reduce", "ce-fusion"):
            out += _on_top(p, sw.setups[0], ok)
    return out + _layout_stacks(p, s, ok)


def _on_top(p: Plan, s: Setup, ok: Fit) -> list[MemoryEstimate]:
    """The least setting of each offload and recompute sweep on ``s`` that is ``ok``."""
    found = [first_fit(p, sw.setups, ok) for sw in [*offload_sweeps(p, s), *recompute_sweeps(p.r.model, s, refuses(p))]]
    return [est for est in found if est is not None]


def _reachable(p: Plan, est: MemoryEstimate) -> bool:
    """Whether anything but a layout change could make ``est`` fit: offload, recompute and the switches never move
    the weights, so where the worst stage's weights alone exceed the budget, no stack of them is tried."""
    return est.worst.weights + p.shift(est.worst) <= p.budget_bytes()


def _layout_stacks(p: Plan, s: Setup, ok: Fit) -> list[MemoryEstimate]:
    """A layout step that does not fit alone, with each offload and recompute sweep on top."""
    m = p.r.model
    out: list[MemoryEstimate] = []
    for lever in levers.LAYOUT_LEVERS:
        variants = levers.layout_variants(lever, m, s)
        if variants and not ok(estimate(m, variants[0])) and _reachable(p, estimate(m, variants[0])):
            out += _on_top(p, variants[0], ok)
    return out
