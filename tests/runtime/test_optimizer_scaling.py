"""The offloaded work scales with the fraction: bytes each way and CPU-optimizer elements are the fraction's,
and the number of host<->device copies follows the buckets, not the tensors.

On the GPU the H200 run cost as much at fraction 0.25 as at 1.0 on 3,000 small tensors + 12 large ones: the greedy
prefix put every small tensor in the first quarter, and each offloaded tensor cost one D2H and one H2D copy launch
(``_foreach_copy_`` across devices is a copy per tensor), so 0.25 issued 3,001 copies each way and 1.0 3,012.
Consecutive small members now move as one copy per run. Counted on CPU by ``transfer_stats``; the time on a GPU is
``benchmarks/gpu_optimizer.py``'s to measure.
"""

from __future__ import annotations

import pytest
import torch

from mbridge_offload_runtime.optimizer import buckets
from mbridge_offload_runtime.optimizer.hybrid import HybridDeviceOptimizer

SMALL = (64, 256, 1024)


def many_small_and_a_few_large() -> list[torch.nn.Parameter]:
    """600 small tensors first (as a model's norms and biases can be), then 4 large ones (Megatron's order)."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(SMALL[i % 3],) for i in range(600)] + [(300_000,)] * 4
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen))
        p.grad = torch.randn(shape, generator=gen)
        params.append(p)
    return params


def one_step(fraction: float) -> tuple[HybridDeviceOptimizer, list[torch.nn.Parameter]]:
    params = many_small_and_a_few_large()
    opt = HybridDeviceOptimizer(params, offload_fraction=fraction, lr=1e-3)
    opt.step()  # the first step materializes the state
    opt.reset_transfer_stats()
    opt.step()
    return opt, params


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75, 1.0])
def test_bytes_and_cpu_elements_per_step_are_the_offloaded_fraction(fraction: float) -> None:
    opt, _params = one_step(fraction)
    stats = opt.transfer_stats
    assert opt.offloaded_numel / opt.total_numel == pytest.approx(fraction, abs=300_000 / opt.total_numel)
    assert stats.d2h_bytes == stats.h2d_bytes == 4 * opt.offloaded_numel
    assert stats.cpu_numel == opt.offloaded_numel


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75, 1.0])
def test_copies_follow_the_buckets_not_the_tensors(fraction: float) -> None:
    opt, params = one_step(fraction)
    stats = opt.transfer_stats
    offloaded = [p for p in params if opt.is_offloaded(p)]
    large = sum(p.numel() >= buckets.SMALL_COPY_NUMEL for p in offloaded)
    assert stats.d2h_copies == stats.h2d_copies <= opt.num_buckets + large
    assert stats.d2h_copies * 20 < len(offloaded)


def test_one_copy_per_tensor_is_what_the_old_path_issued(monkeypatch) -> None:
    """The per-tensor path (threshold 1, every member "large") issues a copy per offloaded tensor each way."""
    monkeypatch.setattr(buckets, "SMALL_COPY_NUMEL", 1)
    opt, params = one_step(0.25)
    assert opt.transfer_stats.d2h_copies == opt.transfer_stats.h2d_copies == sum(opt.is_offloaded(p) for p in params)
