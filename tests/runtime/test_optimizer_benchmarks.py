"""The optimizer benchmark scripts run: the GPU script's CPU fallback and the CPU script's quick mode."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def load(name: str, monkeypatch):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def test_gpu_optimizer_script_falls_back_to_a_tiny_cpu_run_and_writes_its_table(tmp_path, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("on a GPU machine the script runs the real configuration")
    out = tmp_path / "gpu.md"
    assert load("gpu_optimizer", monkeypatch).main(["--steps", "1", "--output", str(out)]) == 0
    text = out.read_text()
    assert "No CUDA device: CPU fallback" in text and "GPU-measured" not in text
    rows = [line for line in text.splitlines() if line.startswith("| ours ")]
    assert len(rows) == 10  # 5 fractions x overlap off/on
    assert "parity: OK" in text
    assert "backward hooks: fraction 1.0" in text and "weights bit-identical" in text


def test_cpu_optimizer_quick_run_writes_every_fraction_and_the_state_dict_table(tmp_path, monkeypatch):
    out = tmp_path / "cpu.md"
    threads = torch.get_num_threads()
    try:
        load("cpu_optimizer", monkeypatch).main(["--quick", "--output", str(out)])
    finally:
        torch.set_num_threads(threads)  # the script pins one thread for itself
    text = out.read_text()
    assert "Measured on CPU, 1 thread, this machine" in text
    for f in ("0.00", "0.25", "0.50", "0.75", "1.00"):
        assert f"| f = {f} |" in text
    assert "| fraction 1.0 |" in text and "(b) HybridDeviceOptimizer, fraction 1.0, overlap" in text


def test_gpu_memory_phases_script_runs_a_labelled_cpu_smoke_run_of_every_setup(tmp_path):
    """The script that measured docs/benchmarks-memory-gpu.md on a GPU: on the CPU it runs tiny sizes in its own
    process (it initialises torch.distributed) and labels the output as no measurement."""
    import json
    import subprocess

    from tests.support.tree import pythonpath

    if torch.cuda.is_available():
        pytest.skip("on a GPU machine the script runs the real configuration")
    out, table = tmp_path / "phases.json", tmp_path / "phases.md"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_memory_phases.py"), "--quick", "--steps", "1"]
    done = subprocess.run(
        [*cmd, "--json", str(out), "--output", str(table)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": pythonpath(), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    payload = json.loads(out.read_text())
    assert payload["cuda"] is False and "NOT a measurement" in table.read_text()
    by_setup = {r["setup"]: r for r in payload["results"]}
    assert set(by_setup) >= {"fp32 grads", "bf16 grads", "bf16 grads, ours 0.5", "bf16 grads, ours 1.0"}
    for name in ("fp32 grads", "bf16 grads"):  # megatron-core's own path runs on CPU with the stand-ins
        assert by_setup[name]["error"] is None and by_setup[name]["params"] > 0
