"""mbridge_offload_tools.cli.agent: apply, test, diagnose through the real CLI entry point, one JSON object each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import tree

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """\
model:
  num_layers: 12  # layers
optimizer:
  lr: 0.0001  # peak
"""


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = tree.pythonpath(inherit=True)
    return subprocess.run(
        [sys.executable, "-m", "mbridge_offload_tools", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG, encoding="utf-8")
    return path


def test_apply_json_dry_run_then_in_place(config_file: Path) -> None:
    dry = _cli("apply", str(config_file), "--mode", "optimizer", "--fraction", "0.5", "--json", cwd=config_file.parent)
    assert dry.returncode == 0, dry.stderr
    data = json.loads(dry.stdout)
    assert set(data) >= {"ok", "changes", "findings", "written"} and data["written"] is None
    assert {"key", "old", "new"} <= set(data["changes"][0])
    done = _cli(
        "apply",
        str(config_file),
        "--mode",
        "optimizer",
        "--fraction",
        "0.5",
        "--in-place",
        "--json",
        cwd=config_file.parent,
    )
    assert json.loads(done.stdout)["written"] == str(config_file)
    assert "lr: 0.0001  # peak" in config_file.read_text()
    assert (config_file.parent / "c.yaml.bak").read_text() == CONFIG


def test_apply_bad_input_exits_2_with_one_json_object(config_file: Path) -> None:
    bad = _cli(
        "apply", str(config_file), "--mode", "activation", "--num-layers", "12", "--json", cwd=config_file.parent
    )
    assert bad.returncode == 2
    assert "at most 11" in json.loads(bad.stdout)["error"]


def test_apply_overrides_format_prints_overrides(config_file: Path) -> None:
    out = _cli(
        "apply",
        str(config_file),
        "--mode",
        "activation",
        "--num-layers",
        "3",
        "--format",
        "overrides",
        cwd=config_file.parent,
    )
    assert out.stdout.splitlines() == ["model.cpu_offloading=true", "model.cpu_offloading_num_layers=3"]


def test_diagnose_json(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_text("iteration 1\nValueError: CUDA graphs not supported with CPU offloading.\n")
    out = _cli("diagnose", "--log", str(log), "--json", cwd=tmp_path)
    assert out.returncode == 0
    assert json.loads(out.stdout)["matches"][0]["fix"] == ["model.cuda_graph_impl=none"]
    assert _cli("diagnose", "--json", cwd=tmp_path).returncode == 2


def test_test_rejects_unsafe_expression_and_bad_bridge_repo(tmp_path: Path) -> None:
    out = _cli("test", "-k", "a && b", "--json", cwd=tmp_path)
    assert out.returncode == 2 and "'&'" in json.loads(out.stdout)["error"]
    out = _cli("test", "--bridge-repo", str(tmp_path), "--json", cwd=tmp_path)
    assert out.returncode == 2 and "Megatron Bridge checkout" in json.loads(out.stdout)["error"]


def test_the_human_test_summary_names_the_code_under_test_and_the_cluster_recipe() -> None:
    from mbridge_offload.actions.testing import subject as testsubject
    from mbridge_offload.actions.testing.result import TestRunResult
    from mbridge_offload_tools.cli.agent import _human_test

    details = {"optimizer": {"class": "HybridDeviceOptimizer", "module": "mbridge_offload_runtime.optimizer.hybrid"}}
    under = testsubject.parity(details)
    result = TestRunResult(suite="parity", command=[], coverage="Ran the parity check. " + under.summary)
    result.under_test = under
    text = _human_test(result.to_dict())
    assert under.summary in text and "megatron-core's own HybridDeviceOptimizer did not run" in text
    assert f"on a GPU cluster, to check {testsubject.CLUSTER_RECIPE['what']}:" in text
    assert all(f"  run {run}" in text for run in testsubject.CLUSTER_RECIPE["runs"])
    ours = TestRunResult(suite="unit", command=[], under_test=testsubject.ours(Path("."), "a file"))
    assert "on a GPU cluster" not in _human_test(ours.to_dict())  # only parity leaves a check to a cluster
