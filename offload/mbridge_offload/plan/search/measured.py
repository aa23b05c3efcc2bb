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

from dataclasses import dataclass, field

from mbridge_offload.plan.evidence.figures import Figure
from mbridge_offload.plan.evidence.ranks import RankLayout, order_from_config, rank_of
from mbridge_offload.plan.evidence.read import read_evidence
from mbridge_offload.plan.evidence.steps import steady_step_s
from mbridge_offload.plan.inputs.resolve import Resolved
from mbridge_offload.plan.memory.stage import MemoryEstimate
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


def measure(r: Resolved, est: MemoryEstimate) -> Measured:
    """The evidence of ``r`` (its log, and the measured_* / ooms inputs) compared with ``est`` (the settings as
    given).

    Raises:
        InputError: a measured_log that cannot be read or holds no figure (the message lists what is accepted).
    """
    i, out = r.inputs, Measured(ooms=bool(r.inputs.ooms))
    if i.measured_log:
        ev = read_evidence(i.measured_log)
        out.notes += ev.notes
        _attribute(ev.memory, layout(r), est)
        _choose_point(out, [f for f in ev.points if f.value_gib is not None], est)
        sized = [f for f in ev.bounds if f.value_gib is not None]
        out.bound = max(sized, key=lambda f: (f.shift_gib or 0.0, -f.line_number)) if sized else None
        out.ooms = out.ooms or ev.ooms
        step, count = steady_step_s(ev.steps)
        if step is not None:
            out.step_s = step
            out.notes.append(f"log: median step time of {count} line(s) after the first (warm-up)")
        out.figures, out.omitted = _shown(ev.memory + ev.steps, out)
    if i.measured_peak_gib is not None:  # the caller's number wins over the log's: a point on the worst stage
        worst = est.worst
        out.point = Figure(
            source="max_memory_allocated",
            kind="point",
            value_gib=i.measured_peak_gib,
            line="measured_peak_gib (given)",
            line_number=0,
            stage=worst.stage,
            stage_source=f"given without a rank: compared with the worst predicted stage ({worst.stage})",
            shift_gib=round(i.measured_peak_gib - worst.total / GiB, 3),
        )
        out.point_shift = i.measured_peak_gib * GiB - worst.total
        out.point_note = (
            f"measured peak {i.measured_peak_gib:.2f} GiB (given) vs predicted {worst.total / GiB:.2f} GiB on the "
            f"worst stage ({worst.stage})"
        )
    if i.measured_step_s is not None:
        out.step_s = i.measured_step_s
    return out


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
