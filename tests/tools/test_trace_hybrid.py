"""Hybrid Mamba stacks in the trace: mamba_ssm's kernel stand-ins against mamba_ssm's source and on real tensors,
and megatron-core's hybrid model traced and held to the planner (real 0.16.1 and 0.19.2, small models).

Set ``MBRIDGE_OFFLOAD_MAMBA_SRC`` to a state-spaces/mamba git checkout with its release tags for the source checks
(as ``tests/tools/test_trace_standins.py`` reads TE's); without it they skip and say so.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

TRACE = Path(__file__).resolve().parents[2] / "tools" / "mbridge_offload_tools" / "trace"
sys.path.insert(0, str(TRACE))  # the child's modules import each other by name, as in the child
from hybrid import mamba_kernels  # noqa: E402

MAMBA_SRC = os.environ.get("MBRIDGE_OFFLOAD_MAMBA_SRC")
needs_src = pytest.mark.skipif(
    MAMBA_SRC is None, reason="set MBRIDGE_OFFLOAD_MAMBA_SRC to a state-spaces/mamba checkout"
)
CASES = [(name, tag) for name, fact in mamba_kernels.FACTS.items() for tag in sorted(fact["saves"])]


def _class_source(name: str, tag: str) -> str:
    assert MAMBA_SRC is not None
    fact = mamba_kernels.FACTS[name]
    text = subprocess.run(
        ["git", "-C", MAMBA_SRC, "show", f"{tag}:{fact['file']}"], capture_output=True, text=True, check=True
    ).stdout
    start = text.index(f"class {fact['function']}")
    following = text.find("\nclass ", start + 1)
    return text[start : following if following > 0 else None]


@needs_src
@pytest.mark.parametrize(("name", "tag"), CASES)
def test_mamba_ssm_saves_what_the_stand_in_says(name: str, tag: str) -> None:
    calls = re.findall(r"save_for_backward\(([^()]*)\)", _class_source(name, tag))
    saved = [[part.strip() for part in call.split(",") if part.strip()] for call in calls]
    assert list(mamba_kernels.FACTS[name]["saves"][tag]) in saved, (tag, saved)


@needs_src
@pytest.mark.parametrize("tag", sorted(mamba_kernels.FACTS["split_conv1d_scan"]["saves"]))
def test_mamba_ssm_allocates_what_the_stand_in_allocates(tag: str) -> None:
    assert MAMBA_SRC is not None
    path = mamba_kernels.FACTS["split_conv1d_scan"]["file"]
    text = subprocess.run(
        ["git", "-C", MAMBA_SRC, "show", f"{tag}:{path}"], capture_output=True, text=True, check=True
    ).stdout
    assert [line for line in mamba_kernels.LINES if line not in text] == [], tag


def _saved(fn: Any) -> tuple[Any, list[Any]]:
    import torch

    kept: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out = fn()
    return out, kept


def _mixer_inputs(b: int = 2, s: int = 256, heads: int = 8, headdim: int = 16, groups: int = 2, state: int = 32):
    import torch

    dim, conv_dim = heads * headdim, heads * headdim + 2 * groups * state
    zxbcdt = torch.randn(b, s, 2 * dim + 2 * groups * state + heads, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(conv_dim, 4, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(conv_dim, dtype=torch.bfloat16, requires_grad=True)
    dt_bias = torch.randn(heads, requires_grad=True)
    A = torch.randn(heads, requires_grad=True)
    D = torch.randn(heads, requires_grad=True)
    return zxbcdt, weight, bias, dt_bias, A, D


def test_the_split_conv1d_scan_keeps_its_input_the_conv_parameters_and_the_ungated_scan_output() -> None:
    import torch

    zxbcdt, weight, bias, dt_bias, A, D = inputs = _mixer_inputs()
    out, kept = _saved(
        lambda: mamba_kernels.mamba_split_conv1d_scan_combined(*inputs, 128, headdim=16, ngroups=2, activation="silu")
    )
    assert out.shape == (2, 256, 128) and out.dtype == torch.bfloat16  # the gated output, [b, l, heads·headdim]
    assert kept[:3] == [zxbcdt, weight, bias] and kept[4:] == [A, D, dt_bias]
    out_x = kept[3]  # the scan's output before the z gate: its own storage, as out's
    assert out_x.shape == (2, 256, 8, 16) and out_x.dtype == torch.bfloat16
    assert out_x.untyped_storage().data_ptr() != out.untyped_storage().data_ptr()
    out.sum().backward()
    for given in inputs:
        assert given.grad is not None and given.grad.shape == given.shape


def test_the_gated_norm_keeps_its_input_its_weight_and_fp32_rstd_per_token_and_group() -> None:
    import torch

    norm = mamba_kernels.RMSNormGated(128, group_size=32, norm_before_gate=False, dtype=torch.bfloat16)
    x = torch.randn(256, 2, 128, dtype=torch.bfloat16, requires_grad=True)
    out, kept = _saved(lambda: norm(x))
    assert out.shape == x.shape
    assert [t.shape for t in kept] == [(512, 128), (128,), (4 * 512,)]
    assert kept[0].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()  # contiguous: no copy
    assert kept[2].dtype == torch.float32


def test_the_einops_stand_in_makes_the_views_megatron_core_asks_for_and_refuses_the_rest() -> None:
    import torch

    t = torch.randn(3, 2, 5)
    assert torch.equal(mamba_kernels.rearrange(t, "l b d -> b l d"), t.permute(1, 0, 2))
    assert mamba_kernels.rearrange(torch.randn(6, 1, 4), "d 1 w -> d w").shape == (6, 4)
    with pytest.raises(NotImplementedError):
        mamba_kernels.rearrange(t, "b l (h p) -> b l h p", p=1)


SMALL = "model:\n  mamba_num_heads: 32\n  mamba_head_dim: 64\n  mamba_state_dim: 64\n  mamba_num_groups: 8\n"
SMALL += "  gated_linear_unit: true\n  add_bias_linear: false\n"
RUNS = [  # a MoE layer with TP/SP and EP; a pipeline of two stages with selective recompute
    (
        {"tp": 2, "sequence_parallel": True, "ep": 2, "etp": 1, "num_gpus": 4, "num_layers": 4},
        SMALL
        + "  hybrid_layer_pattern: M*-E\n  num_moe_experts: 8\n  moe_router_topk: 2\n  moe_ffn_hidden_size: 1024\n",
    ),
    (
        {
            "pp": 2,
            "num_gpus": 4,
            "num_layers": 4,
            "recompute_granularity": "selective",
            "recompute_modules": ["core_attn"],
        },
        SMALL + "  hybrid_layer_pattern: MM*-\n",
    ),
]


@pytest.mark.megatron
@pytest.mark.slow
def test_megatron_core_builds_the_hybrid_stack_and_the_planner_holds_to_its_trace() -> None:
    """megatron-core's own MambaModel / HybridModel on both releases: the parameters per rank the planner's, resident
    state within 1 % and the peak within 5 %."""
    from mbridge_offload.plan.inputs.resolve import resolve
    from mbridge_offload.plan.memory.stage import estimate_memory
    from mbridge_offload.plan.model.architecture import GB
    from mbridge_offload.plan.model.params import stage_params
    from mbridge_offload.plan.service import plan_source
    from mbridge_offload_tools.exact.run import installs
    from mbridge_offload_tools.trace import spec as specs
    from mbridge_offload_tools.trace.run import spawn_batch

    base = {"hidden_size": 1024, "num_attention_heads": 16, "num_query_groups": 8, "kv_channels": 64}
    base.update(ffn_hidden_size=4096, vocab_size=32000, seq_length=1024, micro_batch_size=1, global_batch_size=8)
    resolved = []
    for flags, config in RUNS:
        cfg, raw, source = plan_source({"config": config, "overrides": [], "megatron_args": None})
        resolved.append(resolve({**base, **flags}, cfg, raw, source))
    worst = [estimate_memory(r.model, r.setup).worst for r in resolved]
    batch = [specs.build(r, w.stage) for r, w in zip(resolved, worst, strict=True)]
    releases = sorted({i.version for i in installs()} & {"0.16.1", "0.19.2"})
    assert releases, "no megatron-core release to trace"
    for release in releases:
        got = spawn_batch(release, batch)
        assert not [g["error"] for g in got if "error" in g], release
        for r, w, g in zip(resolved, worst, got, strict=True):
            assert g["params"] == sum(t.numel for t in stage_params(r.model, r.setup, w.stage)), release
            peak = max(g["phases"].values(), key=lambda p: p["total"])
            cat = peak["by_category"]
            resident = cat["weights"] + cat["gradients"] + cat["optimizer"]
            assert (w.weights + w.gradients + w.optimizer) == pytest.approx(resident, rel=0.01), release
            assert w.total - int(r.setup.overhead_gb * GB) == pytest.approx(peak["total"], rel=0.05), release
