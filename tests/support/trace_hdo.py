"""Generated optimizer-offload runs for the trace differential (``tests/plan/test_trace_differential.py``).

The dense and MoE runs of ``trace_cases`` with a HybridDeviceOptimizer: an offload fraction, megatron-core's HDO
(what Bridge builds) or ours (``mbridge_offload_runtime.optimizer.install_optimizer_offload``), the precision-aware
optimizer or not, the distributed optimizer or not, with or without the overlapped D2H/H2D copies. What moves to the
host is whole tensors in the optimizer's order (HDO's greedy split over the shards this rank owns), so the cases keep
real widths: the split's granularity is what they test.
"""

from __future__ import annotations

import random
from typing import Any

from tests.support.trace_cases import generate, generate_moe

FRACTIONS = (0.1, 0.25, 0.5, 0.5, 0.75, 1.0)


def _offload(rng: random.Random, case: dict[str, Any]) -> dict[str, Any]:
    case = dict(case)
    case["optimizer_offload_fraction"] = rng.choice(FRACTIONS)
    case["hybrid_optimizer"] = rng.choice(("megatron-core", "ours"))
    if not case.get("distributed_optimizer", True):
        # megatron-core's HDO cannot step bf16 parameters without the distributed optimizer (the planner refuses it:
        # plan/model/run.py hdo_fails_at_first_step); ours can, after following the wrapper's parameter swap
        case["hybrid_optimizer"] = "ours"
    case["overlap"] = rng.random() < 0.3  # optimizer.overlap_cpu_optimizer_d2h_h2d
    if case.get("distributed_optimizer", True) and rng.random() < 0.4:
        case["precision_aware_optimizer"] = True
    return case


def generate_hdo(seed: int, n: int) -> list[dict[str, Any]]:
    """``n`` cases from ``seed`` (the same list every time): three dense runs to one MoE run, each with an HDO."""
    rng = random.Random(seed)
    moe = max(1, n // 4)
    base = generate(seed, n - moe) + generate_moe(seed + 1, moe)
    return [_offload(rng, case) for case in base]
