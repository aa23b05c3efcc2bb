"""Generated dense runs for the trace differential (``tests/plan/test_trace_differential.py``).

Each case is a dict of planner inputs (the flags ``estimate`` and ``trace`` take): real widths (fake tensors cost
the same at any width), small layer counts (time goes with layers), and every layout and lever the trace builds:
TP with and without SP, PP, VPP, uneven first/last stages, full and selective recompute, the distributed
optimizer or not, fp32 or bf16 gradient reduction, tied embeddings, micro-batch sizes and counts.
"""

from __future__ import annotations

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
