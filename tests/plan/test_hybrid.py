"""Hybrid Mamba stacks, MTP depths and tokenizer-decided vocabularies (Nemotron 3 / 3.5, DeepSeek-V3 MTP)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from mbridge_offload.config import sources
from mbridge_offload.config.errors import BoundsError as InputError
from mbridge_offload.plan.inputs.resolve import resolve
from mbridge_offload.plan.inputs.vocab import tokenizer_vocab
from mbridge_offload.plan.memory.activations import kind_activations, mtp_activations, stage_activations
from mbridge_offload.plan.model.architecture import MambaSpec
from mbridge_offload.plan.model.params import layer_params, padded_vocab, stage_params, total_params
from mbridge_offload.plan.model.run import Setup, check_setup
from mbridge_offload.plan.service import estimate_for_inputs, recommend_for_inputs
from mbridge_offload.plan.time.terms import forward_flops
from tests.support import tree
from tests.support.tree import ROOT

LIGHTNING = ROOT / "tests/data/bridge-0.6.2/perf/nemotron_3_5_lightning_pretrain_16gpu_h100_bf16_config.yaml"


def _lightning():
    loaded = sources.load(str(LIGHTNING))
    return loaded.config, loaded.raw


def _model(**flags):
    config, raw = _lightning()
    return resolve({"gpu": "h100-80gb", "num_gpus": 16, **flags}, config, raw).model


def test_the_recipe_pattern_gives_each_symbol_a_layer_of_its_own():
    m = _model()
    assert m.layer_pattern is not None and len(m.layer_pattern) == m.num_layers == 52
    counts = {c: m.layer_pattern.count(c) for c in "ME*"}
    assert counts == {"M": 23, "E": 23, "*": 6}  # the Nemotron 3 Nano 30B-A3B stack: 23 Mamba, 23 MoE, 6 attention
    s = Setup(num_gpus=16, ep=8, etp=1)
    kinds = {m.layer_kind(i): {t.name for t in layer_params(m, s, i)} for i in range(m.num_layers)}
    assert "in_proj" in kinds["M"] and "linear_qkv" not in kinds["M"] and "router" not in kinds["M"]
    assert "linear_qkv" in kinds["*"] and "pre_mlp_layernorm" not in kinds["*"]
    assert "router" in kinds["E"] and "linear_qkv" not in kinds["E"]


def test_nemotron_3_nano_has_its_published_total_of_31_6_billion_parameters():
    # The model card and the technical report: 31.6B total parameters (no MTP in the released Nano).
    m = replace(_model(), mtp_num_layers=0)
    assert total_params(m) == pytest.approx(31.6e9, rel=0.02)


def test_the_mamba_mixer_parameters_follow_megatron_cores_shapes():
    m = _model()
    mb = m.mamba
    assert mb == MambaSpec(num_heads=64, head_dim=64, state_dim=128, num_groups=8)
    params = {t.name: t.numel for t in layer_params(m, Setup(num_gpus=16, ep=8, etp=1), 0)}
    # in_proj packs z, x, B, C, dt: 2·d_inner + 2·groups·state + heads columns (megatron-core MambaMixer)
    assert params["in_proj"] == m.hidden_size * (2 * 4096 + 2 * 8 * 128 + 64)
    assert params["conv1d_weight"] == (4096 + 2 * 8 * 128) * 4
    assert params["out_proj"] == 4096 * m.hidden_size


def test_tp_must_divide_the_mamba_heads_and_groups():
    m = replace(_model(), num_query_groups=32)  # attention would allow TP 16; the Mamba mixer's 8 groups do not
    with pytest.raises(ValueError, match="ngroups must be evenly divisible by tp_size"):
        check_setup(m, Setup(num_gpus=16, tp=16, ep=1, etp=1))
    check_setup(m, Setup(num_gpus=16, tp=8, ep=2, etp=1))


def test_a_mamba_layer_saves_its_in_proj_output_and_scan_output_not_its_convolution():
    # mamba_ssm's MambaSplitConv1dScanCombinedFn saves zxbcdt and out_x and recomputes the convolution in backward
    m = _model()
    s = Setup(num_gpus=16, ep=8, etp=1, seq_length=8192)
    saved = {t.name: t.nbytes for t in kind_activations(m, s, "M", False)}
    tokens = 8192
    assert saved["zxbcdt"] == 2 * tokens * (2 * 4096 + 2 * 8 * 128 + 64)
    assert "conv_out" not in saved
    assert saved["ssm_out"] == saved["gated_norm_in"] == saved["out_proj_in"] == 2 * tokens * 4096
    assert saved["gated_norm_rstd"] == 4 * tokens * 8  # fp32, one per token and group
    with_tp = {t.name: t.nbytes for t in kind_activations(m, replace(s, tp=2), "M", False)}
    assert with_tp["zxbcdt"] * 2 == saved["zxbcdt"]


def test_mtp_depths_sit_on_the_last_stage_with_their_own_logits():
    m = _model()
    s = Setup(num_gpus=16, pp=2, ep=8, etp=1, seq_length=8192, global_batch_size=64)
    without = replace(m, mtp_num_layers=0)
    last = sum(t.numel for t in stage_params(m, s, 1)) - sum(t.numel for t in stage_params(without, s, 1))
    first = sum(t.numel for t in stage_params(m, s, 0)) - sum(t.numel for t in stage_params(without, s, 0))
    # the MTP stage also builds its own embedding (megatron-core: ``pre_process or mtp_process``)
    embedding = padded_vocab(m, s.tp) * m.hidden_size // s.tp
    assert first == 0 and last > embedding
    # repeated: the two depths share one block's weights but each keeps its activations and logits
    shared = replace(m, mtp_repeated=True)
    separate = replace(m, mtp_repeated=False)
    assert sum(t.numel for t in stage_params(separate, s, 1)) - sum(t.numel for t in stage_params(without, s, 1)) == (
        2 * last - embedding if m.mtp_repeated else last
    )
    assert mtp_activations(shared, s) == mtp_activations(separate, s) > 0
    logits = 4 * 8192 * 131072  # fp32 logits of one depth, TP 1
    assert mtp_activations(m, s) > 2 * logits
    gap = stage_activations(m, s, 1).gpu_bytes - stage_activations(without, s, 1).gpu_bytes
    # megatron-core 0.19.2 frees the depths' bf16 logits (process_mtp_loss) before the main loss runs
    assert gap == mtp_activations(m, s)


def test_mtp_and_mamba_count_in_the_step_flops():
    m = _model()
    plain = replace(m, mtp_num_layers=0)
    assert forward_flops(m, 8192).total > forward_flops(plain, 8192).total
    assert forward_flops(m, 8192).output == 3 * forward_flops(plain, 8192).output  # two MTP depths' logits
    assert m.ssm_flops_per_token() > 0 and m.attention_layers == 6
    dense_attention = replace(plain, layer_pattern=None, mamba=None)
    assert forward_flops(plain, 8192).core_attn < forward_flops(dense_attention, 8192).core_attn


def test_the_lightning_recipe_is_estimated_and_recommended_with_its_tokenizer_vocabulary():
    config, raw = _lightning()
    est = estimate_for_inputs(config, raw, gpu="h100-80gb", num_gpus=16)
    vocab = next(a for a in est.assumptions if a.name == "vocab_size")
    assert vocab.value == 131072 and "hf_vocab.yaml" in (vocab.note or "")
    layers = next(a for a in est.assumptions if a.name == "num_layers")
    assert "23 Mamba" in (layers.note or "") and "not modelled" not in (layers.note or "")
    rec = recommend_for_inputs(config, raw, gpu="h100-80gb", num_gpus=16)
    assert rec.memory_gib.before.total > 0


@pytest.mark.parametrize(
    ("name", "vocab"),
    [
        ("meta-llama/Llama-3.1-8B", 128256),
        ("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", 131072),
        ("Qwen/Qwen3-30B-A3B", 151936),
        ("deepseek-ai/DeepSeek-V3", 129280),
        ("openai/gpt-oss-120b", 201088),
    ],
)
def test_well_known_tokenizers_give_their_vocabulary_offline(name, vocab):
    found = tokenizer_vocab({"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": name})
    assert found is not None and found[1].vocab_size == vocab


def test_an_unknown_tokenizer_still_asks_for_the_vocabulary(tmp_path: Path):
    text = LIGHTNING.read_text().replace(
        "tokenizer_model: nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-BF16", "tokenizer_model: acme/private-tok"
    )
    path = tmp_path / "run_config.yaml"
    path.write_text(text)
    out = subprocess.run(
        [sys.executable, "-m", "mbridge_offload_tools", "estimate", "--model-config", str(path), "--json"],
        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=tree.pythonpath()), timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "--vocab-size" in json.loads(out.stdout)["error"]


def test_an_unknown_pattern_symbol_is_bad_input():
    _, raw = _lightning()
    raw["model"]["hybrid_layer_pattern"] = "MEQ" + raw["model"]["hybrid_layer_pattern"][3:]
    with pytest.raises(InputError, match="unknown layer symbol"):
        resolve({"gpu": "h100-80gb"}, sources.build_config(raw), raw)
