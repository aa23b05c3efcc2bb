"""Every Megatron-LM example command line we collected is read with no silent drop.

Test data: ``tests/config/data/megatron_lm_examples.json``, collected by ``tests/support/collect_mlm_examples.py``
from NVIDIA/Megatron-LM ``examples/**/*.sh`` at d98e8a64dd (41 training/inference scripts with ≥ 3 Megatron-LM
flags; the megatron-core wheels ship no example scripts). Each flag of each command line is either an argument of
Megatron-LM 0.19.2's full parser or reported by ``validate`` as ``CFG-UNKNOWN-ARGUMENT``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mbridge_offload.config.megatron_lm.flags import arguments
from mbridge_offload.config.sources import load
from mbridge_offload.config.validate import validate

DATA = Path(__file__).parent / "data" / "megatron_lm_examples.json"
EXAMPLES = json.loads(DATA.read_text(encoding="utf-8"))
OPTIONS = {opt for row in arguments() for opt in row[0]}


def test_the_collection_is_substantial():
    assert len(EXAMPLES) >= 40
    assert sum(a.startswith("--") for e in EXAMPLES for a in e["argv"]) > 1000


@pytest.mark.parametrize("example", EXAMPLES, ids=[e["source"].rsplit(":", 1)[1] for e in EXAMPLES])
def test_example_is_read_with_no_silent_drop(example):
    loaded = load(argv=example["argv"])
    report = validate(loaded.config, loaded.raw, target="megatron-core==0.19.2")
    warned = {f.message.split()[0] for f in report.by_rule("CFG-UNKNOWN-ARGUMENT")}
    for arg in example["argv"]:
        if not arg.startswith("--"):
            continue
        flag = arg.split("=", 1)[0]
        assert flag in OPTIONS or arg in warned, f"{arg} of {example['source']} was dropped silently"
    assert warned <= {a for a in example["argv"] if a.split("=", 1)[0] not in OPTIONS}


@pytest.mark.megatron
def test_the_argument_table_is_what_megatron_lm_0192_builds():
    """``config/megatron_lm/data/arguments.txt`` equals what the generator writes from Megatron-LM 0.19.2's real
    parser (``add_megatron_arguments``), row for row."""
    import subprocess
    import sys

    from tests.support import tree
    from tests.support.differential import version_env

    env = version_env("0.19.2")
    if env is None:
        pytest.skip("megatron-core 0.19.2 is not installed (scripts/setup puts it in .mcore/0.19.2)")
    script = Path(__file__).resolve().parents[1] / "support" / "gen_mlm_flags.py"
    path = tree.pythonpath(env["PYTHONPATH"])
    done = subprocess.run(
        [sys.executable, str(script), "--check"], env={**env, "PYTHONPATH": path}, capture_output=True, timeout=300
    )
    assert done.returncode == 0, "regenerate it: PYTHONPATH=.mcore/0.19.2 python tests/support/gen_mlm_flags.py"
