"""Per-GPU and host memory model of Megatron training, with and without CPU offloading.

For each pipeline stage the model lists the tensors one GPU holds — parameter shards (dense parts split by TP,
experts by EP and expert-TP, embedding on the first stage, output layer on the last), gradients, optimizer state
(sharded by the distributed optimizer over the dense data-parallel group ``DP·CP`` or the expert data-parallel
group), and the activations each transformer layer saves for backward — and takes each stage's peak as the largest
phase of a step (forward/backward, loss, optimizer step: ``plan/memory/phases.py``), never the sum of transients that
do not coexist; the worst stage's peak is the answer. Offloading is modelled as the upstream code does it:

- ``HybridDeviceOptimizer`` (HDO) inside the distributed optimizer, Bridge's default non precision-aware path:
  the fp32 main-param shards stay on the GPU (they are the DistributedOptimizer's own tensors); HDO clones the
  offloaded ones to the CPU and runs their Adam step there, so the GPU loses only their two Adam moments (8 B).
  With ``use_precision_aware_optimizer`` HDO owns the fp32 masters, so the masters move too (12 B).
  The split is HDO's greedy numel prefix over whole tensors (``greedy_offload``). megatron-core's own HDO (what
  Bridge builds unless our install path is used: ``Setup.hybrid_optimizer``) keeps more on the GPU: its fp32
  gradient copies, and the first build's fp32 clones until a garbage collection (``_megatron_core_kept``).
- Layer-level activation offload (TE ``get_cpu_offload_context``, v2): at most ``model_layers − k`` layers of
  *eligible* saved tensors (≥ 256 Ki elements) stay resident; smaller ones never move.

Megatron-FSDP (``use_megatron_fsdp``) replaces the DDP/DistOpt accounting of weights, gradients and optimizer state
(``plan/memory/fsdp.py``); activations are ``plan/memory/activations.py``. Pipeline stages follow megatron-core: even
split,
``num_layers_in_first/last_pipeline_stage``, or ``pipeline_model_parallel_layout`` (layers per virtual stage).
Sizes are bytes; ``GB`` = 10⁹ bytes. Never imports torch. See ``docs/planner.md`` for every formula.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from dataclasses import dataclass, field

from mbridge_offload.plan.memory import dp_shards
from mbridge_offload.plan.memory.activations import stage_activations
from mbridge_offload.plan.memory.phases import (
    PhaseMemory,
    keeps_param_remainders,
    optimizer_step_transient,
    peak,
    stage_phases,
)
from mbridge_offload.plan.model.architecture import DTYPE_BYTES, GB, GiB, ModelSpec
from mbridge_offload.plan.model.params import Tensor, chunk_params, next_pow2, stage_layers, stage_params
from mbridge_offload.plan.model.run import Setup, check_setup
from mbridge_offload_runtime.upstream import hdo_offload_mask

__all__ = [
    "MemoryEstimate",
    "StageMemory",
    "estimate_memory",
    "greedy_offload",
    "optimizer_memory",
]

# ------------------------------------------------------------------------------------------- optimizer


def optimizer_param_order(params: list[Tensor]) -> list[Tensor]:
    """HDO walks param groups in order, params in group order. megatron-core's ``_get_param_groups`` sorts the groups
    with the default one (weight decay) first and the no-decay overrides after (both releases); dense and expert
    params live in two separate optimizers (ChainedOptimizer). Without the distributed optimizer a group keeps its
    params in model order; with it, in buffer order per rank (``plan/memory/dp_shards.py``)."""
    return [t for t in params if t.decay] + [t for t in params if not t.decay]


def greedy_offload(numels: list[int], fraction: float) -> int:
    """Elements HDO puts on the CPU: whole tensors, in order, while the running total is below
    ``fraction × total`` (the tensor that crosses the threshold goes too; 1.0 → all): ``hdo_offload_mask``'s
    prefix, found by bisection over the running totals (a rank's shards run to tens of thousands)."""
    prefix = list(itertools.accumulate(numels))
    threshold = fraction * (prefix[-1] if prefix else 0)
    if threshold <= 0:
        return 0
    return prefix[min(bisect.bisect_left(prefix, threshold), len(prefix) - 1)]


def _sharded_over(m: ModelSpec, s: Setup, expert: bool) -> int:
    """Ranks the distributed optimizer shards a parameter over: DP·CP for dense params, expert DP for experts."""
    return (s.expert_dp(m) if expert else s.dp * s.cp) if s.distributed_optimizer else 1


def _shards(params: list[Tensor], m: ModelSpec, s: Setup, expert: bool) -> list[int]:
    """Numel of each optimizer-owned shard (DistOpt only: ``_sharded_over``)."""
    d = _sharded_over(m, s, expert)
    return [math.ceil(t.numel / d) for t in optimizer_param_order(params) if t.expert == expert]


@dataclass
class OptimizerMemory:
    gpu_bytes: int  # includes ``kept_bytes``
    host_bytes: int  # steady state: pinned clones and grad buffers (power-of-two rounded) + pageable moments
    host_transient_bytes: int  # the first HDO, built on the full local params, clones them before DistOpt rebuilds
    shard_numel: int
    offloaded_numel: int
    # megatron-core's HDO only: GPU bytes it holds beyond the states (the fp32 gradient copies it never frees, the
    # first build's fp32 clones until a garbage collection), what they are, and its largest GPU-stepped shard.
    kept_bytes: int = 0
    kept_what: str = ""
    largest_gpu_numel: int = 0
    # The largest parameter group's shard (dense or expert optimizer, weight decay or not): TE FusedAdam's step
    # holds its per-group temporaries for one group at a time.
    largest_group_numel: int = 0
    # The GPU of the stage (rank order: TP fastest, then CP, DP) these bytes are for: under the distributed optimizer
    # HDO's split differs from rank to rank (``_rank_split``); 0 where every GPU of the stage holds the same.
    gpu: int = 0


def _moment_bytes(s: Setup) -> tuple[int, int]:
    """Bytes per element of the fp32 master (or what stands for it) and of the two Adam moments."""
    moments = DTYPE_BYTES[s.exp_avg_dtype] + DTYPE_BYTES[s.exp_avg_sq_dtype]
    if s.precision_aware_optimizer and s.distributed_optimizer:
        if keeps_param_remainders(s):
            return 2, moments  # only the 16 low bits the bf16 param lacks (TE FusedAdam store_param_remainders)
        return DTYPE_BYTES[s.main_params_dtype], moments
    return 4, 8  # fp32 main params; exp_avg dtypes only apply to the precision-aware path


def _layout_setup(s: Setup) -> Setup:
    """``s`` reduced to what the buffers' layout reads (the layers of each chunk, their shards, the bucketing): the
    search's many settings that leave it alone (recompute, offloads, batch, dtypes) share one layout."""
    return Setup(
        num_gpus=s.num_gpus,
        tp=s.tp,
        pp=s.pp,
        vpp=s.vpp,
        cp=s.cp,
        ep=s.ep,
        etp=s.etp,
        num_layers_in_first_pipeline_stage=s.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=s.num_layers_in_last_pipeline_stage,
        pipeline_layout=s.pipeline_layout,
        overlap_grad_reduce=s.overlap_grad_reduce,
        moe_grouped_gemm=s.moe_grouped_gemm,
    )


@functools.lru_cache(maxsize=32)
def _shards_by_rank(m: ModelSpec, s: Setup, stage: int) -> dict[bool, list[list[int]]]:
    """Every rank's shards of stage ``stage`` (dense and expert), in HDO's order (``plan/memory/dp_shards.py``);
    ``s`` is :func:`_layout_setup`'s, so that the search lays each layout out once."""
    chunks = chunk_params(m, s, stage)
    shared_embedding = m.tied_embeddings and s.pp > 1
    shared = [[shared_embedding and t.name in ("embedding", "output_layer") for t in c] for c in chunks]
    sizes = [dp_shards.bucket_size(s.dp * s.cp, s.overlap_grad_reduce, stage, c) for c in range(len(chunks))]
    groups = {False: s.dp * s.cp, True: s.expert_dp(m)}
    return {e: dp_shards.rank_shards(chunks, e, d, sizes, shared) for e, d in groups.items()}


def _rank_split(m: ModelSpec, s: Setup, stage: int) -> tuple[int, dict[bool, list[int]]]:
    """The GPU of pipeline stage ``stage`` that keeps the most optimizer state on the GPU under HDO, and its shards
    (dense and expert) in HDO's order: under the distributed optimizer each rank owns different tensors of the
    buffers (``plan/memory/dp_shards.py``), so the greedy split leaves more on some GPUs than on others."""
    per_rank = _shards_by_rank(m, _layout_setup(s), stage)
    left = {
        e: [sum(r) - greedy_offload(r, s.optimizer_offload_fraction) for r in ranks] for e, ranks in per_rank.items()
    }
    ranks = dp_shards.gpu_ranks(s.tp, s.cp, s.dp, s.ep, s.resolved_etp(m))
    gpu = max(range(len(ranks)), key=lambda i: (left[False][ranks[i][0]] + left[True][ranks[i][1]], -i))
    return gpu, {False: per_rank[False][ranks[gpu][0]], True: per_rank[True][ranks[gpu][1]]}


def optimizer_memory(m: ModelSpec, s: Setup, params: list[Tensor], stage: int = 0) -> OptimizerMemory:
    """Optimizer-state bytes on the GPU and the host for one GPU's parameters (pipeline stage ``stage``): with HDO under
    the distributed optimizer, the GPU of the stage that keeps the most (``_rank_split``)."""
    f = s.optimizer_offload_fraction
    param_bytes = DTYPE_BYTES[s.params_dtype]
    master, moments = _moment_bytes(s)
    out = OptimizerMemory(0, 0, 0, 0, 0)
    split: dict[bool, list[int]] = {}
    if f > 0.0 and s.distributed_optimizer:
        out.gpu, split = _rank_split(m, s, stage)
    for expert in (False, True):
        if not any(t.expert == expert for t in params):
            continue
        shards = split[expert] if split else _shards(params, m, s, expert)
        total = sum(shards)
        out.shard_numel += total
        d = _sharded_over(m, s, expert)
        groups = [0, 0]  # the no-decay and the decay group's shards, in one pass over the stage's tensors
        for t in params:
            if t.expert == expert:
                groups[t.decay] += -(-t.numel // d)
        out.largest_group_numel = max(out.largest_group_numel, *groups)
        if f <= 0.0:
            out.gpu_bytes += total * (master + moments)
            continue
        offloaded = greedy_offload(shards, f)
        out.offloaded_numel += offloaded
        # HDO always runs with param_update_in_fp32=True under the MCore factory: fp32 CPU params and fp32 states.
        if s.precision_aware_optimizer:
            out.gpu_bytes += (total - offloaded) * (4 + 8)  # HDO owns fp32 masters and states of the GPU part
        else:
            out.gpu_bytes += total * 4 + (total - offloaded) * 8  # DistOpt keeps every fp32 main-param shard on the GPU
        pinned = 0
        for n in _prefix(shards, offloaded):
            pinned += 2 * next_pow2(4 * n)  # fp32 clone (pin_cpu_params) + fp32 grad buffer (pin_cpu_grads)
        out.host_bytes += pinned + offloaded * 8  # torch AdamW's zeros_like moments are pageable: no rounding
        # Transient: the factory's first HDO clones `f` of the full local bf16 params (pinned) plus fp32 copies.
        local = [t.numel for t in optimizer_param_order(params) if t.expert == expert]
        first_host = _prefix(local, greedy_offload(local, f))
        first_host_bytes = sum(next_pow2(param_bytes * n) + next_pow2(4 * n) for n in first_host)
        out.host_transient_bytes += first_host_bytes
        if s.hybrid_optimizer == "megatron-core":
            _megatron_core_kept(s, out, (shards, offloaded), (local, first_host, first_host_bytes))
    out.gpu_bytes += out.kept_bytes
    return out


def _megatron_core_kept(
    s: Setup, out: OptimizerMemory, split: tuple[list[int], int], first: tuple[list[int], list[int], int]
) -> None:
    """What megatron-core's own HybridDeviceOptimizer keeps beyond ours (``out`` updated; both releases alike).

    ``megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py`` (identical in 0.16.1 and 0.19.2):
    - ``_set_sub_optimizer_grads`` sets ``fp32_param.grad = grad.to(fp32)`` for every bf16 parameter it steps on the
      GPU, every step, and nothing frees it: megatron-core's ``zero_grad`` clears the DistributedOptimizer's groups
      and the HDO's own param groups, never the GPU sub-optimizer's fp32 copies (a copy only of bf16 gradients:
      with ``grad_reduce_in_fp32`` the cast returns the fp32 gradient itself). bf16 parameters reach the HDO only
      on the precision-aware path (the DistributedOptimizer hands it its bf16 shards); otherwise it steps the
      DistributedOptimizer's fp32 shards and clones nothing.
    - ``optimizer/__init__.py`` builds a first HDO over the full local bf16 params (fp32 clones of its GPU part on
      the GPU, pinned clones of the rest on the host); ``distrib_optimizer.py`` then builds a second one over its
      shards and drops the first. The first is a reference cycle (its sub-optimizers' step post-hooks close over it),
      so it is freed only by a full garbage collection: Bridge's ``train.manual_gc`` runs one before training,
      megatron-core never does. (Measured on an H200 at fraction 0.5, world size 1: 8 bytes per GPU-stepped
      parameter above ours, ``tests/plan/test_gpu_measured.py``.)
    """
    shards, offloaded = split
    local, first_host, first_host_bytes = first
    gpu_side = [n for n, h in zip(shards, hdo_offload_mask(shards, s.optimizer_offload_fraction), strict=True) if not h]
    words = []
    # the copy is made of bf16 gradients only: with grad_reduce_in_fp32 the gradient shard is fp32 already and
    # grad.to(fp32) returns it (measured by the trace: tests/plan/test_trace_differential.py, generate_hdo)
    if s.precision_aware_optimizer and not s.grad_reduce_in_fp32 and gpu_side:
        out.kept_bytes += 4 * (sum(shards) - offloaded)
        out.largest_gpu_numel = max(out.largest_gpu_numel, max(gpu_side))
        words.append("the fp32 gradient copies megatron-core's HDO never frees (fp32_param.grad)")
    if s.distributed_optimizer and not s.manual_gc:
        out.kept_bytes += 4 * (sum(local) - sum(first_host))
        out.host_bytes += first_host_bytes  # the first build's pinned clones stay with it
        out.host_transient_bytes -= first_host_bytes
        words.append("the fp32 clones of the factory's first HDO, a reference cycle no gc.collect() has freed")
    out.kept_what = "; ".join(dict.fromkeys([*filter(None, out.kept_what.split("; ")), *words]))


def _prefix(numels: list[int], offloaded: int) -> list[int]:
    out, acc = [], 0
    for n in numels:
        if acc >= offloaded:
            break
        out.append(n)
        acc += n
    return out


# ------------------------------------------------------------------------------------------- estimate


@dataclass
class StageMemory:
    """One GPU of one pipeline stage. ``weights`` ... ``other`` are the phase that sets the stage's peak
    (``peak_phase``); ``phases`` lists every phase of the step (``plan/memory/phases.py``)."""

    stage: int
    weights: int
    gradients: int
    optimizer: int
    activations: int
    other: int
    host: int
    host_transient: int
    shard_numel: int
    offloaded_numel: int
    params: int
    phases: list[PhaseMemory] = field(default_factory=list)
    peak_phase: str = "forward_backward"
    gpu: int = 0  # which GPU of the stage (rank order) these are: OptimizerMemory.gpu

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.other


@dataclass
class MemoryEstimate:
    model: ModelSpec
    setup: Setup
    stages: list[StageMemory]
    warnings: list[str] = field(default_factory=list)

    @property
    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda st: (st.total, -st.stage))

    @property
    def offloaded_fraction(self) -> float:
        w = self.worst
        return w.offloaded_numel / w.shard_numel if w.shard_numel else 0.0

    def breakdown_gib(self, extra: float = 0.0) -> dict[str, float]:
        """The worst stage in GiB (2³⁰ bytes, the unit of Megatron's memory report); ``extra`` bytes go to other."""
        return {k: round(v * GB / GiB, 3) for k, v in self.breakdown_gb(extra, digits=9).items()}

    def breakdown_gb(self, extra: float = 0.0, digits: int = 3) -> dict[str, float]:
        """The worst stage in decimal GB (10⁹ bytes); ``extra`` bytes (a calibration offset) go to other."""
        w = self.worst
        parts = {
            "weights": w.weights,
            "gradients": w.gradients,
            "optimizer": w.optimizer,
            "activations": w.activations,
            "other": w.other + extra,
            "total": w.total + extra,
        }
        return {k: round(v / GB, digits) for k, v in parts.items()}

    @property
    def host_gb(self) -> float:
        return max(st.host for st in self.stages) / GB

    @property
    def host_peak_gb(self) -> float:
        return max(st.host + st.host_transient for st in self.stages) / GB


def _stage_memory(m: ModelSpec, s: Setup, stage: int) -> StageMemory:
    params = stage_params(m, s, stage)
    numel = sum(t.numel for t in params)
    act = stage_activations(m, s, stage)
    overhead = int(s.overhead_gb * GB)
    if s.use_megatron_fsdp:
        from mbridge_offload.plan.memory.fsdp import fsdp_memory

        layers = stage_layers(m, s)[stage]
        f = fsdp_memory(m, s, params, layers, last_stage=stage == s.pp - 1)
        # Optimizer offload is not applied under Megatron-FSDP (see _setup_warnings): nothing moves to the host.
        resident = (f.weights, f.gradients, f.optimizer)
        host, host_transient, shard, offloaded = act.host_bytes, 0, f.shard_numel, 0
        largest, kept, group, gpu = 0, "", 0, 0
    else:
        param_bytes = DTYPE_BYTES[s.params_dtype]
        grad_bytes = 4 if s.grad_reduce_in_fp32 else param_bytes
        opt = optimizer_memory(m, s, params, stage)
        resident = (numel * param_bytes, numel * grad_bytes, opt.gpu_bytes)
        host, host_transient = opt.host_bytes + act.host_bytes, opt.host_transient_bytes
        shard, offloaded = opt.shard_numel, opt.offloaded_numel
        largest, kept, group = opt.largest_gpu_numel, opt.kept_what, opt.largest_group_numel
        gpu = opt.gpu
    step = optimizer_step_transient(s, shard, offloaded, largest, group)
    if s.use_megatron_fsdp and f.end_of_backward > step[0]:  # its unsharded gradients, before the reduce-scatter
        step = (f.end_of_backward, "Megatron-FSDP's unsharded gradients at the end of the backward")
    phases = stage_phases(s, stage, resident, overhead, act, step, kept)
    top = peak(phases)
    return StageMemory(
        stage,
        top.weights,
        top.gradients,
        top.optimizer,
        top.activations,
        top.other,
        host,
        host_transient,
        shard,
        offloaded,
        numel,
        phases,
        top.name,
        gpu,
    )


# Upstream's word on optimizer CPU offload under Megatron-FSDP (Bridge 0.6.2 training/config.py; megatron-core
# fully_sharded_optimizer.py; NVIDIA/Megatron-LM#1986: v1 crashes sharding the pin_memory copies;
# NVIDIA/Megatron-LM#4910: checkpoint save hangs). The planner never proposes it and does not model it.
MFSDP_OPTIMIZER_OFFLOAD = (
    "optimizer CPU offload under Megatron-FSDP is not modelled and never recommended: Bridge refuses it with "
    'MFSDP v2 ("MFSDP V2 does not support optimizer CPU offload."), and with v1 it crashes in pin_memory '
    "(NVIDIA/Megatron-LM#1986) or hangs at checkpoint save (NVIDIA/Megatron-LM#4910); the numbers here ignore "
    "the requested fraction"
)


def _setup_warnings(s: Setup) -> list[str]:
    out = []
    if s.use_megatron_fsdp and s.optimizer_offload_fraction > 0:
        out.append(MFSDP_OPTIMIZER_OFFLOAD)
    return out


def estimate_memory(m: ModelSpec, s: Setup, host_ram_gb: float | None = None) -> MemoryEstimate:
    """Per-GPU memory of every pipeline stage; ``.worst`` is the stage that decides whether the run fits.

    Args:
        m: the architecture.
        s: parallelism, batch, precision and offload settings.
        host_ram_gb: host RAM per GPU; a warning is added when the host side needs more.

    Raises:
        ValueError: for a setup Megatron would reject (see ``check_setup``).

    Example:
        >>> from mbridge_offload.plan.inputs.presets import model_preset
        >>> est = estimate_memory(model_preset("llama3-8b"), Setup(num_gpus=8, tp=2))
        >>> est.breakdown_gb()["weights"] > 7
        True
    """
    check_setup(m, s)
    stages = [_stage_memory(m, s, stage) for stage in range(s.pp)]
    est = MemoryEstimate(m, s, stages)
    from mbridge_offload.plan.memory.activations import reach_warnings

    est.warnings.extend(_setup_warnings(s) + reach_warnings(m, s))
    if host_ram_gb is not None and est.host_peak_gb > host_ram_gb:
        est.warnings.append(
            f"host memory per GPU peaks at {est.host_peak_gb:.1f} GB (pinned, power-of-two "
            f"rounded), above the {host_ram_gb:.0f} GB of host RAM per GPU"
        )
    return est
