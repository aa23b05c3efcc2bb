"""Megatron-FSDP, FP8 saved activations, uneven pipeline stages and the recipe-config path of the planner."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest

from mbridge_offload.config import sources
from mbridge_offload.config.errors import InputError
from mbridge_offload.plan.inputs.presets import model_preset
from mbridge_offload.plan.memory.activations import layer_activations, layer_components
from mbridge_offload.plan.memory.fsdp import STRATEGIES
from mbridge_offload.plan.memory.stage import estimate_memory
from mbridge_offload.plan.model.architecture import GiB
from mbridge_offload.plan.model.layout import decoder_counts, mtp_layers
from mbridge_offload.plan.model.params import stage_layers, total_params
from mbridge_offload.plan.model.run import Setup
from mbridge_offload.plan.service import estimate_for_inputs, recommend_for_inputs
from mbridge_offload_tools.cli import plan as cli_plan

LLAMA70 = model_preset("llama3-70b")
# Bridge 0.6.2 llama3_70b_pretrain_64gpu_gb200_bf16_config: TP1 PP1, MBS 1, seq 8192, bf16 grads, FSDP ZeRO-3.
FSDP = Setup(
    num_gpus=64,
    seq_length=8192,
    grad_reduce_in_fp32=False,
    use_megatron_fsdp=True,
    fsdp_sharding_strategy="optim_grads_params",
)
LAYER_NUMEL = 8192 * (8192 + 2 * 1024) + 8192 * 8192 + 3 * 8192 * 28672 + 2 * 8192  # qkv, proj, fc1+fc2, norms


def test_fully_sharded_weights_are_the_shard_plus_two_unsharded_layers_and_the_output_layer():
    w = estimate_memory(LLAMA70, FSDP).worst
    shard = w.params / 64 * 2
    unsharded = 2 * LAYER_NUMEL * 2 + 128256 * 8192 * 2  # two layers (the double buffer) + output layer
    assert w.weights == pytest.approx(shard + unsharded, rel=0.01)
    assert w.weights / GiB < 10  # not the 131 GiB of an unsharded model
    # early in the backward: two layers' unsharded gradients and the output layer's (bf16: the shapes of the weights)
    assert w.gradients == pytest.approx(shard + 2 * LAYER_NUMEL * 2 + 128256 * 8192 * 2, rel=0.01)
    assert w.optimizer == pytest.approx(w.params / 64 * (4 + 8), rel=0.01)  # fp32 main shard + Adam moments


def test_sharding_strategies_shard_more_state_in_order():
    totals = [estimate_memory(LLAMA70, replace(FSDP, fsdp_sharding_strategy=strategy)).worst for strategy in STRATEGIES]
    no_shard, optim, optim_grads, full = totals
    assert no_shard.optimizer > optim.optimizer == optim_grads.optimizer == full.optimizer
    assert optim.gradients > optim_grads.gradients
    assert optim_grads.weights > full.weights
    assert no_shard.weights == no_shard.params * 2


def test_experts_shard_over_expert_data_parallel_and_dense_over_dp_cp():
    m = model_preset("qwen3-30b-a3b")
    s = Setup(num_gpus=64, ep=8, etp=1, use_megatron_fsdp=True, fsdp_sharding_strategy="optim_grads_params")
    dense_only = estimate_memory(m, replace(s, ep=1)).worst.optimizer
    assert estimate_memory(m, s).worst.optimizer == pytest.approx(dense_only, rel=0.05)
    assert total_params(m) > 30e9


def test_fsdp_grad_dtype_follows_megatron_fsdp_main_grads_dtype_not_grad_reduce_in_fp32():
    bf16 = estimate_memory(LLAMA70, replace(FSDP, grad_reduce_in_fp32=True)).worst.gradients
    fp32 = estimate_memory(LLAMA70, replace(FSDP, fsdp_main_grads_dtype="fp32")).worst.gradients
    assert fp32 == pytest.approx(2 * bf16, rel=0.01)


def test_optimizer_offload_under_fsdp_is_not_modelled_and_says_so():
    est = estimate_memory(LLAMA70, replace(FSDP, optimizer_offload_fraction=0.5))
    assert est.worst.offloaded_numel == 0
    assert any("MFSDP V2 does not support optimizer CPU offload." in w for w in est.warnings)


def test_recommend_never_proposes_optimizer_offload_under_fsdp():
    rec = recommend_for_inputs(
        model="llama3-70b", gpu="gb200", num_gpus=64, seq_length=8192, use_megatron_fsdp=True,
        fsdp_sharding_strategy="optim_grads_params", grad_reduce_in_fp32=False,
    )  # fmt: skip
    assert rec.mode == "activation" and rec.fits
    assert not any(o.startswith("optimizer.") for o in rec.overrides)
    assert any("MFSDP" in line for line in rec.rationale)


def test_fp8_saves_gemm_inputs_in_one_byte_and_mxfp8_adds_scales():
    s = replace(FSDP, seq_length=4096)
    bf16 = {t.name: t for t in layer_activations(LLAMA70, s, 0)}
    fp8 = {t.name: t for t in layer_activations(LLAMA70, replace(s, fp8_recipe="tensorwise"), 0)}
    mx = {t.name: t for t in layer_activations(LLAMA70, replace(s, fp8_recipe="mxfp8"), 0)}
    assert fp8["fc1_in"].nbytes * 2 == bf16["fc1_in"].nbytes
    assert fp8["fc1_out"].nbytes == bf16["fc1_out"].nbytes  # the SwiGLU input stays bf16
    assert fp8["proj_in_fp8"].numel == bf16["attn_out"].numel  # the output projection's own FP8 copy
    assert "mxfp8_scales" in mx and "mxfp8_scales" not in fp8
    assert sum(t.nbytes for t in fp8.values()) < sum(t.nbytes for t in bf16.values())


def test_layer_components_name_every_saved_tensor_with_its_bytes():
    parts = layer_components(LLAMA70, FSDP, 0)
    assert parts["fc1_out"] == 8192 * 2 * 28672 * 2
    assert sum(parts.values()) == sum(t.nbytes for t in layer_activations(LLAMA70, FSDP, 0))


def test_micro_batch_size_scales_activations_linearly():
    one = estimate_memory(LLAMA70, FSDP).worst.activations
    two = estimate_memory(LLAMA70, replace(FSDP, micro_batch_size=2)).worst.activations
    assert two == pytest.approx(2 * one, rel=0.02)


def test_deepseek_layout_gives_uneven_stages_and_vpp_from_the_layout():
    assert decoder_counts("Et*4|(tttt|)*14tmL") == (4,) * 15 + (1,)
    assert mtp_layers("Et*4|(tttt|)*14tmL") == 1
    assert decoder_counts("Ettt|(tt|)*29,m|L") == (3,) + (2,) * 29 + (0, 0)
    est = estimate_for_inputs(
        model="deepseek-v3", gpu="gb200", num_gpus=256, pp=4, ep=64, etp=1, seq_length=4096,
        pipeline_layout="Et*4|(tttt|)*14tmL", global_batch_size=8192,
    )  # fmt: skip
    assert est.parallel["vpp"] == 4
    params = [st.params for st in est.stages]
    assert params[0] > params[3]
    note = next(a.note for a in est.assumptions if a.name == "pipeline_layout")
    assert "MTP layers sit on the last stage" in (note or "")
    without = estimate_for_inputs(
        model="deepseek-v3", gpu="gb200", num_gpus=256, pp=4, ep=64, etp=1, seq_length=4096,
        pipeline_layout="Et*4|(tttt|)*14tL", global_batch_size=8192,
    )  # fmt: skip
    assert est.stages[3].params > without.stages[3].params  # the MTP layer's weights on the last stage
    assert est.stages[0].params == without.stages[0].params


def test_first_and_last_stage_layer_counts():
    m = model_preset("deepseek-v3")
    s = Setup(
        num_gpus=64, pp=4, ep=16, etp=1, num_layers_in_first_pipeline_stage=13, num_layers_in_last_pipeline_stage=15
    )
    assert [len(r) for r in stage_layers(m, s)] == [13, 17, 16, 15]


def test_a_bridge_run_config_flows_fsdp_fp8_and_tokenizer_vocab_into_the_estimate(tmp_path):
    cfg = {
        "model": {
            "num_layers": 80, "hidden_size": 8192, "ffn_hidden_size": 28672, "num_attention_heads": 64,
            "num_query_groups": 8, "kv_channels": 128, "vocab_size": None, "seq_length": 8192,
            "gated_linear_unit": True, "add_bias_linear": False, "share_embeddings_and_output_weights": False,
            "cpu_offloading": True, "cpu_offloading_num_layers": 40, "cross_entropy_loss_fusion": True,
        },
        "ddp": {"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim_grads_params"},
        "mixed_precision": {"bf16": True, "fp8": "hybrid", "fp8_recipe": "tensorwise", "fp8_param_gather": True,
                            "grad_reduce_in_fp32": False},
        "tokenizer": {"vocab_size": 128256},
        "train": {"micro_batch_size": 2, "global_batch_size": 256},
    }  # fmt: skip
    path = tmp_path / "run_config.yaml"
    path.write_text(json.dumps(cfg))
    loaded = sources.load(str(path))
    est = estimate_for_inputs(loaded.config, loaded.raw, gpu="gb200", num_gpus=64)
    values = {a.name: a.value for a in est.assumptions}
    assert values["use_megatron_fsdp"] is True and values["fp8_recipe"] == "tensorwise"
    assert values["vocab_size"] == 128256 and values["activation_offload_layers"] == 40
    assert est.memory_gib.weights < 10


def test_cli_has_the_new_flags():
    parser = argparse.ArgumentParser()
    cli_plan.add_parsers(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["estimate", "--model", "llama3-70b", "--use-megatron-fsdp", "--fsdp-sharding-strategy", "optim",
         "--fp8-recipe", "mxfp8", "--pipeline-layout", "Et|tL", "--gpu", "gb300"]
    )  # fmt: skip
    assert args.use_megatron_fsdp is True and args.fsdp_sharding_strategy == "optim" and args.fp8_recipe == "mxfp8"


def test_the_tokenizers_padded_vocab_size_wins_over_its_raw_one(tmp_path):
    # Bridge builds the embedding with the padded size when the tokenizer section carries one.
    cfg = {
        "model": {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "vocab_size": None},
        "tokenizer": {"vocab_size": 1000, "padded_vocab_size": 1024},
    }
    path = tmp_path / "run_config.yaml"
    path.write_text(json.dumps(cfg))
    loaded = sources.load(str(path))
    est = estimate_for_inputs(loaded.config, loaded.raw, gpu="h100-80gb", num_gpus=1)
    assert {a.name: a.value for a in est.assumptions}["vocab_size"] == 1024


def test_a_vocabulary_only_the_tokenizer_knows_is_asked_for_by_name(tmp_path):
    cfg = {
        "model": {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "vocab_size": None},
        "tokenizer": {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": "org/model"},
    }
    path = tmp_path / "run_config.yaml"
    path.write_text(json.dumps(cfg))
    loaded = sources.load(str(path))
    with pytest.raises(InputError, match="pass --vocab-size"):
        estimate_for_inputs(loaded.config, loaded.raw, gpu="h100-80gb", num_gpus=1)
