"""One declaration of the planner's inputs: bounds, derived CLI flags and MCP parameters, one resolution path."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import anyio
import pytest

from mbridge_offload.config import sources
from mbridge_offload.config.errors import BoundsError as InputError
from mbridge_offload.plan.inputs.fields import FIELDS, PlanInputs, flag_name
from mbridge_offload.plan.inputs.resolve import resolve, validate_inputs
from mbridge_offload.plan.search import planner as plan
from mbridge_offload_tools.cli import main as cli
from mbridge_offload_tools.cli import plan as cli_plan

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "qwen3_30b_a3b_pretrain.yaml"

BAD = [
    ({"num_layers": 10**12}, "num_layers", "less than or equal to 1024"),
    ({"num_layers": -4}, "num_layers", "greater than or equal to 1"),
    ({"hidden_size": math.nan}, "hidden_size", ""),
    ({"link_gbps": math.inf}, "link_gbps", "finite"),
    ({"link_gbps": math.nan}, "link_gbps", "finite"),
    ({"num_attention_heads": 0}, "num_attention_heads", "greater than or equal to 1"),
    ({"link_gbps": 0}, "link_gbps", "greater than 0"),
    ({"host_bw_gbps": 0.0}, "host_bw_gbps", "greater than 0"),
    ({"optimizer_offload_fraction": 1.5}, "optimizer_offload_fraction", "less than or equal to 1"),
    ({"margin": 1.0}, "margin", "less than 1"),
    ({"tp": 0}, "tp", "greater than or equal to 1"),
    ({"baseline_step_s": -1.0}, "baseline_step_s", "greater than 0"),
]


@pytest.mark.parametrize(("bad", "name", "bound"), BAD)
def test_every_bound_is_refused_with_the_bound_in_the_message(bad, name, bound):
    with pytest.raises(InputError) as err:
        resolve({"model": "qwen3-30b-a3b", **bad})
    text = str(err.value)
    assert flag_name(name) in text and bound in text


def test_every_numeric_input_has_an_upper_and_a_lower_bound():
    for name, info in PlanInputs.model_fields.items():
        kinds = [a for a in getattr(info.annotation, "__args__", (info.annotation,)) if a is not type(None)]
        if kinds and kinds[0] in (int, float):
            signs = {
                attr for m in info.metadata for attr in ("ge", "gt", "le", "lt") if getattr(m, attr, None) is not None
            }
            assert signs & {"ge", "gt"} and signs & {"le", "lt"}, name


def test_bounds_apply_to_config_values_too(tmp_path):
    cfg = tmp_path / "huge.yaml"
    cfg.write_text(
        "model:\n  num_layers: 1000000000000\n  hidden_size: 1024\n  num_attention_heads: 8\n  vocab_size: 1000\n"
    )
    loaded = sources.load(str(cfg))
    with pytest.raises(InputError, match=r"num_layers = 1000000000000 \(config\)"):
        resolve({}, loaded.config, loaded.raw)


@pytest.mark.parametrize(("bad", "name", "bound"), [b for b in BAD if b[0] != {"hidden_size": math.nan}])
def test_cli_refuses_them_with_exit_2_and_one_json_error(capsys, bad, name, bound):
    ((key, value),) = bad.items()
    with pytest.raises(SystemExit) as stop:
        cli.main(["estimate", "--model", "qwen3-30b-a3b", f"{flag_name(key)}={value}", "--json"])
    error = json.loads(capsys.readouterr().out)
    assert stop.value.code == 2 and error["ok"] is False and bound in error["error"]


def test_cli_flags_and_mcp_parameters_are_derived_from_the_one_model():
    parser = argparse.ArgumentParser()
    cli_plan.add_parsers(parser.add_subparsers())
    sub = parser._subparsers._group_actions[0].choices
    for command in ("estimate", "recommend"):
        dests = {a.dest for a in sub[command]._actions}
        assert set(FIELDS) <= dests, set(FIELDS) - dests

    from mcp import Client

    from mbridge_offload_tools.server.app import mcp

    async def schemas():
        async with Client(mcp, raise_exceptions=True) as c:
            return {t.name: t.input_schema for t in (await c.list_tools()).tools}

    tools = anyio.run(schemas)
    for name in ("estimate_memory", "recommend_mode"):
        props = tools[name]["properties"]
        assert set(FIELDS) <= set(props)
        assert props["num_layers"]["anyOf"][0]["maximum"] == 1024  # the bound travels with the parameter
        assert props["optimizer_offload_fraction"]["anyOf"][0]["maximum"] == 1.0


def _answer(r) -> dict:
    est = plan.estimate(r).model_dump(exclude={"assumptions", "model"})
    rec = plan.recommend(r).model_dump(exclude={"assumptions"})
    return {"estimate": est, "recommend": rec}


def test_same_effective_settings_same_answer_whichever_way_they_came_in(tmp_path):
    by_preset = _answer(resolve({"model": "qwen3-30b-a3b", "optimizer_offload_fraction": 0.5}))
    # The example YAML is the card's 50 % run; the launcher (not the YAML) gives the GPU count.
    loaded = sources.load(str(EXAMPLE))
    by_config = _answer(resolve({"num_gpus": 16}, loaded.config, loaded.raw))
    flags = {
        "num_layers": 48, "hidden_size": 2048, "ffn_hidden_size": 6144, "num_attention_heads": 32,
        "num_query_groups": 4, "kv_channels": 128, "vocab_size": 151936, "num_moe_experts": 128,
        "moe_ffn_hidden_size": 768, "moe_router_topk": 8, "num_gpus": 16, "tp": 2, "pp": 2, "ep": 4, "etp": 1,
        "seq_length": 4096, "global_batch_size": 8, "recompute_granularity": "full", "recompute_method": "uniform",
        "recompute_num_layers": 1, "optimizer_offload_fraction": 0.5,
    }  # fmt: skip
    # Sizes given one by one: the non-size facts (QK-norm, untied, SwiGLU, no bias) come from a config section.
    arch = sources.load(
        "model:\n  qk_layernorm: true\n  share_embeddings_and_output_weights: false\n"
        "  gated_linear_unit: true\n  add_bias_linear: false\n"
    )
    by_flags = _answer(resolve(flags, arch.config, arch.raw))
    argv = [
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--expert-model-parallel-size",
        "4",
        "--expert-tensor-parallel-size",
        "1",
        "--sequence-parallel",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
        "--bf16",
        "--use-distributed-optimizer",
        "--optimizer-cpu-offload",
        "--optimizer-offload-fraction",
        "0.5",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "8",
        "--seq-length",
        "4096",
        # Megatron-LM ties the output layer to the embedding unless told (its builder: not --untie-...); Qwen3-30B-A3B
        # is untied, so its command line says so (the preset's value no longer stands in for the command line's).
        "--untie-embeddings-and-output-weights",
        # Bridge's recipes collect garbage before training (train.manual_gc=True), which frees megatron-core's first
        # HybridDeviceOptimizer; Megatron-LM does so only with this flag.
        "--manual-gc",
    ]
    mlm = sources.load(argv=argv)
    by_argv = _answer(resolve({"model": "qwen3-30b-a3b", "num_gpus": 16}, mlm.config, mlm.raw))
    for other in (by_config, by_flags, by_argv):
        assert other["estimate"] == by_preset["estimate"]
        assert other["recommend"]["mode"] == by_preset["recommend"]["mode"] == "none"
        assert other["recommend"]["memory_gib"] == by_preset["recommend"]["memory_gib"]


def test_answers_list_assumptions_with_their_sources(capsys):
    loaded = sources.load(str(EXAMPLE))
    r = resolve({"num_gpus": 16, "gpu": "h100-80gb"}, loaded.config, loaded.raw)
    where = {a.name: a.source for a in plan.estimate(r).assumptions}
    assert where["recompute_granularity"] == "config" and where["num_gpus"] == "flag"
    assert where["cp"] == "default" and where["cpu_adam_params_per_s_per_core"] == "preset"
    by_preset = {a.name: a.source for a in plan.recommend(resolve({"model": "qwen3-30b-a3b"})).assumptions}
    assert by_preset["recompute_granularity"] == "preset" and by_preset["etp"] == "preset"
    # The human output prints them too.
    parser = argparse.ArgumentParser()
    cli_plan.add_parsers(parser.add_subparsers())
    args = parser.parse_args(["recommend", "--model", "qwen3-30b-a3b"])
    args.handler(args)
    out = capsys.readouterr().out
    assert "assumptions (value, source):" in out and "recompute_granularity = full (preset)" in out
    assert "GiB" in out and "unit:" in out


def test_partial_config_takes_missing_sizes_from_a_preset_or_names_them():
    loaded = sources.load("model:\n  tensor_model_parallel_size: 2\n  seq_length: 8192\n")
    r = resolve({"model": "llama3-8b"}, loaded.config, loaded.raw)
    assert r.model.num_layers == 32 and r.setup.tp == 2 and r.setup.seq_length == 8192
    with pytest.raises(InputError, match="model sizes missing: hidden_size, num_attention_heads, vocab_size"):
        resolve({}, sources.load("model:\n  num_layers: 4\n").config, {"model": {"num_layers": 4}})


def test_json_of_the_results_is_the_pydantic_dump(capsys):
    parser = argparse.ArgumentParser()
    cli_plan.add_parsers(parser.add_subparsers())
    args = parser.parse_args(["estimate", "--model", "qwen3-30b-a3b", "--json"])
    args.handler(args)
    data = json.loads(capsys.readouterr().out)
    assert data == plan.estimate(resolve({"model": "qwen3-30b-a3b"})).model_dump(mode="json")
    assert data["unit"].startswith("memory_gb: decimal GB") and "memory_gib" in data


def test_validate_inputs_rejects_unknown_names():
    with pytest.raises(InputError, match="extra"):
        validate_inputs({"tensor_parallel": 2})


def test_the_largest_accepted_inputs_answer_quickly_and_larger_work_is_refused():
    import time

    dense = {"num_layers": 1024, "hidden_size": 16384, "num_attention_heads": 128, "vocab_size": 256000}
    start = time.perf_counter()
    plan.recommend(resolve({**dense, "num_gpus": 8}))
    moe = {**dense, "num_layers": 128, "num_moe_experts": 256, "moe_ffn_hidden_size": 2048, "moe_router_topk": 8}
    plan.recommend(resolve({**moe, "num_gpus": 8}))
    assert time.perf_counter() - start < 30  # generous on a shared CI core; about 7 s on 2 idle cores (36 s at load 5)
    with pytest.raises(InputError, match="at most 32768"):
        resolve({**moe, "num_layers": 1024, "num_moe_experts": 1024})


def test_a_moe_without_moe_ffn_hidden_size_takes_the_ffn_width_as_megatron_core():
    # TransformerConfig.__post_init__: num_moe_experts set and moe_ffn_hidden_size None -> ffn_hidden_size.
    # Before, the estimator multiplied by None (TypeError: an internal error for a valid input).
    moe = {"num_layers": 4, "hidden_size": 512, "num_attention_heads": 8, "vocab_size": 32000, "num_moe_experts": 8}
    implicit = plan.estimate(resolve(moe))
    explicit = plan.estimate(resolve({**moe, "moe_ffn_hidden_size": 4 * 512}))  # the default ffn_hidden_size
    assert implicit.model_dump(exclude={"assumptions"}) == explicit.model_dump(exclude={"assumptions"})


def test_an_out_of_bounds_input_is_one_of_the_bad_input_family():
    from mbridge_offload.config import errors
    from mbridge_offload_tools.cli.common import EXIT_BAD_INPUT, error_payload

    with pytest.raises(errors.InputError) as err:
        validate_inputs({"tp": 0})
    payload, code = error_payload(err.value)
    assert code == EXIT_BAD_INPUT and payload["kind"] == "bad_input" and payload["error"].startswith("--tp = 0")


def test_each_input_declares_its_config_key_and_fallback_once_and_every_tool_shows_the_key():
    # One declaration per input (fields.PlanInputs): its key and fallback live on the field, so resolve's tables,
    # the CLI's --help and the MCP parameter descriptions are views of it and cannot name another key.
    from mbridge_offload.config.schema import SECTIONS
    from mbridge_offload.plan.inputs import resolve
    from mbridge_offload.plan.inputs.fields import CONFIG_KEYS, EFFECTIVE_KEYS, config_key, fallbacks
    from mbridge_offload_tools.interface.tools import plan_param

    assert resolve.CONFIG_KEYS is CONFIG_KEYS and fallbacks() == resolve.DEFAULTS
    assert not set(CONFIG_KEYS) & set(EFFECTIVE_KEYS)
    for name in FIELDS:
        key = config_key(name)
        if key is None:
            continue
        assert key.partition(".")[0] in SECTIONS, (name, key)  # a section the config reader knows
        assert key in plan_param(name).description, name
    assert len(set(CONFIG_KEYS.values())) == len(CONFIG_KEYS)  # one name per setting: no key read by two inputs
    for name, (value, why) in {**fallbacks(), **fallbacks("fine_grained"), **fallbacks("loss_fusion")}.items():
        PlanInputs.model_validate({name: value})  # a fallback is a value the input itself accepts
        assert why, name


# Every input Setup carries, with a non-default value (and what it needs beside it) and what Setup then holds.
_CARRIED = {
    "num_gpus": ({"num_gpus": 16}, 16),
    "tp": ({"tp": 2}, 2),
    "pp": ({"pp": 2}, 2),
    "vpp": ({"pp": 2, "vpp": 2, "global_batch_size": 256}, 2),
    "cp": ({"cp": 2}, 2),
    "ep": ({"ep": 2}, 2),
    "etp": ({"etp": 2}, 2),
    "sequence_parallel": ({"tp": 2, "sequence_parallel": False}, False),
    "seq_length": ({"seq_length": 2048}, 2048),
    "micro_batch_size": ({"micro_batch_size": 2}, 2),
    "global_batch_size": ({"global_batch_size": 64}, 64),
    "params_dtype": ({"params_dtype": "fp16"}, "fp16"),
    "grad_reduce_in_fp32": ({"grad_reduce_in_fp32": False}, False),
    "distributed_optimizer": ({"distributed_optimizer": False}, False),
    "precision_aware_optimizer": ({"precision_aware_optimizer": True}, True),
    "main_params_dtype": ({"main_params_dtype": "bf16"}, "bf16"),
    "exp_avg_dtype": ({"exp_avg_dtype": "bf16"}, "bf16"),
    "exp_avg_sq_dtype": ({"exp_avg_sq_dtype": "bf16"}, "bf16"),
    "recompute_granularity": ({"recompute_granularity": "selective"}, "selective"),
    "recompute_method": (
        {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2},
        "block",
    ),
    "recompute_num_layers": (
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
        2,
    ),
    "recompute_modules": ({"recompute_granularity": "selective", "recompute_modules": ["mlp"]}, ("mlp",)),
    "optimizer_offload_fraction": ({"optimizer_offload_fraction": 0.5}, 0.5),
    "activation_offload_layers": ({"activation_offload_layers": 2}, 2),
    "hybrid_optimizer": ({"hybrid_optimizer": "ours"}, "ours"),
    "offload_modules": ({"offload_modules": ["core_attn"]}, ("core_attn",)),
    "min_offloaded_tensor_size": ({"offload_modules": ["core_attn"], "min_offloaded_tensor_size": 4096}, 4096),
    "activation_offload_fraction": ({"offload_modules": ["core_attn"], "activation_offload_fraction": 0.5}, 0.5),
    "use_megatron_fsdp": ({"use_megatron_fsdp": True}, True),
    "fsdp_sharding_strategy": (
        {"use_megatron_fsdp": True, "fsdp_sharding_strategy": "optim_grads_params"},
        "optim_grads_params",
    ),
    "fsdp_main_grads_dtype": ({"use_megatron_fsdp": True, "fsdp_main_grads_dtype": "fp32"}, "fp32"),
    "fp8_recipe": ({"fp8_recipe": "tensorwise"}, "tensorwise"),
    "fp8_param": ({"fp8_recipe": "tensorwise", "fp8_param": True}, True),
    "num_layers_in_first_pipeline_stage": ({"pp": 2, "num_layers_in_first_pipeline_stage": 20}, 20),
    "num_layers_in_last_pipeline_stage": ({"pp": 2, "num_layers_in_last_pipeline_stage": 20}, 20),
    "pipeline_layout": ({"pp": 2, "pipeline_layout": "Et*24|t*24L"}, (24, 24)),
    "cross_entropy_loss_fusion": ({"cross_entropy_loss_fusion": True}, True),
    "cross_entropy_fusion_impl": ({"cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "te"}, "te"),
    "te_version": ({"te_version": "2.14.0"}, "2.14.0"),
    "overlap_grad_reduce": ({"overlap_grad_reduce": False}, False),
    "overlap_param_gather": ({"overlap_param_gather": False}, False),
    "tp_comm_overlap": ({"tp_comm_overlap": True}, True),
    "cuda_graph_impl": ({"cuda_graph_impl": "local"}, "local"),
}
# The inputs that build something else than Setup: the model, the GPU, the constraints, the time model's rates, the
# decision, the evidence. A new input lands here or in _CARRIED (and on Setup), never nowhere.
_ELSEWHERE = {
    "model", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "vocab_size", "num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk", "share_embeddings_and_output_weights",
    "fine_grained_activation_offloading", "moe_paged_stash", "overlap", "gpu", "gpu_memory_gb", "host_ram_gb",
    "gpus_per_node", "link_gbps", "host_bw_gbps", "cpu_cores", "cpu_threads", "cpu_adam_params_per_s",
    "baseline_step_s", "mfu", "host_profile", "calibration", "margin", "headroom_gib", "levers", "measured_peak_gib",
    "measured_step_s", "measured_log", "ooms", "measured_settings",
}  # fmt: skip


def test_every_input_reaches_setup_or_is_read_elsewhere():
    from mbridge_offload.plan.inputs.resolve import SETUP_INPUTS

    assert set(SETUP_INPUTS) == set(_CARRIED)
    assert set(FIELDS) - set(SETUP_INPUTS) == _ELSEWHERE


@pytest.mark.parametrize("name", sorted(_CARRIED))
def test_each_input_setup_carries_arrives_there_with_its_value(name):
    from mbridge_offload.plan.model.run import Setup

    flags, expected = _CARRIED[name]
    assert getattr(Setup(), name) != expected  # a value Setup's default could not pass off as carried
    assert getattr(resolve({"model": "qwen3-30b-a3b", **flags}).setup, name) == expected


def test_setups_defaults_are_the_declared_fallbacks():
    from mbridge_offload.plan.inputs.fields import fallbacks
    from mbridge_offload.plan.inputs.resolve import SETUP_INPUTS
    from mbridge_offload.plan.model.run import Setup

    declared = {**fallbacks(), **fallbacks("fine_grained"), **fallbacks("loss_fusion")}
    for name in set(SETUP_INPUTS) & set(declared):
        value = declared[name][0]
        assert getattr(Setup(), name) == (None if value == "none" and name != "cuda_graph_impl" else value), name


# --tp on its way from the command line to the planner's Setup, module by module (each one a function of which
# receives it: in the parsed flags, a dict of inputs or a PlanInputs): the parser's bounds, the command's deadline,
# the CLI command, the planner's service (the body the MCP tool shares, then the one entry point), the one
# resolution (which builds Setup, declared in plan/model/run.py). A module added on the way fails here.
TP_PATH = [
    "tools/mbridge_offload_tools/interface/build.py",
    "tools/mbridge_offload_tools/cli/main.py",
    "tools/mbridge_offload_tools/cli/plan.py",
    "offload/mbridge_offload/plan/service.py",
    "offload/mbridge_offload/plan/inputs/resolve.py",
]


def test_tp_reaches_setup_through_the_modules_listed(capsys):
    import sys
    from argparse import Namespace

    from mbridge_offload.plan.inputs import resolve as resolve_module

    def holds(value: object) -> bool:
        if isinstance(value, dict):
            return value.get("tp") == 4
        return isinstance(value, Namespace | PlanInputs) and getattr(value, "tp", None) == 4

    path: list[str] = []
    built: list[object] = []

    def watch(frame, event, arg):
        if built:
            return
        if event == "return" and frame.f_code is resolve_module._setup.__code__:
            built.append(arg)
            return
        where = Path(frame.f_code.co_filename)
        if event != "call" or ROOT not in where.parents or where.relative_to(ROOT).parts[0] not in ("offload", "tools"):
            return
        args = [frame.f_locals.get(n) for n in frame.f_code.co_varnames[: frame.f_code.co_argcount]]
        if any(holds(a) for a in args) or frame.f_locals.get("tp") == 4:
            name = where.relative_to(ROOT).as_posix()
            if name not in path:
                path.append(name)

    sys.setprofile(watch)
    try:
        with pytest.raises(SystemExit):
            cli.main(["estimate", "--model", "llama3-8b", "--tp", "4", "--num-gpus", "16", "--json"])
    finally:
        sys.setprofile(None)
    assert getattr(built[0], "tp", None) == 4 and type(built[0]).__module__ == "mbridge_offload.plan.model.run"
    assert path == TP_PATH
    assert json.loads(capsys.readouterr().out)["parallel"]["tp"] == 4


@pytest.mark.parametrize(
    ("given", "release"),
    [("2.17", (2, 17)), ("2.18.0", (2, 18)), ("2.9.0+cu12", (2, 9)), ("v2.13", (2, 13)), ("3", (3, 0))],
)
def test_te_version_takes_validates_spellings_and_reads_the_release(given, release):
    assert resolve({"model": "qwen3-8b", "te_version": given}).setup.te_release() == release


def test_te_version_refuses_what_validate_refuses_with_its_message():
    with pytest.raises(InputError, match="not a Transformer Engine release"):
        resolve({"model": "qwen3-8b", "te_version": "latest"})
