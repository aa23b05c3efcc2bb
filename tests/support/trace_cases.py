"""Generated dense runs for the trace differential (``tests/plan/test_trace_differential.py``).

Each case is a dict of planner inputs (the flags ``estimate`` and ``trace`` take): real widths (fake tensors cost
the same at any width), small layer counts (time goes with layers), and every layout and lever the trace builds:
TP with and without SP, PP, VPP, uneven first/last stages, full and selective recompute, the distributed
optimizer or not, fp32 or bf16 gradient reduction, tied embeddings, micro-batch sizes and counts.
"""

from __future__ import annotations

import math
import random
from typing import Any

WIDTHS = (  # hidden, heads, query groups, ffn: shapes of published dense models, and two small ones
    (1024, 16, 8, 4096),
    (2048, 16, 4, 5632),
    (4096, 32, 8, 14336),
    (5120, 40, 8, 13824),
    (8192, 64, 8, 28672),
    (3072, 24, 24, 8192),
)
VOCABS = (32000, 50304, 128256, 151936)


def _layout(rng: random.Random, case: dict[str, Any]) -> int:
    """Sets tp/pp/vpp/stages; returns the model-parallel size."""
    tp = rng.choice([t for t in (1, 1, 2, 4, 8) if case["num_query_groups"] % t == 0])
    pp = rng.choice((1, 1, 2, 2, 4))
    layers = pp * rng.choice((1, 2, 3))
    case.update(tp=tp, pp=pp, num_layers=layers)
    if tp > 1:
        case["sequence_parallel"] = rng.random() < 0.7
    if pp > 1 and rng.random() < 0.3 and (layers // pp) % 2 == 0:
        case["vpp"] = 2
    elif pp > 2 and rng.random() < 0.25:  # uneven: one layer fewer on the first stage
        per = layers // pp + 1
        case["num_layers"] = per * (pp - 1) + (per - 1)
        case["num_layers_in_first_pipeline_stage"] = per - 1
    return tp * pp


def _levers(rng: random.Random, case: dict[str, Any]) -> None:
    kind = rng.choice(("none", "none", "full", "selective"))
    if kind == "full":
        case.update(recompute_granularity="full", recompute_method=rng.choice(("uniform", "block")))
        case["recompute_num_layers"] = 1
    elif kind == "selective":
        case.update(recompute_granularity="selective", recompute_modules=["core_attn"])


def generate(seed: int, n: int) -> list[dict[str, Any]]:
    """``n`` cases from ``seed`` (the same list every time)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        hidden, heads, groups, ffn = rng.choice(WIDTHS)
        case: dict[str, Any] = {
            "hidden_size": hidden,
            "num_attention_heads": heads,
            "num_query_groups": groups,
            "kv_channels": hidden // heads,
            "ffn_hidden_size": ffn,
            "vocab_size": rng.choice(VOCABS),
            "seq_length": rng.choice((1024, 2048, 4096, 8192)),
            "micro_batch_size": rng.choice((1, 1, 2)),
        }
        mp = _layout(rng, case)
        dp = rng.choice((1, 2, 4, 8))
        case["num_gpus"] = mp * dp
        # interleaving needs at least PP micro-batches (megatron-core refuses fewer)
        least = case["pp"] if case.get("vpp") else 1
        case["global_batch_size"] = case["micro_batch_size"] * dp * max(least, rng.choice((1, 2, 4, 8)))
        case["distributed_optimizer"] = rng.random() < 0.8
        case["grad_reduce_in_fp32"] = rng.random() < 0.7
        case["share_embeddings_and_output_weights"] = rng.random() < 0.2
        _levers(rng, case)
        out.append(case)
    return out


# MoE shapes (hidden, heads, query groups, kv channels, dense ffn, expert ffn, experts, top-k, shared-expert ffn) of
# published models without multi-latent attention: Mixtral 8x7B, Qwen3-30B-A3B, OLMoE, Qwen2-57B-A14B, a
# DeepSeek-V2-Lite-like layer with standard attention, and a small one.
MOE_WIDTHS = (
    (4096, 32, 8, 128, 14336, 14336, 8, 2, None),
    (2048, 32, 4, 128, 6144, 768, 128, 8, None),
    (2048, 16, 16, 128, 8192, 1024, 64, 8, None),
    (3584, 28, 4, 128, 18944, 2560, 64, 8, 20480),
    (2048, 16, 16, 128, 10944, 1408, 64, 6, 2816),
    (1024, 16, 8, 64, 4096, 512, 16, 4, 1024),
)


def moe_fields(width: tuple[Any, ...]) -> dict[str, Any]:
    """The planner inputs of one ``MOE_WIDTHS`` row (its shared-expert width goes in the case's ``config``)."""
    hidden, heads, groups, kv, ffn, moe_ffn, experts, topk, _shared = width
    return {
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "kv_channels": kv,
        "ffn_hidden_size": ffn,
        "moe_ffn_hidden_size": moe_ffn,
        "num_moe_experts": experts,
        "moe_router_topk": topk,
    }


def _moe_config(shared: int | None, dense_first: bool, layers: int) -> str:
    """The model section a MoE case states beyond the planner's flags: shared experts and ``moe_layer_freq``
    (a leading dense layer, as DeepSeek's ``first_k_dense_replace``), SwiGLU without biases."""
    lines = ["model:", "  gated_linear_unit: true", "  add_bias_linear: false"]
    if shared:
        lines.append(f"  moe_shared_expert_intermediate_size: {shared}")
    if dense_first:
        lines.append(f"  moe_layer_freq: {[0] + [1] * (layers - 1)}")
    return "\n".join(lines) + "\n"


def generate_moe(seed: int, n: int) -> list[dict[str, Any]]:
    """``n`` MoE cases from ``seed``: EP (with at most 32 local experts a layer: time goes with them), expert-TP
    equal to TP or 1 (expert DP follows), shared experts, a leading dense layer, top-k, TP/SP, PP/VPP, recompute.
    Each case's ``config`` key holds the model section for :func:`_moe_config`'s fields."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        width = rng.choice(MOE_WIDTHS)
        _, _, groups, _, _, _, experts, topk, shared = width
        case: dict[str, Any] = {
            **moe_fields(width),
            # top-1 needs moe_router_pre_softmax (megatron-core refuses it otherwise): at least 2
            "moe_router_topk": rng.choice((topk, topk, max(2, topk // 2))),
            "vocab_size": rng.choice(VOCABS),
            "seq_length": rng.choice((1024, 2048, 4096)),
            "micro_batch_size": rng.choice((1, 1, 2)),
        }
        tp = rng.choice([t for t in (1, 1, 2, 4) if groups % t == 0])
        pp = rng.choice((1, 1, 2))
        layers = pp * rng.choice((1, 2))
        case.update(tp=tp, pp=pp, num_layers=layers)
        if tp > 1:  # megatron-core refuses MoE with TP and without SP
            case["sequence_parallel"] = True
        if pp > 1 and layers // pp == 2 and rng.random() < 0.3:
            case["vpp"] = 2
        ep = rng.choice([e for e in (1, 2, 4, 8) if experts % e == 0 and experts // e <= 32])
        etp = tp if tp == 1 or rng.random() < 0.5 else 1
        case.update(ep=ep, etp=etp)
        unit = tp * pp
        expert_unit = pp * ep * etp
        base = math.lcm(unit, expert_unit)
        case["num_gpus"] = base * rng.choice((1, 1, 2))
        dp = case["num_gpus"] // unit
        least = pp if case.get("vpp") else 1
        case["global_batch_size"] = case["micro_batch_size"] * dp * max(least, rng.choice((1, 2, 4)))
        case["distributed_optimizer"] = rng.random() < 0.85
        case["grad_reduce_in_fp32"] = rng.random() < 0.7
        _levers(rng, case)
        case["config"] = _moe_config(shared, layers > 1 and rng.random() < 0.3, layers)
        out.append(case)
    return out


def _feature_config(
    mla: dict[str, Any] | None, qk_layernorm: bool, shared: int | None, dense_first: bool, layers: int, moe: bool
) -> str:
    """The model section a feature case states: multi-latent attention (its ranks and head dimensions), the query/key
    norms, and for MoE the fields of :func:`_moe_config`."""
    lines = [
        "model:",
        "  gated_linear_unit: true",
        "  add_bias_linear: false",
        f"  qk_layernorm: {str(qk_layernorm).lower()}",
    ]
    if mla is not None:
        lines.append("  multi_latent_attention: true")
        lines += [f"  {k}: {'null' if v is None else v}" for k, v in mla.items()]
    if moe:
        lines += _moe_config(shared, dense_first, layers).splitlines()[3:]
    return "\n".join(lines) + "\n"


# Multi-latent attention shapes (q latent or none, kv latent, qk / rope / v head dims): DeepSeek-V3, DeepSeek-V2-Lite
# and Moonlight (no query latent), and a small one.
MLA_SHAPES = (
    {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64, "v_head_dim": 128},
    {"q_lora_rank": None, "kv_lora_rank": 512, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64, "v_head_dim": 128},
    {"q_lora_rank": 256, "kv_lora_rank": 128, "qk_head_dim": 64, "qk_pos_emb_head_dim": 32, "v_head_dim": 64},
)
STATE_DTYPES = (("fp32", "fp32", "fp32"), ("bf16", "bf16", "fp32"), ("fp16", "fp16", "fp32"), ("bf16", "fp32", "fp32"))


def generate_features(seed: int, n: int) -> list[dict[str, Any]]:
    """``n`` cases of the features the dense and MoE generators leave out: multi-latent attention with and without a
    query latent, query/key norms, the precision-aware optimizer's state dtypes, and the fused cross entropy
    (megatron-core's ``native`` or Transformer Engine's, before and from TE 2.18), on dense and MoE layers."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        moe = rng.random() < 0.5
        mla = rng.choice((None, *MLA_SHAPES))
        hidden, heads, groups, kv, ffn, moe_ffn, experts, topk, shared = rng.choice(MOE_WIDTHS)
        if mla is not None:
            groups = heads  # MLA has no query groups
        case: dict[str, Any] = {
            "hidden_size": hidden,
            "num_attention_heads": heads,
            "num_query_groups": groups,
            "kv_channels": kv,
            "ffn_hidden_size": ffn,
            "vocab_size": rng.choice(VOCABS),
            "seq_length": rng.choice((1024, 2048, 4096)),
            "micro_batch_size": 1,
        }
        tp = rng.choice([t for t in (1, 1, 2, 4) if groups % t == 0 and heads % t == 0])
        pp = rng.choice((1, 1, 2))
        layers = pp * rng.choice((1, 2))
        case.update(tp=tp, pp=pp, num_layers=layers)
        if tp > 1:
            case["sequence_parallel"] = True
        ep = 1
        if moe:
            case.update(moe_ffn_hidden_size=moe_ffn, num_moe_experts=experts, moe_router_topk=max(2, topk))
            ep = rng.choice([e for e in (1, 2, 4, 8) if experts % e == 0 and experts // e <= 32])
            case.update(ep=ep, etp=1)
        case["num_gpus"] = math.lcm(tp * pp, pp * ep) * rng.choice((1, 2))
        dp = case["num_gpus"] // (tp * pp)
        case["global_batch_size"] = dp * rng.choice((1, 2))
        case["distributed_optimizer"] = True
        case["grad_reduce_in_fp32"] = rng.random() < 0.5
        if rng.random() < 0.6:
            exp_avg, exp_avg_sq, main = rng.choice(STATE_DTYPES)
            case.update(
                precision_aware_optimizer=True,
                exp_avg_dtype=exp_avg,
                exp_avg_sq_dtype=exp_avg_sq,
                main_params_dtype=main,
            )
        if rng.random() < 0.7:
            case.update(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl=rng.choice(("native", "te")))
        case["te_version"] = rng.choice(("2.17", "2.18"))
        _levers(rng, case)
        qk_norm = mla is not None or rng.random() < 0.5
        case["config"] = _feature_config(mla, qk_norm, shared, moe and layers > 1 and rng.random() < 0.3, layers, moe)
        out.append(case)
    return out


# Fine-grained offload module sets (megatron-core's allowed modules, each alone and a few together; attn_proj only
# beside core_attn, as upstream requires). attn_norm and mlp_norm are no-ops where TE fuses the norm into the next
# linear (standard attention; dense MLP): the trace builds TE's layout, the planner knows it.
DENSE_MODULES = (
    ("attn_norm",),
    ("qkv_linear",),
    ("core_attn",),
    ("core_attn", "attn_proj"),
    ("mlp_norm",),
    ("qkv_linear", "core_attn", "attn_proj"),
)
MOE_MODULES = (
    ("expert_fc1",),
    ("moe_act",),
    ("mlp_norm",),
    ("expert_fc1", "moe_act"),
    ("core_attn", "attn_proj", "expert_fc1"),
    ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act"),
)


def _offload_moe(rng: random.Random, case: dict[str, Any]) -> int:
    """One MoE width (Qwen3-30B-A3B's layer, or a small one) on the case; returns EP."""
    width = rng.choice((MOE_WIDTHS[1], MOE_WIDTHS[5]))
    case.update(moe_fields(width))
    experts = case["num_moe_experts"]
    ep = rng.choice([e for e in (2, 4, 8) if experts // e <= 32])
    case.update(ep=ep, etp=1)
    case["config"] = _moe_config(None, False, 1)
    return ep


def generate_offload(seed: int, n: int) -> list[dict[str, Any]]:
    """``n`` cases of the activation offload mechanisms: megatron-core's fine-grained offloading (every allowed module
    alone, a few sets) with and without selective recompute (core_attn; moe_act on MoE), PP 1 or 2, TP with SP; and
    Transformer Engine's layer-level offload of ``k`` layers (upstream allows it at PP 1 without recompute only),
    dense and MoE."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        hidden, heads, groups, ffn = rng.choice(WIDTHS[:4])
        case: dict[str, Any] = {
            "hidden_size": hidden,
            "num_attention_heads": heads,
            "num_query_groups": groups,
            "kv_channels": hidden // heads,
            "ffn_hidden_size": ffn,
            "vocab_size": rng.choice(VOCABS),
            "seq_length": rng.choice((2048, 4096)),
            "micro_batch_size": 1,
        }
        moe = rng.random() < 0.4
        ep = _offload_moe(rng, case) if moe else 1
        groups = case["num_query_groups"]
        tp = rng.choice([t for t in (1, 2, 4) if groups % t == 0])
        layer_level = i % 3 == 2
        pp = 1 if layer_level else rng.choice((1, 1, 2))
        layers = rng.choice((2, 3, 4)) * pp
        case.update(tp=tp, pp=pp, num_layers=layers)
        if tp > 1:
            case["sequence_parallel"] = True
        case["num_gpus"] = math.lcm(tp * pp, pp * ep) * rng.choice((1, 2))
        dp = case["num_gpus"] // (tp * pp)
        case["global_batch_size"] = dp * (pp if pp > 1 else 1) * rng.choice((1, 2))
        case["distributed_optimizer"] = True
        case["grad_reduce_in_fp32"] = True
        if layer_level:
            case["activation_offload_layers"] = rng.randint(1, layers - 1)
        else:
            case["offload_modules"] = list(rng.choice(MOE_MODULES if moe else DENSE_MODULES))
            recompute = rng.choice(("none", "none", "core_attn", "moe_act" if moe else "core_attn"))
            if recompute != "none":
                case.update(recompute_granularity="selective", recompute_modules=[recompute])
        out.append(case)
    return out
