"""Transformer Engine stand-ins for the trace: modules whose *saved tensors* follow TE's source, nothing computed.

TE cannot be installed on a CPU host, and megatron-core's local attention (``DotProductAttention``) keeps the
``[b, heads, s, s]`` score and softmax matrices for backward, which no TE run does. Where the run uses TE (every
Bridge recipe), the trace uses these instead, in the child only. Each stand-in saves, through
``ctx.save_for_backward``, the tensors TE's own autograd function saves (``FACTS``, checked against TE's source by
``tests/tools/test_trace_standins.py``), with TE's shapes and dtypes; its outputs have the real shapes and are never
read (fake tensors).
"""

from __future__ import annotations

from typing import Any

import torch

# TE's source, per stand-in and release: the file, the autograd function, and the names its forward hands to
# ``save_for_backward`` (directly, or through ``prepare_for_saving(...)`` just before it). Checked against TE's git
# tags by ``tests/tools/test_trace_standins.py`` where a TransformerEngine checkout is given.
FACTS: dict[str, dict[str, Any]] = {
    "fused_attention": {
        "file": "transformer_engine/pytorch/attention/dot_product_attention/backends.py",
        "function": "FusedAttnFunc",
        # v2.9: qkvo_tensors = (q, k, v, out); v2.18: f16_tensors = (q, k, v, out_f16) outside FP8
        "saves": {"v2.9": ("*qkvo_tensors", "*aux_ctx_tensors"), "v2.18": ("*f16_tensors", "*aux_ctx_tensors")},
        "meaning": "q, k, v (GQA: k and v at the query-group count), the output, and aux_ctx_tensors: the softmax "
        "statistics (fp32, [b, heads, s_q, 1]) and the dropout RNG state (2 x int64)",
    },
    "rmsnorm": {
        "file": "transformer_engine/pytorch/ops/basic/rmsnorm.py",
        "function": "RMSNorm",
        "saves": {"v2.9": ("x", "rstdevs"), "v2.18": ("x", "rstdevs")},
        "meaning": "the norm's input and its fp32 reciprocal standard deviation per token",
    },
    "layernorm_linear": {
        "file": "transformer_engine/pytorch/module/layernorm_linear.py",
        "function": "_LayerNormLinear",
        "saves": {
            "v2.9": ("inputmat", "ln_out", "mu", "rsigma"),
            "v2.18": ("inputmat", "ln_out_to_save", "mu", "rsigma"),
        },
        "meaning": "the norm's input, the normalized output the GEMM reads (ln_out: the linear's saved input in "
        "megatron-core's local spec) and the statistics: the norm stand-in plus the local linear save the same",
    },
}


class _Norm(torch.autograd.Function):
    """What TE's _LayerNorm / RMSNorm keeps for backward: its input, weight and the fp32 statistics per token."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        tokens = x.numel() // x.shape[-1]
        rsigma = x.new_empty(tokens, dtype=torch.float32)
        ctx.save_for_backward(x, weight, rsigma)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x, weight, _rsigma = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight)


class NormStandIn(torch.nn.Module):
    """In place of TE's norms (and of megatron-core's WrappedTorchNorm, whose torch norm keeps fp32 copies): one
    weight (and a bias for LayerNorm), the saved tensors of TE's kernel."""

    def __init__(self, config: Any, hidden_size: int, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.config = config
        dtype = config.params_dtype
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, dtype=dtype))
        self.bias = (
            torch.nn.Parameter(torch.empty(hidden_size, dtype=dtype)) if config.normalization == "LayerNorm" else None
        )
        for param in (self.weight, self.bias):
            if param is not None:  # as megatron-core marks norm weights under sequence parallelism
                param.__dict__["sequence_parallel"] = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Norm.apply(x, self.weight)


class _FusedAttention(torch.autograd.Function):
    """What TE's FusedAttnFunc keeps for backward: q, k, v, out, softmax statistics, RNG state."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        sq, b, heads, dim = q.shape
        out = q.new_empty(sq, b, heads, dim)
        stats = q.new_empty(b, heads, sq, 1, dtype=torch.float32)
        rng_state = q.new_empty(2, dtype=torch.int64)
        ctx.save_for_backward(q, k, v, out, stats, rng_state)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v, _out, _stats, _rng = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class FusedAttentionStandIn(torch.nn.Module):
    """In place of ``TEDotProductAttention`` (constructor and forward as megatron-core's core attention takes them)."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.config = config

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, *args: Any, **kw: Any
    ) -> torch.Tensor:
        if not all(x.is_contiguous() for x in (query, key, value)):
            # TE's get_qkv_layout (attention/dot_product_attention/utils.py) names a layout from the strides and
            # offsets; megatron-core's q/k (new tensors after RoPE) beside v (a slice of linear_qkv's output, its
            # strides unlike k's) match none, so TE makes all three contiguous: the saved v is a copy and the QKV
            # output is freed, not kept alive by the slice.
            query, key, value = (x.contiguous() for x in (query, key, value))
        out = _FusedAttention.apply(query, key, value)
        sq, b, heads, dim = out.shape
        return out.view(sq, b, heads * dim)


def use_te_attention(layer_spec: Any) -> None:
    """Swap the local spec's core attention for the fused-attention stand-in (in place)."""
    layer_spec.submodules.self_attention.submodules.core_attention = FusedAttentionStandIn


class FusedAdamStandIn(torch.optim.Optimizer):
    """In place of TE's FusedAdam (what megatron-core builds when TE is installed, as in every Bridge run): its state
    is ``exp_avg`` and ``exp_avg_sq`` per parameter, made at the first step, and its multi-tensor kernel updates
    them in place with no temporaries. torch's AdamW, megatron-core's fallback without TE or apex, would add
    per-parameter temporaries on CPU (and a whole fp32 copy per foreach op on a GPU) that no Bridge run has."""

    def __init__(self, params: Any, lr: float = 1e-3, **kwargs: Any) -> None:
        self.state_dtypes = (
            kwargs.pop("exp_avg_dtype", torch.float32) or torch.float32,
            kwargs.pop("exp_avg_sq_dtype", torch.float32) or torch.float32,
        )
        super().__init__(
            params, {"lr": lr, **{k: v for k, v in kwargs.items() if k in ("weight_decay", "betas", "eps")}}
        )

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtypes[0])
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtypes[1])
