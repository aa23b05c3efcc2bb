"""Differential test: megatron-core's own HybridDeviceOptimizer (under 3 labelled shims) is the oracle."""

from __future__ import annotations

import pytest
import torch

from mbridge_offload_runtime.optimizer.hybrid import HybridDeviceOptimizer
from tests.runtime.test_optimizer import HYPER, groups_of, make_model
from tests.support.upstream_shims_hdo import fake_dev_params, upstream_hdo_shims

hybrid = pytest.importorskip("megatron.core.optimizer.cpu_offloading.hybrid_optimizer")
pytestmark = pytest.mark.megatron
UpstreamHDO = hybrid.HybridDeviceOptimizer
CLASSES = {"cpu_optimizer_cls": torch.optim.AdamW, "gpu_optimizer_cls": torch.optim.AdamW}


def upstream_setup(fraction: float, overlap: bool, two_groups: bool):
    model = make_model()
    fake_dev_params(model)  # SHIM-IS-CUDA
    with upstream_hdo_shims():
        opt = UpstreamHDO(
            groups_of(model, two_groups),
            offload_fraction=fraction,
            overlap_cpu_optimizer_d2h_h2d=overlap,
            pin_cpu_grads=False,
            **CLASSES,
            **HYPER,  # SHIM-PIN needs pin_cpu_grads=False
        )
    return model, opt


def train(model, opt, steps: int, shims: bool) -> None:
    gen = torch.Generator().manual_seed(11)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(6, 8, generator=gen)).pow(2).mean().backward()
        if shims:
            with upstream_hdo_shims():
                opt.step()
        else:
            opt.step()


@pytest.mark.parametrize("two_groups", [False, True], ids=["one_group", "two_groups"])
@pytest.mark.parametrize("overlap", [False, True], ids=["no_overlap", "overlap"])
@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.5, 1.0])
def test_same_split_and_same_parameters_after_10_steps(fraction, overlap, two_groups):
    up_model, up = upstream_setup(fraction, overlap, two_groups)
    ours_model = make_model()
    ours = HybridDeviceOptimizer(
        groups_of(ours_model, two_groups),
        offload_fraction=fraction,
        overlap_cpu_optimizer_d2h_h2d=overlap,
        bucket_size_numel=300,
        **CLASSES,
        **HYPER,
    )
    up_split = [p in up.gpu_params_map_cpu_copy for p in up_model.parameters()]
    assert [ours.is_offloaded(p) for p in ours_model.parameters()] == up_split
    assert ours.offloaded_numel == sum(p.numel() for p in up.gpu_params_map_cpu_copy)

    train(up_model, up, 10, shims=True)
    train(ours_model, ours, 10, shims=False)
    for a, b in zip(up_model.parameters(), ours_model.parameters(), strict=True):
        torch.testing.assert_close(b.detach(), a.detach(), atol=1e-6, rtol=0)


def test_upstream_checkpoint_loads_and_continues_identically():
    up_model, up = upstream_setup(0.5, True, two_groups=True)
    train(up_model, up, 3, shims=True)
    sd = up.state_dict()
    assert any(isinstance(v, type) for g in sd["param_groups"] for v in g.values())  # upstream pickles classes

    ours_model = make_model()
    ours_model.load_state_dict({k: v.detach().clone() for k, v in up_model.state_dict().items()})
    ours = HybridDeviceOptimizer(groups_of(ours_model, True), offload_fraction=1.0, **HYPER)
    ours.load_state_dict(sd)
    assert not any(isinstance(v, type) for g in ours.param_groups for v in g.values())

    train(up_model, up, 4, shims=True)
    train(ours_model, ours, 4, shims=False)
    for a, b in zip(up_model.parameters(), ours_model.parameters(), strict=True):
        torch.testing.assert_close(b.detach(), a.detach(), atol=1e-6, rtol=0)
