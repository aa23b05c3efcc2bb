"""The levers a Megatron user tries first, from one search (plan/search/sweeps.py, levers.py, risks.py, options.py):
each new lever's edit, its memory from the planner's model checked against ``estimate`` with the edit written, and the
one sort key with its risk tie-break."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from mbridge_offload.config import sources
from mbridge_offload.config.errors import InputError
from mbridge_offload.plan import service
from mbridge_offload.plan.inputs.hardware import DEFAULT_MARGIN
from mbridge_offload.plan.inputs.presets import model_preset
from mbridge_offload.plan.model.run import Setup
from mbridge_offload.plan.results import MemoryBreakdown, Option, Recommendation
from mbridge_offload.plan.search import levers, options, sweeps

ALL = ",".join(levers.LEVERS)
SFT_YAML = """\
model:
  seq_length: 16384
  tensor_model_parallel_size: 1
train:
  micro_batch_size: 1
  global_batch_size: 64
"""
SFT = {"model": "llama3-8b", "gpu": "h100-80gb", "num_gpus": 8}
OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB "
    "of which 1.10 GiB is free. Of the allocated memory 70.30 GiB is allocated by PyTorch, and {frag} GiB is reserved "
    "by PyTorch but unallocated.\n"
)


def _loaded(tmp_path: Path, text: str = SFT_YAML) -> sources.LoadedConfig:
    path = tmp_path / "run.yaml"
    path.write_text(text, encoding="utf-8")
    return sources.load(str(path))


def _recommend(loaded: sources.LoadedConfig, **flags) -> Recommendation:
    rec = service.plan("recommend", flags, loaded.config, loaded.raw)
    assert isinstance(rec, Recommendation)
    return rec


def _estimate_with(loaded: sources.LoadedConfig, overrides: list[str], **flags):
    raw = copy.deepcopy(loaded.raw)
    sources.apply_overrides(raw, overrides)
    return service.plan("estimate", flags, sources.build_config(raw, "<option>"), raw)


def _option(levers_: list[str], step: float, overrides: int, risk: float, fits: bool = True, total: float = 50.0):
    return Option(
        rank=0,
        changes=[],
        overrides=[f"k{i}=1" for i in range(overrides)],
        levers=levers_,
        memory_gib=MemoryBreakdown(weights=0, gradients=0, optimizer=0, activations=0, other=total, total=total),
        stages_gib=[],
        host_gb=0.0,
        host_gb_per_node=0.0,
        step_time_s=step,
        step_time_factor=1.0,
        step_time_factor_vs_no_levers=1.0,
        fits=fits,
        margin_gib=1.0,
        comfortable=False,
        alternative=False,
        changes_layout=False,
        risk=risk,
        why="",
    )


# ---------------------------------------------------------------------------------------------- new levers


@pytest.mark.parametrize(
    ("lever", "written"),
    [
        ("grad-reduce", {"ddp.grad_reduce_in_fp32=false"}),
        ("ce-fusion", {"model.cross_entropy_loss_fusion=true", "model.cross_entropy_fusion_impl=te"}),
    ],
)
def test_a_switch_lever_writes_its_keys_and_its_memory_is_estimate_with_them(tmp_path, lever, written):
    loaded = _loaded(tmp_path)
    run = {**SFT, "te_version": "2.17"}  # TE's fused cross entropy saves memory before 2.18 only
    rec = _recommend(loaded, **run, levers=["recompute,activation,fine-grained,optimizer,grad-reduce,ce-fusion"])
    pulled = [o for o in rec.options if lever in o.levers]
    assert pulled, [o.levers for o in rec.options]
    for option in pulled:
        assert written <= set(option.overrides), option.overrides
        est = _estimate_with(loaded, option.overrides, **run)
        assert est.memory_gib.total == pytest.approx(option.memory_gib.total, abs=0.01), option.why


def test_te_cross_entropy_is_not_offered_from_te_2_18_where_it_keeps_an_fp32_gradient_too(tmp_path):
    from mbridge_offload.config.errors import InputError

    loaded = _loaded(tmp_path)
    with pytest.raises(InputError, match=r"ce-fusion: from Transformer Engine 2\.18"):
        _recommend(loaded, **SFT, te_version="2.18", levers=["ce-fusion"])
    assert _recommend(loaded, **SFT, te_version="2.17.1", levers=["ce-fusion"]).options


def test_bf16_gradient_reduction_halves_the_gradient_buffers(tmp_path):
    loaded = _loaded(tmp_path)
    fp32 = _estimate_with(loaded, [], **SFT)
    bf16 = _estimate_with(loaded, ["ddp.grad_reduce_in_fp32=false"], **SFT)
    assert bf16.memory_gib.gradients == pytest.approx(fp32.memory_gib.gradients / 2, rel=1e-3)


def test_selective_recompute_sets_hold_only_modules_the_models_layers_have():
    moe, dense = model_preset("qwen3-30b-a3b"), model_preset("llama3-8b")
    moe_modules = {m for s in sweeps.recompute_module_sets(moe, Setup(num_gpus=16, ep=8)) for m in s}
    dense_modules = {m for s in sweeps.recompute_module_sets(dense, Setup()) for m in s}
    assert "mlp" not in moe_modules and "moe" in moe_modules  # every Qwen3-30B-A3B layer is MoE
    assert "moe" not in dense_modules and "moe_act" not in dense_modules and "mlp" in dense_modules
    assert "mla_up_proj" not in moe_modules | dense_modules  # neither has multi-latent attention
    mla = {m for s in sweeps.recompute_module_sets(model_preset("deepseek-v3"), Setup(num_gpus=64, ep=64)) for m in s}
    assert "mla_up_proj" in mla


def test_a_module_the_catalogue_refuses_does_not_spoil_the_larger_sets():
    moe = model_preset("qwen3-30b-a3b")
    sets = sweeps.recompute_module_sets(moe, Setup(num_gpus=16, ep=8), lambda s: "moe_act" in s.recompute_modules)
    assert sets and all("moe_act" not in s for s in sets) and "moe" in sets[-1]


def test_vpp_offers_interleaving_off_or_one_step_either_way():
    m = model_preset("llama3-8b")  # 32 layers: 16 per stage at PP 2
    assert [s.vpp for s in levers.switch_variants("vpp", m, Setup(pp=2))] == [2]
    assert [s.vpp for s in levers.switch_variants("vpp", m, Setup(pp=2, vpp=4))] == [None, 2, 8]
    assert levers.switch_variants("vpp", m, Setup(pp=1)) == []


def test_expandable_segments_is_offered_only_where_an_oom_shows_fragmentation(tmp_path):
    flags = {"model": "qwen3-30b-a3b", "gpu": "h100-80gb"}
    log = tmp_path / "oom.log"
    log.write_text(OOM.format(frag="6.20"), encoding="utf-8")
    rec = service.plan("recommend", {**flags, "measured_log": str(log)})
    assert isinstance(rec, Recommendation)
    (option,) = [o for o in rec.options if o.levers == ["expandable-segments"]]
    assert option.overrides == ["env_vars.PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"] and option.alternative
    assert option.budget_gib > rec.budget_gib  # the static-shape allocator overhead, an assumption said in risks
    log.write_text(OOM.format(frag="0.20"), encoding="utf-8")
    with pytest.raises(InputError, match="expandable-segments: no out-of-memory message"):
        service.plan("recommend", {**flags, "measured_log": str(log), "levers": ["expandable-segments"]})


def test_an_unknown_lever_is_still_bad_input_and_new_names_are_additive():
    assert levers.parse(["grad_reduce,ce-fusion"]) == (("grad-reduce", "ce-fusion"), True)
    assert levers.parse(None)[0] == ("recompute", "activation", "fine-grained", "optimizer")
    with pytest.raises(InputError, match="unknown lever 'swap'"):
        levers.parse(["swap"])


# ---------------------------------------------------------------------------------------------- the sort key


def test_a_one_change_option_leads_an_eight_override_offload_of_near_equal_step_time():
    risky = _option(["optimizer", "activation"], 10.0, 8, risk=0.03 * 0.46 + 0.005 * 7 + 0.01 + 0.02)
    simple = _option(["recompute"], 10.3, 1, risk=0.01)
    assert sorted([risky, simple], key=options.sort_key)[0] is simple


def test_a_clearly_faster_option_still_leads_whatever_it_risks():
    risky = _option(["optimizer", "activation"], 8.0, 8, risk=0.08)
    simple = _option(["recompute"], 10.0, 1, risk=0.0)
    assert sorted([simple, risky], key=options.sort_key)[0] is risky


def test_fitting_before_not_and_among_those_that_do_not_the_lowest_peak_first():
    no = _option(["optimizer"], 1.0, 1, risk=0.0, fits=False, total=90.0)
    closer = _option(["activation"], 5.0, 1, risk=0.0, fits=False, total=80.0)
    fits = _option(["recompute"], 9.0, 1, risk=0.0)
    assert sorted([no, closer, fits], key=options.sort_key) == [fits, closer, no]


def test_every_answer_states_its_ranking_and_each_option_its_risks(tmp_path):
    rec = _recommend(_loaded(tmp_path), **SFT)
    assert rec.ranking == options.RANKING and "risk" in rec.ranking
    changed = [o for o in rec.options if o.changes]
    assert changed and all(o.risks for o in changed if o.risk > 0)
    assert all(o.fits == (o.memory_gib.total <= o.budget_gib) for o in rec.options)


def test_a_config_that_sets_expandable_segments_is_judged_with_its_yardstick_in_estimate_and_recommend(tmp_path):
    flags = {"model": "qwen3-30b-a3b", "gpu": "h100-80gb"}
    log = tmp_path / "oom.log"
    log.write_text(OOM.format(frag="6.20"), encoding="utf-8")
    rec = service.plan("recommend", {**flags, "measured_log": str(log)})
    assert isinstance(rec, Recommendation)
    (option,) = [o for o in rec.options if o.levers == ["expandable-segments"]]
    written = _loaded(tmp_path, "env_vars:\n  PYTORCH_CUDA_ALLOC_CONF: expandable_segments:True\n")
    est = service.plan("estimate", flags, written.config, written.raw)
    plain = service.plan("estimate", flags)
    assert est.budget_gib == pytest.approx(option.budget_gib / (1 - DEFAULT_MARGIN), abs=0.01)
    assert est.budget_gib > plain.budget_gib
