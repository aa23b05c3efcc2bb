"""``validate --exact`` (CLI) and ``exact=true`` (MCP): the installed megatron-core's own errors, verbatim.

Real megatron-core 0.16.1 (installed in the venv) builds the configs in a subprocess; the "not installed" case runs
the CLI with a ``megatron`` package on PYTHONPATH that has no ``core`` (so the real one is shadowed).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = """
model:
  num_layers: 4
  hidden_size: 64
  num_attention_heads: 6
  tensor_model_parallel_size: 4
  recompute_granularity: "none"
optimizer:
  main_grads_dtype: bf16
"""

pytestmark = pytest.mark.megatron


def _cli(tmp_path: Path, *args: str, env: dict | None = None) -> tuple[int, dict]:
    path = tmp_path / "c.yaml"
    path.write_text(textwrap.dedent(CONFIG))
    proc = subprocess.run(
        [sys.executable, "-m", "mbridge_offload_tools.cli", "validate", str(path), "--json", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    return proc.returncode, json.loads(proc.stdout)


def test_exact_reports_megatron_cores_own_errors_verbatim(tmp_path):
    code, payload = _cli(tmp_path, "--exact", "--target", "megatron-core==0.16.1")
    assert code == 1
    exact = [f for f in payload["findings"] if f["rule"] == "MCORE-EXACT"]
    assert [(f["exception"], f["message"]) for f in exact] == [
        ("ValueError", "num_attention_heads (6) must be a multiple of tensor_model_parallel_size (4)."),
        ("AssertionError", "main_grads_dtype can only be fp32 when not using precision-aware optimizer"),
    ]
    assert all(f["origin"] == "mcore" for f in exact)
    # The fast path says the same, first error per stage (the catalogue's findings of those stages are replaced).
    code, fast = _cli(tmp_path, "--target", "megatron-core==0.16.1")
    firsts = {}
    for f in fast["findings"]:
        if f["severity"] == "error":
            firsts.setdefault(f["stage"], f["message"])
    assert [firsts[f["stage"]] for f in exact] == [f["message"] for f in exact]


def test_exact_without_megatron_core_is_a_clear_exit_2(tmp_path):
    shadow = tmp_path / "shadow" / "megatron"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "shadow")}
    code, payload = _cli(tmp_path, "--exact", env=env)
    assert code == 2
    assert payload["ok"] is False and "megatron-core installed" in payload["error"]  # the one JSON error object


def test_mcp_validate_config_exact_parameter(tmp_path):
    from mbridge_offload_tools import server

    path = tmp_path / "c.yaml"
    path.write_text(textwrap.dedent(CONFIG))
    import anyio

    # the tool as the server runs it: guarded (a worker thread under a deadline), hence a coroutine
    report = anyio.run(lambda: server.validate_config(config=str(path), exact=True))
    messages = [f.message for f in report.findings if f.rule == "MCORE-EXACT"]
    assert "num_attention_heads (6) must be a multiple of tensor_model_parallel_size (4)." in messages
    assert "MCORE-EXACT-VERSION" in {f.rule for f in report.findings}  # default target 0.19.2, 0.16.1 installed
