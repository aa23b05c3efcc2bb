"""mbridge_offload.config.megatron_lm.fixes: fixes for a Megatron-LM command line come back as flags, not Bridge
keys."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from mbridge_offload.config.megatron_lm.fixes import flag_edit, megatron_lm_fixes
from mbridge_offload.config.megatron_lm.flags import arguments
from mbridge_offload.config.rules.catalogue import all_rules
from mbridge_offload.config.sources import load
from mbridge_offload.config.validate import validate

EXAMPLES = json.loads((Path(__file__).parent / "data" / "megatron_lm_examples.json").read_text(encoding="utf-8"))
OPTIONS = {opt for row in arguments() for opt in row[0]}
ARGV = "--num-layers 4 --cpu-offloading-num-layers 4 --pipeline-model-parallel-size 2 --optimizer-cpu-offload " \
    "--recompute-activations"  # fmt: skip


@pytest.mark.parametrize(
    ("override", "edit"),
    [
        ("model.cpu_offloading_num_layers=4", (["--cpu-offloading-num-layers 4"], [])),
        ("optimizer.use_precision_aware_optimizer=true", (["--use-precision-aware-optimizer"], [])),
        ("ddp.use_distributed_optimizer=true", (["--use-distributed-optimizer"], [])),
        ("optimizer.optimizer_cpu_offload=false", ([], ["--optimizer-cpu-offload"])),
        ("model.recompute_granularity=null", ([], ["--recompute-granularity", "--recompute-activations"])),
        ("model.cpu_offloading=false", ([], ["--cpu-offloading-num-layers"])),
        ("model.offload_modules=[expert_fc1,moe_act]", (["--offload-modules expert_fc1 moe_act"], [])),
        ("optimizer.main_grads_dtype=fp32", (["--main-grads-dtype fp32"], [])),
        ("model.no_such_key=1", None),
    ],
)
def test_each_override_becomes_the_flag_edit(override: str, edit) -> None:
    assert flag_edit(override) == edit


def test_every_flag_a_fix_names_is_one_megatron_lm_parses() -> None:
    # Every fix template of the catalogue whose key has a flag gets a real option (not a made-up spelling).
    for rule in all_rules():
        for template in rule.fix or ():
            edit = flag_edit(template.replace("{", "").replace("}", ""))
            for flag in [*(edit or ([], []))[0], *(edit or ([], []))[1]]:
                assert flag.split()[0] in OPTIONS, (rule.id, template, flag)


@pytest.mark.parametrize("example", EXAMPLES[:20], ids=[e["source"].rsplit(":", 1)[1] for e in EXAMPLES[:20]])
def test_fixes_for_real_command_lines_are_all_flags(example) -> None:
    loaded = load(argv=example["argv"] + ["--optimizer-cpu-offload", "--cpu-offloading-num-layers", "1"])
    report = megatron_lm_fixes(validate(loaded.config, loaded.raw))
    assert report.fix_notation == "megatron-lm"
    for finding in report.findings:
        for item in [*(finding.fix or []), *(finding.fix_remove or [])]:
            assert item.split()[0] in OPTIONS, (finding.rule, item, finding.fix_overrides)


def test_the_cli_answers_a_megatron_lm_command_line_in_flags() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mbridge_offload_tools", "validate", "--megatron-args", ARGV, "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    out = json.loads(done.stdout)
    assert out["fix_notation"] == "megatron-lm"
    by_rule = {f["rule"]: f for f in out["findings"]}
    assert by_rule["ACT-NUM-LAYERS"]["fix"] == ["--cpu-offloading-num-layers 2"]
    assert by_rule["ACT-NUM-LAYERS"]["fix_overrides"] == ["model.cpu_offloading_num_layers=2"]
    assert by_rule["ACT-RECOMPUTE"]["fix_remove"] == ["--recompute-granularity", "--recompute-activations"]
    # The edited command line is clean of these errors.
    fixed = [a for a in shlex.split(ARGV) if a not in ("--recompute-activations",)]
    fixed[fixed.index("--cpu-offloading-num-layers") + 1] = "2"
    fixed[fixed.index("--pipeline-model-parallel-size") + 1] = "1"
    loaded = load(argv=fixed)
    assert not {"ACT-NUM-LAYERS", "ACT-RECOMPUTE", "ACT-PP"} & {
        f.rule for f in validate(loaded.config, loaded.raw).errors
    }


def test_a_bridge_config_keeps_bridge_notation() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mbridge_offload_tools", "validate", "-", "--json"],
        input="model:\n  num_layers: 4\n  cpu_offloading: true\n  cpu_offloading_num_layers: 4\n",
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = json.loads(done.stdout)
    assert out["fix_notation"] == "bridge"
    assert any(f["fix"] == ["model.cpu_offloading_num_layers=2"] for f in out["findings"]), out["findings"]
