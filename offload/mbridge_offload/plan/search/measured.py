"""The user's evidence against the model: each figure of a log compared with the prediction for its stage.

A log's figures (``plan/evidence``) carry the rank that printed them where the line says; the job's layout (TP, CP,
PP, the GPU count and megatron-core's rank order) tells that rank's pipeline stage, and the figure is compared with
the model's peak for that stage. Without a rank (or a layout that cannot place it) it is compared with the worst
predicted stage, and the answer says so. Then:

- a ``point`` (a measured peak) sets the shift every prediction carries. When the log has a peak for every
  pipeline stage (Megatron and Bridge print one per model-parallel rank), the job's peak (the largest) is compared
  with the model's (its worst stage); otherwise each measured stage with its own prediction, and the largest shift
  counts, so that no measured stage is predicted below its measurement (a peak given as ``measured_peak_gib`` is a
  point on the worst stage);
- a ``bound`` (an out-of-memory message: allocated + requested) raises the shift to at least its own, never lowers
  it; the most demanding bound of the log counts. The failure also means the settings as given do not fit
  (``anchor._anchor_oom`` makes the shift at least that large);
- step-time lines give the measured step (median after the warm-up line), unless ``measured_step_s`` is given.

Never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mbridge_offload.plan.evidence.figures import Evidence, Figure
from mbridge_offload.plan.evidence.physics import bound_problem, point_problem, step_problem, throughput_problem
from mbridge_offload.plan.evidence.ranks import RankLayout, order_from_config, rank_of
from mbridge_offload.plan.evidence.read import read_evidence
from mbridge_offload.plan.evidence.steps import steady_step_s
from mbridge_offload.plan.inputs.resolve import Resolved
from mbridge_offload.plan.memory.stage import MemoryEstimate, StageMemory
from mbridge_offload.plan.model.architecture import GiB

# An answer lists at most this many figures (a 1024-GPU job prints an OOM per rank); the rest are counted.
MAX_FIGURES = 16


@dataclass
class Measured:
    """What the evidence says at the settings as given, before it is turned into a shift."""

    point: Figure | None = None  # the measured peak that sets the shift
    point_shift: float = 0.0  # bytes: what the point asks every prediction to be shifted by
    point_note: str = ""
    bound: Figure | None = None  # the most demanding out-of-memory bound
    ooms: bool = False
    step_s: float | None = None
    figures: list[Figure] = field(default_factory=list)
    omitted: int = 0
    notes: list[str] = field(default_factory=list)
    set_aside: list[str] = field(default_factory=list)  # figures physics refuses, each with why (evidence/physics)

    @property
    def any(self) -> bool:
        return self.point is not None or self.bound is not None or self.ooms or self.step_s is not None


def layout(r: Resolved) -> RankLayout:
    """The job's rank layout as megatron-core builds it (its rank order from the config when it sets one)."""
    s = r.setup
    order, _ = order_from_config(r.raw_config)
    return RankLayout(s.num_gpus, s.tp, s.cp, s.pp, order, r.gpu.gpus_per_node)


def _attribute(figures: list[Figure], where: RankLayout, est: MemoryEstimate) -> None:
    """Each memory figure's stage (the rank's, else the worst predicted one) and its shift from the prediction."""
    predicted = {st.stage: st.total for st in est.stages}
    worst = est.worst.stage
    for f in figures:
        who = rank_of(f.line, inline=f.source == "max_memory_allocated")
        stage, why = where.stage(who)
        if stage is None or stage not in predicted:
            stage, why = worst, f"{why}: compared with the worst predicted stage ({worst})"
        f.stage, f.stage_source = stage, why
        if f.value_gib is not None:
            f.shift_gib = round(f.value_gib - predicted[stage] / GiB, 3)


def measure(r: Resolved, est: MemoryEstimate, ev: Evidence | None = None) -> Measured:
    """The evidence of ``r`` (its log, and the measured_* / ooms inputs) compared with ``est``: ``r`` is the run the
    evidence measured (``plan/evidence/runs.py``), not the run asked about. A figure no run of these settings on this
    GPU can produce is set aside with why (``plan/evidence/physics.py``).

    Args:
        r: the measured run.
        est: its memory estimate.
        ev: the log's evidence when the caller read it already (else ``r.inputs.measured_log`` is read).

    Raises:
        InputError: a measured_log that cannot be read or holds no figure (the message lists what is accepted).
    """
    i, out = r.inputs, Measured(ooms=bool(r.inputs.ooms))
    if i.measured_log:
        ev = ev if ev is not None else read_evidence(i.measured_log)
        out.notes += ev.notes
        _attribute(ev.memory, layout(r), est)
        points = _vetted([f for f in ev.points if f.value_gib is not None], out, lambda f: point_problem(f, r, est))
        _choose_point(out, points, est)
        sized = _vetted([f for f in ev.bounds if f.value_gib is not None], out, lambda f: bound_problem(f, r))
        out.bound = max(sized, key=lambda f: (f.shift_gib or 0.0, -f.line_number)) if sized else None
        out.ooms = out.ooms or ev.ooms
        step, count = steady_step_s(ev.steps)
        if step is not None and (why := throughput_problem(ev.steps, r)) is not None:
            step = None
            out.set_aside.append(why)
            for f in ev.steps:
                f.set_aside = why
        if step is not None:
            out.step_s = step
            out.notes.append(f"log: median step time of {count} line(s) after the first (warm-up)")
        out.figures, out.omitted = _shown(ev.memory + ev.steps, out)
    if i.measured_peak_gib is not None:  # the caller's number wins over the log's: a point on the worst stage
        _given_point(out, i.measured_peak_gib, r, est)
    if i.measured_step_s is not None:
        out.step_s = i.measured_step_s
    if out.step_s is not None:
        where = "measured_step_s" if i.measured_step_s is not None else "the log's step time"
        why = step_problem(out.step_s, r, where)
        if why is not None:
            out.step_s = None
            out.set_aside.append(why)
            for f in out.figures:
                f.set_aside = f.set_aside or (why if f.kind == "step" else None)
    return out


def split(offset: float, st: StageMemory) -> dict[str, float]:
    """The offset (bytes: the measured figure minus the model at the measured run) by category.

    Weights, gradients and optimizer state are counted from the parameters and carry none of it. A positive offset
    (more in use than modelled: uneven MoE routing, workspaces, another process) goes on ``other``; a negative one
    on activations and other in proportion to the measured stage's (``st``), so that the measured run's categories
    sum to the figure and none is negative (physics has set aside a figure below the resident state).
    """
    if offset >= 0:
        return {"other": offset} if offset else {}
    act, other = float(st.activations), float(st.other)
    if act + other <= 0:
        return {"other": offset}
    return {"activations": offset * act / (act + other), "other": offset * other / (act + other)}


def _vetted(figures: list[Figure], out: Measured, problem: Callable[[Figure], str | None]) -> list[Figure]:
    """The figures physics allows; each other one is marked and its reason kept in ``out.set_aside``."""
    kept = []
    for f in figures:
        why = problem(f)
        if why is None:
            kept.append(f)
        else:
            f.set_aside = why
            out.set_aside.append(why)
    return kept


def _given_point(out: Measured, peak_gib: float, r: Resolved, est: MemoryEstimate) -> None:
    """``measured_peak_gib``: a point on the worst stage, unless physics sets it aside."""
    worst = est.worst
    f = Figure(
        source="max_memory_allocated",
        kind="point",
        value_gib=peak_gib,
        line="measured_peak_gib (given)",
        line_number=0,
        stage=worst.stage,
        stage_source=f"given without a rank: compared with the worst predicted stage ({worst.stage})",
        shift_gib=round(peak_gib - worst.total / GiB, 3),
    )
    why = point_problem(f, r, est)
    if why is not None:
        f.set_aside = why
        out.set_aside.append(why)
        out.figures.insert(0, f)
        return
    out.point = f
    out.point_shift = peak_gib * GiB - worst.total
    out.point_note = (
        f"measured peak {peak_gib:.2f} GiB (given) vs predicted {worst.total / GiB:.2f} GiB on the worst stage "
        f"({worst.stage}) of the measured run"
    )


def _choose_point(out: Measured, points: list[Figure], est: MemoryEstimate) -> None:
    """The measured peak that sets the shift, and the shift (see the module docstring)."""
    if not points:
        return
    stages = {f.stage for f in points}
    top = max(points, key=lambda f: (f.value_gib or 0.0, -f.line_number))
    worst = est.worst
    if stages >= {st.stage for st in est.stages}:  # every stage measured: the job's peak against the model's
        out.point, out.point_shift = top, float(top.value_gib or 0.0) * GiB - worst.total
        out.point_note = (
            f"measured peaks of every pipeline stage, the largest {top.value_gib:.2f} GiB on stage {top.stage} "
            f"(line {top.line_number}; a point) vs the model's worst stage {worst.stage} at "
            f"{worst.total / GiB:.2f} GiB"
        )
        return
    chosen = max(points, key=lambda f: (f.shift_gib or 0.0, f.value_gib or 0.0))
    predicted = est.stages[chosen.stage or 0].total if chosen.stage is not None else worst.total
    out.point, out.point_shift = chosen, float(chosen.value_gib or 0.0) * GiB - predicted
    out.point_note = (
        f"measured peak {chosen.value_gib:.2f} GiB (line {chosen.line_number}; a point) on stage {chosen.stage} vs "
        f"predicted {predicted / GiB:.2f} GiB for that stage"
        + (" (the largest shift of the measured stages)" if len(stages) > 1 else "")
    )


def _shown(figures: list[Figure], m: Measured) -> tuple[list[Figure], int]:
    """The figures an answer lists: the ones that count first, then in line order, at most ``MAX_FIGURES``."""
    key = {id(f) for f in (m.point, m.bound) if f is not None}
    ordered = [f for f in figures if id(f) in key] + [f for f in figures if id(f) not in key]
    return ordered[:MAX_FIGURES], max(0, len(ordered) - MAX_FIGURES)


def oom_notes(bound: Figure, capacity_gib: float, gpu: str, context_gib: float) -> list[str]:
    """What an out-of-memory message says beyond its bound: fragmentation, the GPU, other processes."""
    out = []
    frag, free, request = bound.reserved_unallocated_gib, bound.free_gib, bound.requested_gib
    if frag is not None and request is not None:
        enough = (free or 0.0) + frag >= request
        out.append(
            f"{frag:.2f} GiB was reserved by PyTorch but unallocated at the failure (fragmentation of the caching "
            f"allocator): PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True would recover up to that; with "
            f"{free or 0.0:.2f} GiB free, the {request:.2f} GiB request "
            + (
                "could then have been served; whether the rest of the step fits is not in the message (the peak is "
                "at least the bound)"
                if enough
                else "would still have failed"
            )
        )
    if bound.capacity_gib is not None and abs(bound.capacity_gib - capacity_gib) > 0.02 * capacity_gib:
        out.append(
            f"the failing GPU has {bound.capacity_gib:.2f} GiB total capacity, this answer is for {gpu} "
            f"({capacity_gib:.2f} GiB): pass gpu (or gpu_memory_gb) to match the run"
        )
    if bound.other_processes_gib:
        out.append(
            f"other processes held {bound.other_processes_gib:.2f} GiB on that GPU: not modelled (free the GPU, or "
            "lower gpu_memory_gb by that much)"
        )
    if bound.process_gib is not None and bound.allocated_gib is not None:
        outside = bound.process_gib - bound.allocated_gib - (bound.reserved_unallocated_gib or 0.0)
        if outside > 1.0:
            out.append(
                f"the process held {outside:.2f} GiB outside PyTorch's allocator (CUDA context, NCCL and cuBLAS "
                f"buffers); the model assumes {context_gib} GiB of context"
            )
    return out
