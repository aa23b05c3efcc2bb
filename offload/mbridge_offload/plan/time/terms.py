"""Step time in seconds of one configured run, term by term, before any offload cost (``step.py`` adds that).

Per GPU and per optimizer step, for ``m`` micro-batches per DP rank:

- **compute**: model FLOPs (6 x active params per token + causal attention; MoE counts the routed top-k share;
  MLA its real projections) / number of GPUs, at the GPU's peak (dense FP8 peak for the linear layers of an FP8 run,
  bf16 for attention and the output layer) x the compute efficiency (fitted per GPU preset x precision x
  dense/MoE on Megatron Bridge's performance summary, ``mbridge_offload_tools/evidence/data/performance_summary.yaml``)
  x a GEMM efficiency
  ``d / (d + GEMM_HALF_DIM)`` of each GEMM's smallest per-GPU dimension ``d`` (TP, ETP, CP and small expert batches
  shrink it, so splitting a model more finely is not free).
- **recompute**: the forward FLOPs (and forward TP traffic) that recomputation runs again: full recompute re-runs
  the recomputed layers' forward (all layers: about 1/3 more compute); selective re-runs only its modules' share.
- **EP and the MoE layers** (``plan/time/moe.py``): the all-to-alls within and across NVLink domains for the
  dispatcher in use, hidden behind compute under ``overlap_moe_expert_parallel_comm``; the hottest EP rank's share
  under natural routing; the fixed cost per MoE layer and micro-batch.
- **tp / cp / ep / dp communication**: ring collectives over NVLink when the group fits in one NVLink domain; a ring
  that crosses domains sends ``1/r`` of its bytes through each of the NICs of its ``r`` ranks in a domain, so it runs
  at ``min(NVLink, r x NIC)``; both at ``COMM_EFFICIENCY`` of the datasheet bandwidth (``hardware.py``). TP: 4
  all-gathers and 4 reduce-scatters (SP) or 4 all-reduces of ``s·b·h`` per layer, forward and backward; CP: the K/V
  ring, hidden behind attention except its first hop and what the attention cannot cover; EP: 4 all-to-alls of the
  routed tokens per MoE layer; DP: gradient reduce-scatter and parameter all-gather (distributed optimizer; all-reduce
  without it; Megatron-FSDP gathers parameters again for the backward), overlapped with the last micro-batch's
  backward / the first one's forward when ``overlap_grad_reduce`` / ``overlap_param_gather``.
- **bubble**: ``(PP-1)/VPP`` micro-batch times of the 1F1B schedule.

Never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mbridge_offload.plan.inputs.hardware import GpuPreset
from mbridge_offload.plan.model.architecture import DTYPE_BYTES, ModelSpec
from mbridge_offload.plan.model.params import layer_params, mtp_depth_params, padded_vocab
from mbridge_offload.plan.model.run import Setup
from mbridge_offload.plan.time import moe as moe_physics

# Achieved fraction of the datasheet link bandwidth by NCCL ring collectives of tens of MB (nccl-tests "busbw" on
# DGX H100 reaches ~340-370 GB/s of the 450 GB/s NVLink per direction): assumed, the same for the network.
COMM_EFFICIENCY = 0.75
# The per-GPU GEMM dimension at which a GEMM runs at half its large-size efficiency (wave quantisation, tails,
# launch overhead): chosen with MOE_LAYER_OVERHEAD_S on a grid (128, 512, 1024) x (0, 2, 4 ms) by the smallest RMS
# error over the published rows (tests/plan/test_step_time.py states the result).
GEMM_HALF_DIM = 512
# Fraction of TP traffic left exposed with comm_overlap.tp_comm_overlap (TE userbuffers overlap the all-gather and
# reduce-scatter with the neighbouring GEMMs; the first and last of each chain stay exposed): assumed.
TP_OVERLAP_EXPOSED = 0.25
# Fixed time each MoE layer costs per micro-batch (forward + backward) beyond its FLOPs and all-to-alls: dropless
# dispatch waits for the token counts on the host (a device-to-host sync per layer), then permutes and launches
# per-expert work. FITTED (grid, see GEMM_HALF_DIM; 6 ms and more leave rows no efficiency can match): it is what
# makes a small-expert MoE at MBS 1 (Qwen3-30B-A3B on B200, 64 micro-batches) 2.5x slower per token than at MBS 4
# (GB200, 16 micro-batches).
MOE_LAYER_OVERHEAD_S = 0.004
# Recompute modules that cost memory traffic but no matmul FLOPs (elementwise kernels): counted as free.
ELEMENTWISE_MODULES = ("layernorm", "moe_act")


@dataclass(frozen=True)
class Flops:
    """Forward FLOPs per token of the whole model, by the part a recompute module names."""

    attn_linear: float = 0.0  # QKV / output projections (MLA: its down projections and the output projection)
    mla_up_proj: float = 0.0
    core_attn: float = 0.0
    mlp: float = 0.0  # dense layers' MLP
    moe: float = 0.0  # routed experts (top-k share) and the router
    shared_experts: float = 0.0
    output: float = 0.0  # output layer (logits)

    @property
    def total(self) -> float:
        return (
            self.attn_linear
            + self.mla_up_proj
            + self.core_attn
            + self.mlp
            + self.moe
            + self.shared_experts
            + self.output
        )

    @property
    def layers(self) -> float:
        """Everything but the output layer: what full recompute re-runs."""
        return self.total - self.output


_MLA_UP = ("q_up_proj", "kv_up_proj")


# Mamba parameters that are not GEMM weights (the convolution and the per-head SSM scalars).
_NOT_GEMMS = frozenset({"conv1d_weight", "A_log", "D", "dt_bias"})


def _linear_part(name: str) -> str | None:
    if "norm" in name or "bias" in name or name in _NOT_GEMMS:
        return None
    if name.startswith("expert") or name == "router":
        return "moe"
    if name.startswith("shared_expert."):
        return "shared_experts"
    if name.startswith("mlp."):
        return "mlp"
    return "mla_up_proj" if name in _MLA_UP else "attn_linear"


def forward_flops(m: ModelSpec, seq: int) -> Flops:
    """Forward FLOPs per token (2 per multiply-add; causal attention at half the square), whole model."""
    one = Setup(num_gpus=1)
    parts = dict.fromkeys(("attn_linear", "mla_up_proj", "mlp", "moe", "shared_experts"), 0.0)
    tensors = [t for index in range(m.num_layers) for t in layer_params(m, one, index)]
    tensors += mtp_depth_params(m, one) * m.mtp_num_layers  # each MTP depth runs its block, shared weights or not
    for t in tensors:
        part = _linear_part(t.name)
        if part is None:
            continue
        share = m.moe_router_topk / m.experts if t.expert else 1.0
        parts[part] += 2 * t.numel * share
    qk = m.num_attention_heads * (m.mla.qk_head_dim + m.mla.qk_pos_emb_head_dim if m.mla else m.kv_channels)
    core: float = 2 * m.attention_layers * seq * qk  # (QK^T + AV) = 4·s·d, halved by the causal mask
    core += m.ssm_flops_per_token() / 3  # the Mamba scans (training FLOPs there: forward + 2x backward)
    output = 2 * padded_vocab(m, 1) * m.hidden_size * (1 + m.mtp_num_layers)  # every MTP depth has its own logits
    return Flops(**parts, core_attn=core, output=output)


def gemm_efficiency(dim: float) -> float:
    """Fraction of large-GEMM speed a GEMM whose smallest per-GPU dimension is ``dim`` reaches."""
    return dim / (dim + GEMM_HALF_DIM)


def _gemm_dims(m: ModelSpec, s: Setup) -> dict[str, float]:
    """The smallest per-GPU GEMM dimension of each part, for one micro-batch."""
    seq = s.seq_length or m.seq_length
    tokens = s.micro_batch_size * seq / s.cp
    etp = s.resolved_etp(m)
    q = m.num_attention_heads * (m.mla.v_head_dim if m.mla else m.kv_channels)
    expert_tokens = tokens * m.moe_router_topk * s.ep / max(1, m.experts)  # rows of one local expert's GEMM
    shared = m.moe_shared_expert_intermediate_size or m.ffn_hidden_size
    return {
        "attn_linear": min(tokens, m.hidden_size, q / s.tp),
        "mla_up_proj": min(tokens, q / s.tp),
        "core_attn": min(seq / s.cp, 4096),  # flash attention: one query chunk against its keys
        "mlp": min(tokens, m.hidden_size, m.ffn_hidden_size / s.tp),
        "moe": min(expert_tokens, m.hidden_size, m.expert_ffn_hidden_size / etp),
        "shared_experts": min(tokens, shared / s.tp),
        "output": min(tokens, padded_vocab(m, s.tp) / s.tp),
    }


def _fp8_parts(s: Setup) -> frozenset[str]:
    # TE runs the transformer layers' linear GEMMs in FP8; attention and the output layer stay bf16.
    return frozenset(("attn_linear", "mla_up_proj", "mlp", "moe", "shared_experts")) if s.fp8_recipe else frozenset()


def compute_seconds(m: ModelSpec, s: Setup, gpu: GpuPreset, flops: Flops, tokens: float) -> float:
    """Seconds per GPU for ``flops`` per token over ``tokens`` tokens (whole run), at efficiency 1."""
    dims, fp8 = _gemm_dims(m, s), _fp8_parts(s)
    seconds = 0.0
    for part, dim in dims.items():
        peak = (gpu.fp8_tflops or gpu.peak_tflops) if part in fp8 else gpu.peak_tflops
        seconds += getattr(flops, part) * tokens / s.num_gpus / (peak * 1e12 * gemm_efficiency(dim))
    return seconds


def recompute_flops(m: ModelSpec, s: Setup, f: Flops) -> tuple[Flops, float]:
    """The forward FLOPs recomputation runs again, and the fraction of layers fully recomputed."""
    if s.recompute_granularity == "full":
        chunks = s.pp * (s.vpp or 1)
        n = s.recompute_num_layers or 1
        fraction = 1.0 if s.recompute_method != "block" else min(1.0, n * chunks / m.num_layers)
        scaled = {k: getattr(f, k) * fraction for k in Flops.__dataclass_fields__ if k != "output"}
        return Flops(**scaled), fraction
    if s.recompute_granularity == "selective":
        mods = set(s.recompute_modules)
        return Flops(
            core_attn=f.core_attn if "core_attn" in mods else 0.0,
            mlp=f.mlp if "mlp" in mods else 0.0,
            moe=f.moe if "moe" in mods else 0.0,
            shared_experts=f.shared_experts if "shared_experts" in mods or "moe" in mods else 0.0,
            mla_up_proj=f.mla_up_proj if "mla_up_proj" in mods else 0.0,
        ), 0.0
    return Flops(), 0.0


@dataclass
class StepTerms:
    """Seconds per step by term, at compute efficiency ``efficiency`` (compute and recompute are divided by it)."""

    compute: float  # at efficiency 1
    recompute: float  # at efficiency 1
    tp_comm: float
    cp_comm: float
    ep_comm: float
    dp_comm: float  # before overlap
    dp_window: float  # compute the DP collectives can hide behind, at efficiency 1
    cp_window: float  # attention compute the CP ring can hide behind, at efficiency 1
    cp_first_hop: float
    microbatches: int
    bubble_stages: float  # (PP-1)/VPP
    moe_passes: float = 0.0  # MoE layer forward+backward passes per GPU per step (each pays moe_fixed_s)
    moe_fixed_s: float = MOE_LAYER_OVERHEAD_S  # moe.fixed_seconds
    ep_overlap: bool = False  # overlap_moe_expert_parallel_comm: the all-to-alls hide behind compute
    notes: list[str] = field(default_factory=list)

    def seconds(self, efficiency: float) -> dict[str, float]:
        """Every term in seconds at ``efficiency`` (a fraction of peak on the compute terms)."""
        compute, recompute = self.compute / efficiency, self.recompute / efficiency
        cp = self.cp_first_hop + max(0.0, self.cp_comm - self.cp_window / efficiency)
        dp = max(0.0, self.dp_comm - self.dp_window / efficiency)
        moe = self.moe_passes * self.moe_fixed_s
        ep = moe_physics.exposed(self.ep_comm, compute, self.ep_overlap)
        per_mb = (compute + recompute + self.tp_comm + cp + ep + moe) / self.microbatches
        return {
            "compute": compute,
            "recompute": recompute,
            "tp_comm": self.tp_comm,
            "cp_comm": cp,
            "ep_comm": ep,
            "moe_overhead": moe,
            "dp_comm": dp,
            "bubble": self.bubble_stages * per_mb,
        }

    def step(self, efficiency: float) -> float:
        return sum(self.seconds(efficiency).values())

    def efficiency_for(self, measured_s: float) -> float | None:
        """The efficiency at which the step takes ``measured_s``; None when no efficiency in (0, 1.5] does."""
        lo, hi = 1e-4, 1.5
        if not self.step(hi) <= measured_s <= self.step(lo):
            return None
        for _ in range(60):  # bisection: the step shrinks as the efficiency grows
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.step(mid) > measured_s else (lo, mid)
        return (lo + hi) / 2


def _bandwidth(gpu: GpuPreset, ranks: int, stride: int = 1) -> tuple[float, str]:
    """Bytes/s of a ring collective over ``ranks`` ranks ``stride`` GPUs apart, and the link it runs over.

    Inside one NVLink domain: NVLink. Across domains NCCL's rings enter and leave each domain once per channel and
    spread the channels over the NICs of the group's GPUs there, so each of a domain's ``r`` group ranks sends only
    ``1/r`` of the ring's bytes over its own NIC: the ring runs at ``min(NVLink, r x NIC)`` (nccl-tests on DGX H100
    clusters: ~350-400 GB/s all-reduce bus bandwidth over 8 x 400 Gb/s, not 50 GB/s)."""
    if ranks * stride <= gpu.nvlink_domain:
        return gpu.nvlink_gbps * 1e9 * COMM_EFFICIENCY, "NVLink"
    per_domain = max(1, min(ranks, gpu.nvlink_domain // stride))
    return min(gpu.nvlink_gbps, per_domain * gpu.network_gbps) * 1e9 * COMM_EFFICIENCY, "network"


def _tp_seconds(m: ModelSpec, s: Setup, gpu: GpuPreset, layers: float, recomputed: float) -> tuple[float, float, str]:
    """TP traffic per step (forward + backward, and the recomputed forwards)."""
    if s.tp == 1:
        return 0.0, 0.0, ""
    seq = s.seq_length or m.seq_length
    nbytes = s.micro_batch_size * seq / s.cp * m.hidden_size * 2
    bw, link = _bandwidth(gpu, s.tp)
    # 2 all-gathers + 2 reduce-scatters (SP) or 2 all-reduces (each twice the traffic) per layer and direction.
    per_layer_dir = 4 * (s.tp - 1) / s.tp * nbytes / bw
    exposed = TP_OVERLAP_EXPOSED if s.tp_comm_overlap else 1.0
    mb = _microbatches(s)
    return 2 * per_layer_dir * layers * mb * exposed, per_layer_dir * recomputed * mb * exposed, link


def _cp_seconds(m: ModelSpec, s: Setup, gpu: GpuPreset, layers: float) -> tuple[float, float, str]:
    """The K/V ring per step (forward: K, V; backward: K, V and their gradients) and its first, exposed hop."""
    if s.cp == 1:
        return 0.0, 0.0, ""
    seq = s.seq_length or m.seq_length
    if m.mla:
        kv = m.num_attention_heads * (m.mla.qk_head_dim + m.mla.qk_pos_emb_head_dim + m.mla.v_head_dim)
    else:
        kv = 2 * m.num_query_groups * m.kv_channels
    chunk = s.micro_batch_size * seq / s.cp * kv * 2 / (s.tp if s.tp > 1 else 1)
    bw, link = _bandwidth(gpu, s.cp, s.tp)
    hop = chunk / bw
    mb = _microbatches(s)
    return 3 * (s.cp - 1) * hop * layers * mb, 3 * hop * layers * mb, link


def _ep_seconds(m: ModelSpec, s: Setup, gpu: GpuPreset, moe_layers: float) -> tuple[float, str]:
    """All-to-all dispatch and combine of the routed tokens, forward and backward (``plan/time/moe.py``): the
    hottest EP rank receives ``imbalance`` times the mean."""
    if s.ep == 1 or not m.is_moe:
        return 0.0, ""
    one = moe_physics.a2a(m, s, gpu)
    return 4 * one.seconds * moe_physics.imbalance(m, s) * moe_layers * _microbatches(s), one.link


def _dp_seconds(m: ModelSpec, s: Setup, gpu: GpuPreset) -> tuple[float, str]:
    """Gradient reduction and parameter gathering per step (before overlap)."""
    dense = expert = 0
    for index in range(m.num_layers):
        for t in layer_params(m, s, index):
            if t.expert:
                expert += t.numel
            else:
                dense += t.numel
    dense = (dense + padded_vocab(m, s.tp) * m.hidden_size // s.tp * (1 if m.tied_embeddings else 2)) // s.pp
    expert //= s.pp
    grad = 4 if s.grad_reduce_in_fp32 else DTYPE_BYTES.get(s.params_dtype, 2)
    param = 1 if s.fp8_param else DTYPE_BYTES.get(s.params_dtype, 2)
    gathers = 2 if s.use_megatron_fsdp else 1  # Megatron-FSDP gathers again for the backward
    seconds, link = 0.0, ""
    # Megatron's rank order puts TP (ETP and EP for the expert group) inside DP: its ranks are that many GPUs apart.
    etp = s.resolved_etp(m)
    for numel, ranks, stride in ((dense, s.dp * s.cp, s.tp), (expert, s.expert_dp(m), etp * s.ep)):
        if ranks <= 1 or not numel:
            continue
        bw, link = _bandwidth(gpu, ranks, stride)
        ring = (ranks - 1) / ranks * numel / bw
        if s.distributed_optimizer or s.use_megatron_fsdp:
            seconds += ring * (grad + gathers * param)
        else:
            seconds += 2 * ring * grad
    return seconds, link


def _microbatches(s: Setup) -> int:
    return s.num_microbatches() or 4 * s.pp


def step_terms(m: ModelSpec, s: Setup, gpu: GpuPreset) -> StepTerms:
    """The terms of one configured run's step (no offload), at efficiency 1."""
    seq = s.seq_length or m.seq_length
    mb = _microbatches(s)
    tokens = mb * s.micro_batch_size * seq * s.dp
    f = forward_flops(m, seq)
    again, full_fraction = recompute_flops(m, s, f)
    compute = 3 * compute_seconds(m, s, gpu, f, tokens)
    # The hottest EP rank's expert GEMMs set the MoE layers' pace under natural routing (plan/time/moe.py).
    compute += (moe_physics.imbalance(m, s) - 1) * 3 * compute_seconds(m, s, gpu, Flops(moe=f.moe), tokens)
    recompute = compute_seconds(m, s, gpu, again, tokens)
    layers = m.num_layers / s.pp
    moe_layers = sum(m.is_moe_layer(i) for i in range(m.num_layers)) / s.pp
    tp, tp_again, tp_link = _tp_seconds(m, s, gpu, layers, full_fraction * layers)
    cp, cp_first, cp_link = _cp_seconds(m, s, gpu, layers)
    ep, ep_link = _ep_seconds(m, s, gpu, moe_layers)
    if ("moe" in s.recompute_modules and s.recompute_granularity == "selective") or full_fraction:
        ep_again = ep / 4 * 2 * (full_fraction or 1.0)  # the recomputed forward dispatches and combines again
    else:
        ep_again = 0.0
    dp, dp_link = _dp_seconds(m, s, gpu)
    attn = 3 * compute_seconds(m, s, gpu, Flops(core_attn=f.core_attn), tokens)
    if s.use_megatron_fsdp:  # gathers and reductions overlap every micro-batch's compute
        window = compute
    else:  # reduce-scatter behind the last micro-batch's backward, all-gather behind the first one's forward
        window = (compute / mb) * (2 / 3 * s.overlap_grad_reduce + 1 / 3 * s.overlap_param_gather)
    links = {k: v for k, v in (("TP", tp_link), ("CP", cp_link), ("EP", ep_link), ("DP", dp_link)) if v}
    notes = [", ".join(f"{k} over {v}" for k, v in links.items())] if links else []
    return StepTerms(
        compute=compute,
        recompute=recompute,
        tp_comm=tp + tp_again,
        cp_comm=cp,
        ep_comm=ep + ep_again,
        dp_comm=dp,
        dp_window=window,
        cp_window=attn,
        cp_first_hop=cp_first,
        microbatches=mb,
        bubble_stages=(s.pp - 1) / (s.vpp or 1),
        moe_passes=moe_layers * mb * (1 + full_fraction / 2),  # a recomputed forward: half a pass
        moe_fixed_s=moe_physics.fixed_seconds(m, s, MOE_LAYER_OVERHEAD_S),
        ep_overlap=s.overlap_moe_expert_parallel_comm,
        notes=notes,
    )


# Compute efficiency (fraction of peak on the compute terms, after the GEMM efficiency) per GPU preset x
# precision x dense/MoE: FITTED on Megatron Bridge's performance summary (NeMo 25.11; plan/data/
# performance_summary.yaml) by plan/step_fit.fit, the geometric mean over each group's rows; a test checks these
# rounded values against the refit. Keyed by preset, not generation: GB300 and GB200 share a datasheet peak but
# the same Llama3 8B run is 19 % faster per GPU on GB300. A group with no published row borrows the other
# precision of the same preset, then the preset named in EFFICIENCY_LIKE (see ``efficiency``).
EFFICIENCY: dict[tuple[str, str, str], float] = {
    ("gb300", "fp8", "dense"): 0.518,
    ("gb300", "bf16", "moe"): 0.662,
    ("gb300", "fp8", "moe"): 0.54,
    ("gb200", "fp8", "dense"): 0.441,
    ("gb200", "bf16", "moe"): 0.622,
    ("gb200", "fp8", "moe"): 0.41,
    ("b200", "fp8", "dense"): 0.474,
    ("b200", "fp8", "moe"): 0.231,
    ("b200", "bf16", "moe"): 0.192,
    ("h100-80gb", "fp8", "dense"): 0.491,
    ("h100-80gb", "bf16", "moe"): 0.36,
    ("h100-80gb", "fp8", "moe"): 0.135,
}
# Presets without published rows: the nearest published system (same GPU die or generation). A100 has no row
# and no FP8; it borrows H100's efficiencies (an assumption: pass --baseline-step-s to calibrate).
EFFICIENCY_LIKE = {"h200-141gb": "h100-80gb", "gh200": "h100-80gb", "a100-80gb": "h100-80gb", "b300": "b200"}
EFFICIENCY_SOURCE = (
    "fitted on Megatron Bridge's performance summary (NeMo 25.11), "
    "mbridge_offload_tools/evidence/data/performance_summary.yaml"
)


def efficiency_key(m: ModelSpec, s: Setup, gpu: GpuPreset) -> tuple[str, str, str]:
    return gpu.name, "fp8" if s.fp8_recipe else "bf16", "moe" if m.is_moe else "dense"


def efficiency(m: ModelSpec, s: Setup, gpu: GpuPreset) -> tuple[float, str]:
    """The fitted compute efficiency for this run, and which group it comes from."""
    name, precision, kind = efficiency_key(m, s, gpu)
    other = "bf16" if precision == "fp8" else "fp8"
    like = EFFICIENCY_LIKE.get(name, name)
    for key in ((name, precision, kind), (name, other, kind), (like, precision, kind), (like, other, kind)):
        if key in EFFICIENCY:
            borrowed = (
                "" if key == (name, precision, kind) else f" (borrowed: no published {name} {precision} {kind} row)"
            )
            return EFFICIENCY[key], f"{EFFICIENCY_SOURCE}, group {'/'.join(key)}{borrowed}"
    return 0.45, "assumed 0.45 (no fitted group applies)"
