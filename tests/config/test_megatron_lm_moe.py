"""The Megatron-LM front end reads every MoE flag as Megatron-LM 0.19.2 passes it to megatron-core.

``core_transformer_config_from_args`` copies every argument named like a ``TransformerConfig`` field and renames a
few (``--num-experts`` becomes ``num_moe_experts``); ``validate_args`` asserts its own MoE checks first. Both are
read from the 0.19.2 source (``.mcore/0.19.2/megatron/training``) here, not restated.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mbridge_offload.config.megatron_lm.argv import RENAMED, layer_pattern, parse_argv
from mbridge_offload.config.megatron_lm.fixes import megatron_lm_fixes
from mbridge_offload.config.megatron_lm.flags import arguments, transformer_fields
from mbridge_offload.config.sources import load
from mbridge_offload.config.validate import validate

ROOT = Path(__file__).resolve().parents[2]
TRAINING = ROOT / ".mcore" / "0.19.2" / "megatron" / "training"
needs_source = pytest.mark.skipif(not TRAINING.is_dir(), reason="scripts/setup installs megatron-core 0.19.2")
BASE = "--num-layers 4 --hidden-size 64 --num-attention-heads 4 "
MOE = BASE + "--num-experts 8 --moe-router-topk 2 "


def answer(argv: str):
    """validate's answer as the CLI and MCP tool give it for a command line: fixes in flags."""
    loaded = load(argv=argv.split())
    return megatron_lm_fixes(validate(loaded.config, loaded.raw, target="megatron-core==0.19.2"))


def test_num_experts_with_expert_parallelism_is_a_moe_model_not_experts_missing():
    argv = MOE + "--expert-model-parallel-size 2 --disable-bias-linear"
    rep = answer(argv)
    assert rep.ok, [(f.rule, f.message) for f in rep.errors]
    assert load(argv=argv.split()).config.model.num_moe_experts == 8


def test_every_argument_named_like_a_transformer_config_field_reaches_the_model_section():
    missed = []
    for options, dest, kind, _nargs, _const, _default, type_name, choices in arguments():
        # --num-query-groups counts only with --group-query-attention (core_transformer_config_from_args).
        if dest not in transformer_fields() or kind not in ("store", "store_true") or dest == "num_query_groups":
            continue
        value = (
            []
            if kind == "store_true"
            else [str(choices[0]) if choices else {"int": "2", "float": "0.5"}.get(type_name or "", "x")]
        )
        try:
            raw = parse_argv([options[0], *value])
        except ValueError:
            continue  # a value this generic probe cannot spell (a nargs or custom type); the parser says so
        if dest not in raw.get("model", {}):
            missed.append(options[0])
    assert not missed, missed


@needs_source
def test_the_renamed_arguments_are_core_transformer_config_from_args_renames():
    text = (TRAINING / "argument_utils.py").read_text(encoding="utf-8")
    dests = {row[1] for row in arguments()}
    # Unconditional top-level renames: `    kw_args['<field>'] = args.<dest>`; --seed only seeds inference sampling.
    renames = {
        arg: field
        for field, arg in re.findall(r"^    kw_args\['(\w+)'\]\s*=\s*args\.(\w+)\s*$", text, flags=re.M)
        if field != arg and arg in dests and arg != "seed"
    }
    assert renames == RENAMED


@needs_source
def test_the_moe_assertions_are_validate_args_own_text():
    text = (TRAINING / "arguments.py").read_text(encoding="utf-8")
    for rule_message in (
        "num_experts must be non None to use expert model parallelism",
        "Number of experts should be a multiple of expert model parallel_size.",
        "MoE latent projection dimension has to be greater than zero.",
        "MoE latent projections are applicable only for MoE models.",
    ):
        assert f'"{rule_message}"' in text


def test_expert_parallelism_without_experts_gets_megatron_lms_message_first():
    rep = answer(BASE + "--expert-model-parallel-size 2")
    assert rep.errors[0].rule == "CFG-MLM-EP-WITHOUT-EXPERTS"
    assert rep.errors[0].message == "num_experts must be non None to use expert model parallelism"
    assert rep.errors[0].fix == ["--expert-model-parallel-size 1"]


def test_zero_experts_is_no_moe_as_validate_args_makes_it():
    rep = answer(BASE + "--num-experts 0 --expert-model-parallel-size 2")
    assert rep.errors[0].rule == "CFG-MLM-EP-WITHOUT-EXPERTS"


def test_experts_that_do_not_divide_over_expert_parallelism_are_refused():
    rep = answer(BASE + "--num-experts 6 --expert-model-parallel-size 4 --disable-bias-linear")
    assert [f.rule for f in rep.errors] == ["CFG-MLM-EP-EXPERTS-DIVISIBLE"]


def test_moe_latent_size_needs_experts():
    rep = answer(BASE + "--moe-latent-size 16")
    assert rep.errors[0].message == "MoE latent projections are applicable only for MoE models."


def test_a_moe_flag_in_a_fix_is_written_as_its_flag():
    # A rule that concerns offloading's neighbour, recompute (megatron-core's own MoE checks come from the upstream
    # run, whose findings carry no fix): its fix names the MoE flag as a flag to delete.
    rep = answer(
        MOE + "--moe-shared-expert-intermediate-size 64 --moe-shared-expert-overlap "
        "--recompute-granularity selective --recompute-modules shared_experts"
    )
    (finding,) = rep.by_rule("MC-RECOMPUTE-SHARED-EXPERTS-OVERLAP")
    assert finding.fix_remove == ["--moe-shared-expert-overlap"] and finding.fix == []


def test_moe_ffn_hidden_size_defaults_to_ffn_hidden_size():
    raw = parse_argv((MOE + "--ffn-hidden-size 256").split())
    assert raw["model"]["moe_ffn_hidden_size"] == 256


def test_single_element_router_lists_become_scalars():
    raw = parse_argv((MOE + "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 0.01").split())
    assert raw["model"]["moe_router_load_balancing_type"] == "seq_aux_loss"
    assert raw["model"]["moe_aux_loss_coeff"] == 0.01


@pytest.mark.parametrize(
    ("text", "value"), [("2", 2), ("([0]+[1]*3)", [0, 1, 1, 1]), ("([1]*2+[0])*2", [1, 1, 0, 1, 1, 0])]
)
def test_moe_layer_freq_is_read_as_moe_freq_type_reads_it(text, value):
    assert parse_argv([*MOE.split(), "--moe-layer-freq", text])["model"]["moe_layer_freq"] == value


def test_a_layer_pattern_is_never_evaluated_as_code():
    with pytest.raises(ValueError):
        layer_pattern("__import__('os')")
