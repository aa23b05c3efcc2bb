"""`validate --recipe`: Megatron Bridge's real ConfigContainer, built by its recipe function, then validated.

Runs only where megatron-bridge is importable: `make test-bridge` installs megatron-bridge 0.3.1 (no CUDA
dependencies) and points MBRIDGE_OFFLOAD_BRIDGE_PATH at it; Transformer Engine is replaced by the labelled
import stub in tests/support/te_stub.py, because TE cannot be installed on a CPU machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BRIDGE_PATH = os.environ.get("MBRIDGE_OFFLOAD_BRIDGE_PATH")

pytestmark = pytest.mark.skipif(
    not BRIDGE_PATH,
    reason="megatron-bridge is not importable here: run `make test-bridge` (installs megatron-bridge 0.3.1 and its "
    "pure-Python config dependencies into .bridge/, and sets MBRIDGE_OFFLOAD_BRIDGE_PATH)",
)

_RUN = """
import sys
sys.path.insert(0, {root!r})
from tests.support import te_stub
te_stub.install("2.12.0")
from mbridge_offload_tools.cli import main
main(sys.argv[1:])
"""


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    paths = [str(ROOT / p) if not os.path.isabs(p) else p for p in BRIDGE_PATH.split(":")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-c", _RUN.format(root=str(ROOT)), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=ROOT,
    )


def test_recipe_builds_real_container_and_validates_clean():
    proc = run_cli("validate", "--recipe", "gpt3_175b_pretrain_config", "--json")
    report = json.loads(proc.stdout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert report["ok"] is True
    assert report["config"]["model.num_layers"] == 96
    assert report["config"]["model.pipeline_model_parallel_size"] == 8


def test_recipe_with_activation_offload_reports_upstream_pp_error():
    proc = run_cli(
        "validate",
        "--recipe",
        "gpt3_175b_pretrain_config",
        "--set",
        "model.cpu_offloading=true",
        "--set",
        "model.cpu_offloading_num_layers=4",
        "--json",
    )
    report = json.loads(proc.stdout)
    assert proc.returncode == 1, proc.stderr[-2000:]
    messages = [f["message"] for f in report["findings"] if f["severity"] == "error"]
    assert "Currently there is no support for Pipeline parallelism with CPU offloading" in messages


def test_recipe_that_needs_the_hub_says_so():
    # qwen3_30b_a3b_pretrain_config reads Qwen/Qwen3-30B-A3B's HF config at build time; there is no network here.
    proc = run_cli("validate", "--recipe", "qwen3_30b_a3b_pretrain_config", "--json")
    assert proc.returncode == 2
    assert "qwen3_30b_a3b_pretrain_config" in json.loads(proc.stdout)["error"]


def test_unknown_recipe_is_bad_input():
    proc = run_cli("validate", "--recipe", "no_such_recipe_config", "--json")
    assert proc.returncode == 2
    assert "no such recipe" in json.loads(proc.stdout)["error"]
