"""The trace's Transformer Engine stand-ins against TE's source and against what they save on fake tensors.

TE cannot be installed here; its source can be read. Set ``MBRIDGE_OFFLOAD_TE_SRC`` to a TransformerEngine git
checkout (or bare mirror) with its release tags: each fact of ``trace.standins.FACTS`` is then found in that release's
file, inside the forward's ``save_for_backward`` call (or the ``prepare_for_saving(...)`` that feeds it). Without it
those tests skip and say so; the stand-ins' own saved tensors are checked on fake tensors either way.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TRACE = Path(__file__).resolve().parents[2] / "tools" / "mbridge_offload_tools" / "trace"
sys.path.insert(0, str(TRACE))  # the child's modules import each other by name, as in the child
import standins  # noqa: E402

TE_SRC = os.environ.get("MBRIDGE_OFFLOAD_TE_SRC")
CASES = [(name, tag) for name, fact in standins.FACTS.items() for tag in fact["saves"]]


def _source(tag: str, path: str) -> str:
    assert TE_SRC is not None
    return subprocess.run(
        ["git", "-C", TE_SRC, "show", f"{tag}:{path}"], capture_output=True, text=True, check=True
    ).stdout


def _saved_calls(text: str) -> list[str]:
    """The argument lists of every save_for_backward(...) and prepare_for_saving(...) call."""
    return [m.group(1) for m in re.finditer(r"(?:save_for_backward|prepare_for_saving)\(([^()]*)\)", text)]


@pytest.mark.skipif(TE_SRC is None, reason="set MBRIDGE_OFFLOAD_TE_SRC to a TransformerEngine checkout with tags")
@pytest.mark.parametrize(("name", "tag"), CASES)
def test_te_saves_what_the_stand_in_says(name: str, tag: str) -> None:
    fact = standins.FACTS[name]
    text = _source(tag, fact["file"])
    start = text.index(f"class {fact['function']}")
    following = text.find("\nclass ", start + 1)
    calls = _saved_calls(text[start : following if following > 0 else None])
    wanted = fact["saves"][tag]
    assert any(all(re.search(rf"(?<![\w*]){re.escape(n)}\b", c) for n in wanted) for c in calls), (tag, calls)


def _saved_bytes(module_fn) -> int:
    """Bytes of the tensors an autograd graph keeps, through saved-tensor hooks."""
    import torch

    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module_fn()
    return total


def test_fused_attention_keeps_q_k_v_out_and_fp32_statistics() -> None:
    import torch

    s, b, heads, groups, dim = 128, 2, 8, 2, 16
    q = torch.randn(s, b, heads, dim, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(s, b, groups, dim, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(s, b, groups, dim, dtype=torch.bfloat16, requires_grad=True)
    got = _saved_bytes(lambda: standins.FusedAttentionStandIn(None)(q, k, v, None))
    assert got == 2 * (2 * q.numel() + 2 * k.numel()) + 4 * b * heads * s + 16


def test_norm_keeps_its_input_and_fp32_statistics_per_token() -> None:
    import torch

    class Config:
        params_dtype = torch.bfloat16
        normalization = "RMSNorm"
        sequence_parallel = False

    x = torch.randn(64, 2, 32, dtype=torch.bfloat16, requires_grad=True)
    norm = standins.NormStandIn(Config(), 32)
    got = _saved_bytes(lambda: norm(x))
    assert got == 2 * x.numel() + 2 * 32 + 4 * 64 * 2
