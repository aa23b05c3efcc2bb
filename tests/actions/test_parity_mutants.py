"""The parity check can fail: a broken offloaded optimizer, or a model that did not learn, fails its verdict.

Each mutant is a subclass or a monkeypatch made here, in the test (never in the library), and trains through
the real parity run (megatron-core's tiny ``GPTModel`` on the stride task): its loss curve must leave the
baseline's by more than the bar, so ``optimizer_loss_delta`` (and the overall ``ok``) fail.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mbridge_offload.actions.testing.parity import LOSS_BAR, MIN_RELATIVE_DROP, run_parity
from mbridge_offload.config.sources import load
from mbridge_offload_runtime.optimizer import buckets
from mbridge_offload_runtime.optimizer.hybrid import HybridDeviceOptimizer

STEPS = 20  # enough for the loss to fall by a third (checked below), so the mutants have something to spoil
# Optimizer offload only (no activation offload): two runs per check, baseline and HybridDeviceOptimizer at 0.5.
OPTIMIZER_ONLY = "optimizer:\n  optimizer_cpu_offload: true\n  optimizer_offload_fraction: 0.5\n"

pytestmark = pytest.mark.megatron


class StaleGradient(HybridDeviceOptimizer):
    """Mutant: the offloaded parameters are updated with the previous step's gradient (a missed D2H copy)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.previous: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or not self.is_offloaded(p):
                    continue
                current = p.grad.clone()
                if id(p) in self.previous:
                    p.grad.copy_(self.previous[id(p)])
                self.previous[id(p)] = current
        return super().step(closure)


def _checks(result: dict[str, Any]) -> dict[str, bool]:
    return {c["name"]: c["ok"] for c in result["checks"]}


@pytest.fixture(scope="module")
def megatron() -> None:
    pytest.importorskip("megatron.core")


def _run(**kwargs: Any) -> dict[str, Any]:
    return run_parity(load(OPTIMIZER_ONLY).config, steps=STEPS, use_megatron=True, **kwargs)


def _assert_the_optimizer_broke_parity(result: dict[str, Any]) -> None:
    checks = _checks(result)
    assert not result["ok"] and not checks["optimizer_loss_delta"], result["checks"]
    assert result["loss_deltas"]["optimizer_offload"] > LOSS_BAR
    # The baseline learned: the failure is the optimizer's, not a flat loss that nothing could tell apart.
    assert result["loss_fall"]["baseline"]["relative_drop"] >= MIN_RELATIVE_DROP
    assert checks["optimizer_split"]  # the split itself is right; only the update is wrong


def test_skipping_the_host_step_fails_the_parity_check(megatron: None, monkeypatch: pytest.MonkeyPatch) -> None:
    stepped = []
    # Mutant: the CPU optimizer of every host bucket never runs (and nothing is copied back to the model).
    monkeypatch.setattr(buckets.Bucket, "step_and_copy_back", lambda self, missing, stream: stepped.append(1))
    result = _run()
    assert stepped, "the mutant was not reached: the offloaded part has no host bucket"
    _assert_the_optimizer_broke_parity(result)


def test_a_stale_gradient_fails_the_parity_check(megatron: None) -> None:
    result = _run(offload_optimizer_cls=StaleGradient)
    _assert_the_optimizer_broke_parity(result)


def test_a_loss_that_did_not_fall_enough_fails_the_verdict(megatron: None) -> None:
    # Two steps teach the tiny model nothing: the runs agree, but the comparison could not have caught anything.
    result = run_parity(load(OPTIMIZER_ONLY).config, steps=2, use_megatron=True)
    checks = _checks(result)
    assert checks["optimizer_loss_delta"] and not checks["loss_fell"]
    assert not result["ok"]
    assert "too flat" in next(c["detail"] for c in result["checks"] if c["name"] == "loss_fell")


def test_the_unbroken_optimizer_passes_the_same_check(megatron: None) -> None:
    # The control for the mutants above: same config, same steps, our HybridDeviceOptimizer as shipped.
    result = _run()
    assert result["ok"], result["checks"]
    assert result["loss_deltas"]["optimizer_offload"] < LOSS_BAR
    assert set(result["losses"]) == {"baseline", "optimizer_offload", "offload"}
