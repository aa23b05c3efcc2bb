"""Generated pipeline runs for the trace differential (``tests/plan/test_trace_differential.py``): what the other
generators (``tests/support/trace_cases.py``) leave out of pipelines.

``pipeline_model_parallel_layout`` strings (PP 2-4, one or two virtual stages a rank, a standalone embedding or loss
stage, uneven counts), uneven first and last stages (``num_layers_in_first/last_pipeline_stage``, alone, together
and with VPP), on dense and MoE layers, with and without recompute. Real widths, small layer counts.
"""

from __future__ import annotations

import math
import random
from typing import Any

from tests.support.trace_cases import MOE_WIDTHS, VOCABS, WIDTHS, _levers, _moe_config


def _layout(rng: random.Random, pp: int, vpp: int) -> tuple[str, int]:
    """A layout of ``pp·vpp`` virtual stages (embedding first, loss last) and its decoder layer count: the first
    and last virtual stages may hold no decoder layer (a standalone embedding or loss stage), the others 1-3."""
    counts = [rng.choice((1, 1, 2, 3)) for _ in range(pp * vpp)]
    if rng.random() < 0.3:
        counts[0] = 0
    if rng.random() < 0.3:
        counts[-1] = 0
    if sum(counts) < pp:  # the planner asks for at least PP decoder layers
        counts = [max(1, n) for n in counts]
    stages = ["t" * n for n in counts]
    stages[0], stages[-1] = "E" + stages[0], stages[-1] + "L"
    return "|".join(stages), sum(counts)


def _pipeline(rng: random.Random, case: dict[str, Any]) -> None:
    """A layout, or uneven first/last stages (with VPP where megatron-core's split allows it)."""
    pp = rng.choice((2, 2, 3, 4))
    vpp = rng.choice((1, 1, 2))
    case["pp"] = pp
    if rng.random() < 0.5:
        text, layers = _layout(rng, pp, vpp)
        case.update(pipeline_layout=text, num_layers=layers)
        return
    # megatron-core's uneven split: the middle ranks share the rest evenly, and with VPP each rank's layers are
    # split evenly over its chunks (get_num_layers_to_build asserts both)
    per = vpp * rng.choice((1, 2))
    first = vpp * rng.choice((1, 2)) if rng.random() < 0.7 else None
    last = vpp * rng.choice((1, 2, 3)) if first is None or rng.random() < 0.5 else None
    if pp == 2 and vpp > 1 and first is not None:
        # megatron-core's get_transformer_layer_offset divides by the middle ranks' chunk size with VPP: without a
        # middle rank it raises ZeroDivisionError (0.16.1 and 0.19.2), so upstream cannot build that split
        last = None
    middle = pp - (first is not None) - (last is not None)
    case["num_layers"] = (first or 0) + (last or 0) + per * middle
    if first is not None:
        case["num_layers_in_first_pipeline_stage"] = first
    if last is not None:
        case["num_layers_in_last_pipeline_stage"] = last
    if vpp > 1:
        case["vpp"] = vpp


def generate_layouts(seed: int, n: int) -> list[dict[str, Any]]:
    """``n`` pipeline cases from ``seed`` (the same list every time): :func:`_pipeline`'s split on dense widths
    (and MoE widths for a third of them), TP with SP, recompute, the distributed optimizer."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        moe = rng.random() < 0.3
        case: dict[str, Any] = {
            "vocab_size": rng.choice(VOCABS),
            "seq_length": rng.choice((1024, 2048, 4096)),
            "micro_batch_size": rng.choice((1, 1, 2)),
        }
        if moe:
            hidden, heads, groups, kv, ffn, moe_ffn, experts, topk, shared = rng.choice(MOE_WIDTHS)
            case.update(moe_ffn_hidden_size=moe_ffn, num_moe_experts=experts, moe_router_topk=max(2, topk))
        else:
            hidden, heads, groups, ffn = rng.choice(WIDTHS)
            kv, shared = hidden // heads, None
        case.update(
            hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups, kv_channels=kv, ffn_hidden_size=ffn
        )
        _pipeline(rng, case)
        tp = rng.choice([t for t in (1, 2, 4) if groups % t == 0])
        case["tp"] = tp
        if tp > 1:
            case["sequence_parallel"] = True
        ep = 1
        if moe:
            ep = rng.choice([e for e in (1, 2, 4) if experts % e == 0 and experts // e <= 32])
            case.update(ep=ep, etp=1)
        case["num_gpus"] = math.lcm(tp * case["pp"], case["pp"] * ep) * rng.choice((1, 2))
        dp = case["num_gpus"] // (tp * case["pp"])
        # the interleaved schedule needs a multiple of PP micro-batches
        case["global_batch_size"] = case["micro_batch_size"] * dp * case["pp"] * rng.choice((1, 2))
        case["distributed_optimizer"] = rng.random() < 0.85
        case["grad_reduce_in_fp32"] = rng.random() < 0.7
        _levers(rng, case)
        case["config"] = _moe_config(shared, False, case["num_layers"]) if moe else None
        if case["config"] is None:
            del case["config"]
        out.append(case)
    return out


def generate_context(seed: int, n: int) -> list[dict[str, Any]]:
    """``n`` cases from ``seed`` of context parallelism (CP 2 or 4, TE's p2p ring; a fifth of them CP 1) and
    multi-token prediction (one or two depths on the last stage, for half of them), on dense, MoE and
    multi-latent-attention layers, with TP/SP, PP (VPP sometimes) and recompute."""
    from tests.support.trace_cases import MLA_SHAPES, _feature_config

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        moe = rng.random() < 0.4
        mla = rng.choice((None, None, *MLA_SHAPES))
        hidden, heads, groups, kv, ffn, moe_ffn, experts, topk, shared = rng.choice(MOE_WIDTHS)
        if mla is not None:
            groups = heads
        cp = rng.choice((1, 2, 2, 4, 4))
        case: dict[str, Any] = {
            "hidden_size": hidden,
            "num_attention_heads": heads,
            "num_query_groups": groups,
            "kv_channels": kv,
            "ffn_hidden_size": ffn,
            "vocab_size": rng.choice(VOCABS),
            "seq_length": cp * rng.choice((1024, 2048, 4096)),
            "micro_batch_size": 1,
            "cp": cp,
        }
        tp = rng.choice([t for t in (1, 2, 4) if groups % t == 0 and heads % t == 0])
        pp = rng.choice((1, 1, 2))
        layers = pp * rng.choice((1, 2))
        case.update(tp=tp, pp=pp, num_layers=layers)
        if tp > 1:
            case["sequence_parallel"] = True
        if pp > 1 and layers // pp == 2 and rng.random() < 0.3:
            case["vpp"] = 2
        ep = 1
        if moe:
            case.update(moe_ffn_hidden_size=moe_ffn, num_moe_experts=experts, moe_router_topk=max(2, topk))
            ep = rng.choice([e for e in (1, 2, 4) if experts % e == 0 and experts // e <= 32])
            case.update(ep=ep, etp=1)
        case["num_gpus"] = math.lcm(tp * cp * pp, pp * ep) * rng.choice((1, 2))
        dp = case["num_gpus"] // (tp * cp * pp)
        case["global_batch_size"] = dp * pp * rng.choice((1, 2))
        case["distributed_optimizer"] = True
        case["grad_reduce_in_fp32"] = rng.random() < 0.7
        _levers(rng, case)
        config = _feature_config(mla, mla is not None, shared, False, layers, moe)
        mtp = rng.choice((0, 1, 1, 2)) if rng.random() < 0.5 else 0
        if mtp:
            config += f"  mtp_num_layers: {mtp}\n"
        case["config"] = config
        out.append(case)
    return out
