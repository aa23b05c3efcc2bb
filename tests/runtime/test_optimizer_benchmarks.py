"""The optimizer benchmark scripts run: the GPU script's CPU fallback and the CPU script's quick mode."""

from __future__ import annotations

import importlib.util
import json
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


def _factory_hdo_keywords(init_py: Path) -> set[str]:
    """The keywords megatron-core's factory passes to HybridDeviceOptimizer, read from its source (adam branch)."""
    import ast

    tree = ast.parse(init_py.read_text())
    func = next(n for n in ast.walk(tree) if getattr(n, "name", "") == "_get_megatron_optimizer_based_on_param_groups")
    call = next(
        n for n in ast.walk(func) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "HybridDeviceOptimizer"
    )
    named = {k.arg for k in call.keywords if k.arg is not None}
    defaults = next(  # the first ``optimizer_defaults = dict(...)`` is the adam branch's
        n.value
        for n in ast.walk(func)
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "optimizer_defaults"
    )
    return named | {k.arg for k in defaults.keywords}


@pytest.mark.parametrize("release", ["0.16.1", "0.19.2"])
def test_the_benchmark_builds_megatron_cores_hdo_with_its_factorys_keywords(release, monkeypatch):
    import megatron.core

    venv = Path(megatron.core.__file__).parent
    init = venv / "optimizer" / "__init__.py" if release == "0.16.1" else ROOT / ".mcore" / release
    if release != "0.16.1":
        init = init / "megatron" / "core" / "optimizer" / "__init__.py"
        if not init.exists():
            pytest.skip(f"megatron-core {release} is not unpacked in .mcore/")
    peers = load("optimizer_peers", monkeypatch)
    assert _factory_hdo_keywords(init) == peers.FACTORY_KEYWORDS


def test_megatron_cores_hdo_reports_its_fraction_from_its_own_state(monkeypatch):
    from tests.support.upstream_shims_hdo import FakeDevParam, upstream_hdo_shims

    peers = load("optimizer_peers", monkeypatch)
    params = [FakeDevParam(torch.zeros(n)) for n in (100, 300, 600)]
    with upstream_hdo_shims():
        opt = peers.megatron_hdo(params, 0.3)
    assert opt is not None and peers.megatron_hdo_fraction(opt) == pytest.approx(0.4)


def test_the_floor_and_sweep_script_dry_runs_on_cpu_and_labels_it(tmp_path, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("on a GPU machine the script measures")
    out, raw = tmp_path / "sweep.md", tmp_path / "sweep.json"
    sweep = load("gpu_offload_sweep", monkeypatch)
    assert sweep.main(["--dry-run", "--steps", "1", "--output", str(out), "--json", str(raw)]) == 0
    text, result = out.read_text(), json.loads(raw.read_text())
    assert "DRY RUN on CPU, tiny shapes: NOT a measurement" in text and "GPU-measured" not in text
    assert set(result["floor"]) == {"flat shards", "many small"}
    for rows in result["floor"].values():
        assert [r["fraction"] for r in rows] == [0.25, 0.5, 0.75]
        # the bytes each way and the copies follow the split: far fewer copies than offloaded tensors
        assert all(r["d2h_copies"] == r["h2d_copies"] <= max(1, r["offloaded_tensors"]) for r in rows)
    assert {(r["fraction"]) for r in result["overlap"]} == {0.25, 0.5, 1.0} and len(result["overlap"]) == 6
    assert result["rates"]["cpu_adam_per_core_preset"] > 0 and "| CPU AdamW params/s per core |" in text


def test_the_floor_and_sweep_script_refuses_a_cpu_without_dry_run(tmp_path, monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert load("gpu_offload_sweep", monkeypatch).main(["--output", str(tmp_path / "x.md")]) == 2
    assert "error" in json.loads(capsys.readouterr().out)
