"""``recommend --confirm``: option 0 re-checked by the trace (``trace.confirm``), or why it could not be."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest

from mbridge_offload.plan.service import plan_answer
from mbridge_offload_tools.trace.confirm import option_inputs, recommend_answer

SMALL = {
    "num_layers": 8,
    "hidden_size": 2048,
    "ffn_hidden_size": 5632,
    "num_attention_heads": 16,
    "num_query_groups": 4,
    "kv_channels": 128,
    "vocab_size": 32000,
    "seq_length": 8192,
    "micro_batch_size": 2,
    "global_batch_size": 16,
    "num_gpus": 8,
}
_CACHE: dict[str, Any] = {}


def recommend(**changes: Any) -> dict[str, Any]:
    key = json.dumps(changes, sort_keys=True)
    if key not in _CACHE:
        args = {"config": None, "overrides": [], "megatron_args": None, "confirm": True, **SMALL, **changes}
        _CACHE[key] = recommend_answer(args).model_dump(mode="json")
    return _CACHE[key]


def test_bridge_and_megatron_lm_changes_map_to_the_same_planner_inputs() -> None:
    bridge = [
        {"key": "model.recompute_granularity", "value": "full"},
        {"key": "model.tensor_model_parallel_size", "value": 2},
        {"key": "optimizer.optimizer_cpu_offload", "value": True},
        {"key": "optimizer.optimizer_offload_fraction", "value": 0.5},
    ]
    argv = [
        {"key": "--recompute-granularity", "value": "full"},
        {"key": "--tensor-model-parallel-size", "value": 2},
        {"key": "--optimizer-cpu-offload", "value": True},
        {"key": "--optimizer-offload-fraction", "value": 0.5},
    ]
    want = {"recompute_granularity": "full", "tp": 2, "optimizer_offload_fraction": 0.5}
    assert option_inputs(bridge) == (want, None) == option_inputs(argv)


def test_a_change_with_no_planner_input_is_not_traced() -> None:
    _, why = option_inputs([{"key": "model.some_unknown_knob", "value": 1}])
    assert why is not None and "model.some_unknown_knob" in why


def test_without_confirm_there_is_no_confirm_key() -> None:
    args = {"config": None, "overrides": [], "megatron_args": None, **SMALL, "gpu_memory_gb": 13}
    assert plan_answer("recommend", args).confirm is None


@pytest.mark.megatron
@pytest.mark.slow
def test_confirm_traces_option_0_with_its_recompute_and_gives_a_verdict() -> None:
    d = recommend(gpu_memory_gb=13)
    c, option = d["confirm"], d["options"][0]
    assert "recompute" in option["levers"] and c["traced"], c
    assert c["overrides"] == option["overrides"] and c["planner_gib"] == option["memory_gib"]
    peak = c["trace_gib"]["total"]
    assert peak > 0 and c["trace_gib"]["activations"] > 0
    assert c["gap"] == pytest.approx((option["memory_gib"]["total"] - c["overhead_gib"] - peak) / peak, abs=1e-3)
    assert c["fits_by_trace"] == (peak + c["overhead_gib"] <= option["budget_gib"])
    assert ("still fits" in c["verdict"]) == c["fits_by_trace"]


@pytest.mark.megatron
@pytest.mark.slow
def test_full_recompute_in_option_0_is_what_the_trace_ran() -> None:
    """The traced activations fall with option 0's recompute: the changes reached the trace."""
    plain = recommend(gpu_memory_gb=40)  # fits as given: option 0 changes nothing
    assert plain["options"][0]["overrides"] == [] and plain["confirm"]["traced"]
    recomputed = recommend(gpu_memory_gb=13)["confirm"]
    assert recomputed["trace_gib"]["activations"] < 0.8 * plain["confirm"]["trace_gib"]["activations"]


def test_confirm_says_why_when_the_trace_refuses_option_0() -> None:
    # layer offload before TE 2.10 (TE's v1 path) is what the trace refuses here
    d = recommend(gpu_memory_gb=13, levers=["activation"], te_version="2.9")
    option, c = d["options"][0], d["confirm"]
    assert "activation" in option["levers"], option["levers"]
    assert c["traced"] is False and "before Transformer Engine 2.10" in c["why"]
    assert "verdict" not in c


@pytest.mark.megatron
@pytest.mark.slow
def test_option_0s_layer_offload_is_what_the_trace_ran() -> None:
    """Layer-level activation offload in option 0 reaches the trace (TE's offload stand-in) and lowers its peak."""
    plain = recommend(gpu_memory_gb=40)["confirm"]
    d = recommend(gpu_memory_gb=13, levers=["activation"])
    option, c = d["options"][0], d["confirm"]
    assert "activation" in option["levers"] and c["traced"], c
    assert c["trace_gib"]["total"] < plain["trace_gib"]["total"]


def test_the_cli_flag_adds_confirm(capsys: pytest.CaptureFixture[str]) -> None:
    from mbridge_offload_tools.cli import main

    argv = [
        "recommend",
        "--json",
        "--confirm",
        "--levers",
        "activation",
        "--gpu-memory-gb",
        "13",
        "--te-version",
        "2.9",
    ]
    argv += [a for k, v in SMALL.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    with contextlib.suppress(SystemExit):
        main.main(argv)
    d = json.loads(capsys.readouterr().out)
    assert d["confirm"]["traced"] is False and d["confirm"]["option"] == 0


def test_an_offload_switched_off_is_its_input_at_zero() -> None:
    off = [{"key": "model.cpu_offloading", "value": False}, {"key": "optimizer.optimizer_cpu_offload", "value": False}]
    assert option_inputs(off) == ({"activation_offload_layers": 0, "optimizer_offload_fraction": 0}, None)
