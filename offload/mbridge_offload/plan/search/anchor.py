"""What "fits" means, and how a measurement of the user's own run anchors the predictions.

Fits (``Plan.fits``, what ``estimate`` reports for a given config): the predicted peak allocated memory, grown by
the caching allocator's overhead (reserved beyond allocated), stays under what the device exposes less the CUDA
context. No margin: it is the verdict on that config. A recommendation keeps the margin on top
(``Plan.keeps_margin``): the settings it picks fit with ``margin`` of the usable memory still free.

The overhead depends on whether the tensor shapes repeat. PyTorch's caching allocator reuses a freed block for a
request of the same (rounded) size; it fragments when "allocation sizes change frequently" (PyTorch CUDA semantics,
``expandable_segments``). A dropless-MoE layer's per-expert token counts change every micro-batch, so its buffers do;
a dense model at fixed sequence length and micro-batch asks for the same sizes in the same order every step.
- dropless MoE: fitted to the published out-of-memory point (``data/published.yaml``, refitted by ``published.py``);
- dense: the reserved/allocated ratio NVIDIA/Megatron-LM#965 printed at a dense model's attention peak.
Neither relies on ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``: Bridge 0.6.2's Llama 3 70B / 3.1 405B
layer-offload perf recipes do not set it (their ``env_vars``), and no published run gives its overhead.

Anchoring: a measured figure belongs to the run that produced it (``plan/evidence/runs.py``: the config as written,
the hardware inputs, what the log printed about its run). The model is compared with the figure at that run; every
other run (the asked one, each option) is predicted as measured + model(run) - model(measured), category by category:
weights, gradients and optimizer state are counted from the parameters and carry no difference; a positive difference
goes on "other", a negative one on activations and other in proportion to the measured run's. No category is ever
negative: where the difference would drive one below zero it is held at zero and ``calibration.clamped`` says so. A
measured step time fixes the compute efficiency at the measured run (or, with a baseline given too and offload on, the
CPU AdamW rate). "These settings run out of memory" forces the shift to at least what an OOM implies, so the answer
never says the measured run fits. Never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mbridge_offload.plan.evidence import runs
from mbridge_offload.plan.evidence.figures import Figure
from mbridge_offload.plan.evidence.read import read_evidence
from mbridge_offload.plan.evidence.settings import LogSettings
from mbridge_offload.plan.inputs.hardware import DEFAULT_MARGIN, PINNED_HOST_SHARE
from mbridge_offload.plan.inputs.resolve import Assumption, Resolved
from mbridge_offload.plan.memory.stage import MemoryEstimate, StageMemory, estimate_memory
from mbridge_offload.plan.model.architecture import GB, GiB
from mbridge_offload.plan.model.run import Setup
from mbridge_offload.plan.results import Anchor, EvidenceRun, LogMismatch, MemoryBreakdown, SettingChange
from mbridge_offload.plan.search import measured
from mbridge_offload.plan.time.step import baseline_step_s, compute_efficiency, estimate_time, offload_off

# The categories of a prediction, the order of ``MemoryBreakdown``.
CATEGORIES = ("weights", "gradients", "optimizer", "activations", "other")
# The CUDA context and cuBLAS handles live outside PyTorch's allocator (~0.5 GiB on Hopper with CUDA 12).
CUDA_CONTEXT_GIB = 0.5
# Reserved beyond allocated (fragmentation of the caching allocator) for a dropless-MoE model, fitted to the card's
# OOM point: the 24-layer activation-offload run of Qwen3-30B-A3B died with 70.3 GiB allocated on a 79.11 GiB H100
# (tools/mbridge_offload_tools/evidence/published.py).
ALLOCATOR_OVERHEAD = 0.118
# The same for a dense model (static shapes): NVIDIA/Megatron-LM#965 (dense Phi-3-sized GPT, A100, MBS 1, seq 4096,
# Megatron's memory prints inside DotProductAttention): 44,283.33 MB allocated / 44,926.00 MB reserved at its
# highest point, 41,291.26 / 41,854.00 at the end of the forward: 1.45 % and 1.36 %; the larger one is used.
DENSE_ALLOCATOR_OVERHEAD = 0.0145


def _breakdown(parts: dict[str, float], unit: float) -> MemoryBreakdown:
    total = sum(parts.values())
    digits = 3
    return MemoryBreakdown(**{k: round(v / unit, digits) for k, v in parts.items()}, total=round(total / unit, digits))


def allocator_overhead(is_moe: bool) -> float:
    """Reserved beyond allocated, as a share of allocated: dropless MoE (shapes vary) or dense (shapes repeat)."""
    return ALLOCATOR_OVERHEAD if is_moe else DENSE_ALLOCATOR_OVERHEAD


@dataclass
class Plan:
    """One answer's yardstick: the resolved inputs, the budget and the anchoring offset."""

    r: Resolved
    margin: float
    offset: float = 0.0  # bytes added to every prediction
    time_kwargs: dict[str, Any] = field(default_factory=dict)
    anchor: Anchor | None = None
    assumptions: list[Assumption] = field(default_factory=list)
    vet: Any = None  # advice.Vetter: the rule catalogue on each candidate (planner.recommend sets it)
    host_refused: dict[str, str] = field(default_factory=dict)  # mode → why the node's host RAM refuses it
    ooms: bool = False  # the measured run ran out of memory (the ooms input, or an OOM in the measured log)
    measured: Resolved | None = None  # the run the evidence measured (None: the run as given, r)
    split: dict[str, float] = field(default_factory=dict)  # the offset by category (bytes): CATEGORIES' keys

    @property
    def overhead(self) -> float:
        return allocator_overhead(self.r.model.is_moe)

    def usable_bytes(self, s: Setup | None = None) -> float:
        """Peak allocated bytes at which the device is full (no margin). With ``s``'s expandable segments the caching
        allocator maps a growing segment in pages instead of new blocks, so buffers whose size changes every
        micro-batch (dropless MoE) reuse one range: the reserved-beyond-allocated falls to the static-shape figure
        (``DENSE_ALLOCATOR_OVERHEAD``; an assumption, no published run measures it)."""
        overhead = DENSE_ALLOCATOR_OVERHEAD if s is not None and s.expandable_segments else self.overhead
        return (self.r.gpu.capacity_bytes - CUDA_CONTEXT_GIB * GiB) / (1 + overhead)

    def budget_bytes(self, s: Setup | None = None) -> float:
        """What a recommendation may allocate (for ``s``): the usable bytes less the margin."""
        return self.usable_bytes(s) * (1 - self.margin)

    @property
    def measured_run(self) -> Resolved:
        """The run the evidence measured (the run as given when there is no evidence or nothing changed it)."""
        return self.measured if self.measured is not None else self.r

    def categories(self, st: StageMemory) -> dict[str, float]:
        """Stage ``st``'s categories (bytes) with the measured difference (``split``), none below zero; a category
        held at zero is reported once in ``calibration.clamped``."""
        parts = {c: float(getattr(st, c)) + self.split.get(c, 0.0) for c in CATEGORIES}
        for c, v in parts.items():
            if v < 0:
                parts[c] = 0.0
                if self.anchor is not None:
                    _clamped(self.anchor, c, st, self.split[c])
        return parts

    def shift(self, st: StageMemory) -> float:
        """Bytes the calibration adds to stage ``st``'s model peak (``offset``, or less where a category is held at
        zero)."""
        if not self.split:
            return self.offset
        return sum(self.categories(st).values()) - st.total

    def total(self, est: MemoryEstimate) -> float:
        return est.worst.total + self.shift(est.worst)

    def total_gib(self, est: MemoryEstimate) -> float:
        return self.total(est) / GiB

    def fits(self, est: MemoryEstimate) -> bool:
        """The verdict on this config: its peak, after the allocator overhead, within the device (no margin)."""
        if (self.ooms or self.r.inputs.ooms) and est.setup == self.measured_run.setup:
            return False  # the user saw the measured run fail: never contradict a measurement
        return self.total(est) <= self.usable_bytes(est.setup)

    def keeps_margin(self, est: MemoryEstimate) -> bool:
        """What a recommendation asks of the settings it picks: it fits with the margin still free."""
        return self.fits(est) and self.total(est) <= self.budget_bytes(est.setup)

    def free_gib(self, est: MemoryEstimate) -> float:
        """Allocatable memory left free at ``est``'s peak, GiB."""
        return (self.usable_bytes(est.setup) - self.total(est)) / GiB

    @property
    def host_budget_gb(self) -> float:
        """Host memory the offload buffers of one GPU may take: its share of the node (``PINNED_HOST_SHARE``)."""
        return self.r.gpu.host_ram_gb * PINNED_HOST_SHARE

    def host_ok(self, est: MemoryEstimate) -> bool:
        """The node's host RAM holds the offload buffers of all its GPUs within the share allowed."""
        return est.host_peak_gb <= self.host_budget_gb + 1e-9

    def host_sentence(self, est: MemoryEstimate) -> str:
        """Why an offload is refused on host memory: per GPU, per node, and the node's RAM."""
        g = self.r.gpu
        return (
            f"{est.host_peak_gb:.0f} GB of host memory per GPU ({est.host_peak_gb * g.gpus_per_node:,.0f} GB on a "
            f"{g.gpus_per_node}-GPU node) is more than {PINNED_HOST_SHARE:.0%} of the node's "
            f"{g.host_ram_node_gb:,.0f} GB ({g.host_source or 'preset'}; --host-ram-gb sets it per GPU)"
        )

    def breakdown(self, est: MemoryEstimate, gib: bool = False) -> MemoryBreakdown:
        """The worst stage by category, calibrated (``categories``), in GiB or GB."""
        if not self.split:
            return MemoryBreakdown(**(est.breakdown_gib(self.offset) if gib else est.breakdown_gb(self.offset)))
        return _breakdown(self.categories(est.worst), GiB if gib else GB)

    def budget_sentence(self, before: MemoryEstimate) -> str:
        w, gpu = before.worst, self.r.gpu
        return (
            f"without offload the worst stage (stage {w.stage}) peaks at {self.total_gib(before):.1f} GiB "
            f"({self.total(before) / GB:.1f} GB) allocated; the {gpu.name} exposes {gpu.capacity_bytes / GiB:.2f} "
            f"GiB, of which {self.budget_bytes() / GiB:.1f} GiB can be allocated ({CUDA_CONTEXT_GIB} GiB CUDA "
            f"context, {self.overhead:.1%} allocator overhead, {self.margin:.0%} kept free by a recommendation)"
        )

    def edge_note(self, est: MemoryEstimate) -> str | None:
        """When the yardstick says "does not fit" but the predicted peak is below what the device exposes: how
        much fragmentation it would take, so the verdict's uncertainty sits next to the number."""
        total, room = self.total(est), self.r.gpu.capacity_bytes - CUDA_CONTEXT_GIB * GiB
        if self.fits(est) or total >= room:
            return None
        kind = "dropless MoE, fitted to one published MoE OOM" if self.r.model.is_moe else "dense, Megatron-LM #965"
        return (
            f"borderline: the predicted peak {total / GiB:.1f} GiB allocated is below the {room / GiB:.1f} GiB the "
            f"device leaves after the CUDA context: it runs if the caching allocator reserves less than "
            f"{room / total - 1:.1%} beyond it; 'does not fit' comes from the {self.overhead:.1%} assumed here "
            f"({kind})"
        )

    def notes(self) -> list[str]:
        return list(self.anchor.notes) if self.anchor else []


def _anchor_step(p: Plan, est: MemoryEstimate, step: float, a: Anchor) -> None:
    """Baseline from a measured step (``est``: the measured run's); with a baseline given too and offload on, the CPU
    AdamW rate instead."""
    r = p.measured_run
    t = estimate_time(est, r.gpu, overlap=r.overlap, **p.time_kwargs)
    extra = t.optimizer_extra_s + t.activation_extra_s
    offloaded = max(st.offloaded_numel for st in est.stages)
    if offloaded and r.inputs.baseline_step_s is not None:
        copies = 0.0 if r.overlap else t.d2h_s + t.h2d_s
        cpu = step - r.inputs.baseline_step_s - copies
        threads = max(1, min(p.time_kwargs.get("cpu_threads") or 1, r.gpu.cpu_cores))
        if cpu <= 0:
            a.notes.append("the measured step is not slower than the baseline plus the copies: rate not changed")
            return
        rate = offloaded / cpu / threads
        p.time_kwargs["cpu_params_per_s_per_core"] = rate
        a.cpu_adam_params_per_s_per_core = rate
        a.notes.append(
            f"measured step {step:.3f} s at the measured run's settings implies CPU AdamW {rate / 1e9:.2f}e9 "
            "params/s/core"
        )
        return
    baseline = step - extra
    if baseline <= 0:
        a.notes.append(f"measured step {step:.3f} s is below the predicted offload cost {extra:.3f} s: not used")
        return
    p.time_kwargs["baseline_s"] = baseline
    a.baseline_step_s = baseline
    a.notes.append(
        f"measured step {step:.3f} s at the measured run's settings implies a {baseline:.3f} s step without offload"
    )


def _anchor_oom(p: Plan, predicted: float, a: Anchor) -> None:
    needed = p.usable_bytes() - predicted + 0.01 * GiB
    if needed > p.offset:
        p.offset = needed
    a.notes.append(
        f"the measured run ran out of memory: that needs a peak above {p.usable_bytes() / GiB:.1f} GiB allocated, but "
        f"the model predicts {predicted / GiB:.1f} GiB, so at least {p.offset / GiB:.1f} GiB more is in use than "
        "modelled (uneven MoE routing, fragmentation, another process); every prediction here includes it"
    )


def _measured_anything(r: Resolved) -> bool:
    i = r.inputs
    return bool(i.measured_log) or i.ooms is True or i.measured_peak_gib is not None or i.measured_step_s is not None


def _clamped(a: Anchor, category: str, st: StageMemory, split: float) -> None:
    """Say once per category that the measured difference would drive it below zero on some run."""
    if any(c.startswith(f"{category}:") for c in a.clamped):
        return
    a.clamped.append(
        f"{category}: the measured run's difference ({split / GiB:+.2f} GiB on {category}) is more than the "
        f"{getattr(st, category) / GiB:.2f} GiB of {category} the model gives a run this answer predicts (stage "
        f"{st.stage}, {st.peak_phase}): held at 0 GiB there, so that prediction is above measured + model(run) - "
        "model(measured) by the rest (the model's difference between the runs is larger than the measured one)"
    )


def _anchor_point(p: Plan, m: measured.Measured, a: Anchor) -> None:
    """A measured peak: every prediction shifted so that the model reproduces it (``measured.py`` says how)."""
    f = m.point
    assert f is not None
    p.offset = m.point_shift
    f.used = True
    a.measured_peak_gib, a.measured_kind, a.measured_stage = f.value_gib, "point", f.stage
    a.notes.append(
        f"{m.point_note}: every prediction shifted by {p.offset / GiB:+.2f} GiB (the measured run's difference)"
    )


def _anchor_bound(p: Plan, f: Figure, predicted: dict[int, float], a: Anchor) -> None:
    """An out-of-memory message: the peak of its stage is at least allocated + requested; shift up to it."""
    stage = f.stage if f.stage is not None else max(predicted, key=lambda k: predicted[k])
    value = float(f.value_gib or 0.0)
    shift = value * GiB - predicted[stage]
    a.measured_bound_gib = value
    a.fragmentation_gib = f.reserved_unallocated_gib
    what = (
        f"out of memory at line {f.line_number}: {f.allocated_gib or 0.0:.2f} GiB allocated + "
        f"{f.requested_gib or 0.0:.2f} GiB requested = {value:.2f} GiB, a lower bound on the peak of stage {stage} "
        f"({f.stage_source}), where the model predicts {predicted[stage] / GiB:.2f} GiB"
    )
    if shift > p.offset:
        p.offset, f.used = shift, True
        a.measured_kind, a.measured_stage = "bound", stage
        a.notes.append(f"{what}: every prediction shifted by {shift / GiB:+.2f} GiB")
    else:
        a.notes.append(f"{what}: already met by the shift above, kept")
    a.notes.extend(measured.oom_notes(f, p.r.gpu.capacity_bytes / GiB, p.r.gpu.name, CUDA_CONTEXT_GIB))
    if f.reserved_unallocated_gib is not None:
        a.expandable_segments_gib = f.reserved_unallocated_gib


def prepare(r: Resolved) -> Plan:
    """The yardstick for one answer: margin, time settings, and the anchor from the user's own run.

    The evidence is compared with the model at the run it measured (``plan/evidence/runs.py``), never at the run
    asked about; ``calibration.measured_run`` and ``asked_run`` show the two.

    Raises:
        InputError: a measured_log that cannot be read or holds no figure.
    """
    margin = r.inputs.margin if r.inputs.margin is not None else DEFAULT_MARGIN
    p = Plan(r, margin=margin, time_kwargs=r.time_kwargs())
    rate, source = r.cpu_adam_rate_source()
    host = _host_assumptions(r)  # gpus_per_node given as a flag is listed once, with the node's RAM beside it
    kept = [a for a in r.assumptions if a.name not in {h.name for h in host}]
    p.assumptions = [*kept, _rate_assumption(r, rate, source), _overhead_assumption(p), *host]
    if not _measured_anything(r):
        p.assumptions += _baseline_assumptions(p)
        _freeze_efficiency(p)
        return p
    ev = read_evidence(r.inputs.measured_log) if r.inputs.measured_log else None
    printed = ev.settings if ev is not None else None
    pair = runs.runs(r, printed)
    mr = pair.measured if pair.measured is not None else r
    p.measured = mr
    est = estimate_memory(mr.model, mr.setup)
    m = measured.measure(mr, est, ev)
    if pair.measured is None:  # the measured run cannot be modelled: nothing it says is moved to another run
        m.set_aside.append(f"{pair.why}: every figure set aside")
        m.point = m.bound = m.step_s = None
        m.ooms = False
    worst = float(est.worst.total)
    a = Anchor(
        measured_step_s=m.step_s,
        predicted_peak_gib=round(worst / GiB, 3),
        notes=[*m.notes, *(printed.notes if printed else []), *m.set_aside],
        figures=m.figures,
        figures_omitted=m.omitted,
        set_aside=m.set_aside,
    )
    for f in m.figures:  # a bound physics set aside still says what its message says (another GPU, fragmentation)
        if f.kind == "bound" and f.set_aside:
            a.notes.extend(measured.oom_notes(f, mr.gpu.capacity_bytes / GiB, mr.gpu.name, CUDA_CONTEXT_GIB))
    _anchor_memory(p, m, est, a)
    if m.step_s is not None:
        _anchor_step(p, est, m.step_s, a)
    a.memory_offset_gib = round(p.offset / GiB, 3)
    p.split = measured.split(p.offset, _measured_stage(est, a.measured_stage))
    p.anchor = a
    _describe_runs(p, pair, printed, est, a)
    p.assumptions += _baseline_assumptions(p)
    _freeze_efficiency(p)
    return p


def _anchor_memory(p: Plan, m: measured.Measured, est: MemoryEstimate, a: Anchor) -> None:
    """The memory figures: a point sets the offset, a bound raises it, an OOM makes the measured run not fit."""
    predicted = {st.stage: float(st.total) for st in est.stages}
    if m.point is not None:
        _anchor_point(p, m, a)
    if m.bound is not None:
        _anchor_bound(p, m.bound, predicted, a)
    if m.ooms:
        p.ooms = a.ooms = True
        _anchor_oom(p, float(est.worst.total), a)


def _measured_stage(est: MemoryEstimate, stage: int | None) -> StageMemory:
    return next((st for st in est.stages if st.stage == stage), est.worst)


def _describe_runs(p: Plan, pair: runs.Runs, printed: LogSettings | None, est: MemoryEstimate, a: Anchor) -> None:
    """``calibration``: the measured run and the asked run side by side, what differs, what the log printed."""
    r, mr = p.r, p.measured_run
    a.changes = [SettingChange(name=n, measured=mv, asked=av) for n, mv, av in pair.changes]
    a.log_settings = printed.as_inputs() if printed else {}
    a.mismatches = [
        LogMismatch(name=x.name, log=x.log, given=x.given, given_source=x.source, line_number=x.line_number)
        for x in pair.mismatches
    ]
    for x in pair.mismatches:
        a.notes.append(
            f"the log printed {x.name} = {x.log} (line {x.line_number}), the {x.source} says {x.given}: the figures "
            f"belong to the run that printed them, so the measured run takes {x.log}"
        )
    changed = [n for n, _, _ in pair.changes]
    asked = est
    if pair.changes:
        try:
            asked = estimate_memory(r.model, r.setup)
        except ValueError:  # an offload Megatron rejects: recommend's 'before' is then the run without it, as here
            asked = estimate_memory(r.model, offload_off(r.setup))
    written = "the config as written" if r.call is not None and r.call.config is not None else "the flags"
    log = ", measured_settings" if r.inputs.measured_settings else ""
    log += f", the log's {', '.join(pair.taken_from_log)}" if pair.taken_from_log else ""
    a.measured_run = EvidenceRun(
        settings=_settings(mr, changed),
        described_by=f"{written} and the hardware inputs{log}",
        model_gib=round(est.worst.total / GiB, 3),
        memory_gib=p.breakdown(est, gib=True),
    )
    a.asked_run = EvidenceRun(
        settings=_settings(r, changed),
        described_by="the same run (nothing changed)"
        if not pair.changes
        else "the run as given: " + ", ".join(f"{n} {mv} -> {av}" for n, mv, av in pair.changes),
        model_gib=round(asked.worst.total / GiB, 3),
        memory_gib=p.breakdown(asked, gib=True),
    )
    if pair.changes:
        a.notes.append(
            f"the evidence belongs to the measured run ({a.measured_run.described_by}); this answer is about another "
            f"run ({a.asked_run.described_by}): predicted as measured + model(asked) - model(measured) = "
            f"{a.measured_run.memory_gib.total:.2f} + {a.asked_run.model_gib:.2f} - {a.measured_run.model_gib:.2f} GiB"
            + (" (a category held at zero adds the rest)" if a.clamped else "")
        )


def _settings(r: Resolved, changed: list[str]) -> dict[str, Any]:
    """What an answer shows of one run: the batch, sequence, GPUs and parallel sizes, and every changed setting."""
    out: dict[str, Any] = {name: runs.value(r, name) for name in runs.SHOWN}
    for name in changed:
        out.setdefault(name, getattr(r.setup, name, None) if name != "model" else r.model.name)
    return out


def _freeze_efficiency(p: Plan) -> None:
    """A measured step calibrates the compute efficiency at the measured settings, once; every other setting the
    planner tries (another offload, recompute, TP) is then predicted at that efficiency, not pinned to the measured
    seconds."""
    r, kw = p.measured_run, p.time_kwargs
    if kw.get("baseline_s") is None or kw.get("mfu") is not None:
        return
    eff, source = compute_efficiency(r.model, r.setup, r.gpu, baseline_s=kw["baseline_s"])
    if source.startswith("calibrated"):
        kw.update(mfu=eff, mfu_source=f"{source} (at TP{r.setup.tp} PP{r.setup.pp} CP{r.setup.cp} EP{r.setup.ep})")


def _baseline_assumptions(p: Plan) -> list[Assumption]:
    """The step time without offload that every step-time factor divides by, and where it comes from."""
    r = p.r
    measured = p.time_kwargs.get("baseline_s")
    if measured is not None:
        source = "flag" if r.inputs.baseline_step_s is not None else "measured"
        note = "measured step time without offload" if source == "flag" else "implied by the measured step"
        return [Assumption(name="baseline_step_s", value=round(measured, 4), source=source, note=note)]
    mfu, mfu_source = compute_efficiency(r.model, r.setup, r.gpu, mfu=r.inputs.mfu)
    value = baseline_step_s(r.model, r.setup, r.gpu, mfu)
    return [
        Assumption(
            name="mfu",
            value=round(mfu, 4),
            source="flag" if r.inputs.mfu is not None else "default",
            note=f"compute efficiency (fraction of peak on the compute terms): {mfu_source}",
        ),
        Assumption(
            name="baseline_step_s",
            value=round(value, 4),
            source="derived",
            note=f"step-time model (plan/time/terms.py): model FLOPs at efficiency {mfu:.3f} of the GPU's peak "
            f"({r.gpu.peak_tflops:g} TFLOP/s bf16, {r.gpu.fp8_tflops or r.gpu.peak_tflops:g} FP8), TP/CP/EP/DP "
            "communication over NVLink or the network, the 1F1B bubble; pass --baseline-step-s with a measured "
            "step time to calibrate the efficiency",
        ),
    ]


def _host_assumptions(r: Resolved) -> list[Assumption]:
    """The node's host RAM and GPUs per node that every host-memory figure (host_gb per node, the pinned-memory
    check) rests on, each with its source."""
    from mbridge_offload.plan.inputs.implied import host

    rows = host(r.gpu, r.inputs.host_ram_gb is not None, r.inputs.gpus_per_node is not None)
    return [Assumption(name=n, value=v, source=src, note=note) for n, v, src, note in rows]


def _overhead_assumption(p: Plan) -> Assumption:
    """The allocator overhead this answer used, and what "fits" means with it."""
    why = (
        "dropless MoE: per-expert buffers change size every micro-batch; fitted to the Qwen3-30B-A3B card's OOM point"
        if p.r.model.is_moe
        else "dense: the same tensor sizes every step, so the caching allocator reuses its blocks; reserved/allocated "
        "of a dense Megatron run (NVIDIA/Megatron-LM#965)"
    )
    return Assumption(
        name="allocator_overhead",
        value=p.overhead,
        source="default",
        note=f"{why}; expandable_segments not assumed. fits = peak x (1 + overhead) <= GPU memory - "
        f"{CUDA_CONTEXT_GIB} GiB CUDA context; a recommendation also keeps the margin free",
    )


def _rate_assumption(r: Resolved, rate: float, source: str) -> Assumption:
    notes = {
        "preset": "the GPU preset's host CPU, fitted to the upstream card "
        "(mbridge_offload_tools/evidence/data/published.yaml)",
        "host-profile": f"`mbridge-offload calibrate`: {r.host_profile.describe()}" if r.host_profile else None,
        "default": "fused CPU AdamW on one core of the development host (torch 2.13)",
        "flag": None,
    }
    return Assumption(name="cpu_adam_params_per_s_per_core", value=rate, source=source, note=notes.get(source))
