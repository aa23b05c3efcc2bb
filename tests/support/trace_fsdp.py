"""Generated Megatron-FSDP runs for the trace differential (``tests/plan/test_trace_differential.py``).

Each case is a dict of planner inputs (the flags ``estimate`` and ``trace`` take), as ``trace_cases.py`` builds them:
real widths, small layer counts, ``use_megatron_fsdp`` with each ``data_parallel_sharding_strategy``, the main
gradients' dtype (``megatron_fsdp_main_grads_dtype``: unset or bf16, the parameter dtype; fp32 is refused by the
trace), TP with and without SP,
dense and a few MoE layers with EP, full and selective recompute or none. PP 1 only: megatron-core's FSDP adapter
lays its rank mesh over the whole world as ``(dp_cp ep tp)`` (``_get_dp_tp_mesh``), which a pipeline breaks, on
0.16.1 and 0.19.2 alike. ``grad_reduce_in_fp32`` off: 0.19.2 does not read it under FSDP (its main gradients follow
``megatron_fsdp_main_grads_dtype``), and 0.16.1 with it on writes bf16 weight gradients into fp32 ``main_grad``
with ``torch.matmul(out=...)`` (``tensor_parallel/layers.py``), which fails on a GPU as in the trace.
"""

from __future__ import annotations

import random
from typing import Any

from tests.support.trace_cases import MOE_WIDTHS, VOCABS, WIDTHS, _moe_config, moe_fields

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def _dense(rng: random.Random) -> dict[str, Any]:
    hidden, heads, groups, ffn = rng.choice(WIDTHS[:4])
    return {
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "kv_channels": hidden // heads,
        "ffn_hidden_size": ffn,
    }


def _moe(rng: random.Random, case: dict[str, Any]) -> int:
    """A MoE model (small expert counts: time goes with them); returns the experts."""
    width = rng.choice([w for w in MOE_WIDTHS if w[6] <= 16])
    experts, topk, shared = width[6:]
    case.update(moe_fields(width), moe_router_topk=max(2, topk))
    case["config"] = _moe_config(shared, False, case["num_layers"])
    return experts


def generate_fsdp(seed: int, n: int) -> list[dict[str, Any]]:
    """``n`` Megatron-FSDP cases from ``seed`` (the same list every time): every fourth a MoE run."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        case: dict[str, Any] = {"num_layers": rng.choice((2, 3, 4))}
        moe = i % 4 == 3
        experts = _moe(rng, case) if moe else 0
        if not moe:
            case.update(_dense(rng))
        tp = rng.choice([t for t in (1, 1, 2, 4) if case["num_query_groups"] % t == 0])
        dp = rng.choice((2, 4, 8))
        case.update(
            tp=tp,
            pp=1,
            num_gpus=tp * dp,
            vocab_size=rng.choice(VOCABS),
            seq_length=rng.choice((1024, 2048, 4096)),
            micro_batch_size=rng.choice((1, 1, 2)),
            use_megatron_fsdp=True,
            fsdp_sharding_strategy=rng.choice(STRATEGIES),
            grad_reduce_in_fp32=False,
        )
        if tp > 1:
            case["sequence_parallel"] = moe or rng.random() < 0.7  # megatron-core refuses MoE with TP, no SP
        if moe:
            case["ep"] = rng.choice([e for e in (1, 2, 4) if dp % e == 0 and experts % e == 0])
            case["etp"] = tp
        grads = rng.choice((None, "bf16"))  # fp32: refused (trace/spec.py: the local linears' torch.matmul)
        if grads is not None:
            case["fsdp_main_grads_dtype"] = grads
        case["global_batch_size"] = case["micro_batch_size"] * dp * rng.choice((1, 2))
        kind = rng.choice(("none", "full", "selective"))
        if kind == "full":
            case.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        elif kind == "selective":
            case.update(recompute_granularity="selective", recompute_modules=["core_attn"])
        out.append(case)
    return out
