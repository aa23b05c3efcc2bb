"""Measure the CPU optimizer HybridDeviceOptimizer uses (fused AdamW on fp32) on this host: the params/s the
planner's time model needs."""

from __future__ import annotations

import time
from typing import Any

import torch


def measure(
    numel: int = 32 * 1024 * 1024, tensors: int = 4, steps: int = 5, threads: int | None = None
) -> dict[str, Any]:
    """Time ``steps`` fused AdamW steps over ``tensors`` fp32 tensors of ``numel`` elements in all (after a warm-up)."""
    if threads:
        torch.set_num_threads(threads)
    threads_used = torch.get_num_threads()
    params = [torch.nn.Parameter(torch.randn(numel // tensors)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    try:
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
        fused = True
    except (RuntimeError, TypeError):  # torch < 2.4 has no fused CPU AdamW
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, foreach=True)
        fused = False
    opt.step()  # warm-up: allocates exp_avg / exp_avg_sq
    start = time.perf_counter()
    for _ in range(steps):
        opt.step()
    per_step = (time.perf_counter() - start) / steps
    rate = numel / per_step
    return {
        "cpu_adam_params_per_s": rate,
        "cpu_adam_params_per_s_per_core": rate / threads_used,
        "threads": threads_used,
        "numel": numel,
        "seconds_per_step": per_step,
        "torch_version": torch.__version__,
        "fused": fused,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
