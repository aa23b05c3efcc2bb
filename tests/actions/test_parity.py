"""mbridge_offload.actions.parity: the parity suite trains a tiny model with and without offload and compares."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mbridge_offload.actions.parity import LOSS_BAR, TINY_LAYERS, run_parity, settings_from_config
from mbridge_offload.actions.testsuite import DEPTH_ENV, run_tests
from mbridge_offload.config.sources import load

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


def test_torch_fallback_parity_meets_the_upstream_bar(config_file: Path) -> None:
    events = []
    result = run_parity(
        load(str(config_file)).config,
        steps=8,
        use_megatron=False,
        on_progress=lambda done, total, msg: events.append((done, total)),
    )
    assert result["ok"], result["checks"]
    assert result["max_loss_delta"] < LOSS_BAR
    assert result["model"] == "torch MLP stack"
    assert abs(result["optimizer_split"]["achieved"] - 0.75) < 0.2
    assert result["activation_bytes_offloaded_per_step"] > 0
    assert result["step_time_ratio"] > 0
    assert events[-1] == (16, 16)


@pytest.mark.megatron
def test_real_megatron_tiny_gpt_parity() -> None:
    pytest.importorskip("megatron.core")
    result = run_parity(None, steps=6, use_megatron=True)
    assert result["model"] == "megatron-core GPTModel (tiny)"
    assert result["ok"], result["checks"]
    assert {c["name"] for c in result["checks"]} == {"loss_delta", "optimizer_split", "activation_offloaded"}
    assert len(result["losses"]["baseline"]) == 6


def test_too_few_steps_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 2 steps"):
        run_parity(None, steps=1, use_megatron=False)


@pytest.mark.skipif(int(os.environ.get(DEPTH_ENV, "0") or 0) > 0, reason="nested inside run_unit_tests")
def test_parity_suite_through_the_test_runner(config_file: Path) -> None:
    events = []
    result = run_tests(
        suite="parity",
        config=str(config_file),
        steps=4,
        timeout_s=120,
        on_progress=lambda done, total, msg: events.append((done, total, msg)),
    )
    assert result.ok, (result.notes, result.output_tail)
    assert [t.nodeid for t in result.tests] == [
        "parity::loss_delta",
        "parity::optimizer_split",
        "parity::activation_offloaded",
    ]
    assert result.details["settings"]["optimizer_offload_fraction"] == 0.75
    assert events[-1][:2] == (8, 8)
