"""No hidden input: what an answer rests on but a config rarely states is in ``assumptions`` with its source
— tied embeddings, the global batch and micro-batches behind a step time, the node's host RAM and GPUs per node."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mbridge_offload.config import sources
from mbridge_offload.plan import service
from mbridge_offload.plan.inputs.family import TYING, by_name
from mbridge_offload.plan.inputs.presets import MODEL_PRESETS
from mbridge_offload.plan.model.architecture import GiB
from mbridge_offload.plan.model.params import padded_vocab
from mbridge_offload_tools.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
HF = ROOT / "tests" / "data" / "hf-configs"
# Llama 3.1 405B as sizes pasted from its model card (config.json), at NVIDIA's layout: TP 8, PP 8.
L405 = (
    "model:\n  num_layers: 126\n  hidden_size: 16384\n  ffn_hidden_size: 53248\n  num_attention_heads: 128\n"
    "  num_query_groups: 8\n  vocab_size: 128256\n  seq_length: 8192\n  tensor_model_parallel_size: 8\n"
    "  pipeline_model_parallel_size: 8\n  pipeline_dtype: bf16\n  gated_linear_unit: true\n  add_bias_linear: false\n"
)


def _assumed(answer, name: str):
    found = [a for a in answer.assumptions if a.name == name]
    assert len(found) == 1, (name, [a.name for a in answer.assumptions])
    return found[0]


def _estimate(text: str, **flags):
    loaded = sources.load(text)
    return service.estimate_for_inputs(loaded.config, loaded.raw, loaded.source, **flags)


# ---------------------------------------------------------------------------------------------- tied embeddings


def test_a_partial_llama31_config_is_untied_from_its_family_and_says_so():
    est = _estimate(L405, num_gpus=64)
    tied = _assumed(est, "share_embeddings_and_output_weights")
    assert tied.value is False and tied.source == "model family" and "llama3.1-405b" in tied.note


def test_tied_or_untied_changes_the_gib_by_the_output_layer():
    one_stage = L405.replace("pipeline_model_parallel_size: 8", "pipeline_model_parallel_size: 1")
    untied = _estimate(one_stage, num_gpus=64)
    tied = _estimate(one_stage, num_gpus=64, share_embeddings_and_output_weights=True)
    assert _assumed(tied, "share_embeddings_and_output_weights").source == "flag"
    note = _assumed(untied, "share_embeddings_and_output_weights").note
    assert "untied adds the output layer (2,101 M parameters" in note
    # The output layer is what tying removes: its weights exactly (bf16), with its fp32 gradient and its share of
    # the distributed optimizer's state on top.
    vocab = padded_vocab(MODEL_PRESETS["llama3.1-405b"], 8)
    assert untied.stages[0].params - tied.stages[0].params == vocab * 16384 // 8
    weights = (untied.memory_gib.weights - tied.memory_gib.weights) * GiB
    assert weights == pytest.approx(2 * vocab * 16384 / 8, rel=1e-3)
    total = (untied.memory_gib.total - tied.memory_gib.total) * GiB
    per_param = 2 + 4 + 12 / 8  # bf16 weight, fp32 main gradient, fp32 master + Adam moments over DP 8
    assert total == pytest.approx(per_param * vocab * 16384 / 8, rel=0.05)


def test_at_pp_above_1_the_last_stage_holds_the_output_layer_either_way():
    untied = _estimate(L405, num_gpus=64)
    tied = _estimate(L405, num_gpus=64, share_embeddings_and_output_weights=True)
    assert untied.stages[-1].params == tied.stages[-1].params  # megatron-core's copy of the tied embedding
    assert (
        "at PP 8 the last stage holds the output layer" in _assumed(untied, "share_embeddings_and_output_weights").note
    )


def test_a_name_in_the_config_decides_the_family_before_the_defaults():
    for name, tied in (
        ("meta-llama/Llama-3.2-1B", True),
        ("meta-llama/Meta-Llama-3.1-8B-Instruct", False),
        ("Qwen/Qwen3-4B", True),
        ("Qwen/Qwen3-14B", False),
        ("megatron.bridge.models.qwen.qwen_provider.Qwen3MoEModelProvider30B_A3B", False),
        ("deepseek-ai/DeepSeek-V3", False),
    ):
        found = by_name({"model": {"hf_model_id": name}})
        assert found is not None and found[0] is tied, name
    # The shipped Hugging Face configs agree with the table.
    for path in HF.rglob("config.json"):
        name = f"{path.parent.parent.name}/{path.parent.name}"
        found = by_name({"tokenizer": {"tokenizer_model": name}})
        assert found is not None and found[0] is json.loads(path.read_text())["tie_word_embeddings"], name
    assert all(isinstance(tied, bool) and why for _, tied, why in TYING)


def test_every_preset_is_what_its_published_config_says():
    # tie_word_embeddings in each model card's config.json (HF), the value each preset carries.
    published = {
        "llama3-8b": False, "llama3-70b": False, "llama3.1-405b": False, "qwen3-0.6b": True, "qwen3-8b": False,
        "qwen3-30b-a3b": False, "deepseek-v3": False, "gpt-oss-20b": False,
    }  # fmt: skip
    assert {name: m.tied_embeddings for name, m in MODEL_PRESETS.items()} == published
    for name, tied in published.items():
        a = _assumed(service.estimate_for_inputs(model=name), "share_embeddings_and_output_weights")
        assert (a.value, a.source) == (tied, "preset") and name in a.note
        found = by_name({"model": {"hf_model_id": name}})  # the family table agrees with every preset's name
        assert found is not None and found[0] is tied, name


def test_an_unknown_model_takes_the_frontends_default_and_says_it_is_assumed():
    unknown = "model:\n  num_layers: 10\n  hidden_size: 1000\n  num_attention_heads: 10\n  vocab_size: 5000\n"
    bridge = _assumed(_estimate(unknown), "share_embeddings_and_output_weights")
    assert bridge.value is True and bridge.source == "default" and bridge.note.startswith("assumed: Bridge's")
    sizes = {"num_layers": 10, "hidden_size": 1000, "num_attention_heads": 10, "vocab_size": 5000}
    plain = _assumed(service.estimate_for_inputs(**sizes), "share_embeddings_and_output_weights")
    assert plain.value is False and plain.source == "default" and "megatron-core's GPTModel" in plain.note
    written = _assumed(_estimate(unknown + "  share_embeddings_and_output_weights: false\n"), plain.name)
    assert (written.value, written.source) == (False, "config")


def test_a_megatron_lm_command_line_ties_unless_told_not_to():
    base = "--num-layers 4 --hidden-size 512 --num-attention-heads 8 --vocab-size 1000 --seq-length 512"
    for extra, tied in (("", True), (" --untie-embeddings-and-output-weights", False)):
        loaded = sources.load(argv=(base + extra).split())
        est = service.estimate_for_inputs(loaded.config, loaded.raw, loaded.source)
        a = _assumed(est, "share_embeddings_and_output_weights")
        assert (a.value, a.source) == (tied, "argv") and "--untie-embeddings-and-output-weights" in a.note


# ---------------------------------------------------------------------------------------------- batch


def test_without_a_global_batch_the_step_time_says_how_many_micro_batches_it_assumes():
    est = service.estimate_for_inputs(model="llama3-8b", num_gpus=8, pp=2)
    gbs, mb = _assumed(est, "global_batch_size"), _assumed(est, "microbatches_per_step")
    assert (mb.value, mb.source) == (8, "default") and "4 × PP 2" in mb.note
    assert gbs.source == "default" and gbs.value == 8 * 1 * 4 and "--global-batch-size" in gbs.note  # 8 × MBS × DP
    # The figure matters: twice the micro-batches, about twice the step.
    twice = service.estimate_for_inputs(model="llama3-8b", num_gpus=8, pp=2, global_batch_size=2 * gbs.value)
    assert twice.time_s.compute == pytest.approx(2 * est.time_s.compute, rel=1e-4)


def test_a_given_global_batch_is_split_over_micro_batch_and_dp():
    est = service.estimate_for_inputs(model="llama3-8b", num_gpus=16, tp=2, global_batch_size=64, micro_batch_size=2)
    mb = _assumed(est, "microbatches_per_step")
    assert (mb.value, mb.source) == (4, "derived") and "global batch 64 (flag) / (micro-batch 2 × DP 8)" in mb.note
    assert _assumed(est, "global_batch_size").source == "flag"
    odd = service.estimate_for_inputs(model="llama3-8b", num_gpus=16, tp=2, global_batch_size=60, micro_batch_size=2)
    assert "not divisible" in _assumed(odd, "microbatches_per_step").note


# ---------------------------------------------------------------------------------------------- host


@pytest.mark.parametrize("kind", ["estimate", "recommend"])
def test_every_answer_with_host_memory_names_the_nodes_ram_and_gpus(kind):
    answer = service.plan(kind, {"model": "qwen3-30b-a3b", "gpu": "gb200", "optimizer_offload_fraction": 0.5})
    ram, gpus = _assumed(answer, "host_ram_per_node_gb"), _assumed(answer, "gpus_per_node")
    assert (gpus.value, gpus.source) == (4, "preset") and ram.source == "preset" and "GB200" in ram.note
    given = service.plan(kind, {"model": "qwen3-30b-a3b", "host_ram_gb": 250, "gpus_per_node": 8})
    ram, gpus = _assumed(given, "host_ram_per_node_gb"), _assumed(given, "gpus_per_node")
    assert (ram.value, ram.source, gpus.value, gpus.source) == (2000.0, "flag", 8, "flag")
    if kind == "recommend":
        assert all(o.host_gb_per_node == pytest.approx(o.host_gb * 8, abs=2e-3) for o in given.options)


def test_apply_on_the_planners_path_lists_what_the_planner_assumed(tmp_path: Path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(L405)
    with pytest.raises(SystemExit) as stop:
        main(["apply", str(path), "--mode", "recommended", "--gpu", "b200", "--num-gpus", "64", "--json"])
    answer = json.loads(capsys.readouterr().out)
    assert stop.value.code in (0, 1), answer
    names = {a["name"]: a for a in answer["assumptions"]}
    assert {"host_ram_per_node_gb", "gpus_per_node", "share_embeddings_and_output_weights", "gpu"} <= set(names)
    assert names["gpu"]["value"] == "b200" and names["share_embeddings_and_output_weights"]["value"] is False
    with pytest.raises(SystemExit):
        main(["apply", str(path), "--mode", "optimizer", "--fraction", "0.5", "--json"])
    assert json.loads(capsys.readouterr().out)["assumptions"] == []  # no planner, nothing assumed
