"""``HybridDeviceOptimizer.load_state_dict`` memory: the load copies into the live state, it does not double it.

Measured, not modelled: the kernel's resident-set high-water mark around the call (benchmarks/optimizer_load.py's
``measure_call``, which the benchmark uses for the side-by-side table with megatron-core's HDO and plain AdamW).
"""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.optimizer_load import checkpoint_of, measure_call, state_bytes
from mbridge_offload_runtime.optimizer.hybrid import HybridDeviceOptimizer

pytestmark = pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc/self/clear_refs to reset the peak RSS"
)
SHAPES = [(1024, 1024)] * 8  # 8 M fp32 parameters: 64 MiB of Adam moments, well above the resident-set noise
HYPER = {"lr": 1e-3, "weight_decay": 0.01}


def _optimizer(fraction: float, stepped: bool) -> HybridDeviceOptimizer:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    opt = HybridDeviceOptimizer(params, offload_fraction=fraction, **HYPER)
    if stepped:
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return opt


def _checkpoint(fraction: float) -> dict:
    return checkpoint_of(_optimizer(fraction, stepped=True))


@pytest.mark.parametrize("fraction", [1.0, 0.0])
@pytest.mark.parametrize("stepped", [True, False], ids=["into_live_state", "into_fresh_optimizer"])
def test_load_needs_at_most_half_the_state_as_transient_memory(fraction, stepped):
    sd = _checkpoint(fraction)
    opt = _optimizer(fraction, stepped)
    measured = measure_call(lambda: opt.load_state_dict(sd))
    assert measured["transient_bytes"] <= 0.5 * state_bytes(sd), measured


def test_load_into_live_state_keeps_the_live_tensors_and_copies_the_values():
    sd = _checkpoint(1.0)
    opt = _optimizer(1.0, stepped=True)
    flat = opt._buckets[0].flat_state()["exp_avg"]
    opt.load_state_dict(sd)
    assert opt._buckets[0].flat_state()["exp_avg"] is flat  # no new allocation
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], sd["state"][0]["exp_avg"])
    sd["state"][0]["exp_avg"].add_(1.0)  # nothing of the caller's dict is kept
    assert not torch.equal(opt.state_dict()["state"][0]["exp_avg"], sd["state"][0]["exp_avg"])
