"""The expert-parallel terms of a MoE step, from the physics: the token all-to-all within and across NVLink domains
for the dispatcher in use, its overlap with compute, the load imbalance of natural routing, and the fixed cost each
MoE layer pays per micro-batch.

- **Dispatch and combine** (``megatron/core/transformer/moe/token_dispatcher.py``): per MoE layer and micro-batch,
  forward and backward each run a dispatch and a combine (4 all-to-alls). Each EP rank holds ``T`` tokens
  (``MBS·seq/CP``, over TP with SP) and sends ``T·topk`` hidden vectors (bf16) to the ranks of their experts.
  ``alltoall`` (``MoEAlltoAllTokenDispatcher``) sends every copy: of its ``EP-1`` peers, the ``r-1`` in its NVLink
  domain (``r`` EP ranks per domain, ``GpuPreset.nvlink_domain`` / ETP) take ``(r-1)/EP`` of the copies over NVLink,
  the others ``(EP-r)/EP`` over the scale-out network; the two run at once, so the slower sets the time.
  ``flex`` (``MoEFlexTokenDispatcher``: DeepEP's internode kernels, HybridEP) sends a token once to each remote domain
  that holds one of its experts and fans it out there over NVLink: the network carries ``T`` times the expected number
  of remote domains hit, ``(D-1)·(1-(1-1/D)^topk)`` for ``D`` domains under uniform routing.
  ``allgather`` (``MoEAllGatherTokenDispatcher``) gathers every rank's tokens (and reduce-scatters them back):
  ``(EP-1)·T`` vectors per rank, each over the link its span reaches.
- **Overlap** (``overlap_moe_expert_parallel_comm``, megatron-core's combined 1F1B schedule in
  ``pipeline_parallel/combined_1f1b.py``): one micro-batch's all-to-alls run behind another's attention and expert
  compute; what exceeds that compute stays exposed, and the first and last micro-batch of a stage have no partner.
- **Load imbalance**: with natural routing (``moe_router_force_load_balancing`` off) the slowest EP rank sets the
  layer's time: its expert GEMMs and the tokens it receives. The load of one rank is the sum of its ``E/EP`` experts'
  loads; with a per-expert coefficient of variation ``EXPERT_LOAD_CV`` the expected maximum over ``EP`` ranks is about
  ``1 + CV/sqrt(E/EP)·sqrt(2·ln EP)`` (the maximum of ``EP`` near-normal variables).
- **Fixed cost** per MoE layer and micro-batch: the dropless path waits on the host for the token counts
  (``tokens_per_expert`` copied to the CPU) before it can size the permutation and launch the expert GEMMs, so the
  GPU drains once per dispatch; ``terms.MOE_LAYER_OVERHEAD_S`` (fitted) is that cost. Full-iteration CUDA graphs
  (``cuda_graph_impl=full_iteration``, which needs no host sync) remove it; without grouped GEMM each local expert
  launches its own GEMMs (``LAUNCH_S`` each).

Never imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mbridge_offload.plan.inputs.hardware import GpuPreset
from mbridge_offload.plan.model.architecture import ModelSpec
from mbridge_offload.plan.model.run import Setup

# Achieved fraction of datasheet link bandwidth (the same as terms.COMM_EFFICIENCY; kept here to avoid a cycle).
COMM_EFFICIENCY = 0.75
# Coefficient of variation of one expert's token load under natural routing with the auxiliary load-balancing loss:
# ASSUMED (not fitted: no published row separates it from the other terms); forced balancing makes it 0.
EXPERT_LOAD_CV = 0.3
# Share of an overlapped all-to-all that stays exposed even when the partner micro-batch's compute covers it (the
# stream synchronisation around each dispatch and combine, and the unpaired first and last micro-batch): assumed.
OVERLAP_RESIDUAL = 0.1
# One kernel launch (without grouped GEMM each local expert runs 3 GEMMs forward and 6 backward): CUDA's launch
# latency, a few microseconds; assumed.
LAUNCH_S = 5e-6


@dataclass(frozen=True)
class EpTraffic:
    """Seconds of one all-to-all (one direction, one layer, one micro-batch) and the links it uses."""

    seconds: float
    nvlink_bytes: float
    network_bytes: float
    link: str


def ep_ranks_per_domain(m: ModelSpec, s: Setup, gpu: GpuPreset) -> int:
    """EP ranks that share one NVLink domain (expert ranks are laid out ETP-innermost)."""
    return max(1, min(s.ep, gpu.nvlink_domain // max(1, s.resolved_etp(m))))


def a2a(m: ModelSpec, s: Setup, gpu: GpuPreset) -> EpTraffic:
    """One dispatch (or combine) all-to-all of the routed tokens of one micro-batch, per rank (module docstring)."""
    seq = s.seq_length or m.seq_length
    tokens = s.micro_batch_size * seq / s.cp / (s.tp if s.sp else 1)
    vector = m.hidden_size * 2  # bf16 hidden states
    k, ep = m.moe_router_topk, s.ep
    r = ep_ranks_per_domain(m, s, gpu)
    domains = math.ceil(ep / r)
    if s.moe_token_dispatcher_type == "allgather":
        local, remote = tokens * (r - 1) * vector, tokens * (ep - r) * vector
    else:
        local, remote = tokens * k * (r - 1) / ep * vector, tokens * k * (ep - r) / ep * vector
        if s.moe_token_dispatcher_type == "flex" and domains > 1:
            hit = (domains - 1) * (1 - (1 - 1 / domains) ** k)  # remote domains a token reaches
            local += remote  # forwarded inside each remote domain over NVLink
            remote = tokens * hit * vector
    nvl = local / (gpu.nvlink_gbps * 1e9 * COMM_EFFICIENCY)
    net = remote / (gpu.network_gbps * 1e9 * COMM_EFFICIENCY) if remote else 0.0
    return EpTraffic(max(nvl, net), local, remote, "network" if remote else "NVLink")


def imbalance(m: ModelSpec, s: Setup) -> float:
    """The slowest EP rank's load over the mean (1.0 under forced balancing or EP 1)."""
    if s.moe_router_force_load_balancing or s.ep <= 1 or not m.is_moe:
        return 1.0
    per_rank = max(1, m.experts // s.ep)
    return 1 + EXPERT_LOAD_CV / math.sqrt(per_rank) * math.sqrt(2 * math.log(s.ep))


def exposed(a2a_s: float, window_s: float, overlap: bool) -> float:
    """The part of the all-to-alls left on the critical path: all of them, or under EP overlap what the partner
    micro-batch's compute (``window_s``) cannot cover, and at least ``OVERLAP_RESIDUAL`` of them."""
    if not overlap:
        return a2a_s
    return max(a2a_s - window_s, OVERLAP_RESIDUAL * a2a_s)


def fixed_seconds(m: ModelSpec, s: Setup, layer_overhead_s: float) -> float:
    """Fixed time per MoE layer and micro-batch (forward + backward) beyond FLOPs and all-to-alls."""
    if s.cuda_graph_impl == "full_iteration":
        return 0.0
    launches = 0.0 if s.moe_grouped_gemm else 9 * max(1, m.experts // s.ep) * LAUNCH_S
    return layer_overhead_s + launches
