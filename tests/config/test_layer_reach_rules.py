"""The rules for settings megatron-core accepts and then ignores (``config/rules/activation/layer_reach.py``).

Each message names the upstream class and file the table cites for the config's release; the rules fire on a hybrid
stack however the config says so (either pattern key, a Bridge hybrid provider, Megatron-LM's ``--is-hybrid-model``)
and never on a GPT model, over a generated corpus; each fix, applied, clears its finding.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mbridge_offload.config.sources import apply_overrides, build_config, load
from mbridge_offload.config.validate import validate
from mbridge_offload.upstream_layers import cell
from mbridge_offload.upstream_sites import STACK_CLASS
from tests.support import tree

TARGETS = {"megatron-core==0.16.1": "0.16.1", "megatron-core==0.19.2": "0.19.2", "main": "0.19.2"}
OFFLOAD = {"cpu_offloading": True, "cpu_offloading_num_layers": 2}


def _report(model: dict, target: str = "megatron-core==0.19.2", **sections):
    raw = {"model": {"num_layers": 8, **model}, **sections}
    return validate(build_config(raw), raw, target=target), raw


def _rule(report, rule: str):
    return [f for f in report.findings if f.rule == rule]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(
    "hybrid",
    [
        {"hybrid_layer_pattern": "M*M-M*ME", "num_moe_experts": 4},
        {"hybrid_override_pattern": "M*M-M*M-"},
        {"_target_": "megatron.bridge.models.hybrid.hybrid_provider.HybridModelProvider"},
        {"_target_": "megatron.bridge.models.nemotronh.nemotron_h_provider.NemotronHModelProvider8B"},
    ],
    ids=["0.19-pattern", "0.16-pattern", "hybrid-provider", "nemotron-h-provider"],
)
def test_layer_offload_on_a_hybrid_stack_warns_naming_the_releases_class_and_file(target, hybrid):
    report, raw = _report({**hybrid, **OFFLOAD}, target)
    (finding,) = _rule(report, "ACT-HYBRID-LAYER-OFFLOAD")
    release = TARGETS[target]
    name, path = STACK_CLASS[release]
    assert finding.severity == "warning" and report.ok
    assert name in finding.message and cell("cpu_offloading", "hybrid", release).site.where in finding.message
    assert path.endswith(("ssm/mamba_block.py", "hybrid/hybrid_block.py"))
    assert finding.fix == ["model.cpu_offloading=false"]
    fixed = apply_overrides(raw, finding.fix)
    assert not _rule(validate(build_config(fixed), fixed, target=target), "ACT-HYBRID-LAYER-OFFLOAD")


def test_the_fix_points_at_fine_grained_offload_only_where_it_reaches_the_stack():
    new, _ = _report({"hybrid_layer_pattern": "M*M-M*M-", **OFFLOAD})
    old, _ = _report({"hybrid_layer_pattern": "M*M-M*M-", **OFFLOAD}, "megatron-core==0.16.1")
    assert "reaches the stack's attention, MLP and MoE layers" in _rule(new, "ACT-HYBRID-LAYER-OFFLOAD")[0].message
    assert "does not reach a hybrid stack either" in _rule(old, "ACT-HYBRID-LAYER-OFFLOAD")[0].message


def _corpus(seed: int, n: int) -> list[dict]:
    """GPT and hybrid models with random offload and recompute settings."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        layers = rng.choice((4, 8, 12))
        model: dict = {"num_layers": layers}
        if rng.random() < 0.5:
            key = rng.choice(("hybrid_layer_pattern", "hybrid_override_pattern"))
            model[key] = "".join(rng.choice("M*-") for _ in range(layers))
        if rng.random() < 0.5:
            model.update(cpu_offloading=True, cpu_offloading_num_layers=rng.randrange(1, layers))
        if rng.random() < 0.4:
            model.update(recompute_granularity="full", recompute_method=rng.choice(("uniform", "block")))
            model["recompute_num_layers"] = 1
        if rng.random() < 0.3:
            model.update(mtp_num_layers=rng.choice((1, 2)))
        out.append(model)
    return out


@pytest.mark.parametrize("target", ["megatron-core==0.16.1", "megatron-core==0.19.2"])
def test_the_rules_fire_exactly_where_the_table_says_over_a_generated_corpus(target):
    release = TARGETS[target]
    seen: dict[str, int] = {}
    for model in _corpus(28, 60):
        report = validate(build_config({"model": model}), {"model": model}, target=target)
        fired = {f.rule for f in report.findings}
        hybrid = any(k in model for k in ("hybrid_layer_pattern", "hybrid_override_pattern"))
        method = model.get("recompute_method")
        expected = {
            "ACT-HYBRID-LAYER-OFFLOAD": bool(model.get("cpu_offloading")) and hybrid,
            "ACT-HYBRID-FULL-RECOMPUTE": bool(method)
            and hybrid
            and cell(f"recompute:full-{method}", "hybrid", release).verdict == "no effect",
            "ACT-MTP-RECOMPUTE-BLOCK": bool(model.get("mtp_num_layers"))
            and bool(method)
            and cell(f"recompute:full-{method}", "mtp", release).verdict == "no effect",
        }
        for rule, expect in expected.items():
            assert (rule in fired) is expect, (rule, model, fired)
            seen[rule] = seen.get(rule, 0) + expect
    # The corpus reaches every rule that can fire on this release (full recompute is ignored on 0.16.1 only).
    assert seen["ACT-HYBRID-LAYER-OFFLOAD"] and seen["ACT-MTP-RECOMPUTE-BLOCK"]
    assert bool(seen["ACT-HYBRID-FULL-RECOMPUTE"]) is (release == "0.16.1")


def test_fine_grained_and_full_recompute_on_a_hybrid_stack_warn_on_0_16_only():
    model = {
        "hybrid_override_pattern": "M*M-M*M-",
        "fine_grained_activation_offloading": True,
        "offload_modules": ["core_attn", "attn_proj"],
        "transformer_impl": "transformer_engine",
        "recompute_granularity": "full",
        "recompute_method": "block",
        "recompute_num_layers": 2,
    }
    old, _ = _report(model, "megatron-core==0.16.1")
    new, _ = _report(model, "megatron-core==0.19.2", env_vars={"NVTE_CPU_OFFLOAD_V1": 1})
    assert {"ACT-HYBRID-FINE-GRAINED", "ACT-HYBRID-FULL-RECOMPUTE"} <= {f.rule for f in old.findings}
    assert not {"ACT-HYBRID-FINE-GRAINED", "ACT-HYBRID-FULL-RECOMPUTE"} & {f.rule for f in new.findings}
    (fg,) = _rule(old, "ACT-HYBRID-FINE-GRAINED")
    assert "MambaModel" in fg.message and "mamba_model.py" in fg.message
    (full,) = _rule(old, "ACT-HYBRID-FULL-RECOMPUTE")
    assert "MambaStack" in full.message and "ssm/mamba_block.py" in full.message


@pytest.mark.parametrize("target", ["megatron-core==0.16.1", "megatron-core==0.19.2"])
def test_mtp_with_uniform_recompute_of_more_than_one_layer_is_refused(target):
    base = {"mtp_num_layers": 1, "recompute_granularity": "full", "recompute_method": "uniform"}
    bad, raw = _report({**base, "recompute_num_layers": 2}, target)
    (finding,) = _rule(bad, "MC-MTP-RECOMPUTE-LAYERS")
    assert not bad.ok and finding.message == "recompute_num_layers must be 1 for MTP recompute"
    assert finding.exception == "AssertionError" and finding.fix == ["model.recompute_num_layers=1"]
    fixed = apply_overrides(raw, finding.fix)
    assert validate(build_config(fixed), fixed, target=target).ok
    good, _ = _report({**base, "recompute_num_layers": 1}, target)
    without, _ = _report({**base, "recompute_num_layers": 2, "mtp_num_layers": 0}, target)
    assert good.ok and without.ok


def test_validate_on_the_cli_warns_and_exits_0_for_a_hybrid_offload_config(tmp_path: Path):
    path = tmp_path / "hybrid.yaml"
    path.write_text(yaml.safe_dump({"model": {"num_layers": 8, "hybrid_layer_pattern": "M*M-M*M-", **OFFLOAD}}))
    out = subprocess.run(
        [sys.executable, "-m", "mbridge_offload_tools", "validate", str(path), "--json"],
        capture_output=True, text=True, env={"PYTHONPATH": tree.pythonpath()}, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["ok"] and [f["rule"] for f in got["findings"]] == ["ACT-HYBRID-LAYER-OFFLOAD"]
    assert "HybridStack" in got["findings"][0]["message"]


@pytest.mark.parametrize("flag", ["--is-hybrid-model", "--hybrid-layer-pattern M*M-M*M-"])
def test_megatron_lm_hybrid_command_lines_are_hybrid_stacks_too(flag):
    loaded = load(argv=f"--num-layers 8 {flag} --cpu-offloading-num-layers 2".split())
    report = validate(loaded.config, loaded.raw)
    assert _rule(report, "ACT-HYBRID-LAYER-OFFLOAD")
    gpt = load(argv=["--num-layers", "8", "--cpu-offloading-num-layers", "2"])
    assert not _rule(validate(gpt.config, gpt.raw), "ACT-HYBRID-LAYER-OFFLOAD")


def test_the_lightning_recipe_hears_nothing_new_on_its_own_release():
    recipe = tree.ROOT / "tests/data/bridge-0.6.2/perf/nemotron_3_5_lightning_pretrain_16gpu_h100_bf16_config.yaml"
    loaded = load(str(recipe))
    rules = {f.rule for f in validate(loaded.config, loaded.raw, target="megatron-core==0.19.2").findings}
    assert not {r for r in rules if "HYBRID" in r or "MTP" in r}


# ---------------------------------------------------------------------------------------------- recompute modules

_SELECTIVE = {"recompute_granularity": "selective"}
_ALL_MOE = {"num_moe_experts": 8, "add_bias_linear": False, "moe_grouped_gemm": True}
_NO_EFFECT = "ACT-RECOMPUTE-MODULE-NO-EFFECT"


def _no_effect(model: dict, target: str = "megatron-core==0.19.2") -> list[str]:
    report, _ = _report({**_SELECTIVE, **model}, target)
    return [f.message.split(" includes ")[1].split(",")[0] for f in _rule(report, _NO_EFFECT)]


@pytest.mark.parametrize("target", ["megatron-core==0.16.1", "megatron-core==0.19.2"])
def test_mlp_recompute_on_an_all_moe_model_is_flagged(target):
    assert _no_effect({**_ALL_MOE, "recompute_modules": ["mlp", "moe"]}, target) == ["mlp"]


def test_moe_modules_on_a_dense_model_are_flagged():
    assert _no_effect({"recompute_modules": ["core_attn", "moe", "shared_experts"]}) == ["moe", "shared_experts"]


def test_mlp_recompute_reaches_the_dense_layers_of_a_mixed_moe_model():
    assert _no_effect({**_ALL_MOE, "moe_layer_freq": [0, 1, 1, 1], "recompute_modules": ["mlp", "moe"]}) == []


def test_moe_act_on_a_dense_model_is_flagged_where_megatron_core_accepts_it():
    assert _no_effect({"moe_grouped_gemm": True, "recompute_modules": ["moe_act"]}) == ["moe_act"]
    assert _no_effect({**_ALL_MOE, "recompute_modules": ["moe_act"]}) == []


def test_shared_experts_recompute_needs_shared_experts():
    assert _no_effect({**_ALL_MOE, "recompute_modules": ["shared_experts"]}) == ["shared_experts"]
    shared = {**_ALL_MOE, "moe_shared_expert_intermediate_size": 64, "recompute_modules": ["shared_experts"]}
    assert _no_effect(shared) == []


def test_layernorm_recompute_follows_the_layer_spec():
    assert _no_effect({"recompute_modules": ["layernorm"]}) == ["layernorm"]  # the TE spec fuses dense norms
    assert _no_effect({"recompute_modules": ["layernorm"], "transformer_impl": "local"}) == []
    assert _no_effect({**_ALL_MOE, "recompute_modules": ["layernorm"]}) == []  # the MoE pre-MLP norm is a module
    assert _no_effect({"recompute_modules": ["layernorm"], "multi_latent_attention": True}) == []


def test_mla_up_proj_without_mla_is_left_to_megatron_cores_refusal_not_flagged():
    # megatron-core refuses it (its own run in validate says so); a no-effect warning would misname the problem.
    report, _ = _report({**_SELECTIVE, "recompute_modules": ["mla_up_proj"]})
    assert not _rule(report, _NO_EFFECT)


def test_each_no_effect_verdict_is_the_tables():
    for module in ("core_attn", "mlp", "moe", "shared_experts"):
        for model, column in (({}, "dense"), (_ALL_MOE, "moe")):
            flagged = module in _no_effect(
                {**model, "recompute_modules": [module], "moe_shared_expert_intermediate_size": 64 if model else None}
            )
            side = "dense" if module == "core_attn" else column
            assert flagged == (cell(f"recompute_modules:{module}", side, "0.19.2").verdict != "applies"), (
                module,
                model,
            )


def test_the_no_effect_fix_clears_the_finding():
    report, raw = _report({**_SELECTIVE, **_ALL_MOE, "recompute_modules": ["mlp", "moe"]})
    (finding,) = _rule(report, _NO_EFFECT)
    fixed = apply_overrides(raw, finding.fix)
    assert not _rule(validate(build_config(fixed), fixed), _NO_EFFECT)


def test_selective_recompute_modules_on_a_hybrid_stack_are_left_to_the_hybrid_rules():
    assert _no_effect({"hybrid_layer_pattern": "M*-M*-M*-M*", "recompute_modules": ["moe"]}) == []
