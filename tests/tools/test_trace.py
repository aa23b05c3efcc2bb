"""``trace`` / ``trace_memory``: megatron-core's own model, DDP, optimizer and schedule on fake tensors.

Real megatron-core (the venv's 0.16.1 and .mcore/0.19.2), small models; each trace is a subprocess (~10 s).
"""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import pytest

from mbridge_offload.config.errors import InputError
from mbridge_offload_tools.exact.run import installs
from mbridge_offload_tools.trace.run import trace_answer

pytestmark = [pytest.mark.megatron, pytest.mark.slow]
RELEASES = sorted({i.version for i in installs()} & {"0.16.1", "0.19.2"})
SMALL = {
    "num_layers": 4,
    "hidden_size": 256,
    "ffn_hidden_size": 512,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "kv_channels": 64,
    "vocab_size": 1024,
    "seq_length": 2048,
    "num_gpus": 8,
}
_CACHE: dict[str, dict[str, Any]] = {}


def trace(release: str = "0.16.1", **changes: Any) -> dict[str, Any]:
    """The trace of SMALL with ``changes`` (planner inputs), once per distinct call."""
    key = json.dumps([release, changes], sort_keys=True)
    if key not in _CACHE:
        args: dict[str, Any] = {"config": None, "overrides": [], "megatron_args": None, "megatron_core": release}
        _CACHE[key] = trace_answer({**args, **SMALL, **changes})
    return _CACHE[key]


def gib(d: dict[str, Any], what: str) -> float:
    return float(d["memory_gib"][what])


def saved(d: dict[str, Any]) -> float:
    """The most activation bytes any phase holds at its peak."""
    return max(float(p["breakdown_gib"]["activations"]) for p in d["phases"])


@pytest.mark.parametrize("release", RELEASES)
def test_weights_are_the_built_models_parameter_bytes(release: str) -> None:
    d = trace(release)
    # the DDP buffer holds every parameter, padded to its bucket alignment (a few KiB here)
    assert d["param_bytes"] / 2**30 <= gib(d, "weights") <= d["param_bytes"] / 2**30 * 1.01 + 1e-4
    assert d["under_test"]["megatron_core"] == release


def test_parameter_count_is_the_planners() -> None:
    from mbridge_offload.plan.inputs.resolve import resolve
    from mbridge_offload.plan.model.params import stage_params

    r = resolve(dict(SMALL))
    assert trace()["params"] == sum(t.numel for t in stage_params(r.model, r.setup, 0))


def test_activations_grow_with_the_micro_batches_in_flight() -> None:
    one = trace(pp=2, global_batch_size=4, micro_batch_size=1, stage=0)  # DP 4: one micro-batch
    two = trace(pp=2, global_batch_size=8, micro_batch_size=1, stage=0)  # two: 1F1B keeps PP - 0 = 2 in flight
    ratio = saved(two) / saved(one)
    assert 1.7 < ratio < 2.1, ratio


def test_full_recompute_lowers_activations() -> None:
    plain = trace()
    full = trace(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    assert saved(full) < 0.6 * saved(plain)


def test_tensor_parallel_halves_the_weights_per_rank() -> None:
    tp1, tp2 = trace(), trace(tp=2)
    assert 0.45 < gib(tp2, "weights") / gib(tp1, "weights") < 0.55


def test_distributed_optimizer_shards_the_optimizer_state_over_dp() -> None:
    dp8, dp4 = trace(), trace(tp=2)  # DP 8 then DP 4 (and TP halves what each DP group holds)
    assert gib(dp8, "optimizer") == pytest.approx(12 * dp8["params"] / 8 / 2**30, rel=0.02)
    assert gib(dp4, "optimizer") == pytest.approx(12 * dp4["params"] / 4 / 2**30, rel=0.02)


def test_the_answer_has_estimates_shape() -> None:
    d = trace()
    assert set(d["memory_gib"]) == {"weights", "gradients", "optimizer", "activations", "other", "total"}
    assert d["peak_phase"] in {p["name"] for p in d["phases"]}
    assert d["memory_gib"]["total"] == max(p["memory_gib"] for p in d["phases"])
    assert all(v >= 0 for v in d["memory_gib"].values())
    assert d["by_module"] and d["assumptions"]


@pytest.mark.parametrize("release", RELEASES)
def test_optimizer_offload_at_half_moves_optimizer_state_to_the_host(release: str) -> None:
    plain, hdo = trace(release), trace(release, optimizer_offload_fraction=0.5)
    assert hdo["under_test"]["optimizer"].startswith("DistributedOptimizer over megatron-core's HybridDeviceOptimizer")
    # the moments of about half the shard move; the fp32 main parameters of the whole shard stay (the distributed
    # optimizer owns them), and the host gets a copy of the offloaded half, its moments and its gradient
    assert gib(hdo, "optimizer") < 0.7 * gib(plain, "optimizer")
    assert hdo["host_gib"] > 0.2 * gib(plain, "optimizer") > plain["host_gib"]


def test_bf16_gradients_get_fp32_copies_in_the_optimizer_step() -> None:
    fp32, bf16 = trace(), trace(grad_reduce_in_fp32=False)
    step = {p["name"]: p for p in bf16["phases"]}["optimizer_step"]
    assert step["breakdown_gib"]["other"] == pytest.approx(4 * bf16["params"] / 8 / 2**30, rel=0.05)
    assert {p["name"]: p for p in fp32["phases"]}["optimizer_step"]["breakdown_gib"]["other"] < 0.01 * step[
        "breakdown_gib"
    ]["other"] + 1e-4


def test_cli_and_mcp_give_the_same_refusal() -> None:
    import anyio
    from mcp import Client

    from mbridge_offload_tools.server.app import mcp

    code, cli = _cli(["trace", "--model", "qwen3-30b-a3b", "--json"])

    async def call() -> Any:
        async with Client(mcp) as client:
            return await client.call_tool("trace_memory", {"model": "qwen3-30b-a3b"})

    answer = anyio.run(call)
    assert code == 2 and answer.is_error and cli["error"] in answer.content[0].text


def _cli(argv: list[str]) -> tuple[int, dict[str, Any]]:
    from mbridge_offload_tools.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        main(argv)
    return int(exit_.value.code or 0), json.loads(out.getvalue())


@pytest.mark.parametrize(
    "argv",
    [
        ["trace", "--model", "qwen3-30b-a3b", "--json"],  # MoE: not built yet, said so
        ["trace", "--model", "llama3-8b", "--megatron-core", "0.15.0", "--json"],  # not a release it takes
        ["trace", "--model", "llama3-8b", "--pp", "2", "--stage", "5", "--json"],  # outside the pipeline
        ["trace", "--json"],  # no model
    ],
)
def test_bad_input_exits_2_with_one_json_error(argv: list[str]) -> None:
    code, answer = _cli(argv)
    assert code == 2 and answer["ok"] is False and answer["error"]


def test_a_run_it_cannot_build_is_refused_by_name() -> None:
    with pytest.raises(InputError, match="MoE"):
        trace(num_moe_experts=8, moe_ffn_hidden_size=256, moe_router_topk=2)
