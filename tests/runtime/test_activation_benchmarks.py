"""The benchmark scripts write their own docs sections, labelled by where they ran, in one run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.doc_fragment import table, write_section  # noqa: E402


def test_write_section_replaces_only_its_own_block(tmp_path) -> None:
    doc = tmp_path / "f.md"
    doc.write_text("# Title\n\nhand-written\n")
    write_section(doc, "a.py", "first")
    write_section(doc, "b.py", "other")
    write_section(doc, "a.py", "second")
    text = doc.read_text()
    assert text.startswith("# Title\n\nhand-written\n") and "first" not in text
    assert text.index("second") < text.index("other") and text.count("<!-- begin: a.py") == 1
    assert table(["a", "b"], [[1, 2]]) == "| a | b |\n|---|---:|\n| 1 | 2 |"


def test_cpu_benchmark_writes_its_section_labelled_cpu_measured(tmp_path) -> None:
    doc = tmp_path / "benchmarks-activation.md"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "cpu_activation.py"), "--quick", "--write-docs", str(doc)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-1500:]
    text = doc.read_text()
    assert "CPU-measured" in text and "GPU-measured" not in text and "smoke test, not a measurement" in text
    assert "| `ours_k11` |" in text and "289 saved tensors per step" in text


@pytest.mark.slow
def test_one_call_runs_every_gpu_script_and_labels_a_cpu_run(tmp_path) -> None:
    if torch.cuda.is_available():
        pytest.skip("on a GPU machine this is the real run")
    docs, results = tmp_path / "docs", tmp_path / "results"
    docs.mkdir()
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_all.py"), "--allow-cpu", "--docs", str(docs),
           "--results", str(results)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, (done.stdout + done.stderr)[-2000:] + (results / "gpu_optimizer.log").read_text()[
        -2000:
    ]
    assert json.loads(done.stdout.strip().splitlines()[-1])["exit_codes"] == {
        "gpu_activation.py": 0, "gpu_optimizer.py": 0, "gpu_offload_sweep.py": 0, "gpu_trace_check.py": 0
    }  # fmt: skip
    assert "DRY RUN on CPU" in (results / "gpu_offload_sweep.md").read_text()
    for name in ("benchmarks-activation.md", "benchmarks-optimizer.md"):
        text = (docs / name).read_text()
        assert "NOT a measurement" in text and "GPU-measured on" not in text, name
    assert json.loads((results / "gpu_activation.json").read_text())["rows"]["none"]["loss_bitwise_equal"]


def test_one_call_refuses_without_a_gpu_unless_asked() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_all.py")], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)  # fmt: skip
    assert done.returncode == 2 and "error" in json.loads(done.stdout)
