"""``recommend``'s levers and ranked options (plan/search/levers.py, plan/search/options.py): what each option says,
checked
against ``estimate`` on the same config with the option's changes written into it."""

from __future__ import annotations

import copy
import shlex
from pathlib import Path

import pytest

from mbridge_offload.config import sources
from mbridge_offload.config.errors import InputError
from mbridge_offload.plan import service
from mbridge_offload.plan.inputs.hardware import PINNED_HOST_SHARE, gpu_preset
from mbridge_offload.plan.results import Recommendation

PERF = Path(__file__).resolve().parents[1] / "data" / "bridge-0.6.2" / "perf"
SFT = {"model": "llama3-8b", "gpu": "h100-80gb", "num_gpus": 8}
SFT_YAML = """\
model:
  seq_length: 16384
  tensor_model_parallel_size: 1
train:
  micro_batch_size: 1
  global_batch_size: 64
"""


def _config(tmp_path: Path, text: str) -> sources.LoadedConfig:
    path = tmp_path / "run.yaml"
    path.write_text(text, encoding="utf-8")
    return sources.load(str(path))


def _recommend(loaded, **flags) -> Recommendation:
    rec = service.plan("recommend", flags, loaded.config, loaded.raw)
    assert isinstance(rec, Recommendation)
    return rec


def _estimate_with(loaded, overrides: list[str], **flags):
    """``estimate`` on the config with ``overrides`` written into it (the way apply --option writes them)."""
    raw = copy.deepcopy(loaded.raw)
    sources.apply_overrides(raw, overrides)
    return service.plan("estimate", flags, sources.build_config(raw, "<option>"), raw)


def test_sft_16k_on_8_h100s_answers_with_activation_offload_each_option_with_memory_and_time(tmp_path):
    rec = _recommend(_config(tmp_path, SFT_YAML), **SFT)
    fitting = [o for o in rec.options if o.fits and not o.alternative]
    kinds = {tuple(o.levers) for o in fitting}
    assert ("activation",) in kinds
    # Full recompute cannot shrink the loss: at 16k the 128K-vocabulary logits peak at 6 bytes each (bf16 beside
    # their fp32 copy), so its peak is the loss phase; it keeps the 3 % margin (NVIDIA's tightest recipe keeps 3.1 %).
    loaded = _config(tmp_path, SFT_YAML)
    full = ["model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1"]
    est = _estimate_with(loaded, full, **SFT)
    assert est.peak_phase == "loss" and est.fits
    assert est.memory_gib.total <= rec.budget_gib and any("recompute" in k for k in kinds)
    for o in fitting:
        assert o.memory_gib.total > 0 and o.stages_gib and o.step_time_s > 0 and o.step_time_factor >= 1.0
        assert o.margin_gib > 0 and o.why
    # The recommendation is the first option: the legacy keys describe it.
    first = rec.options[0]
    assert rec.overrides == first.overrides and rec.memory_gib.after.total == first.memory_gib.total
    assert rec.levers == ["recompute", "activation", "fine-grained", "optimizer"]


def test_options_are_ranked_by_step_time_among_allowed_options_that_fit(tmp_path):
    rec = _recommend(_config(tmp_path, SFT_YAML), **SFT)
    ranked = [o for o in rec.options if o.fits and not o.alternative]
    assert [o.rank for o in ranked] == list(range(len(ranked)))  # allowed, fitting ones come first
    # One sort key: the step time grown by each option's risk (plan/search/risks.py), then fewer changes.
    adjusted = [o.step_time_s * (1 + o.risk) for o in ranked]
    assert adjusted == sorted(adjusted)
    assert all(o.alternative for o in rec.options[len(ranked) :])


def test_layout_levers_are_alternatives_by_default_and_ranked_when_allowed(tmp_path):
    loaded = _config(tmp_path, SFT_YAML)
    default = _recommend(loaded, **SFT)
    layout = [o for o in default.options if o.changes_layout]
    assert layout and all(o.alternative for o in layout)
    allowed = _recommend(loaded, **SFT, levers=["recompute,activation,fine-grained,optimizer,cp,tp"])
    assert all(o.alternative == bool(set(o.levers) - set(allowed.levers)) for o in allowed.options)
    assert any(o.changes_layout and not o.alternative for o in allowed.options)
    first = allowed.options[0]
    assert first.step_time_s * (1 + first.risk) == min(o.step_time_s * (1 + o.risk) for o in allowed.options if o.fits)


def test_a_comfortable_option_keeps_the_headroom_free_beside_the_tightest(tmp_path):
    rec = _recommend(_config(tmp_path, SFT_YAML), **SFT)
    assert rec.headroom_gib == pytest.approx(0.1 * rec.budget_gib, abs=0.01)  # the fallback's default too
    comfortable = [o for o in rec.options if o.comfortable]
    assert comfortable and all(o.margin_gib >= rec.headroom_gib for o in comfortable)
    asked = _recommend(_config(tmp_path, SFT_YAML), **SFT, headroom_gib=20.0)
    assert all(o.margin_gib >= 20.0 for o in asked.options if o.comfortable)


def test_recompute_ranks_first_where_it_is_faster_than_offload_and_the_rationale_says_so():
    flags = {"model": "qwen3-0.6b", "num_gpus": 1, "seq_length": 16384, "micro_batch_size": 4}
    rec = service.plan("recommend", flags)
    assert isinstance(rec, Recommendation)
    first = rec.options[0]
    assert first.levers == ["recompute"] and rec.mode == "none"
    assert "model.recompute_granularity=full" in rec.overrides
    offload = [o for o in rec.options if o.levers == ["activation"]]
    assert offload and offload[0].step_time_s > first.step_time_s
    assert any("recompute is the better answer" in r for r in rec.rationale)


def test_a_run_that_fits_gets_no_change_first():
    rec = service.plan("recommend", {"model": "qwen3-30b-a3b", "gpu": "h100-80gb"})
    assert isinstance(rec, Recommendation)
    first = rec.options[0]
    assert first.changes == [] and first.levers == [] and rec.mode == "none" and rec.overrides == []
    # "No change" is the config as given: x1.00 (the card's definition; it read x1.42 over no lever).
    assert first.step_time_factor == 1.0 and rec.step_time_factor == 1.0
    # The preset's own full recompute stays, and costs over the run with no lever: the recomputed forward (4/3 of
    # the compute) also repeats its TP and EP communication, so a little more than 4/3.
    assert 4 / 3 <= first.step_time_factor_vs_no_levers <= 1.5
    assert rec.step_time_factor_vs_no_levers == first.step_time_factor_vs_no_levers
    assert any("no offload is the better answer" in r for r in rec.rationale)


def test_step_time_factor_is_over_the_config_as_given_and_the_other_over_no_lever_pulled(tmp_path):
    rec = _recommend(_config(tmp_path, SFT_YAML), **SFT)
    plain = service.plan("estimate", {**SFT, "seq_length": 16384, "global_batch_size": 64})
    # One yardstick for every option: the config as given (1.0 = no change), as the card compares.
    references = [o.step_time_s / o.step_time_factor for o in rec.options]
    assert len(references) > 3 and max(references) == pytest.approx(min(references), rel=2e-3)  # factors: 3 digits
    assert references[0] == pytest.approx(plain.time_s.step, rel=0.01)
    # Beside it, one more: the same run with no lever pulled (recompute and offload off).
    no_lever = [o.step_time_s / o.step_time_factor_vs_no_levers for o in rec.options]
    assert max(no_lever) == pytest.approx(min(no_lever), rel=2e-3)
    assert no_lever[0] == pytest.approx(plain.time_s.baseline, rel=0.01)


SETUPS = {
    "llama3-8b sft 16k": (SFT_YAML, SFT),
    "llama3-8b mbs 2": (SFT_YAML.replace("micro_batch_size: 1", "micro_batch_size: 2"), SFT),
    "llama3-8b pp 2 tp 2 32k": (
        "model:\n  seq_length: 32768\n  tensor_model_parallel_size: 2\n  pipeline_model_parallel_size: 2\n"
        "train:\n  micro_batch_size: 1\n  global_batch_size: 32\n",
        SFT,
    ),
    "qwen3-0.6b mbs 4": (
        "model:\n  seq_length: 16384\ntrain:\n  micro_batch_size: 4\n  global_batch_size: 16\n",
        {"model": "qwen3-0.6b", "gpu": "h100-80gb", "num_gpus": 1},
    ),
    "qwen3-30b-a3b on 48 GB": (
        "train:\n  global_batch_size: 64\noptimizer:\n  use_distributed_optimizer: true\n",
        {"model": "qwen3-30b-a3b", "gpu_memory_gb": 48},
    ),
}
ALL = ["recompute,activation,fine-grained,optimizer,cp,tp,mbs"]


@pytest.mark.parametrize("name", sorted(SETUPS))
def test_every_option_that_says_it_fits_fits_by_estimate_with_its_changes_applied(tmp_path, name):
    text, flags = SETUPS[name]
    loaded = _config(tmp_path, text)
    try:
        rec = _recommend(loaded, **flags, levers=ALL)
    except InputError:  # a lever this setup cannot use (mbs at MBS 1): the default levers instead
        rec = _recommend(loaded, **flags)
    assert rec.options, rec.rationale
    for option in rec.options:
        est = _estimate_with(loaded, option.overrides, **flags)
        assert est.memory_gib.total == pytest.approx(option.memory_gib.total, abs=0.01), option.why
        if option.fits:
            assert est.fits and est.memory_gib.total <= rec.budget_gib + 1e-6, option.why
            assert est.host_peak_gb <= gpu_preset(rec.gpu).host_ram_gb * PINNED_HOST_SHARE + 1e-6


def test_405b_recipe_moved_to_b200_is_refused_layer_offload_for_host_memory():
    loaded = sources.load(str(PERF / "llama31_405b_pretrain_128gpu_b300_bf16_config.yaml"))
    flags = {"gpu": "b200", "num_gpus": 128}
    rec = _recommend(loaded, **flags)
    # Layer-level offload at the recipe's layout is refused; with a layout change (TP) its host need halves, offered
    # as an alternative. Every option stays inside the host RAM share the answer states.
    assert rec.activation_offload_layers == 0 and not any(o.levers == ["activation"] for o in rec.options)
    assert all(o.host_gb_per_node <= 2000 * PINNED_HOST_SHARE + 0.1 for o in rec.options)
    refusal = [r for r in rec.rationale if r.startswith("not offered (activation)")]
    assert refusal and "more than 72% of the node's 2,000 GB" in refusal[0]
    assert rec.fits and rec.options[0].fits  # something else fits: full recompute
    # A 4 TB node (DGX B200's upgrade) holds the same offload: it is offered again.
    bigger = _recommend(loaded, **flags, host_ram_gb=500.0)
    assert any("activation" in o.levers for o in bigger.options)
    offload = next(o for o in bigger.options if "activation" in o.levers)
    assert offload.host_gb_per_node == pytest.approx(8 * offload.host_gb, rel=1e-3)


def test_megatron_lm_argv_gets_its_changes_as_flags():
    argv = (
        "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
        "--group-query-attention --num-query-groups 8 --seq-length 16384 --max-position-embeddings 16384 "
        "--micro-batch-size 1 --global-batch-size 64 --bf16 --use-distributed-optimizer "
        "--vocab-size 128256 --swiglu --untie-embeddings-and-output-weights"
    )
    loaded = sources.load(argv=shlex.split(argv))
    rec = _recommend(loaded, gpu="h100-80gb", num_gpus=8)
    changed = [o for o in rec.options if o.changes]
    assert changed and all(o.notation == "megatron-lm" for o in changed)
    recompute = next(o for o in changed if o.levers == ["recompute"])
    assert {c.key for c in recompute.changes} >= {"--recompute-granularity", "--recompute-method"}


def test_every_gpu_preset_states_its_nodes_host_ram_and_gpu_count_with_a_source():
    from mbridge_offload.plan.inputs.hardware import GPU_PRESETS

    for preset in GPU_PRESETS.values():
        assert preset.gpus_per_node >= 1 and preset.host_source, preset.name
        assert preset.host_ram_node_gb == pytest.approx(preset.host_ram_gb * preset.gpus_per_node)
    # DGX H100/H200/B200: 2 TB for 8 GPUs; GB200: about 480 GB per Grace, two GPUs each.
    assert gpu_preset("b200").host_ram_node_gb == pytest.approx(2000) and gpu_preset("b200").gpus_per_node == 8
    assert gpu_preset("gb200").host_ram_gb == pytest.approx(240)


def test_host_ram_and_gpus_per_node_flags_replace_the_presets_figures(tmp_path):
    loaded = _config(tmp_path, SFT_YAML)
    rec = _recommend(loaded, **SFT, host_ram_gb=80.0, gpus_per_node=4)
    node = next(a for a in rec.assumptions if a.name == "host_ram_per_node_gb")
    assert node.value == pytest.approx(320.0) and node.source == "flag"
    # 72 GB per GPU of activation offload is more than 72 % of 80 GB: refused, and said so.
    assert not any(o.levers == ["activation"] for o in rec.options)
    assert any(r.startswith("not offered (activation)") for r in rec.rationale)


def test_llama3_70b_fsdp_on_64_gb200_gets_a_comfortable_option_beside_the_tightest():
    loaded = sources.load(str(PERF / "llama3_70b_pretrain_64gpu_gb200_bf16_config.yaml"))
    rec = _recommend(loaded, gpu="gb200", num_gpus=64)
    offload = [o for o in rec.options if o.levers == ["activation"]]
    tight = min(offload, key=lambda o: o.margin_gib)
    roomy = [o for o in offload if o.comfortable]
    assert tight.fits and roomy and roomy[0].margin_gib >= rec.headroom_gib > tight.margin_gib
    # More layers for the room: each of them costs host memory, never GPU memory.
    assert roomy[0].host_gb > tight.host_gb and roomy[0].memory_gib.total < tight.memory_gib.total
    assert not any("optimizer" in o.levers for o in rec.options)  # Megatron-FSDP: never optimizer offload


@pytest.mark.parametrize(
    "flags",
    [
        {"model": "llama3-8b", "gpu": "h100-80gb", "num_gpus": 8, "seq_length": 16384},
        {"model": "llama3-8b", "gpu": "h100-80gb", "num_gpus": 8, "seq_length": 65536, "levers": ["optimizer"]},
        {"model": "llama3-70b", "gpu": "h100-80gb", "num_gpus": 8, "tp": 8},
        {"model": "qwen3-30b-a3b", "gpu": "h100-80gb", "num_gpus": 16, "tp": 2, "pp": 2, "ep": 4},
        {"model": "qwen3-30b-a3b", "gpu": "a100-80gb", "num_gpus": 16, "ep": 8, "seq_length": 32768},
    ],
    ids=["fits-with-levers", "nothing-allowed-fits", "70b-tp8", "card", "moe-32k"],
)
def test_option_0_is_the_recommendation_whatever_fits(flags):
    # mode / overrides / memory_gb.after describe option 0, also when no allowed lever fits (then the decision
    # table's most offload leads, not fitting, and the fitting alternatives follow): apply --option 0 writes it.
    rec = service.recommend_for_inputs(**flags)
    assert rec.options, rec.rationale
    first = rec.options[0]
    assert rec.overrides == first.overrides
    assert rec.memory_gib.after.total == pytest.approx(first.memory_gib.total, abs=1e-3)
    assert rec.fits == first.fits
