"""Fine-grained activation offloading: the offload points of megatron-core 0.19.2, their memory, host and time
effect, ``recommend`` choosing it, ``apply --mode fine-grained``, and the published figures."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest

from mbridge_offload.actions.apply.apply import apply_offload
from mbridge_offload.actions.apply.result import ApplyError
from mbridge_offload.config import sources
from mbridge_offload.config.validate import validate
from mbridge_offload.plan import service
from mbridge_offload.plan.inputs.presets import model_preset
from mbridge_offload.plan.inputs.resolve import resolve
from mbridge_offload.plan.memory import fine_grained
from mbridge_offload.plan.memory.activations import in_flight, layer_activations, stage_activations
from mbridge_offload.plan.memory.stage import estimate_memory
from mbridge_offload.plan.model.architecture import MLASpec, ModelSpec
from mbridge_offload.plan.model.run import Setup
from mbridge_offload.plan.search import planner as plan
from mbridge_offload.upstream_layers import ALLOWED_OFFLOAD_MODULES
from mbridge_offload_tools.evidence import published_fine_grained

ROOT = Path(__file__).resolve().parents[2]
MCORE = ROOT / ".mcore" / "0.19.2" / "megatron" / "core" / "transformer" / "transformer_config.py"
MOE = ModelSpec(
    name="tiny-moe",
    num_layers=8,
    hidden_size=1024,
    ffn_hidden_size=4096,
    num_attention_heads=8,
    num_query_groups=8,
    kv_channels=128,
    vocab_size=1024,
    seq_length=4096,
    num_moe_experts=8,
    moe_ffn_hidden_size=1024,
    moe_router_topk=2,
)
MLA = replace(MOE, name="tiny-mla", mla=MLASpec(512, 256, 128, 64, 128))
DENSE = replace(MOE, name="tiny-dense", num_moe_experts=None)
DSV3 = dict(
    model="deepseek-v3",
    gpu="h200-141gb",
    num_gpus=256,
    pp=4,
    ep=64,
    global_batch_size=2048,
    recompute_granularity="selective",
    recompute_modules=["mla_up_proj"],
)


def _acts(m: ModelSpec, s: Setup, stage: int = 0) -> int:
    return stage_activations(m, s, stage).gpu_bytes


def _bytes(m: ModelSpec, s: Setup, name: str) -> int:
    return next(t.nbytes for t in layer_activations(m, s, 0) if t.name == name)


# ------------------------------------------------------------------------------------------- offload points


@pytest.mark.skipif(not MCORE.exists(), reason="megatron-core 0.19.2 source not installed under .mcore/")
def test_the_module_names_are_exactly_what_megatron_core_0_19_2_accepts():
    tree = ast.parse(MCORE.read_text())
    sets = [
        {elt.value for elt in node.value.elts}  # type: ignore[attr-defined]
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "allowed_modules"
    ]
    found = next(s for s in sets if "attn_proj" in s)  # the offload set (the other one is recompute's)
    assert found == set(ALLOWED_OFFLOAD_MODULES) == set(fine_grained.POINTS)


def test_every_tensor_an_offload_point_names_is_one_the_memory_model_lists():
    names = set()
    for m in (MOE, MLA, replace(DENSE, qk_layernorm=True)):
        names |= {t.name for i in range(m.num_layers) for t in layer_activations(m, Setup(num_gpus=1), i)}
    for point in fine_grained.POINTS.values():
        assert set(point.tensors + point.transfer_only) <= names, point.name


def test_expert_fc1_frees_the_routed_tokens_of_every_in_flight_layer_but_one():
    s = Setup(num_gpus=1)
    saving = _acts(MOE, s) - _acts(MOE, replace(s, offload_modules=("expert_fc1",)))
    routed = 4096 * 2 * 1024 * 2  # tokens × top-k × hidden × bf16
    assert _bytes(MOE, s, "expert_fc1_in") == routed
    assert saving == (8 - 1) * routed


def test_pipeline_stages_keep_the_schedules_in_flight_micro_batches():
    s = Setup(num_gpus=4, pp=4, vpp=2, global_batch_size=64)
    assert [in_flight(s, st) for st in range(4)] == [5.5, 4.5, 3.5, 2.5]  # (2(PP-r-1) + (VPP-1)PP + 1) / VPP
    assert [in_flight(replace(s, vpp=None), st) for st in range(4)] == [4, 3, 2, 1]
    m = replace(MOE, num_layers=16)
    per = _bytes(m, s, "expert_fc1_in")
    saving = _acts(m, s) - _acts(m, replace(s, offload_modules=("expert_fc1",)))
    assert saving == int((5.5 * 4 - 1) * per)


def test_tensors_below_min_offloaded_tensor_size_stay():
    s = replace(Setup(num_gpus=1), offload_modules=("expert_fc1",), min_offloaded_tensor_size=10**9)
    assert _acts(MOE, s) == _acts(MOE, Setup(num_gpus=1))


def test_attn_norm_moves_nothing_where_te_fuses_the_norm_but_does_for_mla():
    s = Setup(num_gpus=1)
    on = replace(s, offload_modules=("attn_norm",))
    assert _acts(DENSE, on) == _acts(DENSE, s)  # TELayerNormColumnParallelLinear: input_layernorm is IdentityOp
    assert _acts(MOE, on) == _acts(MOE, s)
    assert _acts(MLA, s) - _acts(MLA, on) == 7 * _bytes(MLA, s, "input_norm_in")


def test_mlp_norm_moves_only_in_moe_layers():
    s = Setup(num_gpus=1)
    on = replace(s, offload_modules=("mlp_norm",))
    assert _acts(DENSE, on) == _acts(DENSE, s)
    assert _acts(MOE, s) - _acts(MOE, on) == 7 * _bytes(MOE, s, "mlp_norm_in")


def test_qkv_linear_takes_the_fused_norm_input_except_with_mla():
    s = Setup(num_gpus=1)
    on = replace(s, offload_modules=("qkv_linear",))
    assert _acts(MOE, s) - _acts(MOE, on) == 7 * (_bytes(MOE, s, "input_norm_in") + _bytes(MOE, s, "qkv_in"))
    big = [t for t in layer_activations(MLA, s, 0) if t.numel >= s.min_offloaded_tensor_size]
    moved = ("qkv_in", "q_down_out", "q_up_in", "kv_down_out", "kv_up_in")
    assert _acts(MLA, s) - _acts(MLA, on) == 7 * sum(t.nbytes for t in big if t.name in moved)


def test_core_attn_alone_copies_its_output_without_freeing_it():
    s = Setup(num_gpus=1)
    acts = layer_activations(MOE, s, 0)
    alone = fine_grained.stage_saving([acts], ("core_attn",), 2.0)
    pair = fine_grained.stage_saving([acts], ("core_attn", "attn_proj"), 2.0)
    attn_out = _bytes(MOE, s, "attn_out")
    assert pair.gpu_saving_bytes - alone.gpu_saving_bytes == attn_out
    assert alone.copied_bytes_per_microbatch > alone.gpu_saving_bytes / 1  # the output is copied anyway


def test_activation_offload_fraction_keeps_the_latest_groups():
    s = replace(Setup(num_gpus=1), offload_modules=("expert_fc1",))
    full = _acts(MOE, Setup(num_gpus=1)) - _acts(MOE, s)
    half = _acts(MOE, Setup(num_gpus=1)) - _acts(MOE, replace(s, activation_offload_fraction=0.5))
    # upstream takes the margin group out first, then disables int(7 * 0.5) = 3 of the 7 left: 4 stay offloaded
    # (held to megatron-core's manager by the trace: tests/tools/test_trace_offload.py)
    assert full == 7 * _bytes(MOE, s, "expert_fc1_in") and half == 4 * _bytes(MOE, s, "expert_fc1_in")


def test_full_recompute_leaves_nothing_inside_the_scopes():
    s = Setup(num_gpus=1, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    assert _acts(MOE, replace(s, offload_modules=("expert_fc1",))) == _acts(MOE, s)


def test_host_memory_is_the_pinned_in_flight_groups():
    s = replace(Setup(num_gpus=1), offload_modules=("expert_fc1",))
    est = estimate_memory(MOE, s)
    assert est.host_gb * 1e9 == pytest.approx(7 * fine_grained._next_pow2(_bytes(MOE, s, "expert_fc1_in")))


def test_the_planner_refuses_with_the_catalogues_fine_grained_rules():
    # One home: the planner asks config.validate.fine_grained_errors, so the refusal names the catalogue's rule.
    with pytest.raises(ValueError, match=r"\(ACT-FG-ATTN-PROJ\)"):
        estimate_memory(MOE, replace(Setup(num_gpus=1), offload_modules=("attn_proj",)))
    with pytest.raises(ValueError, match=r"\(MC-FG-FUSED-GROUP-MLP-PARTIAL\)"):
        estimate_memory(MOE, replace(Setup(num_gpus=1), offload_modules=("fused_group_mlp", "expert_fc1")))
    with pytest.raises(ValueError, match=r"\(ACT-FG-FRACTION-RANGE\)"):
        estimate_memory(
            MOE, replace(Setup(num_gpus=1), offload_modules=("expert_fc1",), activation_offload_fraction=1.5)
        )


def test_upstream_refusals_are_refused():
    with pytest.raises(ValueError, match="attn_proj cannot be set"):
        estimate_memory(MOE, replace(Setup(num_gpus=1), offload_modules=("attn_proj",)))
    with pytest.raises(ValueError, match="cannot be enabled with cpu_offloading"):
        estimate_memory(MOE, replace(Setup(num_gpus=1), offload_modules=("expert_fc1",), activation_offload_layers=2))
    with pytest.raises(ValueError, match="Invalid choices"):
        estimate_memory(MOE, replace(Setup(num_gpus=1), offload_modules=("dense_mlp",)))


def test_copies_the_link_cannot_hide_cost_step_time():
    assert fine_grained.exposed_copy_s(100, 10.0, 20.0) == 0.0
    assert fine_grained.exposed_copy_s(300, 10.0, 20.0) == pytest.approx(10.0)  # 30 s copy, 20 s fwd, 40 s bwd


# ------------------------------------------------------------------------------------------- estimate / recommend


def test_estimate_takes_the_fine_grained_inputs():
    base = service.estimate_for_inputs(**DSV3)
    with_fg = service.estimate_for_inputs(**DSV3, offload_modules=["expert_fc1"])
    assert with_fg.memory_gb.activations < base.memory_gb.activations and with_fg.host_gb > base.host_gb
    assert with_fg.offload_modules == ["expert_fc1"] and base.offload_modules == []
    off = service.estimate_for_inputs(**DSV3, offload_modules=["expert_fc1"], fine_grained_activation_offloading=False)
    assert off.memory_gb.total == base.memory_gb.total  # the modules are inert with the switch off


def test_recommend_proposes_fine_grained_where_layer_level_is_refused():
    rec = plan.recommend(resolve(DSV3))
    assert rec.mode == "fine-grained" and rec.fits and rec.offload_modules[0] == "expert_fc1"
    assert "model.fine_grained_activation_offloading=true" in rec.overrides
    assert "model.transformer_impl=transformer_engine" in rec.overrides
    assert "env_vars.NVTE_CPU_OFFLOAD_V1=1" in rec.overrides
    assert any("Pipeline parallelism" in line for line in rec.rationale)


def test_the_recommended_overrides_pass_the_rule_catalogue():
    rec = plan.recommend(resolve(DSV3))
    raw = {
        "model": {
            "num_layers": 61,
            "pipeline_model_parallel_size": 4,
            "pipeline_dtype": "bf16",
            "multi_latent_attention": True,
            "num_moe_experts": 256,
            "expert_model_parallel_size": 64,
            "recompute_granularity": "selective",
            "recompute_modules": ["mla_up_proj"],
        }
    }
    sources.apply_overrides(raw, rec.overrides)
    report = validate(sources.build_config(raw, "<recommended>"), raw)
    assert report.errors == []


def test_recommend_keeps_layer_level_offload_where_it_is_allowed():
    rec = plan.recommend(resolve({"model": "llama3-8b", "gpu_memory_gb": 24, "pp": 1, "recompute_granularity": "none"}))
    assert rec.mode in ("activation", "optimizer", "both") and rec.offload_modules == []


def test_fine_grained_and_optimizer_offload_together_when_neither_alone_fits():
    rec = plan.recommend(resolve({"model": "qwen3-30b-a3b", "recompute_granularity": "none", "gpu_memory_gb": 44}))
    together = [o for o in rec.options if o.levers == ["fine-grained", "optimizer"] and o.fits]
    assert rec.fits and together and together[0].alternative is False
    assert "optimizer.optimizer_cpu_offload=true" in together[0].overrides
    assert any(o.startswith("model.offload_modules=[expert_fc1") for o in together[0].overrides)


def test_no_fine_grained_set_under_full_recompute():
    from mbridge_offload.plan.search import fine_grained_plan

    s = Setup(num_gpus=16, pp=2, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    assert fine_grained_plan.useful_sets(model_preset("qwen3-30b-a3b"), s, {}) == []


# ------------------------------------------------------------------------------------------- apply


MOE_YAML = """\
# a MoE run
model:
  num_layers: 48
  num_moe_experts: 128
  pipeline_model_parallel_size: 2
  pipeline_dtype: bf16
optimizer:
  lr: 0.0003
"""


def test_apply_fine_grained_writes_a_config_that_validates(tmp_path):
    src = tmp_path / "run.yaml"
    src.write_text(MOE_YAML)
    out = tmp_path / "out.yaml"
    result = apply_offload(str(src), "fine-grained", modules="expert_fc1,moe_act", output=str(out))
    assert result.ok and result.written
    keys = {c.key: c.new for c in result.changes}
    assert keys["model.fine_grained_activation_offloading"] is True
    assert keys["model.offload_modules"] == ["expert_fc1", "moe_act"]
    assert keys["env_vars.NVTE_CPU_OFFLOAD_V1"] == 1
    assert "# a MoE run" in out.read_text() and src.read_text() == MOE_YAML
    assert not [f for f in result.findings if f["severity"] == "error"]


def test_apply_fine_grained_defaults_to_expert_fc1_on_moe(tmp_path):
    result = apply_offload(MOE_YAML, "fine-grained")
    assert {c.key: c.new for c in result.changes}["model.offload_modules"] == ["expert_fc1"]


@pytest.mark.parametrize(
    ("modules", "extra", "match"),
    [
        ("attn_proj", None, "without core_attn"),
        ("dense_mlp", None, "Invalid choices"),
        ("core_attn,attn_proj", "model.cuda_graph_impl=local", "cuda_graph_impl='local'"),
        ("expert_fc1", "model.recompute_granularity=selective", None),
    ],
)
def test_apply_fine_grained_refuses_what_upstream_refuses(modules, extra, match):
    overrides = [extra] if extra else []
    if match is None:
        apply_offload(MOE_YAML, "fine-grained", modules=modules, overrides=overrides)
        return
    with pytest.raises(ApplyError, match=match):
        apply_offload(MOE_YAML, "fine-grained", modules=modules, overrides=overrides)


def test_apply_modules_need_the_fine_grained_mode():
    with pytest.raises(ApplyError, match="modules apply to fine-grained"):
        apply_offload(MOE_YAML, "optimizer", modules="expert_fc1")


# ------------------------------------------------------------------------------------------- published figures


@pytest.mark.parametrize("check", published_fine_grained.evaluate(), ids=lambda c: c.id)
def test_published_fine_grained_figures_fall_within_their_stated_tolerance(check):
    assert check.passed, f"{check.id}: ours {check.value:.4f} outside {check.low:.4f}…{check.high:.4f}"


def test_the_recipe_rows_show_what_their_modules_save():
    rows = published_fine_grained.render_recipe_rows()
    assert "expert_fc1" in rows and "fused_group_mlp" in rows and "not estimated" in rows
    row = published_fine_grained.recipe_row("dsv3-gb200-expert-fc1")
    assert row.saving_gb and row.saving_gb > 0 and row.host_gb and row.host_gb > 0


def test_dense_models_get_only_modules_that_free_something():
    from mbridge_offload.plan.search import fine_grained_plan

    s = Setup(num_gpus=2, pp=2)
    sets = fine_grained_plan.useful_sets(DENSE, s, {})
    assert sets and all("expert_fc1" not in mods and "mlp_norm" not in mods for mods in sets)
    assert sets[0] == ("core_attn", "attn_proj")
