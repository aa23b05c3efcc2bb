"""Upstream's refusals that validate used to miss, and the ones it made that upstream does not.

Each case states the releases' own behaviour, read from their source (megatron-core 0.16.1 in the venv, 0.19.2 in
``.mcore/0.19.2``; Megatron Bridge 0.3.1 / 0.6.2); the differential test (tests/config/test_differential.py) runs the
megatron-core ones against the real dataclasses too.
"""

from __future__ import annotations

import pytest

from mbridge_offload.config.sources import load
from mbridge_offload.config.validate import validate

NEW, OLD = "megatron-core==0.19.2", "megatron-core==0.16.1"


def report(*overrides: str, target: str = NEW):
    loaded = load(None, ["model.num_layers=4", *overrides])
    return validate(loaded.config, loaded.raw, target=target)


def errors(rep) -> list[tuple[str, str]]:
    return [(f.rule, f.message) for f in rep.errors]


def upstream(*overrides: str, target: str = NEW):
    """validate as it answers by default: the catalogue with megatron-core's own run (checks no rule restates; its
    TransformerConfig needs the sizes, hence hidden_size and num_attention_heads)."""
    from mbridge_offload_tools.interface.calls import validate_answer
    from mbridge_offload_tools.interface.tools import TOOLS

    v = {p.name: p.default for p in TOOLS["validate_config"].params}
    config = "model:\n  num_layers: 4\n  hidden_size: 64\n  num_attention_heads: 4\n"
    return validate_answer({**v, "config": config, "overrides": list(overrides), "target": target, "exact": True})


def upstream_errors(rep) -> list[str]:
    """The errors' messages, megatron-core's own (rule MCORE-EXACT) where no rule of ours says the same."""
    return [f.message for f in rep.errors]


# ---------------------------------------------------------------------------------------------- CUDA-graph scope


@pytest.mark.megatron
def test_full_iteration_scope_beside_te_graphs_is_refused_with_0_19s_message():
    rep = upstream("+model.cuda_graph_scope=full_iteration", "model.cuda_graph_impl=transformer_engine")
    assert upstream_errors(rep) == [
        "cuda_graph_modules='full_iteration' cannot be combined with cuda_graph_impl='transformer_engine'."
    ]


@pytest.mark.megatron
def test_full_iteration_scope_beside_te_graphs_is_refused_with_0_16s_message():
    rep = upstream("+model.cuda_graph_scope=full_iteration", "model.external_cuda_graph=true", target=OLD)
    assert upstream_errors(rep) == [
        "To use full iteration cuda graph, please use cuda_graph_impl=local instead of "
        "cuda_graph_impl=transformer_engine."
    ]


@pytest.mark.megatron
@pytest.mark.parametrize("target", [NEW, OLD])
def test_full_iteration_scope_with_the_local_graphs_is_accepted(target):
    assert upstream("+model.cuda_graph_scope=full_iteration", "model.cuda_graph_impl=local", target=target).ok


# ---------------------------------------------------------------------------------------------- recompute type


@pytest.mark.megatron
@pytest.mark.parametrize("value", ["true", "false", "1"])
def test_recompute_granularity_that_is_no_string_is_refused_as_written(value):
    rep = upstream(f"model.recompute_granularity={value}")
    shown = {"true": "True", "false": "False", "1": "1"}[value]
    assert upstream_errors(rep) == [f'When using recompute_granuarlity: {shown} must be "full"or "selective".']


def test_recompute_granularity_true_with_layer_offload_gets_the_offload_check_first():
    rep = report("model.cpu_offloading=true", "model.cpu_offloading_num_layers=1", "model.recompute_granularity=true")
    assert rep.errors[0].rule == "ACT-RECOMPUTE"
    assert rep.errors[0].fix == ["model.recompute_granularity=null"]


# ---------------------------------------------------------------------------------------------- optimizer fraction


def test_a_null_offload_fraction_without_offload_is_accepted_as_the_dataclass_does():
    assert report("optimizer.optimizer_offload_fraction=null").ok


def test_a_null_offload_fraction_with_offload_gets_the_optimizers_type_error():
    rep = report("optimizer.optimizer_cpu_offload=true", "optimizer.optimizer_offload_fraction=null")
    assert errors(rep) == [("MC-OPT-FRACTION-TYPE", "unsupported operand type(s) for *: 'int' and 'NoneType'")]


# ---------------------------------------------------------------------------------------------- Bridge's finalize

_PROVIDER = "+model._target_=megatron.bridge.models.gpt_provider.GPTModelProvider"


def test_sp_without_tp_behind_a_bridge_target_follows_bridge_0_6_and_says_so():
    rep = report(_PROVIDER, "model.sequence_parallel=true")
    assert rep.ok
    (note,) = rep.by_rule("CFG-BRIDGE-FINALIZE")
    assert "megatron-bridge 0.6.x, paired with megatron-core 0.19.2" in note.message
    assert "megatron-core alone, and Bridge 0.3.x (megatron-core 0.16), refuse it" in note.message


@pytest.mark.megatron
def test_sp_without_tp_behind_a_bridge_target_is_refused_on_0_16_as_bridge_0_3_does():
    rep = upstream(_PROVIDER, "model.sequence_parallel=true", target=OLD)
    assert upstream_errors(rep) == ["Cannot use sequence parallelism without tensor parallelism"]


@pytest.mark.megatron
def test_sp_without_tp_in_a_plain_megatron_core_config_is_refused_on_0_19():
    rep = upstream("model.sequence_parallel=true")
    assert upstream_errors(rep) == ["Cannot use sequence parallelism without tensor parallelism"]


# ---------------------------------------------------------------------------------------------- ConfigContainer


def test_a_distributed_optimizer_mismatch_is_bridges_warning_not_a_refusal():
    rep = report(_PROVIDER, "ddp.use_distributed_optimizer=true", "optimizer.use_distributed_optimizer=false")
    (finding,) = rep.by_rule("CFG-BRIDGE-DIST-OPT-SYNC")
    assert rep.ok and finding.severity == "warning"
    assert finding.message.startswith("Distributed optimizer settings were not in sync: ddp.use_distributed_optimizer")


def test_container_checks_leave_a_plain_megatron_core_config_alone():
    rep = report("ddp.use_distributed_optimizer=true", "+model.seq_length=2048", "+dataset.seq_length=4096")
    assert not [f for f in rep.findings if f.rule.startswith("CFG-BRIDGE-")]


@pytest.mark.parametrize(
    ("target", "graph"),
    [
        (NEW, ["model.cuda_graph_impl=full_iteration"]),
        (OLD, ["model.cuda_graph_impl=local", "+model.cuda_graph_scope=full_iteration"]),
    ],
)
def test_the_full_iteration_graph_needs_the_nan_check_off_in_a_bridge_container(target, graph):
    rep = report(_PROVIDER, *graph, target=target)
    assert [f.rule for f in rep.errors] == ["CFG-BRIDGE-FULL-ITERATION-NAN-CHECK"]
    assert report(_PROVIDER, *graph, "+rerun_state_machine.check_for_nan_in_loss=false", target=target).ok


def test_context_parallelism_needs_a_sequence_of_twice_its_size():
    assert report(_PROVIDER, "model.context_parallel_size=2", "+model.seq_length=4098").errors[0].message == (
        "Sequence length must be divisible by 2 * context parallel size if context parallel is used."
    )
    assert report(_PROVIDER, "model.context_parallel_size=2", "+model.seq_length=4096").ok


def test_mxfp8_parameter_gather_needs_the_buffer_reuse_on_bridge_0_6_only():
    recipe = {"bf16": True, "fp8": "e4m3", "fp8_recipe": "mxfp8", "fp8_param_gather": True}
    sets = [f"+mixed_precision.{k}={str(v).lower()}" for k, v in recipe.items()]
    assert report(_PROVIDER, *sets).errors[0].rule == "CFG-BRIDGE-MXFP8-REUSE-GRAD-BUF"
    assert not report(_PROVIDER, *sets, target=OLD).by_rule("CFG-BRIDGE-MXFP8-REUSE-GRAD-BUF")


def test_precision_aware_optimizer_needs_the_models_precision_in_the_optimizer():
    dist = ["optimizer.use_distributed_optimizer=true", "ddp.use_distributed_optimizer=true"]
    rep = report(_PROVIDER, "model.bf16=true", "optimizer.use_precision_aware_optimizer=true", *dist)
    assert [f.fix for f in rep.errors] == [["optimizer.bf16=true"]]
