"""``validate --exact`` (CLI) and ``exact=true`` (MCP): the installed megatron-core's own errors, verbatim.

Real megatron-core builds the configs in a subprocess: the target's release, 0.16.1 from the venv or 0.19.2 from
``.mcore/0.19.2`` (``scripts/setup``); the "not installed" case runs the CLI with a ``megatron`` package on PYTHONPATH
that has no ``core`` (so the real one is shadowed) and ``MBRIDGE_OFFLOAD_MCORE_DIR`` at an empty folder.
"""

from __future__ import annotations

import json
import os
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
        [sys.executable, "-m", "mbridge_offload_tools.cli.main", "validate", str(path), "--json", *args],
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
    # megatron-core's own errors; where a catalogue rule says the same, the rule's finding carries it (keys, fix)
    exact = [f for f in payload["findings"] if f["rule"] == "MCORE-EXACT" or "upstream run" in (f["why"] or "")]
    assert sorted((f["exception"], f["message"]) for f in exact) == [
        ("AssertionError", "main_grads_dtype can only be fp32 when not using precision-aware optimizer"),
        ("ValueError", "num_attention_heads (6) must be a multiple of tensor_model_parallel_size (4)."),
    ]
    assert all(f["origin"] == "mcore" for f in exact)
    # The fast path keeps the TP check (a rule: the planner asks it without torch); megatron-core's optimizer dtype
    # check is no rule of ours, and the answer names the check that did not run.
    code, fast = _cli(tmp_path, "--target", "megatron-core==0.16.1", "--no-upstream")
    errors = [f["message"] for f in fast["findings"] if f["severity"] == "error"]
    assert errors[0] == "num_attention_heads (6) must be a multiple of tensor_model_parallel_size (4)."
    assert "megatron-core OptimizerConfig.__post_init__" in fast["coverage"]["not_run"]


def test_exact_without_megatron_core_is_a_clear_exit_2(tmp_path):
    shadow = tmp_path / "shadow" / "megatron"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    (tmp_path / "no-trees").mkdir()
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": os.pathsep.join(str(p) for p in (tmp_path / "shadow", ROOT / "offload", ROOT / "tools")),
        "MBRIDGE_OFFLOAD_MCORE_DIR": str(tmp_path / "no-trees"),
    }
    code, payload = _cli(tmp_path, "--exact", env=env)
    assert code == 2
    assert payload["ok"] is False and "megatron-core installed" in payload["error"]  # the one JSON error object
    assert "none could run" in payload["error"] and "scripts/setup" in payload["error"]


def test_mcp_validate_config_exact_parameter(tmp_path):
    from mbridge_offload_tools.server import app as server

    path = tmp_path / "c.yaml"
    path.write_text(textwrap.dedent(CONFIG))
    import anyio

    # the tool as the server runs it: guarded (a worker thread under a deadline), hence a coroutine
    report = anyio.run(lambda: server.validate_config(config=str(path), exact=True))
    messages = [f.message for f in report.findings if f.severity == "error" and f.origin == "mcore"]
    assert "num_attention_heads (6) must be a multiple of tensor_model_parallel_size (4)." in messages
    assert "MCORE-EXACT-VERSION" in {f.rule for f in report.findings}  # every exact answer names the release that ran


# --- Bridge's normalisations, TE's absence, the target's release ---------------------------------

PERF = ROOT / "tests" / "data" / "bridge-0.6.2" / "perf"
MCORE_NEW = ROOT / ".mcore" / "0.19.2" / "megatron" / "core"
needs_019 = pytest.mark.skipif(not MCORE_NEW.is_dir(), reason="scripts/setup installs megatron-core 0.19.2 in .mcore/")
PP2 = """
model:
  {target}num_layers: 4
  hidden_size: 64
  num_attention_heads: 4
  pipeline_model_parallel_size: 2
  bf16: true
"""
PRECISION_AWARE = """
optimizer:
  optimizer: adam
  use_distributed_optimizer: true
  use_precision_aware_optimizer: true
  main_grads_dtype: bf16
  exp_avg_dtype: bf16
  exp_avg_sq_dtype: bf16
ddp:
  use_distributed_optimizer: true
"""


def _exact(source: str, target: str = "megatron-core==0.19.2"):
    from mbridge_offload.config.sources import load
    from mbridge_offload.config.validate import validate
    from mbridge_offload_tools.exact.run import exact_report

    loaded = load(source)
    report = validate(loaded.config, loaded.raw, target=target)
    report.source = loaded.source
    return report, exact_report(report, loaded.raw, 300, loaded.config)


@pytest.mark.long
@pytest.mark.parametrize("target", [pytest.param("megatron-core==0.19.2", marks=needs_019), "megatron-core==0.16.1"])
def test_bridge_yaml_with_pp_and_no_pipeline_dtype_is_clean_and_names_the_release_that_ran(target):
    bridge_yaml = PP2.format(target="_target_: megatron.bridge.models.gpt_provider.GPTModelProvider\n  ")
    fast, exact = _exact(bridge_yaml, target)
    assert exact.errors == [] and fast.ok
    (note,) = exact.by_rule("MCORE-EXACT-VERSION")
    label = target.split("==")[1]
    assert exact.env["exact_megatron_core"] == label and f"megatron-core {label}, the target" in note.message
    # A partial YAML (no _target_, merged onto a recipe) also gets Bridge's finalize() fill of pipeline_dtype, as the
    # catalogue assumes; a real error in it is still megatron-core's answer.
    partial_fast, partial = _exact(PP2.format(target=""), target)
    assert partial.errors == [] and partial_fast.ok
    heads = PP2.format(target="").replace(
        "num_attention_heads: 4", "num_attention_heads: 6\n  tensor_model_parallel_size: 4"
    )
    _, refused = _exact(heads, target)
    # megatron-core's first refusal; the stage's rules after it (checks it never reached) stay beside it
    assert refused.errors[0].message == "num_attention_heads (6) must be a multiple of tensor_model_parallel_size (4)."
    assert "raised this very message in the upstream run" in (refused.errors[0].why or "")


@pytest.mark.long
@pytest.mark.parametrize("target", [pytest.param("megatron-core==0.19.2", marks=needs_019), "megatron-core==0.16.1"])
def test_precision_aware_optimizer_without_te_is_a_stated_skip_not_an_error(target):
    _, exact = _exact(PRECISION_AWARE, target)
    assert exact.errors == []
    assert not any("NoneType" in f.message for f in exact.findings)
    skipped = [f.message for f in exact.by_rule("MCORE-EXACT-SKIPPED")]
    assert any("OptimizerConfig" in m and "is_te_min_version('2.1.0')" in m and "not installed" in m for m in skipped)
    # the checks that need no TE still run: precision-aware with a non-adam optimizer is still refused
    _, refused = _exact(PRECISION_AWARE.replace("optimizer: adam", "optimizer: sgd"), target)
    assert [f.message for f in refused.errors] == ["--use-precision-aware-optimizer only supported with adam"]


@needs_019
@pytest.mark.long
@pytest.mark.parametrize(
    "path",
    [
        ROOT / "examples" / "qwen3_30b_a3b_pretrain.yaml",
        *(
            PERF / (json.loads((PERF / "index.json").read_text())["recipes"][name]["fixture"])
            for name in (
                "llama3_70b_pretrain_64gpu_gb200_bf16_config",
                "deepseek_v3_pretrain_128gpu_gb300_fp8mx_hsdp_config",
                "nemotron_3_5_lightning_pretrain_16gpu_h100_bf16_config",
                # ..._partial_cg_dev_config is refused by megatron-core itself (VPP against the layout), no rule of
                # ours: test_bridge_configs.py::test_the_dev_recipe_bridge_refuses_gets_bridges_error
            )
        ),
    ],
    ids=lambda p: p.stem,
)
def test_exact_and_catalogue_agree_on_bridge_configs(path):
    fast, exact = _exact(str(path))
    assert exact.ok == fast.ok, [f.message for f in exact.errors]
    assert exact.env["exact_megatron_core"] == "0.19.2"
    if "partial_cg_dev" in path.name:  # Bridge 0.6.2 itself refuses it: its VPP size contradicts its layout
        assert any("conflicts with pipeline_model_parallel_layout" in f.message for f in exact.errors)


def test_a_target_that_is_not_installed_says_which_release_ran_and_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MBRIDGE_OFFLOAD_MCORE_DIR", str(tmp_path))  # no side-by-side trees: only the venv's 0.16.1
    _, exact = _exact(textwrap.dedent(CONFIG), "megatron-core==0.19.2")
    (note,) = exact.by_rule("MCORE-EXACT-VERSION")
    assert exact.env["exact_megatron_core"] == "0.16.1"
    assert "ran megatron-core 0.16.1" in note.message and "not the target megatron-core==0.19.2" in note.message
    assert "scripts/setup" in note.message


# --- the fallback release and Bridge's mixed_precision ----------------------------------------------------------

PP2_BRIDGE = {
    "provider": PP2.format(target="_target_: megatron.bridge.models.gpt_provider.GPTModelProvider\n  "),
    "recipe-name": PP2.format(target="") + "mixed_precision: bf16_mixed\n",
    "section": PP2.format(target="")
    + "mixed_precision:\n  bf16: true\n  params_dtype: {_target_: torch.bfloat16, _call_: false}\n"
    + "  pipeline_dtype: {_target_: torch.bfloat16, _call_: false}\n",
}


@pytest.mark.long
@pytest.mark.parametrize("variant", sorted(PP2_BRIDGE))
def test_on_the_fallback_release_a_bridge_pp2_bf16_yaml_gets_bridges_normalisations(variant, tmp_path, monkeypatch):
    # The target 0.19.2 is not installed (no side-by-side trees): the venv's 0.16.1 runs, after the same
    # mixed_precision and finalize() as on the target's path, and the answer names the release that ran.
    monkeypatch.setenv("MBRIDGE_OFFLOAD_MCORE_DIR", str(tmp_path))
    _, exact = _exact(PP2_BRIDGE[variant], "megatron-core==0.19.2")
    assert exact.errors == [], [f.message for f in exact.errors]
    assert (
        exact.env["exact_megatron_core"] == "0.16.1"
        and "this Python environment" in exact.env["exact_megatron_core_from"]
    )
    (note,) = exact.by_rule("MCORE-EXACT-VERSION")
    assert "ran megatron-core 0.16.1" in note.message and "not the target megatron-core==0.19.2" in note.message
    # Without Bridge's normalisations the same model is refused by megatron-core itself: the check can fail.
    from mbridge_offload_tools.exact.run import run_children

    body = _payload(PP2.format(target=""))
    body["model"].pop("pipeline_dtype")
    (answer,) = run_children([body], "megatron-core==0.19.2")
    assert [e["message"] for e in answer["errors"]] == [
        "When using pipeline parallelism, pipeline_dtype must be specified"
    ]


def _payload(text: str) -> dict:
    from mbridge_offload.config.sources import load
    from mbridge_offload_tools.exact.run import payload

    loaded = load(text)
    return payload(loaded.raw, loaded.config, "megatron-core==0.19.2", loaded.source)


def test_a_mixed_precision_recipe_name_is_applied_as_bridge_resolves_it():
    bf16 = _payload(PP2_BRIDGE["recipe-name"])
    assert bf16["model"]["pipeline_dtype"] == {"_target_": "torch.bfloat16", "_call_": False}
    assert bf16["model"]["params_dtype"] == bf16["model"]["pipeline_dtype"] and bf16["ddp"]["grad_reduce_in_fp32"]
    fp16 = _payload(PP2.format(target="") + "mixed_precision: fp16-mixed\n")  # the hyphenated name too
    assert fp16["model"]["fp16"] is True and fp16["ddp"]["grad_reduce_in_fp32"] is False
    assert fp16["model"]["pipeline_dtype"] == {"_target_": "torch.float16", "_call_": False}


def test_a_mixed_precision_section_sets_fields_the_model_section_does_not_write():
    # Bridge copies every field of MixedPrecisionConfig onto each config that has it (hasattr), written or not.
    body = _payload(PP2_BRIDGE["section"])
    assert body["model"]["pipeline_dtype"] == {"_target_": "torch.bfloat16", "_call_": False}
    # Fields the section leaves out take MixedPrecisionConfig's defaults, as Bridge's dataclass does.
    assert body["ddp"]["grad_reduce_in_fp32"] is True and body["model"]["fp8"] is None
    assert body["optimizer"]["fp8_param"] is False  # finalize(): fp8_param unset takes fp8_param_gather


def test_an_unknown_mixed_precision_recipe_changes_nothing():
    body = _payload(PP2.format(target="") + "mixed_precision: no_such_recipe\n")
    assert "fp8" not in body["model"] and body["model"]["pipeline_dtype"] == "fp32"  # finalize() only


def test_a_partial_yaml_gets_pipeline_dtype_from_its_params_dtype_as_bridges_finalize_sets_it():
    assert _payload(PP2.format(target=""))["model"]["pipeline_dtype"] == "bf16"  # model.bf16: params_dtype bf16
    assert _payload(PP2.format(target="").replace("  bf16: true\n", ""))["model"]["pipeline_dtype"] == "fp32"
    written = _payload(PP2.format(target="") + "  pipeline_dtype: fp16\n")
    assert written["model"]["pipeline_dtype"] == "fp16"  # a written value is kept
    assert "pipeline_dtype" not in _payload(PP2.format(target="").replace("size: 2", "size: 1"))["model"]


@needs_019
def test_without_triton_the_0192_error_says_to_run_the_setup(tmp_path):
    # A fresh clone before this set-up pinned triton: megatron-core 0.19.2 cannot load; the answer is exit 2 with the
    # command that installs it, never a traceback. A `triton` on PYTHONPATH that fails to import stands for its absence.
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'triton'\")\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    code, payload = _cli(tmp_path, "--exact", env=env)
    assert code == 2 and "No module named 'triton'" in payload["error"] and "scripts/setup" in payload["error"]


def _validate(text: str, **kw) -> dict:
    from mbridge_offload_tools.interface.calls import validate_answer
    from mbridge_offload_tools.interface.tools import TOOLS

    v = {p.name: p.default for p in TOOLS["validate_config"].params}
    return validate_answer({**v, "config": textwrap.dedent(text), **kw}).to_dict()


LAYERS_61_PP_8 = """
model:
  num_layers: 61
  hidden_size: 256
  num_attention_heads: 8
  pipeline_model_parallel_size: 8
  pipeline_dtype: bf16
"""


@needs_019
def test_validate_builds_the_layout_and_returns_upstreams_refusal_verbatim():
    # 61 layers over PP 8 with no uneven split: TransformerConfig accepts it, the model build refuses it.
    answer = _validate(LAYERS_61_PP_8)
    build = [f for f in answer["findings"] if f["rule"] == "MCORE-BUILD"]
    assert answer["ok"] is False
    assert [(f["origin"], f["exception"], f["message"]) for f in build] == [
        ("mcore", "AssertionError", "num_layers=61 should be divisible by config.pipeline_model_parallel_size=8")
    ]
    assert "ran megatron-core 0.19.2" in answer["coverage"]["upstream"]


def test_no_upstream_names_every_check_it_did_not_run():
    from mbridge_offload.config.validate import UPSTREAM_CHECKS

    answer = _validate(LAYERS_61_PP_8, upstream=False)
    assert answer["coverage"]["not_run"] == list(UPSTREAM_CHECKS)
    assert "upstream=false" in answer["coverage"]["upstream"]


# Configs whose refusal was a hand-ported rule (MC-PP-LAYOUT-*, MC-PP-UNEVEN-MIDDLE-VPP, MC-FP8-STAGE-LAYERS-TYPE):
# megatron-core's own checks now answer them through validate's upstream run.
PORTED = {
    **{
        f"layout-{step}": {"num_layers": 4, "pipeline_model_parallel_size": 2, "pipeline_dtype": "bf16", **extra}
        for step, extra in {
            "conflict": {"pipeline_model_parallel_layout": "Ett|ttL", "num_layers_in_last_pipeline_stage": 2},
            "parse": {"pipeline_model_parallel_layout": "Etx|ttL"},
            "type": {"pipeline_model_parallel_layout": 5},
            "divisible": {"pipeline_model_parallel_layout": "Et|t|tL"},
            "layers": {"pipeline_model_parallel_layout": "tt|EttL"},
            "decoders": {"pipeline_model_parallel_layout": "Et(t)*2|ttL"},
            "mtp": {"pipeline_model_parallel_layout": "Ett|ttmL"},
        }.items()
    },
    "uneven-middle-vpp": {
        "num_layers": 10,
        "pipeline_model_parallel_size": 4,
        "virtual_pipeline_model_parallel_size": 2,
        "num_layers_in_first_pipeline_stage": 2,
        "num_layers_in_last_pipeline_stage": 2,
        "bf16": True,
        "pipeline_dtype": "bf16",
    },
    "fp8-stage-layers-type": {
        "num_layers": "4",
        "pipeline_model_parallel_size": 2,
        "fp8": "hybrid",
        "bf16": True,
        "pipeline_dtype": "bf16",
    },
}


@needs_019
@pytest.mark.parametrize("name", sorted(PORTED))
def test_a_deleted_ports_config_is_refused_by_megatron_core_itself(name):
    import yaml

    model = {"hidden_size": 64, "num_attention_heads": 4, **PORTED[name]}
    answer = _validate(yaml.safe_dump({"model": model}))
    refusals = [f for f in answer["findings"] if f["severity"] == "error" and f["origin"] == "mcore"]
    assert answer["ok"] is False and refusals, answer["findings"]
    assert all(f["rule"] in ("MCORE-EXACT", "MCORE-BUILD") and f["exception"] for f in refusals)
    assert all(f["message"] == f["upstream_message"] or not f["upstream_message"] for f in refusals)


def test_a_pipeline_size_written_as_a_float_skips_the_layer_count_not_the_whole_answer():
    # megatron-core's dataclass keeps 2.0 as written; the build's stage walk cannot count from it (it once crashed
    # the child, and with it every config of a batch).
    from mbridge_offload_tools.exact.run import run_children

    model = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "pipeline_model_parallel_size": 2.0}
    body = {"model": {**model, "pipeline_dtype": "bf16"}, "optimizer": {}, "ddp": {}, "te_version": "2.18.0"}
    (answer,) = run_children([body], "megatron-core==0.16.1")
    assert any("the pipeline sizes are no integers" in s for s in answer["skipped"]), answer


def test_the_exact_childs_assumed_te_release_is_the_config_sides() -> None:
    from mbridge_offload.config.rules.base import TE_VERSION_ASSUMED
    from mbridge_offload_tools.exact import child

    assert child.ASSUMED_TE == TE_VERSION_ASSUMED
