"""Upstream facts that the runtime and the planner both need, each stated once, with where upstream states it.

A room of its own, plain Python (no torch, no project imports), inside the runtime package so that the runtime
needs nothing from the agent side: the runtime (``mbridge_offload_runtime``) and the planner (``mbridge_offload.plan``)
both import it, so the model of what upstream does and our reproduction of it cannot drift apart. Importing it
imports no torch (the package's ``__init__`` imports nothing), so the config side stays torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence

# Transformer Engine v2 offloads a saved activation only from this many elements up.
# Source: transformer_engine/pytorch/cpu_offload.py (TE 2.x), the size check of its tensor-push hook.
TE_MIN_OFFLOAD_NUMEL = 256 * 1024


def hdo_offload_mask(numels: Sequence[int], offload_fraction: float) -> list[bool]:
    """Which tensors ``HybridDeviceOptimizer`` puts on the host: a greedy prefix over whole tensors.

    Walk the tensors in param_groups order and offload each while the offloaded element count is still below
    ``offload_fraction × sum(numels)``; the tensor that crosses the threshold goes whole, so 0.0 offloads nothing
    and 1.0 everything. Source: megatron-core 0.16.1 and 0.19.2 (byte-identical),
    ``megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py``, ``_get_sub_optimizer_param_groups``.
    A tensor of size 0 counts for nothing and is placed like its neighbours would be.
    """
    threshold = offload_fraction * sum(numels)
    offloaded, mask = 0, []
    for n in numels:
        take = offloaded < threshold
        offloaded += n if take else 0
        mask.append(take)
    return mask
