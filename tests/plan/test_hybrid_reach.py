"""The planner does what megatron-core does, model class by model class (``mbridge_offload.upstream_layers``).

A hybrid (Mamba) stack never opens the layer-level offload context: estimate counts no saving and says why,
recommend never offers it. Fine-grained offloading and selective recompute act only on the layers that have the
module (the Mamba mixer has none; a norm fused into the next linear layer is not a module). MTP depths follow full
recompute only with the uniform method. Every expectation is read from the table, so the planner and the table
cannot drift apart.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from mbridge_offload.config import sources
from mbridge_offload.plan.inputs.presets import model_preset
from mbridge_offload.plan.memory import fine_grained
from mbridge_offload.plan.memory.activations import (
    layer_activations,
    layer_components,
    mtp_activations,
    mtp_rebuilt,
    stage_activations,
    stage_groups,
)
from mbridge_offload.plan.memory.stage import estimate_memory
from mbridge_offload.plan.model.architecture import MambaSpec, ModelSpec
from mbridge_offload.plan.model.run import Setup
from mbridge_offload.plan.service import estimate_for_inputs, recommend_for_inputs
from mbridge_offload.upstream_layers import ALLOWED_OFFLOAD_MODULES, PLANNER_RELEASE, applies, cell
from tests.support import tree

# Nemotron-H 8B-like shapes (52 layers: 24 Mamba, 5 attention, 23 MLP), the model class of the issue's report.
NEMOTRON_H_8B = {
    "num_layers": 52,
    "hidden_size": 4096,
    "ffn_hidden_size": 21504,
    "num_attention_heads": 32,
    "num_query_groups": 8,
    "kv_channels": 128,
    "seq_length": 8192,
    "vocab_size": 131072,
    "gated_linear_unit": False,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M",
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "mamba_state_dim": 128,
    "mamba_num_groups": 8,
}
HYBRID_MOE = ModelSpec(
    name="tiny-hybrid",
    num_layers=8,
    hidden_size=1024,
    ffn_hidden_size=4096,
    num_attention_heads=8,
    num_query_groups=8,
    kv_channels=128,
    vocab_size=4096,
    num_moe_experts=8,
    moe_ffn_hidden_size=1024,
    moe_shared_expert_intermediate_size=1024,
    layer_pattern="M*ME-M*E",
    mamba=MambaSpec(num_heads=32, head_dim=64, state_dim=128, num_groups=8),
)


def _raw(**model) -> dict:
    return {"model": {**NEMOTRON_H_8B, **model}, "train": {"micro_batch_size": 1, "global_batch_size": 128}}


def _estimate(raw: dict, **flags):
    return estimate_for_inputs(sources.build_config(raw), raw, gpu="h100-80gb", num_gpus=8, **flags)


# ---------------------------------------------------------------------------------------------- layer-level offload


def test_the_table_says_no_hybrid_stack_offloads_layer_by_layer():
    assert cell("cpu_offloading", "hybrid", PLANNER_RELEASE).verdict == "no effect"
    assert applies("cpu_offloading", "block", PLANNER_RELEASE)


def test_estimate_counts_no_saving_from_layer_offload_on_a_hybrid_stack_and_says_why():
    raw = _raw()
    without, with_k = _estimate(raw), _estimate(raw, activation_offload_layers=12)
    assert with_k.memory_gib.total == without.memory_gib.total
    assert with_k.memory_gib.activations == without.memory_gib.activations
    assert with_k.host_gb == 0.0 and with_k.step_time_factor == without.step_time_factor
    (warning,) = [w for w in with_k.warnings if "cpu_offloading" in w]
    assert "HybridStack" in warning and "models/hybrid/hybrid_block.py" in warning and "12 layers" in warning
    assert not any("cpu_offloading" in w for w in without.warnings)


def test_the_same_layers_in_a_gpt_block_do_save():
    """The counter-case: without the hybrid pattern the model is a TransformerBlock, where the offload applies."""
    m = model_preset("llama3-8b")
    s = Setup(num_gpus=8, seq_length=8192)
    assert stage_activations(m, replace(s, activation_offload_layers=12), 0).gpu_bytes < (
        stage_activations(m, s, 0).gpu_bytes
    )
    hybrid = replace(m, layer_pattern="*-" * (m.num_layers // 2))
    assert stage_activations(hybrid, replace(s, activation_offload_layers=12), 0) == stage_activations(hybrid, s, 0)
    assert estimate_memory(hybrid, replace(s, activation_offload_layers=12)).warnings


def test_estimate_and_recommend_on_the_cli_count_and_offer_no_layer_offload_for_a_hybrid_config(tmp_path: Path):
    path = tmp_path / "nemotron_h_8b.yaml"
    path.write_text(yaml.safe_dump(_raw()))
    got = []
    for extra in ([], ["--activation-offload-layers", "12"]):
        out = subprocess.run(
            [sys.executable, "-m", "mbridge_offload_tools", "estimate", "--model-config", str(path), "--gpu",
             "h100-80gb", "--num-gpus", "8", "--json", *extra],
            capture_output=True, text=True, env={"PYTHONPATH": tree.pythonpath()}, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        got.append(json.loads(out.stdout))
    assert got[1]["memory_gib"] == got[0]["memory_gib"] and got[1]["host_gb"] == 0.0
    assert any("HybridStack" in w for w in got[1]["warnings"])
    out = subprocess.run(
        [sys.executable, "-m", "mbridge_offload_tools", "recommend", "--model-config", str(path), "--gpu",
         "h100-80gb", "--num-gpus", "8", "--json"],
        capture_output=True, text=True, env={"PYTHONPATH": tree.pythonpath()}, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rec = json.loads(out.stdout)
    offered = [c["key"] for o in rec["options"] for c in o["changes"] if c["value"] is True]
    assert "model.cpu_offloading" not in offered
    assert any("ACT-HYBRID-LAYER-OFFLOAD" in line for line in rec["rationale"])


def _patterns(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        p = "".join(rng.choice("MM*-E") for _ in range(rng.choice((8, 12, 16, 24))))
        if "M" in p and ("*" in p or "E" in p):
            out.append(p)
    return out


@pytest.mark.parametrize("pattern", _patterns(28, 6))
def test_recommend_never_offers_layer_level_offload_on_a_hybrid_stack(pattern):
    raw = {
        "model": {
            "num_layers": len(pattern),
            "hidden_size": 2048,
            "ffn_hidden_size": 8192,
            "num_attention_heads": 16,
            "num_query_groups": 8,
            "kv_channels": 128,
            "seq_length": 32768,
            "vocab_size": 65536,
            "num_moe_experts": 8 if "E" in pattern else None,
            "moe_ffn_hidden_size": 2048 if "E" in pattern else None,
            "hybrid_layer_pattern": pattern,
            "mamba_num_heads": 64,
        },
        "train": {"micro_batch_size": 4, "global_batch_size": 256},
    }
    raw["model"] = {k: v for k, v in raw["model"].items() if v is not None}
    rec = recommend_for_inputs(sources.build_config(raw), raw, gpu="h100-80gb", num_gpus=8)
    offered = [c.key for o in rec.options for c in o.changes if c.value is True]  # fine-grained writes it false
    assert "model.cpu_offloading" not in offered and rec.mode not in ("activation", "both")
    assert "model.cpu_offloading=true" not in rec.overrides  # fine-grained modes write it false, never true
    if not any(line.startswith("it fits") for line in rec.rationale):  # the search ran: it says why not
        assert any("ACT-HYBRID-LAYER-OFFLOAD" in line for line in rec.rationale)


def test_recommend_on_the_issues_nemotron_h_case_offers_no_layer_offload():
    raw = _raw()
    rec = recommend_for_inputs(sources.build_config(raw), raw, gpu="h100-80gb", num_gpus=8)
    assert not any(c.key == "model.cpu_offloading" and c.value is True for o in rec.options for c in o.changes)
    assert rec.fits  # full recompute reaches the 0.19.2 HybridStack: it is offered and fits
    assert applies("recompute:full-block", "hybrid", PLANNER_RELEASE)


# ---------------------------------------------------------------------------------------------- module-level settings


def _kinds(m: ModelSpec) -> dict[str, int]:
    return {m.layer_kind(i): i for i in range(m.num_layers)}


def _recompute_drops(m: ModelSpec, s: Setup, index: int, module: str) -> set[str]:
    plain = set(layer_components(m, s, index))
    kept = set(layer_components(m, replace(s, recompute_granularity="selective", recompute_modules=(module,)), index))
    return plain - kept


def _offloads(m: ModelSpec, s: Setup, index: int, module: str) -> bool:
    return module in fine_grained._released(layer_activations(m, s, index), [module], min_size=0)


RECOMPUTE = ("core_attn", "layernorm", "mlp", "moe", "moe_act", "shared_experts", "mla_up_proj")
OFFLOAD = ALLOWED_OFFLOAD_MODULES


@pytest.mark.parametrize("module", RECOMPUTE)
def test_selective_recompute_acts_on_a_layer_only_where_the_table_says(module):
    s = Setup(num_gpus=8, ep=8, seq_length=4096)
    kinds = _kinds(HYBRID_MOE)
    # The Mamba mixer: no module at all. A pure MoE (E) layer: the MoE column. An MLP (-) layer: the dense column's
    # MLP side; an attention (*) layer: the dense column's attention side.
    assert not _recompute_drops(HYBRID_MOE, s, kinds["M"], module)
    assert not applies(f"recompute_modules:{module}", "mamba")
    assert bool(_recompute_drops(HYBRID_MOE, s, kinds["E"], module)) is applies(f"recompute_modules:{module}", "moe")
    if module in ("mlp", "layernorm"):
        assert bool(_recompute_drops(HYBRID_MOE, s, kinds["-"], module)) is applies(
            f"recompute_modules:{module}", "dense"
        )
    if module in ("core_attn", "layernorm"):
        assert bool(_recompute_drops(HYBRID_MOE, s, kinds["*"], module)) is applies(
            f"recompute_modules:{module}", "dense"
        )
    dense = model_preset("llama3-8b")
    if cell(f"recompute_modules:{module}", "dense").verdict != "refused":
        assert bool(_recompute_drops(dense, Setup(num_gpus=8), 0, module)) is applies(
            f"recompute_modules:{module}", "dense"
        )


def test_layernorm_recompute_drops_mlas_norm_output_and_the_routers_input_only():
    mla = model_preset("deepseek-v3")
    s = Setup(num_gpus=256, ep=64, pp=16, seq_length=4096)
    moe_layer = next(i for i in range(mla.num_layers) if mla.is_moe_layer(i))
    assert _recompute_drops(mla, s, moe_layer, "layernorm") == {"qkv_in", "router_in"}
    assert applies("recompute_modules:layernorm", "mla") and applies("recompute_modules:layernorm", "moe")
    assert _recompute_drops(model_preset("llama3-8b"), Setup(num_gpus=8), 0, "layernorm") == set()


@pytest.mark.parametrize("module", OFFLOAD)
def test_fine_grained_offload_acts_on_a_layer_only_where_the_table_says(module):
    s = Setup(num_gpus=8, ep=8, seq_length=4096)
    kinds = _kinds(HYBRID_MOE)
    assert not _offloads(HYBRID_MOE, s, kinds["M"], module) and not applies(f"offload_modules:{module}", "mamba")
    assert _offloads(HYBRID_MOE, s, kinds["E"], module) is applies(f"offload_modules:{module}", "moe")
    dense = model_preset("llama3-8b")
    assert _offloads(dense, Setup(num_gpus=8), 0, module) is applies(f"offload_modules:{module}", "dense")
    mla = model_preset("deepseek-v3")
    if module in ("attn_norm", "qkv_linear", "core_attn", "attn_proj"):
        expected = applies(f"offload_modules:{module}", "mla")
        assert _offloads(mla, Setup(num_gpus=256, ep=64, pp=16), 0, module) is expected


@pytest.mark.parametrize("modules", [("expert_fc1",), ("core_attn", "attn_proj"), ("qkv_linear", "mlp_norm")])
def test_fine_grained_saving_on_a_hybrid_stack_ignores_the_mamba_layers(modules):
    """Adding Mamba layers to a pattern adds nothing to what fine-grained offloading frees or pins."""
    s = Setup(num_gpus=8, ep=8, seq_length=4096, offload_modules=modules)
    few = replace(HYBRID_MOE, layer_pattern="*E*E-", num_layers=5)
    many = replace(HYBRID_MOE, layer_pattern="MM*EM*-MEM", num_layers=10)
    a, b = stage_groups(few, s, 0), stage_groups(many, s, 0)
    assert a.gpu_saving_bytes == b.gpu_saving_bytes > 0 and a.host_bytes == b.host_bytes
    only_mamba = replace(HYBRID_MOE, layer_pattern="MMMM", num_layers=4)
    assert stage_groups(only_mamba, s, 0).gpu_saving_bytes == 0


# ---------------------------------------------------------------------------------------------- MTP


def test_mtp_depths_follow_full_recompute_only_with_the_uniform_method():
    m = replace(model_preset("deepseek-v3"), mtp_num_layers=2)
    s = Setup(num_gpus=256, ep=64, pp=16, seq_length=4096)
    uniform, block = (replace(s, recompute_granularity="full", recompute_method=x) for x in ("uniform", "block"))
    assert applies("recompute:full-uniform", "mtp") and not applies("recompute:full-block", "mtp")
    assert mtp_activations(m, block) == mtp_activations(m, s)
    assert mtp_activations(m, uniform) < mtp_activations(m, s)
    # One depth: while the loss runs it keeps its inputs; its backward rebuilds what the checkpoint dropped, once the
    # logits are gone (the trace, megatron-core 0.19.2)
    one = replace(m, mtp_num_layers=1)
    assert mtp_activations(one, uniform) < mtp_activations(one, s)
    assert mtp_rebuilt(one, uniform) > 0 == mtp_rebuilt(one, s) == mtp_rebuilt(one, block)


def test_fine_grained_offload_reaches_the_mtp_depths_on_the_last_stage():
    assert applies("offload_modules:expert_fc1", "mtp")
    m = replace(model_preset("deepseek-v3"), mtp_num_layers=1)
    s = Setup(num_gpus=256, ep=64, pp=16, seq_length=4096, offload_modules=("expert_fc1",))
    without = replace(m, mtp_num_layers=0)
    assert stage_groups(m, s, 15).gpu_saving_bytes > stage_groups(without, s, 15).gpu_saving_bytes
    assert stage_groups(m, s, 0).gpu_saving_bytes == stage_groups(without, s, 0).gpu_saving_bytes
