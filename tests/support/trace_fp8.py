"""Generated FP8 runs for the trace differential (``tests/plan/test_trace_differential.py``).

Each case is a dict of planner inputs, as in ``tests/support/trace_cases.py``: real widths, small layer counts, every
FP8 recipe Bridge runs (``delayed``, ``tensorwise`` current scaling, ``mxfp8``, ``blockwise``) on dense layers and a
few MoE ones, TP with and without SP, PP and VPP, selective recompute of ``core_attn`` and ``mlp`` (megatron-core
refuses ``layernorm`` and ``moe_act`` recompute under delayed scaling; the planner proposes neither under FP8), full
recompute, the distributed optimizer or not, FP8 primary weights (``fp8_param``) or not.
"""

from __future__ import annotations

import math
import random
from typing import Any

from tests.support.trace_cases import MOE_WIDTHS, VOCABS, WIDTHS, _moe_config, moe_fields

RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")


def _levers(rng: random.Random, case: dict[str, Any]) -> None:
    kind = rng.choice(("none", "full", "core_attn", "mlp", "both"))
    if kind == "full":
        case.update(recompute_granularity="full", recompute_method=rng.choice(("uniform", "block")))
        case["recompute_num_layers"] = 1
    elif kind != "none":
        modules = ["core_attn", "mlp"] if kind == "both" else [kind]
        case.update(recompute_granularity="selective", recompute_modules=modules)


def _dense(rng: random.Random) -> dict[str, Any]:
    hidden, heads, groups, ffn = rng.choice(WIDTHS)
    case: dict[str, Any] = {
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "kv_channels": hidden // heads,
        "ffn_hidden_size": ffn,
        "seq_length": rng.choice((2048, 4096, 8192)),
    }
    tp = rng.choice([t for t in (1, 2, 4, 8) if groups % t == 0])
    pp = rng.choice((1, 1, 2, 4))
    case.update(tp=tp, pp=pp, num_layers=pp * rng.choice((1, 2)))
    if tp > 1:
        case["sequence_parallel"] = rng.random() < 0.7
    if pp > 1 and case["num_layers"] // pp == 2 and rng.random() < 0.4:
        case["vpp"] = 2
    return case


def _moe(rng: random.Random) -> dict[str, Any]:
    width = rng.choice(MOE_WIDTHS)
    _, _, groups, _, _, _, experts, _, shared = width
    case: dict[str, Any] = {**moe_fields(width), "seq_length": rng.choice((2048, 4096))}
    tp = rng.choice([t for t in (1, 2) if groups % t == 0])
    pp = rng.choice((1, 2))
    case.update(tp=tp, pp=pp, num_layers=pp * rng.choice((1, 2)))
    if tp > 1:  # megatron-core refuses MoE with TP and without SP
        case["sequence_parallel"] = True
    ep = rng.choice([e for e in (2, 4, 8) if experts % e == 0 and experts // e <= 32])
    case.update(ep=ep, etp=tp)
    case["config"] = _moe_config(shared, False, case["num_layers"])
    return case


def generate_fp8(seed: int, n: int) -> list[dict[str, Any]]:
    """``n`` FP8 cases from ``seed`` (the same list every time): each recipe in turn, about one in five MoE."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        case = _moe(rng) if rng.random() < 0.2 else _dense(rng)
        case["fp8_recipe"] = RECIPES[i % len(RECIPES)]
        case["vocab_size"] = rng.choice(VOCABS)
        case["micro_batch_size"] = rng.choice((1, 1, 2))
        unit = case["tp"] * case["pp"]
        if "ep" in case:
            unit = math.lcm(unit, case["pp"] * case["ep"] * case["etp"])
        case["num_gpus"] = unit * rng.choice((1, 2))
        dp = case["num_gpus"] // (case["tp"] * case["pp"])
        least = case["pp"] if case.get("vpp") else 1
        case["global_batch_size"] = case["micro_batch_size"] * dp * max(least, rng.choice((1, 2, 4)))
        case["distributed_optimizer"] = rng.random() < 0.8
        case["grad_reduce_in_fp32"] = rng.random() < 0.7
        _levers(rng, case)
        # FP8 primary weights (fp8_param_gather, as Bridge's FP8 perf recipes set it): no cached FP8 weight
        case["fp8_param"] = rng.random() < 0.3
        out.append(case)
    return out
