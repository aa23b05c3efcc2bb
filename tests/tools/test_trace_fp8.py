"""FP8 recipes in the trace: TE's FP8 linear stand-in against TE's source and on real tensors, and megatron-core's
model traced under each recipe and held to the planner (megatron-core 0.19.2 where installed, small models).

Set ``MBRIDGE_OFFLOAD_TE_SRC`` to a TransformerEngine git checkout with its release tags for the source checks (as
``tests/tools/test_trace_standins.py``); without it they skip and say so.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

TRACE = Path(__file__).resolve().parents[2] / "tools" / "mbridge_offload_tools" / "trace"
sys.path.insert(0, str(TRACE))  # the child's modules import each other by name, as in the child
from te_standins import fp8  # noqa: E402

TE_SRC = os.environ.get("MBRIDGE_OFFLOAD_TE_SRC")
CASES = [(tag, path, line) for tag, files in fp8.FACTS.items() for path, lines in files.items() for line in lines]


@pytest.mark.skipif(TE_SRC is None, reason="set MBRIDGE_OFFLOAD_TE_SRC to a TransformerEngine checkout with tags")
@pytest.mark.parametrize(("tag", "path", "line"), CASES)
def test_te_source_has_the_line_the_fp8_stand_in_follows(tag: str, path: str, line: str) -> None:
    assert TE_SRC is not None
    text = subprocess.run(["git", "-C", TE_SRC, "show", f"{tag}:{path}"], capture_output=True, text=True, check=True)
    assert line in text.stdout, (tag, path, line)


def _saved_bytes(recipe: str, shape: tuple[int, int], out: int) -> tuple[int, int]:
    """Bytes the FP8 linear saves for one input of ``shape`` (real CPU tensors), and the cached weight's bytes."""
    import torch

    fp8.reset(recipe)
    kept: list[torch.Tensor] = []
    x = torch.empty(*shape, dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.empty(out, shape[-1], dtype=torch.bfloat16))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        fp8.linear(x, w)
    cache = sum(t.numel() * t.element_size() for t in fp8.weight_cache(w))
    fp8.reset(None)
    return sum(t.numel() * t.element_size() for t in kept if t is not w), cache


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_the_fp8_linear_saves_its_input_in_one_byte_and_caches_two_weight_copies(recipe: str) -> None:
    tokens, h, out = 256, 512, 1024
    saved, cache = _saved_bytes(recipe, (tokens, h), out)
    scales = {"delayed": 4, "tensorwise": 4, "mxfp8": tokens * h // 32, "blockwise": tokens * h // 128 * 4}[recipe]
    assert saved == tokens * h + scales  # bf16 would be 2 * tokens * h
    weight_scales = {"delayed": 4, "tensorwise": 4, "mxfp8": 2 * out * h // 32, "blockwise": 2 * 4 * 32}[recipe]
    assert cache == 2 * out * h + weight_scales


def _trace(runs: list[dict[str, Any]]) -> list[tuple[Any, dict[str, Any]]]:
    from mbridge_offload.plan.inputs.resolve import resolve
    from mbridge_offload.plan.memory.stage import estimate_memory
    from mbridge_offload_tools.exact.run import installs
    from mbridge_offload_tools.trace import spec as specs
    from mbridge_offload_tools.trace.run import DEFAULT_RELEASE, spawn_batch

    release = DEFAULT_RELEASE if DEFAULT_RELEASE in {i.version for i in installs()} else "0.16.1"
    resolved = [resolve(dict(r)) for r in runs]
    batch = [specs.build_run(r.model, r.setup, estimate_memory(r.model, r.setup).worst.stage) for r in resolved]
    got = spawn_batch(release, batch, deadline_s=600)
    assert not [g["error"] for g in got if "error" in g]
    return list(zip(resolved, got, strict=True))


def _saved(m: Any, s: Any) -> int:
    from mbridge_offload.plan.memory.activations import layer_activations

    return sum(t.nbytes for i in range(m.num_layers) for t in layer_activations(m, s, i))


@pytest.mark.megatron
@pytest.mark.slow
def test_megatron_core_under_each_recipe_saves_the_gemm_inputs_quantized_and_the_planner_holds_to_it() -> None:
    from mbridge_offload.plan.memory.fp8 import fp8_weight_cache_bytes, te_dummy_wgrad_bytes
    from mbridge_offload.plan.memory.stage import estimate_memory
    from mbridge_offload.plan.model.architecture import GB

    base = dict(
        hidden_size=1024,
        num_attention_heads=16,
        num_query_groups=8,
        kv_channels=64,
        ffn_hidden_size=4096,
        vocab_size=32000,
        num_layers=2,
        seq_length=2048,
        micro_batch_size=1,
        global_batch_size=1,
        num_gpus=2,
        tp=2,
        sequence_parallel=True,
        distributed_optimizer=True,
    )
    traced = _trace([base] + [{**base, "fp8_recipe": r} for r in fp8.RECIPES])
    (r16, bf16), *fp8_runs = traced

    def loss_activations(got: dict[str, Any]) -> int:
        # the loss runs after the forward (PP 1, one micro-batch): every layer's saved tensors, no backward yet
        return got["phases"]["loss"]["by_category"]["activations"]

    for r, got in fp8_runs:
        m, s = r.model, r.setup
        # what quantizing the GEMM inputs takes off the saved tensors, per the planner's names (1 byte for 2)
        saved_less = _saved(m, r16.setup) - _saved(m, s)
        assert saved_less > 0
        expected = loss_activations(bf16) - saved_less + fp8_weight_cache_bytes(m, s, 0)
        assert abs(loss_activations(got) - expected) <= 0.02 * expected, (s.fp8_recipe, loss_activations(got), expected)
        # TE's dummy weight gradients, made at build for the steady state: "other" from the start
        assert got["phases"]["loss"]["by_category"]["other"] >= te_dummy_wgrad_bytes(m, s, 0)
        worst = estimate_memory(m, s).worst
        peak = max(p["total"] for p in got["phases"].values())
        assert abs(worst.total - s.overhead_gb * GB - peak) <= 0.05 * peak, s.fp8_recipe
