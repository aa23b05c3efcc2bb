"""Bridge 0.6 configs read and judged as Bridge would: the committed run_config.yaml of every offload perf recipe
(tests/data/bridge-0.6.2/perf/, written by Bridge 0.6.2 itself), non-finite floats, env_vars, finalize().

No Bridge needed: the fixtures are plain YAML (tests/config/test_bridge062.py checks them against Bridge itself).
"""

from __future__ import annotations

import json

import pytest

from mbridge_offload.actions.apply.apply import apply_offload
from mbridge_offload.config.sources import ConfigError, load
from mbridge_offload.config.validate import validate
from tests.support import bridge062

PERF = bridge062.ROOT / "tests" / "data" / "bridge-0.6.2" / "perf"
INDEX = json.loads((PERF / "index.json").read_text())
# Bridge 0.6.2 itself refuses this development recipe (its VPP size contradicts its own pipeline layout): see
# test_the_dev_recipe_bridge_refuses_gets_bridges_error.
REFUSED_BY_BRIDGE = {"deepseek_v3_pretrain_256gpu_gb200_fp8mx_partial_cg_dev_config"}
FINE_GRAINED = "nemotron_3_5_lightning_pretrain_16gpu_h100_bf16_config"


def _report(path, *overrides: str, env: dict[str, str] | None = None):
    loaded = load(str(path), list(overrides))
    loaded.config.env.update(env or {})
    return validate(loaded.config, loaded.raw)


@pytest.mark.parametrize("name", sorted(set(INDEX["recipes"]) - REFUSED_BY_BRIDGE))
def test_every_offload_perf_recipe_validates_clean_as_nvidia_runs_it(name):
    report = _report(PERF / INDEX["recipes"][name]["fixture"])
    assert report.errors == [], [f.message for f in report.errors]
    assert report.target == "megatron-core==0.19.2"
    assert report.env["te_version"] == "2.17.1" and "assumed" in report.env["te_version_source"]


@pytest.mark.megatron
def test_the_dev_recipe_bridge_refuses_gets_bridges_error():
    # megatron-core's own refusal (VPP against the layout), from the upstream run: no rule of ours restates it.
    from mbridge_offload_tools.interface.calls import validate_answer
    from mbridge_offload_tools.interface.tools import TOOLS

    (name,) = REFUSED_BY_BRIDGE
    v = {p.name: p.default for p in TOOLS["validate_config"].params}
    report = validate_answer({**v, "config": str(PERF / f"{name}.yaml"), "exact": True})
    assert [(f.rule, f.origin, f.exception) for f in report.errors] == [("MCORE-EXACT", "mcore", "AssertionError")]
    assert report.errors[0].message == (
        "virtual_pipeline_model_parallel_size conflicts with pipeline_model_parallel_layout, "
        "(self.virtual_pipeline_model_parallel_size=2,  detected_vpp_size=4)"
    )


def test_index_names_gpu_count_and_offload_kind_of_each_recipe():
    entry = INDEX["recipes"]["llama3_70b_pretrain_64gpu_gb200_bf16_config"]
    assert (entry["gpu"], entry["num_gpus"], entry["offload"]["kind"]) == ("gb200", 64, "layer")
    assert entry["offload"]["cpu_offloading_num_layers"] == 20
    assert INDEX["recipes"][FINE_GRAINED]["offload"]["offload_modules"] == ["expert_fc1"]
    assert all("not" in why or "offline" in why for why in INDEX["skipped"].values())


def test_bridges_own_inf_default_reads_and_round_trips_through_apply(tmp_path):
    source = tmp_path / "run_config.yaml"
    source.write_bytes((PERF / "llama3_70b_pretrain_64gpu_gb200_bf16_config.yaml").read_bytes())
    assert "grad_norm_skip_threshold: .inf" in source.read_text()
    out = tmp_path / "with_optimizer_offload.yaml"
    result = apply_offload(str(source), "optimizer", fraction=0.5, output=str(out))
    assert result.ok, [f.message for f in result.findings if f.severity == "error"]
    assert "grad_norm_skip_threshold: .inf" in out.read_text()
    assert load(str(out)).raw["optimizer"]["grad_norm_skip_threshold"] == float("inf")


@pytest.mark.parametrize(
    "text", ["optimizer:\n  lr: -.inf\n", "optimizer:\n  clip_grad: .inf\n", "optimizer:\n  adam_eps: .nan\n"]
)
def test_non_finite_float_where_upstream_takes_any_float_is_read(text):
    loaded = load(text)
    assert validate(loaded.config, loaded.raw).errors == []


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("optimizer:\n  optimizer_offload_fraction: .nan\n", "optimizer.optimizer_offload_fraction"),
        ("model:\n  activation_offload_fraction: .inf\n", "model.activation_offload_fraction"),
        ("model:\n  cpu_offloading_num_layers: .inf\n", "model.cpu_offloading_num_layers"),
    ],
)
def test_non_finite_number_where_the_bound_is_ours_or_a_count_is_bad_input(text, key):
    with pytest.raises(ConfigError, match=rf"{key} = (nan|inf): not a finite number"):
        load(text)


def test_env_vars_set_nvte_cpu_offload_v1_for_fine_grained_offloading():
    report = _report(PERF / f"{FINE_GRAINED}.yaml")
    assert not report.by_rule("ACT-FG-NVTE-V1")
    assert report.env["NVTE_CPU_OFFLOAD_V1"] == "1"


def test_fine_grained_without_nvte_cpu_offload_v1_is_bridges_start_up_error():
    report = _report(PERF / f"{FINE_GRAINED}.yaml", "~env_vars")
    (finding,) = report.by_rule("ACT-FG-NVTE-V1")
    assert finding.severity == "error" and finding.exception == "ValueError" and finding.origin == "bridge"
    assert finding.message == (
        "For fine-grained activation offloading with TE >= 2.10.0, NVTE_CPU_OFFLOAD_V1 environment variable "
        "should be set to 1 to avoid offloading weights."
    )
    assert finding.fix == ["++env_vars.NVTE_CPU_OFFLOAD_V1=1"]
    fixed = _report(PERF / f"{FINE_GRAINED}.yaml", "~env_vars", *finding.fix)
    assert fixed.errors == []


def test_the_callers_environment_sets_it_too_and_wins_over_env_vars():
    assert _report(PERF / f"{FINE_GRAINED}.yaml", "~env_vars", env={"NVTE_CPU_OFFLOAD_V1": "1"}).errors == []
    report = _report(PERF / f"{FINE_GRAINED}.yaml", env={"NVTE_CPU_OFFLOAD_V1": "0"})
    assert [f.rule for f in report.errors] == ["ACT-FG-NVTE-V1"]


def test_older_te_needs_no_nvte_cpu_offload_v1():
    assert _report(PERF / f"{FINE_GRAINED}.yaml", "~env_vars", env={"te_version": "2.9"}).errors == []


_BRIDGE_YAML = """\
_target_: megatron.bridge.training.config.ConfigContainer
model:
  _target_: megatron.bridge.models.gpt_provider.GPTModelProvider
  num_layers: 8
  hidden_size: 256
  num_attention_heads: 8
  tensor_model_parallel_size: 1
  sequence_parallel: true
"""


def _with_upstream(text: str, target: str = "megatron-core==0.19.2"):
    """validate as it answers by default: the catalogue with megatron-core's own run, on Bridge's effective config."""
    from mbridge_offload_tools.interface.calls import validate_answer
    from mbridge_offload_tools.interface.tools import TOOLS

    v = {p.name: p.default for p in TOOLS["validate_config"].params}
    return validate_answer({**v, "config": text, "target": target, "exact": True})


_SP_WITHOUT_TP = "Cannot use sequence parallelism without tensor parallelism"


@pytest.mark.megatron
def test_bridge_finalize_clears_sequence_parallel_at_tp1_before_megatron_cores_check():
    report = _with_upstream(_BRIDGE_YAML)
    assert report.errors == []
    (note,) = report.by_rule("CFG-BRIDGE-FINALIZE")
    assert note.keys == ["model.sequence_parallel"] and note.severity == "info"


@pytest.mark.megatron
def test_a_plain_megatron_core_config_keeps_megatron_cores_check():
    text = "\n".join(line for line in _BRIDGE_YAML.splitlines() if "_target_" not in line)
    assert [f.message for f in _with_upstream(text).errors] == [_SP_WITHOUT_TP]


@pytest.mark.megatron
def test_bridge_03_finalize_does_not_clear_sequence_parallel():
    report = _with_upstream(_BRIDGE_YAML, target="megatron-core==0.16.1")
    assert [f.message for f in report.errors] == [_SP_WITHOUT_TP]


_GRAPH = """\
model:
  num_layers: 4
  hidden_size: 64
  num_attention_heads: 4
  cpu_offloading: true
  cpu_offloading_num_layers: 1
  cuda_graph_impl: {impl}
  cuda_graph_scope: full_iteration
"""


@pytest.mark.parametrize("impl", ["local", "none"])
def test_full_iteration_scope_is_the_full_iteration_graph_that_offloading_may_use_on_019(impl):
    # megatron-core 0.19.2 migrates the deprecated scope to cuda_graph_impl="full_iteration" and accepts it
    loaded = load(_GRAPH.format(impl=impl))
    assert validate(loaded.config, loaded.raw, target="megatron-core==0.19.2").errors == []


def test_local_graphs_with_offloading_stay_refused_on_016():
    loaded = load(_GRAPH.format(impl="local"))
    report = validate(loaded.config, loaded.raw, target="megatron-core==0.16.1")
    assert [f.rule for f in report.errors] == ["ACT-CUDA-GRAPH"]
