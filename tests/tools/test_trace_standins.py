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
from typing import Any

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


class _ExpertConfig:
    params_dtype = None  # set per test (torch imported lazily)
    gradient_accumulation_fusion = True
    expert_model_parallel_size = 4
    expert_tensor_parallel_size = 2
    tensor_model_parallel_size = 2


class _Group:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


class _Groups:
    expt_tp = _Group(2)


def _grouped(row: bool = False, gemms: int = 4, bias: bool = False):
    import torch

    config = _ExpertConfig()
    config.params_dtype = torch.bfloat16
    cls = standins.RowGroupedLinearStandIn if row else standins.GroupedLinearStandIn
    return cls(gemms, 64, 96, config=config, bias=bias, skip_bias_add=False, pg_collection=_Groups())


def test_grouped_linear_has_one_weight_per_expert_split_over_expert_tp_as_megatron_core_lays_them_out() -> None:
    column, row = _grouped(), _grouped(row=True)
    assert [n for n, _ in column.named_parameters()] == ["weight0", "weight1", "weight2", "weight3"]
    assert column.weight0.shape == (48, 64) and row.weight0.shape == (96, 32)  # output / input split over ETP 2
    assert all(p.allreduce is False for p in [*column.parameters(), *row.parameters()])  # DDP's expert buffers


def test_grouped_linear_keeps_its_input_once_and_makes_one_output_for_every_expert() -> None:
    import torch

    linear = _grouped()
    x = torch.randn(40, 64, dtype=torch.bfloat16, requires_grad=True)
    weights = sum(p.numel() * 2 for p in linear.parameters())
    got = _saved_bytes(lambda: linear(x, [10, 10, 10, 10]))
    assert got == 2 * x.numel() + weights  # the input once (TE's splits are views of it), the weights uncopied
    out, bias = linear(x, torch.tensor([10, 12, 8, 10]))
    assert out.shape == (40, 48) and bias is None


def test_grouped_linear_backward_writes_main_grad_and_hands_autograd_one_cached_dummy_per_shape() -> None:
    import torch

    standins.reset()
    linear = _grouped()
    for p in linear.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
        p.grad_added_to_main_grad = False
    x = torch.randn(40, 64, dtype=torch.bfloat16, requires_grad=True)
    out, _ = linear(x, [10, 10, 10, 10])
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert all(p.grad_added_to_main_grad for p in linear.parameters())
    # one dummy per (shape, dtype) for the whole run (TE v2.18's get_dummy_wgrad), not one per expert
    assert len(standins._DUMMY_WGRADS) == 1


@pytest.mark.skipif(TE_SRC is None, reason="set MBRIDGE_OFFLOAD_TE_SRC to a TransformerEngine checkout with tags")
@pytest.mark.parametrize("tag", sorted(standins.FUSED_ADAM_FACTS))
def test_te_fused_adam_has_the_lines_the_stand_in_follows(tag: str) -> None:
    text = _source(tag, "transformer_engine/pytorch/optimizers/fused_adam.py")
    for line in standins.FUSED_ADAM_FACTS[tag]:
        assert line in text, (tag, line)


@pytest.mark.skipif(TE_SRC is None, reason="set MBRIDGE_OFFLOAD_TE_SRC to a TransformerEngine checkout with tags")
def test_bf16_moments_are_fused_from_the_release_the_stand_in_names() -> None:
    major, minor = standins.FusedAdamStandIn.FUSE_UNSCALE_FROM
    fused = "self.fuse_unscale = self.exp_avg_dtype == self.exp_avg_sq_dtype == torch.bfloat16"
    path = "transformer_engine/pytorch/optimizers/fused_adam.py"
    assert fused in _source(f"v{major}.{minor}", path)
    assert fused not in _source(f"v{major}.{minor - 1}", path)


def _adam_step_bytes(te: tuple[int, int], **kwargs) -> tuple[dict[str, Any], int]:
    """The stand-in's state (dtype and bytes per name) after one step over one bf16 parameter, and the most bytes
    its step held beyond that state (through a dispatch mode that sees every allocation)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Peak(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live, self.peak = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and func.__name__.split(".")[0] in ("_to_copy", "zeros_like", "ones"):
                self.live += out.numel() * out.element_size()
                self.peak = max(self.peak, self.live)
            return out

    old, standins.TE_VERSION = standins.TE_VERSION, te
    try:
        p = torch.nn.Parameter(torch.zeros(1000, dtype=torch.bfloat16))
        p.decoupled_grad = torch.zeros(1000, dtype=torch.bfloat16)
        opt = standins.FusedAdamStandIn([p], use_decoupled_grad=True, **kwargs)
        opt.initialize_state(p, opt._remainders(p))
        with Peak() as peak:
            opt.step()
    finally:
        standins.TE_VERSION = old
    state = {k: (v.dtype, v.numel() * v.element_size()) for k, v in opt.state[p].items() if v.numel() > 1}
    return state, peak.peak


def test_fused_adam_keeps_int16_remainders_for_a_bf16_parameter_with_an_fp32_master() -> None:
    import torch

    state, _ = _adam_step_bytes(
        (2, 18), master_weights=True, master_weight_dtype=torch.float32, store_param_remainders=True
    )
    assert state["master_param"] == (torch.int16, 2000)
    assert state["exp_avg"] == state["exp_avg_sq"] == (torch.float32, 4000)


def test_fused_adam_copies_low_precision_states_to_fp32_in_its_step_unless_two_bf16_moments_are_fused() -> None:
    import torch

    bf16 = {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16, "master_weights": True}
    fp16 = {"exp_avg_dtype": torch.float16, "exp_avg_sq_dtype": torch.float16, "master_weights": True}
    assert _adam_step_bytes((2, 18), store_param_remainders=True, **bf16)[1] == 0  # fuse_unscale
    assert _adam_step_bytes((2, 9), store_param_remainders=True, **bf16)[1] == 2 * 4000  # before v2.13
    assert _adam_step_bytes((2, 18), store_param_remainders=True, **fp16)[1] == 2 * 4000
    # a bf16 master is not a remainder: fused with the moments on 2.18, copied on 2.9
    assert _adam_step_bytes((2, 18), master_weight_dtype=torch.bfloat16, **bf16)[1] == 0
    assert _adam_step_bytes((2, 9), master_weight_dtype=torch.bfloat16, **bf16)[1] == 3 * 4000


@pytest.mark.skipif(TE_SRC is None, reason="set MBRIDGE_OFFLOAD_TE_SRC to a TransformerEngine checkout with tags")
@pytest.mark.parametrize("tag", sorted(standins.CROSS_ENTROPY_FACTS))
def test_te_cross_entropy_keeps_what_the_stand_in_keeps(tag: str) -> None:
    for path, lines in standins.CROSS_ENTROPY_FACTS[tag].items():
        text = _source(tag, path)
        for line in lines:
            assert line in text, (tag, path, line)


def test_te_cross_entropy_keeps_the_bf16_logits_before_2_18_and_an_fp32_gradient_from_2_18() -> None:
    import torch

    logits = torch.randn(64, 2, 100, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.zeros(64, 2, dtype=torch.long)
    old = standins.TE_VERSION
    try:
        standins.TE_VERSION = (2, 17)
        in_place = _saved_bytes(lambda: standins.te_parallel_cross_entropy(logits * 1, labels))
        standins.TE_VERSION = (2, 18)
        fp32 = _saved_bytes(lambda: standins.te_parallel_cross_entropy(logits * 1, labels))
    finally:
        standins.TE_VERSION = old
    assert (in_place, fp32) == (2 * logits.numel(), 4 * logits.numel())


@pytest.mark.skipif(TE_SRC is None, reason="set MBRIDGE_OFFLOAD_TE_SRC to a TransformerEngine checkout with tags")
@pytest.mark.parametrize("tag", ["v2.9", "v2.18"])
def test_te_rmsnorm_saves_a_contiguous_copy_of_a_view(tag: str) -> None:
    assert "input_.contiguous()" in _source(tag, standins.FACTS["rmsnorm"]["file"])


def test_a_norm_over_a_view_keeps_its_own_copy_not_the_whole_storage() -> None:
    import torch

    class Config:
        params_dtype = torch.bfloat16
        normalization = "RMSNorm"
        sequence_parallel = False

    qkv = torch.randn(64, 2, 3, 32, dtype=torch.bfloat16, requires_grad=True)
    key = qkv[:, :, 1]  # a view, as the key heads split out of the QKV projection's output
    kept: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        standins.NormStandIn(Config(), 32)(key)
    assert max(kept) == 2 * key.numel() < qkv.untyped_storage().nbytes()
