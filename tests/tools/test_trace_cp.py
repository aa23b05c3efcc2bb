"""Context parallelism in the trace: TE's p2p attention stand-in against TE's source and on real tensors, and
megatron-core's model with CP > 1 traced and held to the planner (real 0.16.1 and 0.19.2, small models).

Set ``MBRIDGE_OFFLOAD_TE_SRC`` to a TransformerEngine git checkout with its release tags for the source checks (as
``tests/tools/test_trace_standins.py``); without it they skip and say so.
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
import standins  # noqa: E402
from te_standins import context_parallel  # noqa: E402

TE_SRC = os.environ.get("MBRIDGE_OFFLOAD_TE_SRC")
FACT = context_parallel.FACTS["context_parallel_p2p"]
needs_te = pytest.mark.skipif(TE_SRC is None, reason="set MBRIDGE_OFFLOAD_TE_SRC to a TransformerEngine checkout")


def _class_source(tag: str) -> str:
    assert TE_SRC is not None
    text = subprocess.run(
        ["git", "-C", TE_SRC, "show", f"{tag}:{FACT['file']}"], capture_output=True, text=True, check=True
    ).stdout
    start = text.index(f"class {FACT['function']}")
    following = text.find("\nclass ", start + 1)
    return text[start : following if following > 0 else None]


@needs_te
@pytest.mark.parametrize("tag", sorted(FACT["saves"]))
def test_te_p2p_attention_saves_what_the_stand_in_says(tag: str) -> None:
    found = re.finditer(r"(?:save_for_backward|prepare_for_saving)\(([^()]*)\)", _class_source(tag))
    calls = [m.group(1) for m in found]
    wanted = FACT["saves"][tag]
    assert any(all(re.search(rf"(?<![\w*]){re.escape(n)}\b", c) for n in wanted) for c in calls), (tag, calls)


@needs_te
@pytest.mark.parametrize("tag", sorted(context_parallel.LINES))
def test_te_p2p_attention_allocates_what_the_stand_in_allocates(tag: str) -> None:
    assert TE_SRC is not None
    text = subprocess.run(
        ["git", "-C", TE_SRC, "show", f"{tag}:{FACT['file']}"], capture_output=True, text=True, check=True
    ).stdout
    missing = [line for line in context_parallel.LINES[tag] if line not in text]
    assert missing == [], (tag, missing)


class _Config:
    def __init__(self, cp: int) -> None:
        self.context_parallel_size = cp


def _saved(fn: Any) -> list[Any]:
    import torch

    kept: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out = fn()
    return [out, *kept]


def _qkv(s: int = 64, b: int = 2, heads: int = 8, groups: int = 2, dim: int = 16) -> list[Any]:
    import torch

    return [torch.randn(s, b, n, dim, dtype=torch.bfloat16, requires_grad=True) for n in (heads, groups, groups)]


@pytest.mark.parametrize("cp", [2, 4])
def test_p2p_saves_what_fused_attention_saves_at_the_local_length_and_an_rng_state_per_step(cp: int) -> None:
    q, k, v = _qkv()
    out, *kept = _saved(lambda: standins.FusedAttentionStandIn(_Config(cp))(q, k, v, None))
    plain = _saved(lambda: standins.FusedAttentionStandIn(_Config(1))(q, k, v, None))[1:]
    nbytes = sum(t.numel() * t.element_size() for t in kept)
    assert nbytes == sum(t.numel() * t.element_size() for t in plain) + (cp - 1) * 16
    # q, one KV chunk (k and v in one buffer), the output, fp32 statistics [b, heads, s], an RNG state per step
    assert [tuple(t.shape) for t in kept[:4]] == [(64, 2, 8, 16), (2 * 64 * 2 * 2 * 16,), (64, 2, 8, 16), (2, 8, 64)]
    assert kept[3].dtype.is_floating_point and kept[3].element_size() == 4 and len(kept) == 4 + cp
    assert tuple(out.shape) == (64, 2, 8 * 16)


def test_p2p_backward_gives_each_input_its_gradient_k_and_v_from_one_ring_buffer() -> None:
    q, k, v = _qkv()
    out = context_parallel.attention(q, k, v, 4)
    dq, dk, dv = context_parallel._AttentionP2P.backward(_Ctx(q, k, v), out)[:3]
    assert [x.shape for x in (dq, dk, dv)] == [q.shape, k.shape, v.shape]
    assert dk.untyped_storage().data_ptr() == dv.untyped_storage().data_ptr() != dq.untyped_storage().data_ptr()


class _Ctx:
    """The context backward reads, as the forward leaves it."""

    def __init__(self, q: Any, k: Any, v: Any) -> None:
        import torch

        self.saved_tensors = (q, torch.cat((k.reshape(-1), v.reshape(-1))))
        self.k_shape, self.v_shape = k.shape, v.shape


SMALL = {  # a real width: at toy widths fixed-size tensors the planner leaves out weigh several per cent
    "num_layers": 2,
    "hidden_size": 2048,
    "ffn_hidden_size": 5632,
    "num_attention_heads": 16,
    "num_query_groups": 4,
    "kv_channels": 128,
    "vocab_size": 32000,
    "micro_batch_size": 1,
}


@pytest.mark.megatron
@pytest.mark.slow
def test_megatron_core_with_cp_is_traced_and_the_planner_holds_to_it() -> None:
    """CP 4 over a sequence 4x as long: the same parameters and resident state as CP 1; each rank's activations
    those of its s/CP tokens (the ring's buffers are transient), and the planner within the issue's bars."""
    from mbridge_offload.plan.inputs.resolve import resolve
    from mbridge_offload.plan.memory.stage import estimate_memory
    from mbridge_offload.plan.model.architecture import GB
    from mbridge_offload_tools.exact.run import installs
    from mbridge_offload_tools.trace import spec as specs
    from mbridge_offload_tools.trace.run import spawn_batch

    runs = [
        {**SMALL, "cp": 4, "seq_length": 16384, "num_gpus": 8, "tp": 2},
        {**SMALL, "cp": 1, "seq_length": 4096, "num_gpus": 8, "tp": 2},
        {**SMALL, "cp": 2, "pp": 2, "seq_length": 8192, "num_gpus": 8, "global_batch_size": 8},
    ]
    resolved = [resolve(dict(r)) for r in runs]
    batch = [specs.build_run(r.model, r.setup, estimate_memory(r.model, r.setup).worst.stage) for r in resolved]
    for release in sorted({i.version for i in installs()} & {"0.16.1", "0.19.2"}):
        got = spawn_batch(release, batch)
        assert not [g["error"] for g in got if "error" in g], release
        peaks = [max(g["phases"].values(), key=lambda p: p["total"]) for g in got]
        cp4, cp1 = (p["by_category"] for p in peaks[:2])
        for c in ("weights", "gradients", "optimizer"):
            assert cp4[c] == pytest.approx(cp1[c], rel=1e-5), c
        assert cp4["activations"] == pytest.approx(cp1["activations"], rel=0.02)
        for r, peak in zip(resolved, peaks, strict=True):
            w = estimate_memory(r.model, r.setup).worst
            cat = peak["by_category"]
            resident = cat["weights"] + cat["gradients"] + cat["optimizer"]
            assert (w.weights + w.gradients + w.optimizer) == pytest.approx(resident, rel=0.01)
            assert w.total - int(r.setup.overhead_gb * GB) == pytest.approx(peak["total"], rel=0.05)


@pytest.mark.megatron
@pytest.mark.slow
def test_the_answer_says_which_context_parallel_attention_it_traced() -> None:
    from mbridge_offload_tools.trace.run import trace_answer

    args = {"config": None, "overrides": [], "megatron_args": None, "megatron_core": None}
    d = trace_answer({**args, **SMALL, "cp": 2, "seq_length": 4096, "num_gpus": 4})
    assert any("p2p ring" in note for note in d["notes"]) and d["memory_gib"]["activations"] > 0
