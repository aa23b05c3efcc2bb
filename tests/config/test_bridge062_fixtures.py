"""The committed Bridge 0.6.2 perf-recipe fixtures are exactly what the installed package generates.

tests/data/bridge-0.6.2/perf/ holds the run_config.yaml (``cfg.to_yaml``) of every ``megatron.bridge.perf_recipes``
recipe that switches offloading on, and index.json; tests/support/gen_bridge_perf.py enumerates them from the
package. Regenerating into a temporary folder and comparing byte for byte keeps them enumerated from the package.
Runs under `make test-bridge` (Bridge 0.6.2 in .bridge/0.6.2, under the labelled shims of tests/support/bridge062.py).
"""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys

import pytest

from tests.support import bridge062, tree

FIXTURES = bridge062.ROOT / "tests" / "data" / "bridge-0.6.2" / "perf"

pytestmark = pytest.mark.skipif(
    not (os.environ.get("MBRIDGE_OFFLOAD_BRIDGE_PATH") and bridge062.available()),
    reason="Megatron Bridge 0.6.2 is not installed here: run `make test-bridge` (installs it into .bridge/0.6.2)",
)


def test_committed_fixtures_are_what_the_package_generates(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.gen_bridge_perf", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=tree.pythonpath()),
        timeout=600,
        cwd=bridge062.ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = sorted(p.name for p in FIXTURES.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ours
    _same, mismatch, errors = filecmp.cmpfiles(FIXTURES, tmp_path, ours, shallow=False)
    assert not mismatch and not errors, f"regenerate: python -m tests.support.gen_bridge_perf ({mismatch + errors})"
    index = json.loads((FIXTURES / "index.json").read_text())
    kinds = {entry["offload"]["kind"] for entry in index["recipes"].values()}
    assert kinds == {"layer", "fine-grained"}
    assert len(index["recipes"]) + 1 == len(ours)
