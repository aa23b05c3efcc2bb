"""The planner's decisions and the time model."""

from __future__ import annotations

from pathlib import Path

import pytest

from mbridge_offload.config import sources
from mbridge_offload.plan import service
from mbridge_offload.plan.inputs.hardware import GPU_PRESETS, LINK_EFFICIENCY, gpu_preset, with_overrides
from mbridge_offload.plan.inputs.presets import model_preset
from mbridge_offload.plan.inputs.resolve import resolve
from mbridge_offload.plan.memory.stage import estimate_memory
from mbridge_offload.plan.model.run import Setup
from mbridge_offload.plan.search import planner as plan
from mbridge_offload.plan.time.step import DEFAULT_CPU_ADAM_PARAMS_PER_S_PER_CORE, cpu_adam_rate, estimate_time

H100 = gpu_preset("h100-80gb")
# Upstream card: step time at 25/50/75/100 % optimizer offload on a 996 ms baseline (no overlap), and 100 % + overlap.
MEASURED_STEP_MS = {0.25: 1871, 0.5: 2484, 0.75: 3187, 1.0: 4189}
MEASURED_OVERLAP_100_MS = 3877


def _rec(**flags):
    return plan.recommend(resolve(flags))


def test_the_cards_own_setup_gets_none():
    # Upstream ran Qwen3-30B-A3B (TP2 PP2 EP4, full recompute) on 80 GB H100s without any offload: 47.2 GiB.
    rec = _rec(model="qwen3-30b-a3b", gpu="h100-80gb")
    assert rec.mode == "none" and rec.fits and rec.overrides == []
    assert rec.memory_gib.before.total == pytest.approx(47.2, rel=0.05)
    # The same with every recipe setting spelled out as inputs (as the README's command does).
    same = _rec(model="qwen3-30b-a3b", gpu="h100-80gb", num_gpus=16, tp=2, pp=2, ep=4, etp=1)
    assert same.model_dump(exclude={"assumptions"}) == rec.model_dump(exclude={"assumptions"})


def test_qwen_on_a_small_gpu_gets_the_smallest_fraction_that_fits():
    rec = _rec(model="qwen3-30b-a3b", gpu_memory_gb=48)
    assert rec.mode == "optimizer" and rec.fits
    fraction = rec.optimizer_offload_fraction
    assert 0 < fraction < 1
    assert f"optimizer.optimizer_offload_fraction={fraction}" in rec.overrides
    assert rec.memory_gib.after.total <= rec.budget_gib < rec.memory_gib.before.total
    assert any("no support for Pipeline parallelism with CPU offloading (ACT-PP)" in r for r in rec.rationale)
    smaller = plan.estimate(
        resolve({"model": "qwen3-30b-a3b", "gpu_memory_gb": 48, "optimizer_offload_fraction": fraction - 0.05})
    )
    assert smaller.memory_gib.total > rec.budget_gib  # one grid step less does not keep the margin


def test_config_that_fits_gets_none_on_h200():
    rec = _rec(model="qwen3-30b-a3b", gpu="h200-141gb", recompute_granularity="none")
    assert rec.mode == "none" and rec.overrides == [] and rec.fits and rec.step_time_factor == 1.0


def test_without_recompute_the_same_model_needs_more_memory():
    full = _rec(model="qwen3-30b-a3b")
    none = _rec(model="qwen3-30b-a3b", recompute_granularity="none")
    assert none.memory_gib.before.activations > 3 * full.memory_gib.before.activations


def test_small_model_with_dominant_activations_gets_activation_offload():
    # Offload levers only: with recompute allowed, full recompute is faster here (tests/plan/test_options.py).
    flags = {"model": "qwen3-0.6b", "num_gpus": 1, "seq_length": 16384, "micro_batch_size": 4}
    rec = _rec(**flags, levers=["activation,optimizer,fine-grained"])
    assert rec.mode == "activation" and rec.fits
    k = rec.activation_offload_layers
    assert 0 < k < 28
    assert f"model.cpu_offloading_num_layers={k}" in rec.overrides and "model.cpu_offloading=true" in rec.overrides
    # one layer less does not keep the margin (an estimate's fits has none)
    assert plan.estimate(resolve({**flags, "activation_offload_layers": k - 1})).memory_gib.total > rec.budget_gib


def test_cuda_graphs_block_activation_offload():
    rec = _rec(
        model="qwen3-0.6b", num_gpus=1, seq_length=16384, micro_batch_size=4, cuda_graph_impl="transformer_engine"
    )
    assert rec.mode != "activation"
    assert any("CUDA graphs not supported with CPU offloading. (ACT-CUDA-GRAPH)" in r for r in rec.rationale)


def test_nothing_fits_says_what_would_with_numbers():
    # Local CUDA graphs over whole layers rule out fine-grained offloading too (with it, this run fits: see
    # tests/plan/test_fine_grained.py), so only optimizer offload is left.
    rec = _rec(model="qwen3-30b-a3b", recompute_granularity="none", gpu_memory_gb=44, cuda_graph_impl="local")
    assert not rec.fits and rec.mode == "optimizer"
    assert any(s.startswith("PP=4") and "GiB per GPU" in s for s in rec.suggestions)
    assert any("recompute_granularity=full" in s for s in rec.suggestions)


def test_recommend_for_bridge_yaml_revalidates_overrides():
    loaded = sources.load("examples/qwen3_30b_a3b_pretrain.yaml")
    rec = service.recommend_for_inputs(loaded.config, loaded.raw, num_gpus=16, gpu_memory_gb=48)
    assert rec.mode == "optimizer"
    data = rec.model_dump(mode="json")
    assert set(data) >= {"mode", "overrides", "memory_gb", "fits", "step_time_factor", "rationale"}
    assert set(data["memory_gb"]["before"]) == {"weights", "gradients", "optimizer", "activations", "other", "total"}
    assert any("rule catalogue" in r for r in rec.rationale)


def test_recommend_replans_a_config_whose_activation_offload_upstream_rejects(tmp_path):
    bad = tmp_path / "bad.yaml"
    text = Path("examples/qwen3_30b_a3b_pretrain.yaml").read_text()
    bad.write_text(
        text.replace(
            "recompute_granularity: full",
            "recompute_granularity: null\n  cpu_offloading: true\n  cpu_offloading_num_layers: 24",
        )
    )
    loaded = sources.load(str(bad))
    assert loaded.config.model.cpu_offloading and loaded.config.model.pipeline_model_parallel_size == 2
    with pytest.raises(ValueError, match="Pipeline parallelism"):
        plan.estimate(resolve({"num_gpus": 16}, loaded.config, loaded.raw))
    rec = service.recommend_for_inputs(loaded.config, loaded.raw, num_gpus=16, gpu_memory_gb=48)
    # Layer-level offload is refused at PP 2; fine-grained offloading with optimizer offload fits, and so does full
    # recompute with a smaller fraction, within 2 % of its step and with less host RAM and fewer changes: the risk
    # tie-break (plan/search/risks.py) puts that first. Both switch the config's layer-level offloading off.
    assert rec.fits and rec.mode in ("optimizer", "fine-grained+optimizer")
    assert any(o.levers == ["fine-grained", "optimizer"] and o.fits for o in rec.options)
    assert "model.cpu_offloading=true" not in rec.overrides and "model.cpu_offloading=false" in rec.overrides
    assert not any(o.startswith("model.cpu_offloading_num_layers") for o in rec.overrides)
    assert any("pass the rule catalogue" in r for r in rec.rationale)
    assert rec.given_mode == "both" and rec.memory_gib.before == rec.memory_gib.without_offload


def test_partial_yaml_without_optimizer_keys_gets_bridge_defaults_and_says_so(tmp_path):
    cfg = tmp_path / "m.yaml"
    cfg.write_text("model:\n  num_layers: 4\n  hidden_size: 256\n  num_attention_heads: 4\n  vocab_size: 1000\n")
    loaded = sources.load(str(cfg))
    r = resolve({}, loaded.config, loaded.raw)
    assert r.setup.distributed_optimizer and r.setup.grad_reduce_in_fp32
    assert r.model.ffn_hidden_size == 1024 and r.model.tied_embeddings
    sources_of = {a.name: a.source for a in r.assumptions}
    assert sources_of["num_layers"] == "config" and sources_of["grad_reduce_in_fp32"] == "default"
    assert sources_of["etp"] == "default" and r.setup.etp == r.setup.tp
    assert any(a.note and "Bridge recipes" in a.note for a in r.assumptions if a.name == "grad_reduce_in_fp32")


# ------------------------------------------------------------------------------------ time model


def _qwen_factor(fraction: float, overlap: bool) -> float:
    flags = {
        "model": "qwen3-30b-a3b",
        "baseline_step_s": 0.996,
        "optimizer_offload_fraction": fraction,
        "overlap": overlap,
    }
    # The card divides by its own baseline, which keeps the recipe's full recompute; step_time_factor divides by the
    # run without any lever (recompute off too), so the card's factor is the step over the step without offload.
    t = plan.estimate(resolve(flags)).time_s
    return t.step / t.without_offload


@pytest.mark.parametrize("fraction", sorted(MEASURED_STEP_MS))
def test_step_factor_within_10_percent_of_the_card(fraction):
    assert _qwen_factor(fraction, overlap=False) == pytest.approx(MEASURED_STEP_MS[fraction] / 996, rel=0.10)


def test_overlap_hides_the_copies_not_the_cpu_step():
    no, yes = _qwen_factor(1.0, False), _qwen_factor(1.0, True)
    assert yes < no
    assert yes == pytest.approx(MEASURED_OVERLAP_100_MS / 996, rel=0.10)
    assert (no - yes) / no < 0.15  # upstream: about 7 %


def test_nvlink_c2c_makes_copies_cheap():
    est = estimate_memory(model_preset("llama3-8b"), Setup(num_gpus=8, optimizer_offload_fraction=1.0))
    pcie = estimate_time(est, H100, overlap=False, baseline_s=1.0)
    c2c = estimate_time(est, gpu_preset("gh200"), overlap=False, baseline_s=1.0)
    # Measured on GH200 (NVIDIA/Megatron-LM#6491): GPU->CPU ~170 GB/s, CPU->GPU ~415 GB/s, against PCIe Gen5's ~44.
    assert c2c.d2h_s < pcie.d2h_s / 3
    assert c2c.h2d_s < pcie.h2d_s / 8


def test_measured_host_link_replaces_the_nominal_one_per_direction():
    gh200 = gpu_preset("gh200")
    assert gh200.d2h_effective_gbps == pytest.approx(170.0)
    assert gh200.h2d_effective_gbps == pytest.approx(415.0)
    assert gh200.link_effective_gbps == pytest.approx(170.0)  # the slower direction
    stated = with_overrides(gh200, link_gbps=450.0)  # a stated link drops the measured figures
    assert stated.d2h_effective_gbps == pytest.approx(450.0 * LINK_EFFICIENCY)


def test_every_gpu_preset_says_where_its_figures_come_from():
    for preset in GPU_PRESETS.values():
        assert preset.source, preset.name
    assert {"gb200", "gb300", "b300"} <= set(GPU_PRESETS)
    assert gpu_preset("gb200").capacity_gib == pytest.approx(184.31)
    assert gpu_preset("b300").capacity_gib == pytest.approx(267.69)


def test_cpu_adam_rate_takes_the_callers_rate_else_the_preset_else_the_default():
    assert cpu_adam_rate(3, 2.0e9) == 6.0e9
    assert cpu_adam_rate(2, None, 1.5e9) == 3.0e9
    assert cpu_adam_rate(1) == DEFAULT_CPU_ADAM_PARAMS_PER_S_PER_CORE


def test_gpu_presets_cover_the_issue_list():
    assert {"h100-80gb", "h200-141gb", "gh200", "a100-80gb", "b200"} <= set(GPU_PRESETS)
    assert gpu_preset("H200-141GB").hbm_gb == 141
    # What CUDA exposes, not the marketed size (PyTorch's "total capacity of X GiB").
    assert gpu_preset("h100-80gb").capacity_gib == pytest.approx(79.1, abs=0.05)
    assert gpu_preset("h200-141gb").capacity_gib == pytest.approx(139.8, abs=0.05)
    with pytest.raises(KeyError, match="known"):
        gpu_preset("tpu-v5")


def test_recommend_never_proposes_what_the_catalogue_warns_about():
    # 80 layers, nothing fits: the most activation offload proposed is 78, not 79 (TE's ACT-NO-OVERLAP warning).
    flags = {"model": "llama3-70b", "num_gpus": 8, "tp": 8, "pp": 1, "recompute_granularity": None}
    rec = _rec(**flags, gpu_memory_gb=48, seq_length=8192)
    layers = [o for o in rec.options if "activation" in o.levers]
    assert layers and all("model.cpu_offloading_num_layers=78" in o.overrides for o in layers)
    assert any("ACT-NO-OVERLAP" in line for line in rec.rationale if line.startswith("not proposed"))


def test_a_run_that_fits_gets_a_fallback_for_a_stated_headroom():
    rec = _rec(model="qwen3-30b-a3b", gpu="h100-80gb")
    assert rec.mode == "none" and rec.fallback is not None
    f = rec.fallback
    assert f.freed_gib >= f.headroom_gib and f.step_time_factor > 1 and f.overrides
    asked = _rec(model="qwen3-30b-a3b", gpu="h100-80gb", headroom_gib=2.0).fallback
    assert asked.headroom_gib == 2.0 and asked.freed_gib >= 2.0 and asked.step_time_factor <= f.step_time_factor


def test_recommend_compares_against_the_config_as_given_and_says_it_removes_its_offload():
    loaded = sources.load("examples/qwen3_30b_a3b_pretrain.yaml")
    rec = service.recommend_for_inputs(loaded.config, loaded.raw, num_gpus=16)
    assert rec.given_mode == "optimizer" and rec.mode == "none"
    assert rec.memory_gib.before.total < rec.memory_gib.after.total == rec.memory_gib.without_offload.total
    assert "switch that offload off" in rec.advice and rec.advice in rec.rationale
    assert "optimizer.optimizer_cpu_offload=false" in rec.overrides
    assert rec.gpu == "h100-80gb" and rec.num_gpus == 16


def test_cli_and_mcp_share_one_planner_entry_point():
    import inspect

    from mbridge_offload.plan import service
    from mbridge_offload_tools.cli import plan as cli_plan
    from mbridge_offload_tools.server import app as server

    # One body for both surfaces (plan.service.plan_answer), and it calls the planner's one entry point.
    body = inspect.getsource(service.plan_answer)
    assert "plan(kind, " in body and "revalidate" not in body and "resolve(" not in body
    for module in (cli_plan, server):
        text = inspect.getsource(module)
        assert "plan_answer" in text and "revalidate" not in text and "resolve(" not in text
