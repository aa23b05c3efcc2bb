"""The planner's answers as pydantic models: the library returns them, the CLI's ``--json`` prints
``model_dump(mode="json")`` of them and the MCP tools use them as structured output. One schema, no copies.

Units: ``memory_gb`` is decimal GB (10⁹ bytes, design.md's contract); ``memory_gib`` is GiB (2³⁰ bytes), the unit of
Megatron's memory report ("MB" there is bytes / 1024²) and of PyTorch's OOM messages. Every answer says so in
``unit``. Never imports torch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from mbridge_offload.config.effective import EffectiveValue
from mbridge_offload.plan.evidence.figures import Figure
from mbridge_offload.plan.inputs.resolve import Assumption

EFFECTIVE_DOC = (
    "the config's one resolution (mbridge_offload.config.effective): dotted key → {value, source}, identical to "
    "validate's for the same input; empty without a config"
)

# What every step_time_factor means (the upstream card's definition), said once for every answer.
FACTOR_DOC = (
    "step time over the run as given without the change (1.0 = no change; the card's Qwen3-30B-A3B setup at 50 % "
    "optimizer offload reads about x2.5)"
)
NO_LEVERS_DOC = "step time over the same run with no lever at all (recompute and every offload off)"

UNIT = (
    "memory_gb: decimal GB (10^9 bytes); memory_gib: GiB (2^30 bytes, the unit of Megatron's memory report, "
    "which prints bytes/1024^2 as 'MB'); both are peak memory allocated by PyTorch on the worst pipeline stage"
)


class MemoryBreakdown(BaseModel):
    """Per-GPU memory of the worst pipeline stage by kind, at the phase of the step that sets its peak (``total``
    is that phase's; see ``Estimate.phases``)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    other: float = Field(description="workspaces, MoE dispatch buffers, and any calibration offset")
    total: float


class BeforeAfter(BaseModel):
    before: MemoryBreakdown = Field(description="the config as given, its offload included")
    after: MemoryBreakdown = Field(description="with the recommendation")
    without_offload: MemoryBreakdown | None = Field(None, description="the config with every offload off")


class Fallback(BaseModel):
    """For a run that fits without offload: the cheapest offload that frees a stated headroom."""

    mode: Literal["optimizer", "activation"]
    overrides: list[str]
    headroom_gib: float = Field(description="the memory it had to free, GiB")
    headroom_source: str
    freed_gib: float = Field(description="per-GPU peak it frees (worst stage), GiB")
    freed_gb: float
    memory_gib: float = Field(description="per-GPU peak with it (worst stage), GiB")
    step_time_factor: float = Field(description="its step time over the config as given (" + FACTOR_DOC + ")")
    step_time_factor_vs_no_levers: float = Field(description=NO_LEVERS_DOC)


class StageTotal(BaseModel):
    stage: int
    total_gb: float
    params: int
    total_gib: float = Field(0.0, description="this stage's peak, GiB, with any calibration offset (as memory_gib)")
    peak_phase: str | None = Field(None, description="the phase of the step that sets this stage's peak")


class TimeBreakdown(BaseModel):
    """Seconds per step: the step without any lever (``baseline``), the configured run by term, and what offloading
    adds. ``step`` = ``without_offload`` + ``optimizer_extra`` + ``activation_extra``; ``without_offload`` is the sum
    of ``compute`` ... ``bubble``."""

    baseline: float = Field(
        description="the same run with recompute and every offload off (step_time_factor_vs_no_levers' base)"
    )
    d2h: float
    cpu_adam: float
    h2d: float
    optimizer_extra: float
    activation_extra: float
    step: float = Field(0.0, description="the configured run's step time, offload included")
    without_offload: float = Field(
        0.0, description="the configured run's step without its offload cost (estimate's step_time_factor's base)"
    )
    compute: float = Field(0.0, description="model FLOPs at the compute efficiency and the GEMM efficiency")
    recompute: float = Field(0.0, description="forward FLOPs that activation recomputation runs again")
    tp_comm: float = Field(0.0, description="tensor-parallel all-gather/reduce-scatter (or all-reduce), exposed")
    cp_comm: float = Field(0.0, description="context-parallel K/V ring, the part attention does not hide")
    ep_comm: float = Field(0.0, description="expert-parallel all-to-all of the routed tokens")
    moe_overhead: float = Field(0.0, description="fixed per-MoE-layer cost per micro-batch (fitted)")
    dp_comm: float = Field(0.0, description="gradient reduce-scatter + parameter all-gather not hidden by overlap")
    bubble: float = Field(0.0, description="pipeline bubble, (PP-1)/VPP micro-batch times")
    efficiency: float = Field(0.0, description="fraction of peak on the compute terms (fitted or calibrated)")
    assumptions: list[str] = Field([], description="what these seconds rest on: efficiency source, links, overlap")


class Phase(BaseModel):
    """One phase of a training step on one pipeline stage and the memory allocated at its highest point.

    Canonical names: ``forward_backward`` (weights, gradients and optimizer states resident, plus the activations of
    the micro-batches in flight for the schedule), ``loss`` (the logits / cross-entropy peak on the last stage),
    ``optimizer_step`` (after activations are freed: the step's transients such as the distributed optimizer's fp32
    gradient copy and the HybridDeviceOptimizer's copies)."""

    name: str
    memory_gib: float = Field(description="peak allocated in this phase on one GPU of the stage, GiB")
    memory_gb: float = Field(0.0, description="the same in decimal GB")
    what: str = Field("", description="what is live at this phase's highest point")


class StagePhases(BaseModel):
    """The phases of one pipeline stage; the stage's peak is the largest of them (phases never coexist)."""

    stage: int
    phases: list[Phase]
    peak_phase: str = Field(description="the name of the phase that sets this stage's peak")


class EvidenceRun(BaseModel):
    """One of the two runs an answer with evidence speaks of: the run the evidence measured, or the run asked about."""

    settings: dict[str, Any] = Field(
        description="the run's batch, sequence, GPU count and parallel sizes, and every setting where the two runs "
        "differ (planner input names; Setup field names for the rest)"
    )
    described_by: str = Field(description="what describes this run: the config as written, the log, the flags, ...")
    model_gib: float = Field(description="the model's peak for this run (worst stage), uncalibrated, GiB")
    memory_gib: MemoryBreakdown = Field(
        description="measured run: the model's categories with the evidence's difference on activations/other, "
        "summing to the measured figure; asked run: measured + model(asked) - model(measured) per category, GiB"
    )


class SettingChange(BaseModel):
    """A setting where the asked run differs from the measured one."""

    name: str
    measured: Any
    asked: Any


class LogMismatch(BaseModel):
    """A setting the log printed about its own run that disagrees with the config (or the flags)."""

    name: str = Field(description="planner input name (num_gpus for the world size)")
    log: int = Field(description="what the log printed")
    given: Any = Field(description="what the config or the flags say")
    given_source: str = Field(description="where that came from: config, argv, flag")
    line_number: int = Field(description="the log line that printed it (1-based)")


class Anchor(BaseModel):
    """How the user's evidence (a log, a measured peak or step, "it ran out of memory") changed the predictions.

    ``figures`` lists what was read from ``measured_log``, each with its line, its kind (``bound``: an out-of-memory
    message, the peak is at least allocated + requested; ``point``: a measured peak; ``step``: a step time) and the
    pipeline stage it was compared with; ``measured_kind`` says which kind set ``memory_offset_gib``."""

    measured_peak_gib: float | None = Field(None, description="the measured peak (a point) the shift reproduces, GiB")
    measured_step_s: float | None = None
    predicted_peak_gib: float = Field(description="the model's peak at the measured settings, before anchoring")
    memory_offset_gib: float = Field(
        0.0,
        description="the measured run's figure minus the model's prediction for that run (GiB); added to every "
        "prediction, on 'other' when positive, on activations and other in proportion when negative, never below 0",
    )
    baseline_step_s: float | None = Field(None, description="the baseline step time the measurement implies")
    cpu_adam_params_per_s_per_core: float | None = Field(None, description="the CPU AdamW rate it implies")
    ooms: bool = False
    notes: list[str] = []
    measured_bound_gib: float | None = Field(
        None, description="an out-of-memory message's lower bound on the peak (allocated + requested), GiB"
    )
    measured_kind: Literal["point", "bound"] | None = Field(
        None, description="what set memory_offset_gib: a measured peak (point) or an out-of-memory bound (bound)"
    )
    measured_stage: int | None = Field(
        None, description="the pipeline stage that figure was compared with (the failing rank's, else the worst)"
    )
    fragmentation_gib: float | None = Field(
        None, description="reserved by PyTorch but unallocated at the out-of-memory failure (allocator fragmentation)"
    )
    expandable_segments_gib: float | None = Field(
        None,
        description="what PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True would recover: the fragmentation at the "
        "failure, GiB (notes say whether the failing request would then have been served)",
    )
    figures: list[Figure] = Field([], description="the figures read from measured_log, those that counted first")
    figures_omitted: int = Field(0, description="figures read but not listed (a log of many ranks)")
    measured_run: EvidenceRun | None = Field(
        None, description="the run the evidence measured: the config as written, the hardware inputs, the log's own"
    )
    asked_run: EvidenceRun | None = Field(
        None, description="the run this answer is about (the config as given); the same settings when none changed"
    )
    changes: list[SettingChange] = Field([], description="where the asked run differs from the measured run")
    set_aside: list[str] = Field([], description="figures physics refuses (impossible for that run on that GPU): why")
    log_settings: dict[str, int] = Field(
        {}, description="what the log printed about its own run (batch, sequence, world size, parallel sizes)"
    )
    mismatches: list[LogMismatch] = Field([], description="printed settings that disagree with the config or flags")
    clamped: list[str] = Field(
        [], description="a category the measured difference would drive below zero, held at zero, and why"
    )


class Estimate(BaseModel):
    """``estimate``: memory, host memory and step time of one setting."""

    unit: str = UNIT
    memory_gb: MemoryBreakdown
    memory_gib: MemoryBreakdown
    host_gb: float
    offloaded_fraction: float
    step_time_factor: float = Field(
        description="step time over the same config with its offload off, recompute as given (time_s.step / "
        "time_s.without_offload; " + FACTOR_DOC + ")"
    )
    step_time_factor_vs_no_levers: float = Field(description=NO_LEVERS_DOC + " (time_s.step / time_s.baseline)")
    fits: bool
    budget_gb: float = Field(description="peak allocated memory that fits: exposed capacity less context, overhead")
    budget_gib: float
    gpu_memory_gb: float = Field(description="what the device exposes to CUDA, decimal GB")
    gpu_memory_gib: float
    worst_stage: int
    stages: list[StageTotal]
    host_peak_gb: float
    time_s: TimeBreakdown
    model: str
    gpu: str = Field("", description="the GPU preset every memory figure is for")
    num_gpus: int = Field(0, description="the GPU count it assumes")
    parallel: dict[str, Any]
    optimizer_offload_fraction: float
    activation_offload_layers: int
    offload_modules: list[str] = Field([], description="model.offload_modules in force (fine-grained offloading)")
    warnings: list[str]
    notes: list[str] = []
    assumptions: list[Assumption]
    calibration: Anchor | None = None
    effective: dict[str, EffectiveValue] = Field(default_factory=dict, description=EFFECTIVE_DOC)
    phases: list[StagePhases] = Field([], description="per pipeline stage: the step's phases and the one that peaks")
    peak_phase: str | None = Field(None, description="the phase that sets the worst stage's peak")


class Change(BaseModel):
    """One edit of an option, in the config's own notation: a Bridge dotted key, or a Megatron-LM flag when the
    input was Megatron-LM argv (value null: delete the flag; true: a bare switch)."""

    key: str
    value: Any


class StageGib(BaseModel):
    stage: int
    total_gib: float = Field(description="predicted peak allocated on one GPU of this pipeline stage, GiB")
    peak_phase: str | None = Field(None, description="the phase of the step that sets this stage's peak")


class Option(BaseModel):
    """One way to make the run fit: its changes, memory, host memory and step time (``recommend``'s ``options``)."""

    rank: int = Field(description="0 = the recommendation (what mode/overrides/memory_gb.after describe)")
    changes: list[Change] = Field(description="the edits, in the config's notation (see notation)")
    notation: Literal["bridge", "megatron-lm"] = "bridge"
    overrides: list[str] = Field(description="the same edits as Bridge/Hydra overrides (what apply --option writes)")
    levers: list[str] = Field(description="the levers it pulls: recompute, activation, fine-grained, optimizer, ...")
    memory_gib: MemoryBreakdown = Field(description="worst pipeline stage, GiB (the breakdown of its peak phase)")
    peak_phase: str | None = Field(None, description="the phase of the step that sets the worst stage's peak")
    stages_gib: list[StageGib]
    host_gb: float = Field(description="host memory per GPU (pinned buffers and pageable moments, peak), GB")
    host_gb_per_node: float = Field(description="host_gb times the GPUs of one node")
    step_time_s: float
    step_time_factor: float = Field(description="step_time_s over the config as given (" + FACTOR_DOC + ")")
    step_time_factor_vs_no_levers: float = Field(description=NO_LEVERS_DOC)
    fits: bool = Field(description="fits the device with the recommendation margin kept free")
    margin_gib: float = Field(
        description="allocatable GPU memory left free at the predicted peak, GiB (0 for an option over its budget: "
        "memory_gib.total - budget_gib is how far over)",
        ge=0,
    )
    comfortable: bool = Field(description="margin_gib is at least the headroom asked for (headroom_gib)")
    alternative: bool = Field(description="pulls a lever the caller did not allow: shown, not ranked first")
    changes_layout: bool = Field(description="changes TP, CP, VPP or the micro-batch size (checkpoints, throughput)")
    budget_gib: float = Field(
        0.0,
        description="what it may allocate with the margin kept, GiB: fits holds exactly when memory_gib.total <= it",
    )
    risk: float = Field(0.0, description="its risk as a share of the step time (ranking: step_time_s x (1 + risk))")
    risks: list[str] = Field([], description="what it risks, in words (host RAM share, changes, known upstream bugs)")
    why: str


class Recommendation(BaseModel):
    """``recommend``: the smallest offload that fits, with the why and the assumptions behind it."""

    mode: Literal["none", "optimizer", "activation", "both", "fine-grained", "fine-grained+optimizer"]
    overrides: list[str]
    memory_gb: BeforeAfter
    memory_gib: BeforeAfter
    fits: bool
    step_time_factor: float = Field(
        description="the recommendation's step time over the config as given (" + FACTOR_DOC + ")"
    )
    step_time_factor_vs_no_levers: float = Field(description=NO_LEVERS_DOC)
    rationale: list[str]
    unit: str = UNIT
    budget_gb: float
    budget_gib: float
    optimizer_offload_fraction: float
    offloaded_fraction: float
    activation_offload_layers: int
    offload_modules: list[str] = Field([], description="recommended model.offload_modules (fine-grained modes)")
    host_gb: float
    host_peak_gb: float
    suggestions: list[str] = []
    warnings: list[str] = []
    gpu: str = Field("", description="the GPU preset every memory figure is for")
    num_gpus: int = Field(0, description="the GPU count it assumes")
    given_mode: str = Field("none", description="the offload the config as given switches on")
    advice: str | None = Field(None, description="the advice in words when it changes the config's own offload")
    fallback: Fallback | None = Field(None, description="mode none: the cheapest offload that frees the headroom")
    options: list[Option] = Field(
        [], description="ways to fit, in the order ranking states; options[0] = mode/overrides"
    )
    ranking: str = Field("", description="the order of options[] in words (the one sort key, options.RANKING)")
    levers: list[str] = Field([], description="the levers the caller allowed (ranked first); others are alternatives")
    headroom_gib: float | None = Field(None, description="the free memory a 'comfortable' option keeps, GiB")
    assumptions: list[Assumption]
    calibration: Anchor | None = None
    effective: dict[str, EffectiveValue] = Field(default_factory=dict, description=EFFECTIVE_DOC)
    phases: list[StagePhases] = Field([], description="with the recommendation, per pipeline stage: the step's phases")
    peak_phase: str | None = Field(None, description="the phase that sets the worst stage's peak (memory_*.after)")
    confirm: dict[str, Any] | None = Field(
        None,
        description="recommend --confirm only: options[0] re-checked by trace (its peak and categories beside the "
        "planner's, the gap, fits_by_trace and the verdict), or why the trace could not build it",
    )
