"""Generated hybrid Mamba runs for the trace differential (``tests/plan/test_trace_differential.py``).

Each case is a dict of planner inputs (the flags ``estimate`` and ``trace`` take) and a ``config`` model section with
the hybrid fields Bridge's providers state (``hybrid_layer_pattern``, the Mamba mixer's shapes, MoE for ``E``): real
widths of Nemotron-H-like models (fake tensors cost the same at any width), small layer counts (time goes with
layers), patterns mixing Mamba (``M``), attention (``*``), MLP (``-``) and MoE (``E``) layers as megatron-core's
hybrid allocation reads them, TP with and without SP, PP with the pattern split evenly over the stages (no ``|``
marks: megatron-core's fallback), full, selective or no recompute. Only runs megatron-core builds: the mixer's heads
and groups divisible by TP, no VPP (megatron-core refuses interleaving on a pattern without ``|``).
"""

from __future__ import annotations

import math
import random
from typing import Any

# hidden, heads, query groups, kv channels, ffn, Mamba heads, head dim, state, groups, MLP gated, MoE or None
# (experts, top-k, expert ffn, shared ffn): published hybrid shapes and a small one
HYBRID_WIDTHS: tuple[tuple[Any, ...], ...] = (
    (4096, 32, 8, 128, 21504, 128, 64, 128, 8, False, None),  # Nemotron-H 8B
    (8192, 64, 8, 128, 30720, 256, 64, 256, 8, False, None),  # Nemotron-H 47B
    (4480, 40, 8, 128, 15680, 128, 80, 128, 8, False, None),  # Nemotron Nano 2 9B
    (2688, 32, 2, 128, 1856, 64, 64, 128, 8, False, (128, 6, 1856, 3712)),  # Nemotron 3 Nano 30B-A3B
    (1024, 16, 8, 64, 4096, 32, 64, 64, 8, True, (16, 2, 1024, None)),  # small, SwiGLU
)
VOCABS = (131072, 32000, 50304)


def _pattern(rng: random.Random, layers: int, moe: bool) -> str:
    """``layers`` symbols with a Mamba layer on every stage's share and the others mixed in (Nemotron-H's order:
    mostly Mamba, some attention, MLP or MoE after)."""
    symbols = "MM*" + ("EE" if moe else "--")
    pattern = [rng.choice(symbols) for _ in range(layers)]
    pattern[0] = "M"
    return "".join(pattern)


def _config(width: tuple[Any, ...], pattern: str) -> str:
    *_, mamba_heads, head_dim, state, groups, gated, moe = width
    lines = [
        "model:",
        f"  hybrid_layer_pattern: {pattern}",
        f"  mamba_num_heads: {mamba_heads}",
        f"  mamba_head_dim: {head_dim}",
        f"  mamba_state_dim: {state}",
        f"  mamba_num_groups: {groups}",
        f"  gated_linear_unit: {str(gated).lower()}",
        "  add_bias_linear: false",
    ]
    if moe is not None and "E" in pattern:
        experts, topk, expert_ffn, shared = moe
        lines += [f"  num_moe_experts: {experts}", f"  moe_router_topk: {topk}", f"  moe_ffn_hidden_size: {expert_ffn}"]
        if shared:
            lines.append(f"  moe_shared_expert_intermediate_size: {shared}")
    return "\n".join(lines) + "\n"


def generate_hybrid(seed: int, n: int) -> list[dict[str, Any]]:
    """``n`` hybrid cases from ``seed`` (the same list every time)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        width = rng.choice(HYBRID_WIDTHS)
        hidden, heads, groups, kv, ffn, mamba_heads, _, _, mamba_groups, _, moe = width
        tp = rng.choice([t for t in (1, 1, 2, 4, 8) if math.gcd(groups, mamba_heads, mamba_groups) % t == 0])
        pp = rng.choice((1, 1, 2))
        layers = pp * rng.choice((2, 3, 4))
        pattern = _pattern(rng, layers, moe is not None)
        case: dict[str, Any] = {
            "hidden_size": hidden,
            "num_attention_heads": heads,
            "num_query_groups": groups,
            "kv_channels": kv,
            "ffn_hidden_size": ffn,
            "num_layers": layers,
            "vocab_size": rng.choice(VOCABS),
            "seq_length": rng.choice((1024, 2048, 4096, 8192)),
            "micro_batch_size": rng.choice((1, 1, 2)),
            "tp": tp,
            "pp": pp,
        }
        if tp > 1:  # megatron-core refuses MoE with TP and without SP
            case["sequence_parallel"] = "E" in pattern or rng.random() < 0.7
        unit = tp * pp
        if "E" in pattern:
            experts = moe[0]
            ep = rng.choice([e for e in (2, 4, 8) if experts % e == 0 and experts // e <= 32])
            case.update(ep=ep, etp=1)
            unit = math.lcm(unit, pp * ep)
        case["num_gpus"] = unit * rng.choice((1, 2))
        dp = case["num_gpus"] // (tp * pp)
        case["global_batch_size"] = case["micro_batch_size"] * dp * rng.choice((1, 2, 4))
        case["distributed_optimizer"] = rng.random() < 0.85
        case["grad_reduce_in_fp32"] = rng.random() < 0.7
        kind = rng.choice(("none", "none", "full", "selective"))
        if kind == "full":
            case.update(recompute_granularity="full", recompute_method=rng.choice(("uniform", "block")))
            case["recompute_num_layers"] = 1
        elif kind == "selective":
            case.update(recompute_granularity="selective", recompute_modules=["core_attn"])
        case["config"] = _config(width, pattern)
        out.append(case)
    return out
