"""The rule catalogue: integrity, each rule's trigger and fix, version gating, and the generated docs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mbridge_offload.config.rules.base import (
    ORIGINS,
    SEVERITIES,
    STAGE_ADVISORY,
    STAGE_FIRST_STEP,
    TARGETS,
    parse_target,
    spec_contains,
)
from mbridge_offload.config.rules.catalogue import all_rules, get_rule, render_rules_markdown
from mbridge_offload.config.schema import OffloadConfig
from mbridge_offload.config.sources import load
from mbridge_offload.config.validate import validate

# The offload suite (`mbridge-offload test -k cpu_offload`, `pytest -k cpu_offload`): see pyproject.toml.
pytestmark = pytest.mark.cpu_offload

ROOT = Path(__file__).resolve().parents[2]


def findings(*overrides: str, target: str = "megatron-core==0.19.2", env: dict | None = None):
    loaded = load(None, list(overrides))
    loaded.config.env.update(env or {})
    return validate(loaded.config, loaded.raw, target=target)


def ids(report) -> list[str]:
    return [f.rule for f in report.findings]


ACT = ["model.num_layers=8", "model.cpu_offloading=true", "model.cpu_offloading_num_layers=2"]
OPT = [
    "optimizer.optimizer_cpu_offload=true",
    "optimizer.optimizer_offload_fraction=0.5",
    "optimizer.use_distributed_optimizer=true",
]


# ---------------------------------------------------------------------------------------------- integrity


def test_rule_ids_are_unique_and_well_formed():
    rule_ids = [r.id for r in all_rules()]
    assert len(rule_ids) == len(set(rule_ids))
    assert all(re.fullmatch(r"(ACT|OPT|CFG|MC)-[A-Z0-9-]+", i) for i in rule_ids)


def test_every_rule_has_the_catalogue_fields():
    for rule in all_rules():
        assert rule.severity in SEVERITIES, rule.id
        assert rule.origin in ORIGINS, rule.id
        assert rule.summary and rule.why and rule.message, rule.id
        assert rule.fix is None or all("=" in f for f in rule.fix), rule.id


def test_upstream_errors_name_their_exception_and_stage():
    for rule in all_rules():
        if rule.severity == "error" and rule.origin != "advisory":
            # KeyError: megatron-core's own code failing at the first step (STAGE_FIRST_STEP), not a check of its
            assert rule.exception in {"ValueError", "AssertionError", "TypeError", "NotImplementedError", "KeyError"}, (
                rule.id
            )
            assert rule.stage != STAGE_ADVISORY, rule.id
        if rule.origin == "advisory":
            assert not rule.upstream, rule.id


def test_the_brief_rule_ids_exist():
    for rule_id in (
        "ACT-PP",
        "ACT-RECOMPUTE",
        "ACT-NUM-LAYERS",
        "ACT-FINE-GRAINED",
        "ACT-PAGED-STASH",
        "ACT-CUDA-GRAPH",
        "ACT-NOTHING-TO-OFFLOAD",
        "OPT-DECOUPLED-WD",
        "OPT-FRACTION-ZERO",
        "OPT-FRACTION-RANGE",
        "CFG-UNKNOWN-KEY",
    ):
        assert get_rule(rule_id).id == rule_id


# ---------------------------------------------------------------------------------------------- versions


def test_targets_parse_in_the_usual_spellings():
    assert parse_target("megatron-core==0.16.1").label == "0.16.1"
    assert parse_target("megatron-core==0.16").label == "0.16.1"
    assert parse_target("0.19").label == "0.19.2"
    assert parse_target("megatron-core==main").label == "main"
    with pytest.raises(ValueError, match="unsupported target"):
        parse_target("megatron-core==0.18.0")
    with pytest.raises(ValueError):
        parse_target("torch==2.3")


def test_specifiers():
    assert spec_contains("", (0, 16, 1))
    assert spec_contains(">=0.19", (0, 19, 2)) and not spec_contains(">=0.19", (0, 16, 1))
    assert spec_contains(">=0.16,<0.19", (0, 16, 1)) and not spec_contains(">=0.16,<0.19", (0, 19, 2))


def test_release_only_rules_are_gated_by_target():
    stash = [*ACT, "model.moe_paged_stash=true"]
    assert "ACT-PAGED-STASH" in ids(findings(*stash))
    assert "ACT-PAGED-STASH" not in ids(findings(*stash, target="0.16.1"))
    fg = [
        "model.fine_grained_activation_offloading=true",
        "model.offload_modules=[core_attn]",
        "model.min_offloaded_tensor_size=-1",
        "model.activation_offload_fraction=1.5",
    ]
    env = {"NVTE_CPU_OFFLOAD_V1": "1"}
    assert {"ACT-FG-MIN-TENSOR-SIZE", "ACT-FG-FRACTION-RANGE"} <= set(ids(findings(*fg, env=env)))
    assert findings(*fg, target="0.16.1", env=env).ok


def test_allowed_offload_modules_grow_by_release():
    fg = [
        "model.fine_grained_activation_offloading=true",
        "model.offload_modules=[fused_group_mlp]",
        "+model.use_transformer_engine_op_fuser=true",
    ]
    env = {"NVTE_CPU_OFFLOAD_V1": "1"}
    assert findings(*fg, env=env).ok
    old = findings(*fg, target="0.16.1", env=env)
    (finding,) = old.by_rule("ACT-FG-MODULES-INVALID")
    assert finding.message.startswith("Invalid choices for offload_modules: {'fused_group_mlp'}. Allowed modules")
    assert finding.fix == ["model.offload_modules=[core_attn]"]


def test_skip_megatron_wrapping_exists_only_from_0_19():
    cfg = [*OPT, "optimizer.skip_megatron_wrapping=true"]
    assert "OPT-SKIP-WRAPPING" in ids(findings(*cfg))
    assert "OPT-SKIP-WRAPPING" not in ids(findings(*cfg, target="0.16.1"))


def test_mfsdp_v2_rules_apply_to_main_only():
    cfg = [*OPT, "ddp.use_megatron_fsdp=true", "ddp.megatron_fsdp_version=2"]
    assert {"OPT-MFSDP-V2", "OPT-BRIDGE-MFSDP-V2"} <= set(ids(findings(*cfg, target="main")))
    assert findings(*cfg).ok


# ---------------------------------------------------------------------------------------------- activation rules


def test_a_clean_activation_config_passes():
    report = findings(*ACT)
    assert report.ok and report.findings == []


def test_range_check_is_inclusive_of_zero_and_excludes_num_layers():
    assert "ACT-NUM-LAYERS" not in ids(findings(*ACT, "model.cpu_offloading_num_layers=7"))
    assert "ACT-NUM-LAYERS" in ids(findings(*ACT, "model.cpu_offloading_num_layers=8"))
    assert "ACT-NUM-LAYERS" in ids(findings(*ACT, "model.cpu_offloading_num_layers=-1"))
    zero = findings(*ACT, "model.cpu_offloading_num_layers=0")
    assert zero.ok and "ACT-ZERO-LAYERS" in ids(zero)


def test_te_all_layers_is_hidden_behind_the_mcore_range_check():
    report = findings(*ACT, "model.cpu_offloading_num_layers=8")
    assert "ACT-NUM-LAYERS" in ids(report)
    assert "ACT-TE-ALL-LAYERS" not in ids(report)


@pytest.mark.parametrize(
    ("te", "exception", "text"),
    [
        # TE 2.14+ (Bridge 0.6.2 pins 2.18): a ValueError naming both numbers; 2.10-2.13: an assert without them.
        ("2.18.0", "ValueError", "not offloaded. Got num_layers=4, model_layers=4."),
        ("2.14.0", "ValueError", "not offloaded. Got num_layers=4, model_layers=4."),
        ("2.12.0", "AssertionError", "last layer is not offloaded."),
    ],
)
def test_te_all_layers_says_what_the_assumed_te_release_raises(te, exception, text):
    from mbridge_offload.config.rules.base import Context
    from mbridge_offload.config.validate import _finding

    loaded = load("model:\n  num_layers: 4\n  cpu_offloading: true\n  cpu_offloading_num_layers: 4\n")
    loaded.config.env["te_version"] = te
    rule = get_rule("ACT-TE-ALL-LAYERS")  # its own check: megatron-core's range check hides it in a report
    ctx = Context(config=loaded.config, raw=loaded.raw, target=parse_target("megatron-core==0.19.2"))
    (finding,) = [_finding(rule, match) for match in rule.run(ctx)]
    assert finding.exception == exception and finding.message.endswith(text), finding.message
    assert finding.message.startswith("Cannot offload all layers without manual synchronization")


def test_num_layers_minus_one_warns_about_overlap_on_te_v2_only():
    last = [*ACT, "model.cpu_offloading_num_layers=7"]
    (finding,) = findings(*last).by_rule("ACT-NO-OVERLAP")
    assert finding.severity == "warning"
    assert finding.fix == ["model.cpu_offloading_num_layers=6"]
    assert "ACT-NO-OVERLAP" not in ids(findings(*last, env={"NVTE_CPU_OFFLOAD_V1": "1"}))


def test_pp_fix_also_clears_virtual_pipeline():
    report = findings(*ACT, "model.pipeline_model_parallel_size=4", "model.virtual_pipeline_model_parallel_size=2")
    (finding,) = report.by_rule("ACT-PP")
    assert finding.fix == ["model.pipeline_model_parallel_size=1", "model.virtual_pipeline_model_parallel_size=null"]


def test_recompute_fix_clears_method_and_layers():
    recompute = ["model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1"]
    broken = [*ACT, *recompute]
    (finding,) = findings(*broken).by_rule("ACT-RECOMPUTE")
    assert finding.fix == [
        "model.recompute_granularity=null",
        "model.recompute_method=null",
        "model.recompute_num_layers=null",
    ]
    assert findings(*broken, *finding.fix).findings == []


def test_deprecated_enable_cuda_graph_maps_to_local():
    report = findings(*ACT, "model.enable_cuda_graph=true")
    assert {"ACT-CUDA-GRAPH-DEPRECATED", "ACT-CUDA-GRAPH"} <= set(ids(report))
    assert "ACT-BRIDGE-CUDAGRAPH-ASSERT" not in ids(report)  # unreachable: MCore stops first


def test_unknown_cuda_graph_impl_is_rejected():
    (finding,) = findings("model.cuda_graph_impl=magic").by_rule("ACT-CUDA-GRAPH-IMPL")
    assert finding.message == "Invalid cuda graph implementation: magic"


def test_bridge_0_6_local_graph_message():
    report = findings(*ACT, "model.cuda_graph_impl=local")
    assert report.by_rule("ACT-BRIDGE-LOCAL-CUDA-GRAPH")[0].message.startswith(
        'Megatron Bridge supports model.cuda_graph_impl="local" only for full-iteration CUDA graphs.'
    )
    assert "ACT-BRIDGE-LOCAL-CUDA-GRAPH" not in ids(findings(*ACT, "model.cuda_graph_impl=local", target="0.16.1"))


def test_weights_only_offload_is_deprecated_and_fix_turns_activations_back_on():
    (finding,) = findings(*ACT, "model.cpu_offloading_weights=true", "model.cpu_offloading_activations=false").by_rule(
        "ACT-WEIGHTS-DEPRECATED"
    )
    assert finding.message == "Offloading weights is deprecated. Using offload_weights=True does not have any effect."
    assert finding.fix == ["model.cpu_offloading_weights=false", "model.cpu_offloading_activations=true"]


def test_double_buffering_is_flagged_only_on_te_v2():
    db = [*ACT, "model.cpu_offloading_double_buffering=true"]
    assert "ACT-DOUBLE-BUFFERING" in ids(findings(*db))
    assert "ACT-DOUBLE-BUFFERING" not in ids(findings(*db, env={"te_version": "2.8.0"}))


def test_fine_grained_needs_te_impl_and_the_v1_env_on_new_te():
    fg = ["model.fine_grained_activation_offloading=true", "model.offload_modules=[core_attn]"]
    local = findings(*fg, "model.transformer_impl=local", env={"NVTE_CPU_OFFLOAD_V1": "1"})
    assert local.by_rule("ACT-FG-TE-IMPL")[0].message.endswith("Current transformer_impl: local")
    assert "ACT-FG-NVTE-V1" in ids(findings(*fg))
    assert findings(*fg, env={"NVTE_CPU_OFFLOAD_V1": "1"}).ok


def test_fine_grained_module_checks():
    fg = ["model.fine_grained_activation_offloading=true"]
    env = {"NVTE_CPU_OFFLOAD_V1": "1"}
    empty = findings(*fg, env=env).by_rule("ACT-FG-MODULES-EMPTY")[0]
    assert empty.upstream_message == ""  # upstream's bare assert has no text
    assert "offload_modules" in empty.message
    proj = findings(*fg, "model.offload_modules=[attn_proj]", env=env).by_rule("ACT-FG-ATTN-PROJ")[0]
    assert proj.message.startswith("attn_proj cannot be set to offload_modules alone without core_attn")


def test_num_layers_without_offloading_is_inert_info():
    (finding,) = findings("model.cpu_offloading_num_layers=95").by_rule("ACT-NUM-LAYERS-INERT")
    assert finding.severity == "info"


# ---------------------------------------------------------------------------------------------- optimizer rules


def test_a_clean_optimizer_config_passes_without_findings():
    assert findings(*OPT, "optimizer.overlap_cpu_optimizer_d2h_h2d=true").findings == []


def test_distributed_optimizer_is_advisory_and_either_section_counts():
    report = findings(
        "optimizer.optimizer_cpu_offload=true", "optimizer.optimizer_offload_fraction=0.5", "optimizer.bf16=false"
    )
    (finding,) = report.by_rule("OPT-DISTRIBUTED-OPTIMIZER")
    assert finding.severity == "warning" and finding.origin == "advisory"
    assert "not enforced upstream" in finding.message
    assert not report.by_rule("OPT-HDO-FLOAT16-WRAPPER")
    assert (
        findings(
            "optimizer.optimizer_cpu_offload=true",
            "optimizer.optimizer_offload_fraction=0.5",
            "ddp.use_distributed_optimizer=true",
        ).findings
        == []
    )


def test_torch_optimizer_flag_and_non_adam_names():
    report = findings(*OPT, "optimizer.use_torch_optimizer_for_cpu_offload=true", "optimizer.optimizer=lion")
    assert {"OPT-TORCH-OPTIMIZER", "OPT-NON-ADAM"} <= set(ids(report))
    assert "'lion'" in report.by_rule("OPT-NON-ADAM")[0].message
    assert "OPT-NON-ADAM" not in ids(findings(*OPT, "optimizer.optimizer=sgd"))


def test_fraction_without_offload_is_inert_info():
    (finding,) = findings("optimizer.optimizer_offload_fraction=0.5").by_rule("OPT-FRACTION-INERT")
    assert finding.severity == "info"


def test_overlap_is_suggested_at_high_fractions():
    assert "OPT-OVERLAP" in ids(findings(*OPT, "optimizer.optimizer_offload_fraction=1.0"))
    assert "OPT-OVERLAP" not in ids(findings(*OPT))


def test_precision_aware_needs_adam_and_distributed_optimizer():
    pa = ["optimizer.use_precision_aware_optimizer=true"]
    assert findings(*pa, "optimizer.optimizer=sgd").by_rule("OPT-PRECISION-AWARE-ADAM")[0].message == (
        "--use-precision-aware-optimizer only supported with adam"
    )
    assert "OPT-PRECISION-AWARE-DO" in ids(findings(*pa))


def test_megatron_lm_rules_apply_only_to_megatron_lm_command_lines():
    bridge = findings("optimizer.optimizer_cpu_offload=true", "optimizer.optimizer_offload_fraction=1.0")
    assert "OPT-MLM-PRECISION-AWARE" not in ids(bridge)
    mlm = load(None, argv=["--optimizer-cpu-offload", "--use-distributed-optimizer"])
    report = validate(mlm.config, mlm.raw)
    assert "OPT-MLM-PRECISION-AWARE" in ids(report)


# ---------------------------------------------------------------------------------------------- docs


def test_docs_rules_md_is_up_to_date():
    assert (ROOT / "docs" / "rules.md").read_text(encoding="utf-8") == render_rules_markdown(), (
        "docs/rules.md is stale: run python -m mbridge_offload_tools.docgen"
    )


def test_docs_list_every_rule_and_target():
    text = render_rules_markdown()
    for rule in all_rules():
        assert f"## {rule.id}" in text
    for target in TARGETS.values():
        assert f"megatron-core=={target.label}" in text


def test_every_fix_validates_for_every_optimizer_type():
    """On generated configs with each optimizer type, applying any proposed fix clears its finding and adds no
    new error (the distributed optimizer is never advised for Muon)."""
    import copy

    from mbridge_offload.config.sources import apply_overrides, build_config
    from tests.support.config_gen import generate, raw_config

    checked = 0
    for case in generate(11, 120):
        for name in ("adam", "sgd", "muon"):
            raw = raw_config(case)
            raw["optimizer"]["optimizer"] = name
            report = validate(build_config(copy.deepcopy(raw)), raw)
            before = {f.rule for f in report.errors}
            for finding in report.findings:
                if not finding.fix:
                    continue
                if name == "muon":
                    assert not any("use_distributed_optimizer=true" in x for x in finding.fix), finding
                fixed_raw = apply_overrides(copy.deepcopy(raw), finding.fix)
                after = validate(build_config(copy.deepcopy(fixed_raw)), fixed_raw)
                assert {f.rule for f in after.errors} <= before, (finding.rule, finding.fix)
                assert not [f for f in after.findings if (f.rule, f.message) == (finding.rule, finding.message)]
                checked += 1
    assert checked > 200


def test_activation_mode_edits_are_both_validates_fix_and_applys_edit(tmp_path, monkeypatch):
    from mbridge_offload.actions.apply.apply import apply_offload

    text = "model:\n  num_layers: 8\n  recompute_granularity: full\n  recompute_method: uniform\n"
    text += "  recompute_num_layers: 1\n"
    path = tmp_path / "c.yaml"
    path.write_text(text)
    nulls = ["model.recompute_granularity=null", "model.recompute_method=null", "model.recompute_num_layers=null"]
    raw = {"model": {"num_layers": 8, "cpu_offloading": True, "cpu_offloading_num_layers": 2}}
    raw["model"].update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    report = validate(OffloadConfig.model_validate(raw), raw)
    assert report.by_rule("ACT-RECOMPUTE")[0].fix == nulls
    monkeypatch.chdir(tmp_path)
    result = apply_offload(str(path), "activation", num_layers=2)
    assert [o for o in result.overrides if o.startswith("model.recompute_")] == nulls
    assert result.ok, result.findings


def test_stage_order_comes_from_each_rules_declared_follows_not_from_the_file_list() -> None:
    from mbridge_offload.config.rules import catalogue
    from mbridge_offload.config.rules.activation.layer_offload import ACTIVATION_RULES

    groups = tuple(f.RULES for f in catalogue.TRANSFORMER_CONFIG_FILES)
    order = catalogue.merge_stage(ACTIVATION_RULES, groups)
    assert catalogue.merge_stage(ACTIVATION_RULES, groups[::-1]) == order
    ids = [r.id for r in order]
    assert ids.index("MC-RECOMPUTE-DISTRIBUTE-SP") == ids.index("ACT-RECOMPUTE") + 1  # declared: follows ACT-RECOMPUTE
    assert [r.id for r in ACTIVATION_RULES] == [i for i in ids if i.startswith("ACT-")]  # the backbone keeps its order


def test_a_rule_that_follows_no_check_of_its_stage_is_refused() -> None:
    import dataclasses

    from mbridge_offload.config.rules import catalogue
    from mbridge_offload.config.rules.activation import recompute

    stray = dataclasses.replace(recompute.RULES[0], follows="ACT-DOES-NOT-EXIST")
    with pytest.raises(RuntimeError, match="ACT-DOES-NOT-EXIST"):
        catalogue.merge_stage((), ((stray,),))
    with pytest.raises(RuntimeError, match="both follow"):
        catalogue.merge_stage(recompute.RULES[:1], ((stray,), (stray,)))


def test_hdo_with_16_bit_parameters_needs_the_distributed_optimizer():
    # megatron-core's HDO under Float16OptimizerWithFloat16Params: KeyError at the first step (the trace runs it:
    # tests/runtime/test_optimizer_megatron.py runs it in real megatron-core); the planner refuses the same run
    for dtype in ("optimizer.bf16=true", "optimizer.fp16=true"):
        report = findings("optimizer.optimizer_cpu_offload=true", "optimizer.optimizer_offload_fraction=0.5", dtype)
        (finding,) = report.by_rule("OPT-HDO-FLOAT16-WRAPPER")
        assert finding.severity == "error" and finding.stage == STAGE_FIRST_STEP and finding.exception == "KeyError"
        assert not report.by_rule("OPT-DISTRIBUTED-OPTIMIZER")  # the error says it; no second finding
        fixed = findings("optimizer.optimizer_cpu_offload=true", dtype, "ddp.use_distributed_optimizer=true").by_rule(
            "OPT-HDO-FLOAT16-WRAPPER"
        )
        assert fixed == []
