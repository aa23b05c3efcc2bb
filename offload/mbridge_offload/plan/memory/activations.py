"""Activation memory: the tensors each transformer layer saves for backward, and a stage's at each moment of a step.

A stage's activations are taken at the moments of a step: in flight per model chunk, full recompute's rebuild,
backward's buffers, the loss.

Activation bytes follow Korthikanti et al. (2022) in Megatron's variant (``18 + 4·ffn/h`` bytes per ``s·b·h`` for
a GeLU MLP with dropout, flash attention so no ``5·a·s/h`` term), generalised tensor by tensor to SwiGLU, GQA,
MLA, MoE, QK-norm, no-dropout models, TP with or without SP, CP, micro-batches > 1 (tokens = seq × MBS / CP) and
FP8 compute (``fp8_saved``). ``layer_components`` names every saved tensor with its bytes, so a module-level
offload can subtract exactly what it moves. Layer-level offloading (TE v2) keeps at most ``L − k`` layers of
eligible (≥ 256 Ki elements) tensors resident. Hybrid stacks: each pattern symbol is a layer of its own (Mamba
mixer, attention, MLP or MoE); MTP depths sit on the last stage with their own pass through the output layer.
Not modelled: FP8 attention (``fp8_dot_product_attention``), bf16 first/last layers of an FP8 recipe. Never
imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mbridge_offload.plan.memory import fine_grained, schedule
from mbridge_offload.plan.memory.fp8 import fp8_saved, fp8_weight_cache_bytes, te_dummy_wgrad_bytes
from mbridge_offload.plan.model.architecture import ATTENTION_SYMBOLS, MAMBA, MOE, ModelSpec
from mbridge_offload.plan.model.params import Tensor, chunk_layers, next_pow2, padded_vocab, stage_layers
from mbridge_offload.plan.model.run import Setup
from mbridge_offload.upstream_layers import applies, because
from mbridge_offload_runtime.upstream import te_min_offload_numel


def te_offload_min_numel(s: Setup) -> int:
    """The smallest saved tensor TE's layer offload moves (numel >= this) in the run's TE release (``te_version``:
    256 Ki elements from 2.12, none before; see mbridge_offload_runtime.upstream.TE_OFFLOAD_THRESHOLDS)."""
    major, minor = s.te_release()  # any spelling validate takes (v2.13, 2.9.0+cu12, 3)
    try:
        return te_min_offload_numel(f"{major}.{minor}")
    except ValueError:  # a release before TE had layer offload (1.3): validate refuses the offload; nothing moves
        return 0


def layer_activations(m: ModelSpec, s: Setup, index: int) -> list[Tensor]:
    """Tensors one GPU saves for backward in transformer layer ``index`` for one micro-batch (no recompute).

    With FP8 compute (``s.fp8_recipe``) the inputs of the GEMMs are saved quantized (``fp8_saved``)."""
    return fp8_saved(_bf16_layer_activations(m, s, index), s)


def _bf16_layer_activations(m: ModelSpec, s: Setup, index: int) -> list[Tensor]:
    return kind_activations(m, s, m.layer_kind(index), m.is_moe_layer(index))


def kind_activations(m: ModelSpec, s: Setup, kind: str, moe: bool) -> list[Tensor]:
    """bf16 tensors one layer of ``kind`` (``T`` or a hybrid symbol) saves for one micro-batch."""
    seq = s.seq_length or m.seq_length
    tokens = seq * s.micro_batch_size // s.cp  # tokens per GPU along the sequence after CP
    t_sp = tokens // s.tp if s.sp else tokens  # tokens in the sequence-parallel regions (norms, residual)
    if kind in (MAMBA, "G"):
        return _mamba_activations(m, s, tokens, t_sp)
    out: list[Tensor] = []
    if kind == "T" or kind in ATTENTION_SYMBOLS:
        out += _attention_activations(m, s, tokens, t_sp)
    if kind in ATTENTION_SYMBOLS:
        return out
    out.append(Tensor("mlp_norm_in", t_sp * m.hidden_size))
    out += _moe_activations(m, s, tokens, t_sp) if moe else _mlp_activations(m, s, tokens, t_sp)
    if m.dropout > 0:
        out.append(Tensor("mlp_dropout_mask", t_sp * m.hidden_size, nbytes_per=1))
    return out


def _attention_activations(m: ModelSpec, s: Setup, tokens: int, t_sp: int) -> list[Tensor]:
    h, tp = m.hidden_size, s.tp
    out = [Tensor("input_norm_in", t_sp * h)]
    if m.mla is not None:
        a, mla = m.num_attention_heads, m.mla
        qk = mla.qk_head_dim + mla.qk_pos_emb_head_dim
        out.append(Tensor("qkv_in", t_sp * h))
        if mla.q_lora_rank:
            out += [Tensor("q_down_out", tokens * mla.q_lora_rank), Tensor("q_up_in", tokens * mla.q_lora_rank)]
        out += [
            Tensor("kv_down_out", tokens * (mla.kv_lora_rank + mla.qk_pos_emb_head_dim)),
            Tensor("kv_up_in", tokens * mla.kv_lora_rank),
            Tensor("q", tokens * a * qk // tp),
            Tensor("k", tokens * a * qk // tp),
            Tensor("v", tokens * a * mla.v_head_dim // tp),
            Tensor("attn_out", tokens * a * mla.v_head_dim // tp),
        ]
        heads = a // tp
    else:
        q = m.num_attention_heads * m.kv_channels // tp
        kv = m.num_query_groups * m.kv_channels // tp
        out += [
            Tensor("qkv_in", t_sp * h),
            Tensor("q", tokens * q),
            Tensor("k", tokens * kv),
            Tensor("v", tokens * kv),
            Tensor("attn_out", tokens * q),
        ]  # flash output = proj input, saved once
        if m.qk_layernorm:
            out += [Tensor("q_norm_in", tokens * q), Tensor("k_norm_in", tokens * kv)]
        heads = m.num_attention_heads // tp
    out.append(Tensor("softmax_lse", tokens * heads, nbytes_per=4))
    if m.dropout > 0:
        out.append(Tensor("attn_dropout_mask", t_sp * h, nbytes_per=1))
    return out


def _mlp_activations(m: ModelSpec, s: Setup, tokens: int, t_sp: int) -> list[Tensor]:
    gate, ffn = 2 if m.gated_linear_unit else 1, m.ffn_hidden_size // s.tp
    return [
        Tensor("fc1_in", t_sp * m.hidden_size),
        Tensor("fc1_out", tokens * gate * ffn),
        Tensor("act_out", tokens * ffn),
    ]


def _moe_activations(m: ModelSpec, s: Setup, tokens: int, t_sp: int) -> list[Tensor]:
    """What megatron-core's ``MoELayer`` saves (measured on CPU against 0.16.1, tests/plan/test_moe_activations.py).

    Router (``moe/router.py``): its input (the pre-MLP norm's output), the fp32 softmax over all experts that the
    load-balancing loss reads, the fp32 softmax over the top-k scores, and the int64 top-k indices twice (the
    ``topk`` and the ``scatter`` into the routing map). Dispatcher (``token_dispatcher.py`` + ``moe_utils.permute``
    / ``unpermute``): the int64 index over all ``T·E`` (token, expert) pairs that ``permute`` selects the probs with
    (0.19.2; 0.16.1's ``masked_select`` keeps the bf16 probs and the bool routing map instead, 3 bytes a pair), and
    the int64 index of ``unpermute``'s ``scatter_add``; the permuted tokens themselves are saved once, as the experts'
    fc1 input. Experts (``experts.py`` with ``bias_activation_fusion``, as Bridge's MoE providers set it): fc1's
    input and output, the routed probs the weighted SwiGLU saves, and fc2's input. A non-gated expert activation has
    no weighted fused kernel (``mlp.py``: only SwiGLU and quick-GeGLU take ``per_token_scale`` fused), so the
    multiplication by the probs also saves the activation's output (``expert_act_unweighted``)."""
    gate, h, etp = 2 if m.gated_linear_unit else 1, m.hidden_size, s.resolved_etp(m)
    routed = t_sp * m.moe_router_topk * etp  # balanced routing: each GPU receives its own tokens × top-k
    ffn, k, e = m.expert_ffn_hidden_size // etp, m.moe_router_topk, m.experts
    out = [
        Tensor("router_in", t_sp * h),
        Tensor("router_probs", t_sp * e, nbytes_per=4),
        Tensor("router_topk", t_sp * k, nbytes_per=4),
        Tensor("router_indices", 2 * t_sp * k, nbytes_per=8),
        Tensor("dispatch_probs_index", t_sp * e, nbytes_per=8),
        Tensor("unpermute_index", t_sp * k, nbytes_per=8),
        Tensor("expert_fc1_in", routed * h),
        Tensor("expert_fc1_out", routed * gate * ffn),
        Tensor("expert_probs", routed),
        Tensor("expert_act_out", routed * ffn),
    ]
    if not m.gated_linear_unit:
        out.append(Tensor("expert_act_unweighted", routed * ffn))
    if m.moe_shared_expert_intermediate_size:
        sh = m.moe_shared_expert_intermediate_size // s.tp
        out += [Tensor("shared_fc1_out", tokens * gate * sh), Tensor("shared_act_out", tokens * sh)]
    return out


def _mamba_activations(m: ModelSpec, s: Setup, tokens: int, t_sp: int) -> list[Tensor]:
    """What megatron-core's ``MambaMixer`` keeps for backward in training (``_ssm_training``; mamba_ssm v2.2 / v2.3,
    ``ops/triton/ssd_combined.py`` and ``layernorm_gated.py``): the fused norm's input and ``in_proj``'s input
    (sequence-parallel), the contiguous ``[b, l, d]`` copy of the packed z/x/B/C/dt ``in_proj`` output and the scan's
    output before the ``silu(z)`` gate (``out_x``), both saved by ``MambaSplitConv1dScanCombinedFn``; the gated
    norm's input (the gated output laid back to ``[l, b, d]``) and its fp32 ``rstd`` per token and group; and
    ``out_proj``'s input. The convolution output, the chunk states and the decays are recomputed in backward."""
    mb, tp, h = m.mamba, s.tp, m.hidden_size
    if mb is None:
        raise ValueError(f"{m.name}: Mamba layers without Mamba shapes")
    return [
        Tensor("mamba_norm_in", t_sp * h),
        Tensor("in_proj_in", t_sp * h),
        Tensor("zxbcdt", tokens * mb.in_proj_width // tp),
        Tensor("ssm_out", tokens * mb.d_inner // tp),
        Tensor("gated_norm_in", tokens * mb.d_inner // tp),
        Tensor("gated_norm_rstd", tokens * mb.num_groups // tp, nbytes_per=4),
        Tensor("out_proj_in", tokens * mb.d_inner // tp),
    ]


def mamba_backward_bytes(m: ModelSpec, s: Setup) -> int:
    """The Mamba mixer's kernel backward at its largest (``MambaSplitConv1dScanCombinedFn.backward`` and
    ``_mamba_chunk_scan_combined_bwd``, mamba_ssm v2.2 / v2.3): the recomputed convolution output, ``dzxbcdt`` and
    ``dxBC``, the gated output's gradient (bf16); the recomputed ``dt`` and ``dA_cumsum`` (fp32 per head) and ``CB``
    (fp32, ``groups × chunk`` per token); the chunk states and their gradients in fp32 while ``_state_passing_bwd``
    writes both again in bf16 (``headdim × state`` per head and chunk each), beside the gradient arriving from the
    gated norm."""
    mb = m.mamba
    if mb is None:
        return 0
    seq = s.seq_length or m.seq_length
    tokens = seq * s.micro_batch_size // s.cp
    chunks = math.ceil(seq / mb.chunk_size)
    heads, groups, d_inner, tp = mb.num_heads // s.tp, mb.num_groups // s.tp, mb.d_inner // s.tp, s.tp
    per_token = 2 * (2 * mb.conv_dim // tp + mb.in_proj_width // tp + heads + 2 * d_inner)
    per_token += 2 * 4 * heads + 4 * groups * mb.chunk_size
    states = s.micro_batch_size * chunks * d_inner * mb.state_dim * (4 + 4 + 2 + 2)
    return tokens * per_token + states


def layer_offload_reaches(m: ModelSpec) -> bool:
    """Whether layer-level offload (``model.cpu_offloading``) moves anything in this model: megatron-core opens its
    context only in ``TransformerBlock``; a hybrid (Mamba) stack never does (``mbridge_offload.upstream_layers``)."""
    return applies("cpu_offloading", "hybrid" if m.layer_pattern else "block")


def reach_warnings(m: ModelSpec, s: Setup) -> list[str]:
    """What the setup asks for that megatron-core ignores in this model, each counted as no saving."""
    out = []
    if s.activation_offload_layers and not layer_offload_reaches(m):
        out.append(
            f"model.cpu_offloading ({s.activation_offload_layers} layers) saves nothing here and is counted as no "
            f"saving: {because('cpu_offloading', 'hybrid')}; fine-grained offloading (offload_modules) reaches the "
            "attention, MLP and MoE layers, never the Mamba mixers"
        )
    return out


def mtp_activations(m: ModelSpec, s: Setup) -> int:
    """Bytes one micro-batch's MTP depths keep on the last stage: per depth the two norms' inputs, ``eh_proj``'s
    input (2h), the depth's layers, and its own pass through the output layer and the loss (the logits again).

    Full recompute with the uniform method checkpoints each depth (megatron-core's ``MultiTokenPredictionLayer``):
    a depth then keeps its two inputs (hidden_states and the depth's embedding output: the two norms' inputs) while
    the loss runs, and one depth's internals are rebuilt at a time in backward (:func:`mtp_rebuilt`), after the
    logits are gone; the block method skips the MTP depths (``mbridge_offload.upstream_layers``, row
    ``recompute:full-block``)."""
    if not m.mtp_num_layers:
        return 0
    tokens, t_sp = _mtp_tokens(m, s)
    output = output_bytes(m, s, tokens, t_sp)
    if _mtp_checkpointed(s):
        return (2 * (2 * t_sp * m.hidden_size) + output) * m.mtp_num_layers
    return (_mtp_internal(m, s) + output) * m.mtp_num_layers


def mtp_rebuilt(m: ModelSpec, s: Setup) -> int:
    """What a checkpointed MTP depth re-materialises in backward (full recompute, uniform): its internals, one depth
    at a time, before the decoder layers run backward; 0 when the depths are not checkpointed."""
    return _mtp_internal(m, s) if m.mtp_num_layers and _mtp_checkpointed(s) else 0


def _mtp_checkpointed(s: Setup) -> bool:
    return s.recompute_granularity == "full" and applies(f"recompute:full-{s.recompute_method or 'uniform'}", "mtp")


def _mtp_tokens(m: ModelSpec, s: Setup) -> tuple[int, int]:
    seq = s.seq_length or m.seq_length
    tokens = seq * s.micro_batch_size // s.cp
    return tokens, tokens // s.tp if s.sp else tokens


def _mtp_internal(m: ModelSpec, s: Setup) -> int:
    """One depth's saved tensors: the two norms' inputs, ``eh_proj``'s input (2h) and the depth's layers."""
    _, t_sp = _mtp_tokens(m, s)
    h = m.hidden_size
    return 2 * t_sp * h * 2 + 2 * t_sp * 2 * h + sum(t.nbytes for acts in _mtp_depth(m, s) for t in acts)


def _mtp_depth(m: ModelSpec, s: Setup) -> list[list[Tensor]]:
    """The saved tensors of each layer of one MTP depth (after selective recompute)."""
    return [
        _stored(fp8_saved(kind_activations(m, s, kind, kind == MOE or (kind == "T" and m.is_moe)), s), s)
        for kind in m.mtp_kinds()
    ]


def te_cross_entropy_in_place(s: Setup) -> bool:
    """Whether the loss is Transformer Engine's fused cross entropy of a release that writes the logits' gradient over
    the bf16 logits (``triton/cross_entropy.py`` before 2.18). From 2.18 it stores the gradient in a new fp32 tensor
    ("so it is not quantized before backward"), which it saves, as megatron-core's own cross entropy saves its fp32
    softmax."""
    return s.te_cross_entropy() and not s.te_at_least(2, 18)


def output_bytes(m: ModelSpec, s: Setup, tokens: int, t_sp: int) -> int:
    """Final norm input and output-layer input (bf16) plus the logits the loss keeps: the fp32 softmax (4·sb·V/t) of
    megatron-core's cross entropy (unfused, or fused ``native``) and the fp32 gradient of TE's fused kernel from 2.18,
    or the bf16 logits that TE's fused kernel before 2.18 overwrites with their gradient (2·sb·V/t)."""
    logits = 2 if te_cross_entropy_in_place(s) else 4
    return 2 * t_sp * m.hidden_size + 2 * t_sp * m.hidden_size + logits * tokens * padded_vocab(m, s.tp) // s.tp


def layer_components(m: ModelSpec, s: Setup, index: int) -> dict[str, int]:
    """Bytes of each tensor layer ``index`` saves for backward (one micro-batch, after selective recompute): the
    per-module components that fine-grained offloading (``offload_modules``) and recompute subtract from."""
    return {t.name: t.nbytes for t in _stored(layer_activations(m, s, index), s)}


# Which saved tensors each selective-recompute module drops (MCore recompute_modules). A norm is recomputed only where
# it is a module of its own (references/upstream-layers.md, row recompute_modules:layernorm): a MoE layer's pre-MLP
# norm (its output feeds the router) and MLA's input norm; the TE spec fuses a dense layer's and a hybrid stack's
# attention and MLP norms into linear_qkv / linear_fc1 (IdentityOp), where megatron-core recomputes nothing.
_RECOMPUTE_DROPS = {
    "core_attn": {"softmax_lse"},  # flash attention stores no scores: only its statistics go
    "layernorm": {"router_in"},
    "mlp": {"fc1_out", "act_out"},
    "moe_act": {"expert_act_out", "expert_act_unweighted", "shared_act_out"},
    # moe_layer.py checkpoints custom_forward, which runs the router, the dispatcher, the routed experts and the
    # shared experts (shared_experts_compute): all of them go, only the checkpoint's input (router_in) stays.
    "moe": {
        "router_probs",
        "router_topk",
        "router_indices",
        "dispatch_probs_index",
        "unpermute_index",
        "expert_fc1_in",
        "expert_fc1_out",
        "expert_probs",
        "expert_act_out",
        "expert_act_unweighted",
        "shared_fc1_out",
        "shared_act_out",
    },
    "shared_experts": {"shared_fc1_out", "shared_act_out"},
    "mla_up_proj": {"q", "k", "v", "q_up_in", "kv_up_in"},
}


# Drops only in an MLA layer (one that saves ``kv_down_out``): its input norm is a TENorm of its own.
_MLA_RECOMPUTE_DROPS = {"layernorm": {"qkv_in"}}


def _stored(acts: list[Tensor], s: Setup) -> list[Tensor]:
    if s.recompute_granularity != "selective":
        return acts
    drops = set().union(*(_RECOMPUTE_DROPS.get(name, set()) for name in s.recompute_modules))
    mla = any(t.name == "kv_down_out" for t in acts)
    if mla:
        drops |= set().union(*(_MLA_RECOMPUTE_DROPS.get(name, set()) for name in s.recompute_modules))
    out = [t for t in acts if t.name not in drops]
    named = {t.name: t for t in acts}
    if "core_attn" in s.recompute_modules and not mla and "v" in named:
        # The checkpoint saves its arguments: megatron-core's v is a view of linear_qkv's output (torch.split), so
        # the whole QKV output stays alive, its q and k parts beside the new q and k that RoPE made (the trace shows
        # it to the byte; without the checkpoint TE's attention copies v and the output is freed).
        out.append(Tensor("qkv_out_under_v", named["q"].numel + named["k"].numel))
    return out


def in_flight(s: Setup, stage: int) -> float:
    """Micro-batches whose activations stage ``stage`` holds at its peak, in whole-stage units.

    megatron-core's schedule (``plan/memory/schedule.py``): without VPP, ``PP − stage − 1`` warm-up forwards plus the
    one that starts 1F1B; with VPP, ``2·(PP − stage − 1) + (VPP − 1)·PP`` warm-up model chunks plus one, each chunk
    ``1/VPP`` of the stage (stage 0: ``PP + (PP−1)/VPP``, Megatron's interleaving penalty). Capped by the step's
    micro-batches.
    """
    vectors = schedule.inflight_vectors(s.pp, s.vpp, s.num_microbatches(), stage)
    return max(sum(v) for v in vectors) / (s.vpp or 1)


@dataclass
class ActivationMemory:
    """One GPU's activation bytes on one pipeline stage, by the moment of the step they belong to.

    ``saved`` is the largest sum of the tensors the in-flight micro-batches keep for backward (per model chunk, at
    megatron-core's schedule moments), ``rebuilt`` what full recompute re-materialises at once in backward,
    ``workspace`` backward's transient gradient buffers of the largest layer plus the MoE dispatch buffers of the
    running layer. On the last stage, ``loss_saved`` is what is live when the loss runs (the in-flight micro-batches,
    the output layer's inputs, the saved logits, MTP depths) and ``loss_transient`` the logits' second copy while the
    cross entropy casts them (bf16 beside fp32; none with Transformer Engine's in-place fused kernel)."""

    saved: int
    rebuilt: int
    workspace: int
    loss_saved: int
    loss_transient: int
    offloadable_bytes: int  # eligible bytes per layer set that activation offload moves (one micro-batch)
    host_bytes: int
    # kept from the first forward to the end of the step (in ``saved`` and ``loss_saved`` too): TE's cached FP8
    # weights and dummy weight gradients under FP8, still there while the optimizer steps
    held: int = 0

    @property
    def forward_backward_bytes(self) -> int:
        return self.saved + self.rebuilt + self.workspace

    @property
    def loss_bytes(self) -> int:
        return self.loss_saved + self.loss_transient

    @property
    def gpu_bytes(self) -> int:
        """The stage's activation peak: the larger of its forward/backward and loss moments (never their sum)."""
        return max(self.forward_backward_bytes, self.loss_bytes)


def moe_dispatch_bytes(m: ModelSpec, s: Setup, layers: list[int]) -> int:
    """Transient token-dispatch buffers of the layer being run: the permuted tokens before and after the
    all-to-all (bf16, ``T_sp·k·ETP × h`` each, balanced routing); freed when the layer is done."""
    if not any(m.is_moe_layer(i) for i in layers):
        return 0
    seq = s.seq_length or m.seq_length
    t_sp = seq * s.micro_batch_size // s.cp // (s.tp if s.sp else 1)
    return 2 * 2 * t_sp * m.moe_router_topk * s.resolved_etp(m) * m.hidden_size


# Saved tensors whose gradients one sub-module's backward holds at once (the gradient of its output arriving, the
# gradients of its inputs being produced): attention core, MLP, routed experts, shared experts, Mamba mixer.
_BACKWARD_GROUPS = (
    frozenset({"q", "k", "v", "attn_out"}),
    frozenset({"fc1_out", "act_out"}),
    frozenset({"expert_fc1_out", "expert_act_out"}),
    frozenset({"shared_fc1_out", "shared_act_out"}),
)


# Column-parallel linears whose backward turns the gradient of their output (the saved tensors named) into the
# gradient of their input at the full sequence: fc1 and the QKV projection.
_COLUMN_PARALLEL = (frozenset({"fc1_out"}), frozenset({"q", "k", "v"}))


def backward_workspace(m: ModelSpec, s: Setup, layers: list[int]) -> int:
    """Bytes of the largest sub-module's gradient buffers in backward (bf16, as TE's dgrad GEMMs write them) over
    ``layers``: e.g. a SwiGLU MLP holds the gradient of its activation output and of ``fc1``'s output together.

    A column-parallel linear's backward (megatron-core ``tensor_parallel/layers.py``,
    ``LinearWithGradAccumulationAndAsyncCommunication.backward``; TE's ``_Linear`` / ``_LayerNormLinear`` alike)
    holds the gradient of its output while it writes the gradient of its input over the whole sequence
    (``grad_output.matmul(weight)``: tokens × h, all-reduced in place, or reduce-scattered with SP) and, with SP,
    the input all-gathered again for the weight gradient (tokens × h, the saved input is the local shard).

    Under FP8 (TE's ``_Linear`` / ``_GroupedLinear`` backward, ``trace/te_standins/fp8.py``) the output gradient is
    also quantized for the two GEMMs, one byte per element for each usage (as many bytes as its bf16 copy), and the
    input is gathered again quantized: one byte per element, and its transpose for the per-tensor recipes. A grouped
    expert fc1 is the same without TP communication (its input gradient over the routed tokens)."""
    seq = s.seq_length or m.seq_length
    tokens = seq * s.micro_batch_size // s.cp
    h = m.hidden_size
    gather = s.sp and s.tp > 1
    full = tokens * h * (2 if gather else 1)
    if s.fp8_recipe and gather:  # dgrad in bf16, the input gathered again in FP8 (+ transpose: per-tensor recipes)
        full = tokens * h + tokens * h * (1 if s.fp8_recipe in ("mxfp8", "blockwise") else 2) // 2
    best = 0
    for kind, moe in {(m.layer_kind(i), m.is_moe_layer(i)) for i in layers}:
        acts = kind_activations(m, s, kind, moe)
        for group in _BACKWARD_GROUPS:
            best = max(best, 2 * sum(t.numel for t in acts if t.name in group))
        for group in _COLUMN_PARALLEL:
            out = sum(t.numel for t in acts if t.name in group)
            quantized = out if s.fp8_recipe else 0  # the FP8 output gradient, two one-byte usages
            best = max(best, 2 * (out + quantized + full) if out else 0)
        if s.fp8_recipe:
            for name, rows in (("expert_fc1_out", "expert_fc1_in"), ("shared_fc1_out", None)):
                out = sum(t.numel for t in acts if t.name == name)
                dgrad = sum(t.numel for t in acts if t.name == rows) if rows else full // 2
                best = max(best, 2 * (2 * out + dgrad) if out else 0)
    return max(best, _mamba_backward_net(m, s, layers))


def _mamba_backward_net(m: ModelSpec, s: Setup, layers: list[int]) -> int:
    """The Mamba kernel's backward (``mamba_backward_bytes``) beyond what the stage holds then: the layers after a
    Mamba layer have run their backward and freed this micro-batch's saved tensors (without full recompute; with
    it they kept only their checkpoint inputs, not subtracted)."""
    best, mixers = 0, [j for j, i in enumerate(layers) if m.layer_kind(i) in (MAMBA, "G")]
    if not mixers:
        return 0
    kernel = mamba_backward_bytes(m, s)
    for j in mixers:
        later = 0
        if s.recompute_granularity != "full":
            later = sum(t.nbytes for i in layers[j + 1 :] for t in _stored(layer_activations(m, s, i), s))
        best = max(best, kernel - later)
    return best


def vocab_backward_bytes(m: ModelSpec, s: Setup, stage: int, first_chunk_saved: int) -> int:
    """The largest transient of the vocabulary layers' backward on ``stage`` beyond the in-flight activations.

    Last stage: the output layer is megatron-core's own ``ColumnParallelLinear`` in every spec; its backward
    (``tensor_parallel/layers.py``) holds the logits' gradient, the gradient of its input, and a weight-sized
    ``grad_weight = torch.empty(weight.main_grad.shape)`` that it returns even when the fused kernel accumulated
    into ``main_grad`` (so that DDP's hook runs on the main thread; with TE installed it is TE's cached
    ``get_dummy_wgrad`` buffer, which then also outlives the backward: not counted in the other phases).
    First stage: the embedding's backward (``VocabParallelEmbedding``: indexing the weight) writes a dense
    weight-sized gradient, after that micro-batch's layers are done (so without its activations); with tied
    embeddings on one stage autograd also still holds the output layer's and sums the two into a third."""
    seq = s.seq_length or m.seq_length
    tokens = seq * s.micro_batch_size // s.cp
    vocab = padded_vocab(m, s.tp) // s.tp
    weight = 2 * vocab * m.hidden_size
    best = 0
    if stage == s.pp - 1:
        best = weight + 2 * tokens * vocab + 2 * tokens * m.hidden_size
        if m.mtp_num_layers:
            best = max(best, _mtp_vocab_backward(m, s, tokens, weight))
    if stage == 0:
        tied_here = m.tied_embeddings and s.pp == 1
        best = max(best, (3 if tied_here else 1) * weight - first_chunk_saved)
    return best


def _mtp_vocab_backward(m: ModelSpec, s: Setup, tokens: int, weight: int) -> int:
    """The MTP stage's vocabulary backward: the output layer runs once per depth beside the main loss, and autograd
    sums the weight-sized ``grad_weight`` each run returns (the previous sum, the new one and their sum: three at
    once, the trace shows it on 0.16.1 and 0.19.2), while the depths not yet back-propagated keep their tensors
    (their checkpoint inputs under full recompute) and all but the last their logits for the loss."""
    _, t_sp = _mtp_tokens(m, s)
    kept = 2 * (2 * t_sp * m.hidden_size) if _mtp_checkpointed(s) else _mtp_internal(m, s)
    logits = (2 if te_cross_entropy_in_place(s) else 4) * tokens * padded_vocab(m, s.tp) // s.tp
    return 3 * weight + 2 * tokens * m.hidden_size + kept * m.mtp_num_layers + logits * (m.mtp_num_layers - 1)


def p2p_gradient_bytes(m: ModelSpec, s: Setup, stage: int) -> int:
    """The gradient of a chunk's output that the next pipeline stage sends back (megatron-core
    ``pipeline_parallel/p2p_communication.py``: ``recv_backward`` allocates it, ``[s/CP(/TP with SP), b, h]`` in the
    pipeline dtype) and that stays alive while the chunk runs backward. Every chunk but the model's last receives
    one: stages before the last, and with VPP every stage."""
    if s.pp == 1 or (stage == s.pp - 1 and not s.vpp):
        return 0
    seq = s.seq_length or m.seq_length
    tokens = seq * s.micro_batch_size // s.cp
    t_sp = tokens // s.tp if s.sp and s.tp > 1 else tokens
    return 2 * t_sp * m.hidden_size


def loss_transient_bytes(m: ModelSpec, s: Setup) -> int:
    """The logits' second copy while the loss runs: megatron-core's cross entropy (unfused, or fused ``native``)
    casts the bf16 logits to fp32 while the bf16 ones are still referenced (forward) and casts the fp32 gradient back
    to bf16 (backward): 2 bytes per logit beside the 4 saved. Transformer Engine's fused kernel from 2.18 does the
    same: its fp32 gradient is made while the bf16 logits are referenced, and autograd casts the fp32 gradient it
    returns to the logits' bf16. TE's kernel before 2.18 works in place. With MTP, megatron-core 0.19.2 computes the
    depths' losses in ``process_mtp_loss``, whose bf16 logits are freed when it returns, before the main loss (the
    trace shows it); 0.16.1's ``GPTModel._postprocess`` still holds the last depth's (``mtp_logits``) then, one
    bf16 copy more than counted here (measured: the planner 4-5 % under that release's peak on a 2-layer stage)."""
    if te_cross_entropy_in_place(s):
        return 0
    seq = s.seq_length or m.seq_length
    tokens = seq * s.micro_batch_size // s.cp
    return 2 * tokens * padded_vocab(m, s.tp) // s.tp


def _chunk_saved(full: list[int], layer_input: int, s: Setup) -> int:
    """Bytes one micro-batch keeps through one model chunk (one ``TransformerBlock``) whose layers save ``full``."""
    if s.recompute_granularity != "full":
        return sum(full)
    n = s.recompute_num_layers or 1
    if s.recompute_method == "block":  # the first n layers keep only their input
        return sum(full[n:]) + layer_input * min(n, len(full))
    return layer_input * math.ceil(len(full) / n)  # uniform: the input of every group of n layers


def _rebuilt(full: list[list[int]], s: Setup) -> int:
    """What full recompute re-materialises at once in backward: one checkpointed group of n layers (uniform) or one
    layer (block), the largest of the stage."""
    if s.recompute_granularity != "full":
        return 0
    n = s.recompute_num_layers or 1
    if s.recompute_method == "block":
        # The first n layers of a chunk are rebuilt after the chunk's last layers ran their backward: the current
        # micro-batch's saved tensors of those (counted in ``saved``) are gone by then.
        return max((max(0, max(chunk[:n], default=0) - sum(chunk[n:])) for chunk in full), default=0)
    return sum(sorted((b for chunk in full for b in chunk), reverse=True)[:n])


def stage_activations(m: ModelSpec, s: Setup, stage: int) -> ActivationMemory:
    """Activation bytes on one GPU of ``stage`` at the moments of a step (transformer layers per model chunk and
    in-flight micro-batch, embedding input, output layer + loss on the last stage)."""
    seq = s.seq_length or m.seq_length
    tokens = seq * s.micro_batch_size // s.cp
    t_sp = tokens // s.tp if s.sp else tokens
    h = m.hidden_size
    chunks = chunk_layers(m, s, stage)
    layers = [i for chunk in chunks for i in chunk]
    stored = {i: _stored(layer_activations(m, s, i), s) for i in layers}
    full = [[sum(t.nbytes for t in stored[i]) for i in chunk] for chunk in chunks]
    per_chunk = [_chunk_saved(f, 2 * t_sp * h, s) for f in full]
    floor = te_offload_min_numel(s)
    eligible = [sum(t.nbytes for t in stored[i] if t.numel >= floor) for i in layers]
    host = 0
    k = s.activation_offload_layers if layer_offload_reaches(m) else 0
    if k:
        # TE v2 keeps at most model_layers − k layers of eligible tensors resident; small ones stay (PP 1: one chunk).
        per_chunk[0] -= sum(sorted(eligible, reverse=True)[: min(k, len(layers))])
        host = sum(next_pow2(t.nbytes) for i in layers[:k] for t in stored[i] if t.numel >= floor)
    if stage == 0:
        per_chunk[0] += 8 * tokens + (t_sp * h if m.dropout > 0 else 0)  # int64 token ids, embedding dropout mask
    vectors = schedule.inflight_vectors(s.pp, s.vpp, s.num_microbatches(), stage)
    # TE's FP8 weights (made at the first forward) and dummy weight gradients (the first backward), held for the run
    cache = fp8_weight_cache_bytes(m, s, stage) + te_dummy_wgrad_bytes(m, s, stage)
    saved = max(sum(c * b for c, b in zip(v, per_chunk, strict=True)) for v in vectors) + cache
    loss_saved = loss_transient = 0
    if stage == s.pp - 1:
        # The loss runs right after the last chunk's forward of a micro-batch; its logits are freed before that
        # micro-batch's layers run backward, so they never meet the recompute or the backward workspace.
        with_loss = [v for v in vectors if v[-1]] or list(vectors)
        loss_saved = max(sum(c * b for c, b in zip(v, per_chunk, strict=True)) for v in with_loss) + cache
        loss_saved += output_bytes(m, s, tokens, t_sp) + mtp_activations(m, s)
        loss_transient = loss_transient_bytes(m, s)
    if s.offload_modules and s.recompute_granularity != "full":  # full recompute saves nothing inside the scopes
        fg = stage_groups(m, s, stage)
        saved -= fg.gpu_saving_bytes
        loss_saved -= fg.gpu_saving_bytes if loss_saved else 0
        host += fg.host_bytes
    # Two moments of backward: a decoder layer's (the rebuilt layer, its gradient buffers, the MoE dispatch
    # buffers) and a vocabulary layer's (the output layer before the decoder layers run backward, the embedding
    # after): never at once, so the vocabulary's transient meets no rebuilt layer.
    rebuilt = max(_rebuilt(full, s), mtp_rebuilt(m, s) if stage == s.pp - 1 else 0)
    layer = backward_workspace(m, s, layers) + moe_dispatch_bytes(m, s, layers)
    workspace = max(layer, vocab_backward_bytes(m, s, stage, per_chunk[0]) - rebuilt) + p2p_gradient_bytes(m, s, stage)
    return ActivationMemory(
        saved, rebuilt, workspace, loss_saved, loss_transient, max(eligible, default=0), host, held=cache
    )


def stage_groups(
    m: ModelSpec, s: Setup, stage: int, per_layer: list[list[Tensor]] | None = None
) -> fine_grained.FineGrainedMemory:
    """``fine_grained.stage_saving`` of one pipeline stage: its decoder layers (``per_layer`` when the caller has
    them), and on the last stage the MTP depths' layers, which run inside the same offload chunk."""
    if per_layer is None:
        per_layer = [_stored(layer_activations(m, s, i), s) for i in stage_layers(m, s)[stage]]
    if stage == s.pp - 1 and m.mtp_num_layers:
        per_layer = per_layer + _mtp_depth(m, s) * m.mtp_num_layers
    return fine_grained.stage_saving(
        per_layer,
        s.offload_modules,
        in_flight(s, stage),
        min_size=s.min_offloaded_tensor_size,
        fraction=s.activation_offload_fraction,
    )


def step_extra_s(
    m: ModelSpec, s: Setup, link_bytes_per_s: float, baseline_s: float, microbatches: int
) -> tuple[float, str | None]:
    """Exposed copy time per step of fine-grained offloading, and a note when the link cannot hide it.

    Every stage copies each micro-batch's groups D2H in forward and H2D in backward; the slowest stage sets the
    step. One layer's forward is taken as a third of its share of the baseline step (backward ≈ 2× forward).
    """
    if not s.offload_modules or s.recompute_granularity == "full":
        return 0.0, None
    worst, note = 0.0, None
    for stage, layers in enumerate(stage_layers(m, s)):
        fg = stage_groups(m, s, stage)
        if not fg.copied_bytes_per_microbatch or not len(layers):
            continue
        compute = baseline_s / (1 + (s.pp - 1) / (microbatches * (s.vpp or 1)))
        layer_fwd = compute / microbatches / len(layers) / 3
        per_layer_copy = fg.copied_bytes_per_microbatch / len(layers)
        extra = (
            fine_grained.exposed_copy_s(int(per_layer_copy), link_bytes_per_s, layer_fwd) * len(layers) * microbatches
        )
        if extra > worst:
            worst = extra
            note = (
                f"fine-grained copies ({per_layer_copy / link_bytes_per_s * 1e3:.1f} ms per layer each way) exceed "
                f"a layer's forward ({layer_fwd * 1e3:.1f} ms) on stage {stage}: not fully hidden"
            )
    return worst, note
