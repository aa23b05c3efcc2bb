"""Gradient clipping by the global norm over parameters on any mix of devices (host and device shards)."""

from __future__ import annotations

from collections import defaultdict

import torch

from mbridge_offload_runtime.optimizer.buckets import grad_of


def clip_grad_norm_(params, max_norm: float, norm_type: float = 2.0, process_group=None) -> torch.Tensor:
    """Global-norm clipping over tensors on any mix of devices (``decoupled_grad`` preferred over ``.grad``).

    Returns:
        The total norm before clipping (a 0-dim fp32 tensor on the first gradient's device).
    """
    grads = [g for g in (grad_of(p) for p in params) if g is not None]
    if not grads:
        return torch.zeros(())
    by_device: dict[torch.device, list] = defaultdict(list)
    for g in grads:
        by_device[g.device].append(g)
    home = grads[0].device
    inf = norm_type == float("inf")
    parts = [
        torch.linalg.vector_norm(torch.stack(torch._foreach_norm(gs, norm_type)).float(), norm_type).to(home)
        for gs in by_device.values()
    ]
    total = torch.stack(parts).max() if inf else torch.stack(parts).pow(norm_type).sum()
    if process_group is not None:
        op = torch.distributed.ReduceOp.MAX if inf else torch.distributed.ReduceOp.SUM
        torch.distributed.all_reduce(total, op=op, group=process_group)
    total = total if inf else total.pow(1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for gs in by_device.values():
        torch._foreach_mul_(gs, coef.to(gs[0].device))
    return total
