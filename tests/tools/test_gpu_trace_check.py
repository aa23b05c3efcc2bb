"""``benchmarks/gpu_trace_check.py``: its dry run on the CPU runs the GPU path (the trace's model on real tensors,
megatron-core's schedule, the trace and estimate for every setting) and writes nothing tracked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.megatron, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("check")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_trace_check.py"), "--dry-run"]
    cmd += ["--output", str(out / "doc.md"), "--json", str(out / "check.json")]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT), out


def _row(stdout: str, setting: str) -> list[str]:
    line = next(ln for ln in stdout.splitlines() if ln.startswith(f"| {setting}"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_the_dry_run_exits_0_labelled_and_writes_nothing(dry_run) -> None:
    done, out = dry_run
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Dry run on the CPU" in done.stdout and "NOT a measurement" in done.stdout
    assert list(out.iterdir()) == []


def test_the_dry_run_traces_and_estimates_each_setting_the_trace_builds(dry_run) -> None:
    done, _ = dry_run
    for setting in ("no lever", "full recompute", "selective recompute", "HDO 0.5"):
        cells = _row(done.stdout, setting)
        assert cells[1] == "-", cells  # no CUDA counter on the CPU
        assert float(cells[2]) > 0 and float(cells[4]) > 0, cells  # the trace's and the estimate's fwd/bwd


def test_the_dry_run_traces_layer_offload_through_tes_offload_stand_in(dry_run) -> None:
    done, _ = dry_run
    cells = _row(done.stdout, "layer offload")
    assert float(cells[2]) > 0 and float(cells[4]) > 0 and "trace refused" not in cells[-1], cells
