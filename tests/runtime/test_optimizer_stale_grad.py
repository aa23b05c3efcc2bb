"""Megatron-LM #7551: a parameter whose ``.grad`` is None in a step must not be updated with an older gradient.

Upstream's HybridDeviceOptimizer copies each gradient into a persistent inner parameter; when the model parameter
has no gradient it only sets ``requires_grad=False``, so the inner ``.grad`` of the last step stays and torch's Adam
applies it again (an MoE expert that got no tokens keeps moving). Ours keeps no gradient between steps: a bucket
member without a gradient is restored after the flat step and a device master gets ``grad = None``
(``hybrid._step_in_place``, ``buckets.step_and_copy_back``). The reference is torch's AdamW on the same sequence,
which skips parameters without a gradient.
"""

from __future__ import annotations

import pytest
import torch

from mbridge_offload_runtime.optimizer.hybrid import HybridDeviceOptimizer
from tests.support.upstream_shims_hdo import fake_dev_params, upstream_hdo_shims

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
# Step 2 leaves the "expert" out of the forward: it has no gradient in that step only.
ACTIVE = (True, False, True)


class TwoExperts(torch.nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.shared = torch.nn.Parameter(torch.randn(8, 8, generator=gen).to(dtype))
        self.expert = torch.nn.Parameter(torch.randn(8, 8, generator=gen).to(dtype))

    def forward(self, x: torch.Tensor, expert_active: bool) -> torch.Tensor:
        y = x @ self.shared
        return y + x @ self.expert if expert_active else y


def _run(model: TwoExperts, opt, step=None) -> list[torch.Tensor]:
    """The expert's weight after each step."""
    gen = torch.Generator().manual_seed(1)
    seen = []
    for active in ACTIVE:
        opt.zero_grad(set_to_none=True)
        x = torch.randn(4, 8, generator=gen).to(model.shared.dtype)
        model(x, active).float().pow(2).mean().backward()
        assert (model.expert.grad is None) == (not active)
        (step or opt.step)()
        seen.append(model.expert.detach().clone())
    return seen


@pytest.mark.parametrize("overlap", [False, True], ids=["no_overlap", "overlap"])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_a_parameter_without_a_grad_is_not_updated_with_the_previous_one(fraction, overlap):
    model = TwoExperts()
    opt = HybridDeviceOptimizer(
        model.parameters(), offload_fraction=fraction, overlap_cpu_optimizer_d2h_h2d=overlap, **HYPER
    )
    seen = _run(model, opt)
    assert torch.equal(seen[1], seen[0])  # step 2: no grad, no change (weight decay included)


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_the_sequence_equals_torch_adamw_when_each_parameter_has_its_own_step_count(fraction):
    # bucket_size_numel=1: one bucket per parameter. In a shared bucket the Adam step count is the bucket's, so a
    # member skipped in one step uses the bucket's (one higher) count in its bias correction afterwards.
    model = TwoExperts()
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=fraction, bucket_size_numel=1, **HYPER)
    seen = _run(model, opt)
    ref = TwoExperts()
    ref_seen = _run(ref, torch.optim.AdamW(ref.parameters(), **HYPER))
    for ours, theirs in zip(seen, ref_seen, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)  # torch's fused vs per-tensor kernel


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_a_bf16_parameter_without_a_grad_keeps_its_fp32_master(fraction):
    model = TwoExperts(torch.bfloat16)
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=fraction, param_update_in_fp32=True, **HYPER)
    seen = _run(model, opt)
    assert torch.equal(seen[1], seen[0])
    master = opt.state_dict()["state"][1]["master_param"]
    assert torch.equal(master.to(torch.bfloat16), seen[2])


def test_megatron_cores_hdo_on_cpu_shows_the_contrast():
    hybrid = pytest.importorskip("megatron.core.optimizer.cpu_offloading.hybrid_optimizer")
    model = TwoExperts()
    fake_dev_params(model)  # SHIM-IS-CUDA
    with upstream_hdo_shims():
        opt = hybrid.HybridDeviceOptimizer(
            list(model.parameters()),
            offload_fraction=1.0,
            cpu_optimizer_cls=torch.optim.AdamW,
            gpu_optimizer_cls=torch.optim.AdamW,
            pin_cpu_grads=False,  # SHIM-PIN
            **HYPER,
        )

    def step() -> None:
        with upstream_hdo_shims():
            opt.step()

    seen = _run(model, opt, step)
    if torch.equal(seen[1], seen[0]):
        pytest.skip("this megatron-core already skips parameters without a gradient (Megatron-LM #7551 fixed)")
    # Upstream moved the expert in step 2 although its grad was None: step 1's gradient was applied again.
    ours = TwoExperts()
    ours_seen = _run(ours, HybridDeviceOptimizer(ours.parameters(), offload_fraction=1.0, **HYPER))
    assert not torch.equal(seen[1], seen[0]) and torch.equal(ours_seen[1], ours_seen[0])
