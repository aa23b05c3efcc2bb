"""Megatron Bridge 0.6.2 as the judge: `validate` on every offload perf recipe agrees with Bridge's own
``ConfigContainer.validate()`` (run for real, megatron-core 0.19.2 underneath), and `validate --recipe` builds them.

Runs under `make test-bridge` (Bridge 0.6.2 in .bridge/0.6.2), offline, under the LABELLED SHIMS of
tests/support/bridge062.py (typing.override; a TE import stub at 2.17.1, Bridge 0.6.2's pin, with TE's FusedAdam
signature). One more difference from a training node, also labelled: Transformer Engine's kernels are absent here, so
the fusions whose check imports them (``_NEEDS_TE_KERNELS``) are switched off in the container Bridge validates;
on a node with TE they pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import bridge062, tree

pytestmark = pytest.mark.skipif(
    not (os.environ.get("MBRIDGE_OFFLOAD_BRIDGE_PATH") and bridge062.available()),
    reason="Megatron Bridge 0.6.2 is not installed here: run `make test-bridge` (installs it into .bridge/0.6.2)",
)

_PRELUDE = """
import os, sys, json, tempfile
from pathlib import Path
sys.path.insert(0, {root!r})
from tests.support import bridge062
os.environ.update(bridge062.offline_env(bridge062.hub_cache(Path(tempfile.mkdtemp()) / "hub")))
bridge062.activate()
"""

_BOTH = (
    _PRELUDE
    + """
from mbridge_offload.config.sources import build_config, recipe_config
from mbridge_offload.config.validate import validate
from mbridge_offload_tools.exact.run import merge, payload, run_children
from tests.support.gen_bridge_perf import recipe_functions
from megatron.bridge.training.config import runtime_config_update
# Fusions whose megatron-core check imports TE kernels (absent on CPU; present on a training node).
_NEEDS_TE_KERNELS = ("moe_permute_fusion", "apply_rope_fusion")
index = json.loads(Path({index!r}).read_text())
functions = recipe_functions()
out = {{}}
# What validate answers by default: the catalogue, with megatron-core's own run (the target's, one import for all)
# in place of the checks it makes.
reports, bodies = {{}}, []
for name in index["recipes"]:
    raw = recipe_config(name)
    config = build_config(raw)
    report = validate(config, raw, source=f"recipe:{{name}}")
    body = payload(raw, config, report.target, f"recipe:{{name}}")
    body["te_version"] = report.env.get("te_version")
    reports[name] = report
    bodies.append(body)
targets = {{r.target for r in reports.values()}}
assert len(targets) == 1, targets
answers = run_children(bodies, targets.pop())
for name, answer in zip(index["recipes"], answers):
    report = merge(reports[name], answer, notes=False)
    ours = [[f.exception, f.upstream_message or f.message] for f in report.errors]
    cfg = functions[name]()
    for key in _NEEDS_TE_KERNELS:
        if getattr(cfg.model, key, False):
            setattr(cfg.model, key, False)
    saved = dict(os.environ)
    # The job's launch environment: as many ranks as the recipe is for.
    os.environ["WORLD_SIZE"] = str(index["recipes"][name]["num_gpus"])
    try:
        # Bridge's start-up sequence: env_vars into the environment, mixed precision and comm overlap applied,
        # then ConfigContainer.validate().
        runtime_config_update(cfg)
        theirs = None
    except Exception as exc:
        import traceback
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        theirs = [type(exc).__name__, str(exc), f"{{frame.filename}}:{{frame.lineno}}"]
    finally:
        os.environ.clear()
        os.environ.update(saved)
    out[name] = {{"ours": ours, "theirs": theirs, "target": report.target, "env": report.env}}
print(json.dumps(out))
"""
)


_NEEDS_A_GPU = "Torch not compiled with CUDA enabled"


def _run(script: str, *args: str, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=tree.pythonpath()),
        timeout=timeout,
        cwd=bridge062.ROOT,
    )


def test_verdict_on_every_offload_perf_recipe_matches_container_validate():
    index = bridge062.ROOT / "tests" / "data" / "bridge-0.6.2" / "perf" / "index.json"
    proc = _run(_BOTH.format(root=str(bridge062.ROOT), index=str(index)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(json.loads(index.read_text())["recipes"]) >= 20
    problems = []
    needs_gpu = []
    for name, r in results.items():
        assert r["target"] == "megatron-core==0.19.2" and r["env"]["te_version"] == "2.17.1"
        if r["theirs"] is not None and _NEEDS_A_GPU in r["theirs"][1]:
            needs_gpu.append(name)  # Bridge's own check asks CUDA (a device query): not decidable on this machine
            assert not r["ours"], f"{name}: we report {r['ours']}"
            continue
        if r["theirs"] is None and r["ours"]:
            problems.append(f"{name}: Bridge accepts it, we report {r['ours'][0]}")
        elif r["theirs"] is not None and r["theirs"][:2] not in [[e, m] for e, m in r["ours"]]:
            problems.append(f"{name}: Bridge raises {r['theirs']}, we report {r['ours'] or 'no error'}")
    agree = len(results) - len(problems) - len(needs_gpu)
    print(
        f"{agree} of {len(results)} offload perf recipes: same verdict as ConfigContainer.validate(); "
        f"{len(needs_gpu)} need a GPU for Bridge's own check ({', '.join(needs_gpu)})"
    )
    assert not problems, "\n".join(problems)


_CLI = (
    _PRELUDE
    + """
from mbridge_offload_tools.cli.main import main
main(sys.argv[1:])
"""
)


def test_validate_recipe_builds_a_perf_recipe_and_finds_it_clean():
    name = "nemotron_3_5_lightning_pretrain_16gpu_h100_bf16_config"
    proc = _run(_CLI.format(root=str(bridge062.ROOT)), "validate", "--recipe", name, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["ok"] is True and report["source"] == f"recipe:{name}"
    assert report["config"]["model.fine_grained_activation_offloading"] is True
    assert report["env"]["NVTE_CPU_OFFLOAD_V1"] == "1"  # from the recipe's env_vars


def test_validate_recipe_without_its_env_vars_is_bridges_start_up_error():
    name = "nemotron_3_5_lightning_pretrain_16gpu_h100_bf16_config"
    proc = _run(_CLI.format(root=str(bridge062.ROOT)), "validate", "--recipe", name, "--set", "~env_vars", "--json")
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [f for f in json.loads(proc.stdout)["findings"] if f["severity"] == "error"]
    assert [f["rule"] for f in errors] == ["ACT-FG-NVTE-V1"]


# ConfigContainer.validate()'s checks on the keys we read, one mutation of a real perf recipe each: the attribute path
# Bridge's config object takes, and the same edit as an override of ours. Bridge 0.6.2 is the judge both ways: where it
# raises, we report its exception and text; where it accepts (a warning, or a value its finalize() normalises), we
# report no error.
_MUTATIONS = {
    "dist-opt in optimizer only": [
        ("ddp.use_distributed_optimizer", False), ("optimizer.use_distributed_optimizer", True)
    ],
    "dist-opt in ddp only": [("ddp.use_distributed_optimizer", True), ("optimizer.use_distributed_optimizer", False)],
    "overlap_param_gather in optimizer only": [("optimizer.overlap_param_gather", True)],
    "seq_length mismatch": [("model.seq_length", 2048), ("dataset.seq_length", 4096)],
    "deterministic with CE fusion": [("model.deterministic_mode", True), ("model.cross_entropy_loss_fusion", True)],
    "sequence parallel at TP 1": [("model.tensor_model_parallel_size", 1), ("model.sequence_parallel", True)],
    "full_iteration graph with the NaN check": [
        ("model.cuda_graph_impl", "full_iteration"), ("model.cuda_graph_modules", []), ("model.cuda_graph_scope", None),
        ("model.fine_grained_activation_offloading", False), ("model.offload_modules", []),
        ("rerun_state_machine.check_for_nan_in_loss", True),
    ],
}  # fmt: skip

_MUTATE = (
    _PRELUDE
    + """
from mbridge_offload.config.overrides import format_override
from mbridge_offload.config.sources import apply_overrides, build_config, recipe_config
from mbridge_offload.config.validate import validate
from mbridge_offload_tools.exact.run import merge, payload, run_children
from tests.support.gen_bridge_perf import recipe_functions
from megatron.bridge.training.config import runtime_config_update
name, mutations = {name!r}, {mutations!r}
out = {{}}
for label, edits in mutations.items():
    raw = apply_overrides(recipe_config(name), [format_override(k, v) for k, v in edits])
    report = validate(build_config(raw), raw)
    ours = [[f.exception, f.upstream_message or f.message] for f in report.errors]
    cfg = recipe_functions()[name]()
    for key in ("moe_permute_fusion", "apply_rope_fusion"):  # TE kernels, absent on CPU (as in the test above)
        if getattr(cfg.model, key, False):
            setattr(cfg.model, key, False)
    for key, value in edits:
        section, field = key.split(".")
        setattr(getattr(cfg, section), field, value)
    saved = dict(os.environ)
    os.environ["WORLD_SIZE"] = "16"
    try:
        runtime_config_update(cfg)
        theirs = None
    except Exception as exc:
        theirs = [type(exc).__name__, str(exc)]
    finally:
        os.environ.clear()
        os.environ.update(saved)
    out[label] = {{"ours": ours, "theirs": theirs, "warnings": [f.rule for f in report.findings]}}
print(json.dumps(out))
"""
)


def test_container_validate_checks_on_our_keys_agree_with_bridge_both_ways():
    name = "nemotron_3_5_lightning_pretrain_16gpu_h100_bf16_config"
    proc = _run(_MUTATE.format(root=str(bridge062.ROOT), name=name, mutations=_MUTATIONS))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    problems = []
    for label, r in results.items():
        if r["theirs"] is not None and _NEEDS_A_GPU in r["theirs"][1]:
            # validate()'s last step, the flex dispatcher's device query (this recipe uses it), needs a GPU: every
            # check before it passed, so Bridge accepted the mutation as far as a CPU can tell.
            r["theirs"] = None
        if r["theirs"] is None and r["ours"]:
            problems.append(f"{label}: Bridge accepts it, we report {r['ours']}")
        elif r["theirs"] is not None and r["theirs"] not in r["ours"]:
            problems.append(f"{label}: Bridge raises {r['theirs']}, we report {r['ours'] or 'no error'}")
    assert not problems, "\n".join(problems)
    assert "CFG-BRIDGE-DIST-OPT-SYNC" in results["dist-opt in ddp only"]["warnings"]
    assert results["seq_length mismatch"]["theirs"] is not None  # the mutations do reach Bridge's checks
