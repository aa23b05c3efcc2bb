"""mbridge_offload.actions.testing.parity: the parity suite trains a tiny model with and without offload and
compares."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import mbridge_offload
from mbridge_offload.actions.testing.parity import (
    LOSS_BAR,
    MIN_RELATIVE_DROP,
    STRIDES,
    TINY_LAYERS,
    VOCAB,
    loss_fall,
    main,
    run_parity,
    settings_from_config,
    stride_batches,
)
from mbridge_offload.actions.testing.run import DEPTH_ENV
from mbridge_offload.actions.testing.suite import run_tests
from mbridge_offload.config.sources import load
from mbridge_offload_runtime.optimizer.hybrid import HybridDeviceOptimizer

CONFIG = """\
# 32-layer dense model, activation + optimizer offload.
model:
  num_layers: 32
  cpu_offloading: true
  cpu_offloading_num_layers: 16  # half the layers
optimizer:
  optimizer_cpu_offload: true
  optimizer_offload_fraction: 0.75
  overlap_cpu_optimizer_d2h_h2d: true
"""


CHECKS = [
    "loss_fell",
    "loss_delta",
    "optimizer_loss_delta",
    "activation_loss_delta",
    "optimizer_split",
    "activation_offloaded",
]


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "offload.yaml"
    path.write_text(CONFIG, encoding="utf-8")
    return path


def test_settings_scale_the_offloaded_layers_to_the_tiny_model(config_file: Path) -> None:
    settings = settings_from_config(load(str(config_file)).config)
    assert (settings.optimizer_fraction, settings.overlap) == (0.75, True)
    assert settings.activation_layers == TINY_LAYERS // 2


def test_a_config_without_offload_is_said_to_compare_identical_runs() -> None:
    settings = settings_from_config(load("model:\n  num_layers: 8\n").config)
    assert settings.optimizer_fraction == 0.0 and settings.activation_layers == 0
    assert "offloads nothing" in settings.notes[0]


def test_torch_fallback_parity_meets_the_upstream_bar_on_a_loss_that_falls(config_file: Path) -> None:
    events = []
    result = run_parity(
        load(str(config_file)).config,
        steps=20,
        use_megatron=False,
        on_progress=lambda done, total, msg: events.append((done, total)),
    )
    assert result["ok"], result["checks"]
    assert result["max_loss_delta"] < LOSS_BAR
    assert result["model"] == "torch MLP stack"
    assert abs(result["optimizer_split"]["achieved"] - 0.75) < 0.2
    assert result["activation_bytes_offloaded_per_step"] > 0
    # Four runs (baseline, optimizer only, activation only, both) of 20 steps each.
    assert set(result["losses"]) == {"baseline", "optimizer_offload", "activation_offload", "offload"}
    assert events[-1] == (80, 80)
    for name, fall in result["loss_fall"].items():
        assert fall["start"] == result["losses"][name][0]
        assert fall["relative_drop"] >= MIN_RELATIVE_DROP, (name, fall)
    # No CPU timing is presented as a speed figure.
    assert not any("time" in key for key in result)


def test_the_stride_task_is_deterministic_and_learnable_in_principle() -> None:
    first, again = stride_batches(3, seed=7, device="cpu"), stride_batches(3, seed=7, device="cpu")
    for a, b in zip(first, again, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    batch = first[0]
    tokens = torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1)
    steps = (tokens[:, 1:] - tokens[:, :-1]) % VOCAB
    # Every sequence keeps one stride from the task's set: the next token follows from the two before it.
    assert (steps == steps[:, :1]).all()
    assert set(steps[:, 0].tolist()) <= set(STRIDES)
    assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])


def test_loss_fall_reads_the_start_and_the_mean_of_the_last_steps() -> None:
    fall = loss_fall([4.0, 3.0, 2.0, 2.0, 2.0, 1.0])
    assert fall["start"] == 4.0 and fall["end"] == pytest.approx(5 / 3)
    assert fall["relative_drop"] == pytest.approx(1 - 5 / 12)
    assert loss_fall([3.0, 3.0])["relative_drop"] == 0.0


@pytest.mark.megatron
def test_real_megatron_tiny_gpt_parity() -> None:
    pytest.importorskip("megatron.core")
    result = run_parity(None, steps=20, use_megatron=True)
    assert result["model"] == "megatron-core GPTModel (tiny)"
    assert result["ok"], result["checks"]
    assert [c["name"] for c in result["checks"]] == CHECKS
    assert len(result["losses"]["baseline"]) == len(result["losses"]["offload"]) == 20
    assert result["loss_fall"]["baseline"]["relative_drop"] >= MIN_RELATIVE_DROP
    assert result["max_loss_delta"] == max(result["loss_deltas"].values()) < LOSS_BAR
    # The answer names whose optimizer ran and which megatron-core built the model.
    from megatron.core import package_info

    assert result["optimizer"] == {"class": "HybridDeviceOptimizer", "module": HybridDeviceOptimizer.__module__}
    assert result["megatron_core"] == package_info.__version__


def test_too_few_steps_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 2 steps"):
        run_parity(None, steps=1, use_megatron=False)


@pytest.mark.skipif(int(os.environ.get(DEPTH_ENV, "0") or 0) > 0, reason="nested inside run_unit_tests")
def test_parity_suite_through_the_test_runner(config_file: Path) -> None:
    events = []
    result = run_tests(
        suite="parity",
        config=str(config_file),
        steps=20,
        timeout_s=300,
        on_progress=lambda done, total, msg: events.append((done, total, msg)),
    )
    assert result.ok, (result.notes, result.output_tail)
    assert [t.nodeid for t in result.tests] == [f"parity::{name}" for name in CHECKS]
    assert result.details["settings"]["optimizer_offload_fraction"] == 0.75
    assert result.details["loss_fall"]["offload"]["relative_drop"] >= MIN_RELATIVE_DROP
    assert events[-1][:2] == (80, 80)
    # What was tested: our HybridDeviceOptimizer on the tiny GPT here, not megatron-core's own (the recipe says how).
    under = result.under_test
    assert under is not None and under.kind == "parity"
    assert under.optimizer == {
        "class": "HybridDeviceOptimizer",
        "module": HybridDeviceOptimizer.__module__,
        "origin": f"this project (mbridge-offload {mbridge_offload.__version__})",
    }
    assert under.model == f"{result.details['model']} on {result.details['device']}"
    assert under.megatron_core == result.details["megatron_core"]
    assert "megatron-core's own HybridDeviceOptimizer did not run" in under.summary
    assert under.summary in result.coverage
    assert any("optimizer.optimizer_cpu_offload=true" in run for run in under.cluster_recipe["runs"])


def test_the_cli_exits_1_when_the_loss_did_not_fall(capsys: pytest.CaptureFixture[str]) -> None:
    # Two steps: the runs agree to the last bit, yet the verdict fails, because nothing was learned to compare.
    code = main(["--torch-model", "--steps", "2", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 1 and not result["ok"]
    failed = [c["name"] for c in result["checks"] if not c["ok"]]
    assert failed == ["loss_fell"]
    assert result["max_loss_delta"] < LOSS_BAR
    assert len(result["losses"]["baseline"]) == 2
