"""TE's context-parallel attention (``cp_comm_type`` p2p, the default) as a stand-in: what it allocates and saves.

megatron-core's local ``DotProductAttention`` refuses CP > 1; every CP run uses TE's ``DotProductAttention``, which
hands q, k, v (each CP rank's ``s/CP`` tokens, two halves of the sequence for causal balance) to
``AttnFuncWithCPAndKVP2P``. Its forward runs ``CP`` steps around a ring: step ``i`` attends the local q to the KV
chunk received ``i`` hops away. What it allocates (``FACTS``, checked against TE's tags by
``tests/tools/test_trace_cp.py``):

- ``p2p_comm_buffers``: ``cat(k, v)`` (a copy) for step 0 and one ``empty_like`` receive buffer per later step, all
  held by the list until the forward returns;
- per step, the output of the fused kernel and its fp32 softmax statistics (``out_per_step``, ``softmax_lse_per_step``:
  the whole local q on the diagonal step and the steps ``i <= rank``, the second half of q on the others), held to the
  end too; the merged statistics (``softmax_lse = torch.clone(...)``) and the merged output (``out_corrected``, in
  q's dtype, so the ``.to`` after it is the same tensor);
- saved for backward: q, the last receive buffer (``kv = p2p_comm_buffers[-1]``: one chunk's k and v), the output,
  the merged fp32 statistics ``[b, heads, s/CP]`` and one RNG state per step. The same bytes as the fused attention
  without CP at ``s/CP`` tokens, plus ``CP − 1`` RNG states.

Backward (the path outside FP8): ``dq_buffer = torch.empty_like(q)``, two ring buffers ``[2, *kv.shape]`` (a KV
chunk and its gradient each), one step's kernel gradients at a time; dk and dv are views of a ring buffer.

The traced rank's role is the last CP rank's (``rank = CP − 1``): every step but none of the upper-triangle ones, so
its per-step outputs are all full-size, the largest transient of any CP rank; the saved bytes are the same on every
rank. Imported by the child only (torch).
"""

from __future__ import annotations

from typing import Any

import torch

TE_FILE = "transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py"
# The names AttnFuncWithCPAndKVP2P's forward hands to prepare_for_saving, per release (checked like standins.FACTS).
FACTS: dict[str, dict[str, Any]] = {
    "context_parallel_p2p": {
        "file": TE_FILE,
        "function": "AttnFuncWithCPAndKVP2P",
        "saves": {
            "v2.9": ("*f16_tensors", "softmax_lse", "*rng_states"),
            "v2.18": ("*f16_tensors", "softmax_lse", "*rng_states"),
        },
        "meaning": "q, the last received KV chunk, the output (f16_tensors outside FP8), the merged fp32 softmax "
        "statistics and one RNG state per step",
    },
}
# The lines of the same file the stand-in's allocations follow, per release.
LINES: dict[str, tuple[str, ...]] = {
    tag: (
        "p2p_comm_buffers[0] = torch.cat((k.view(-1), v.view(-1)), dim=-1)",
        "p2p_comm_buffers[i + 1] = torch.empty_like(p2p_comm_buffers[i])",
        "out_per_step = [None for _ in range(cp_size)]",
        "softmax_lse = torch.clone(softmax_lse_per_step[0])",
        "return out_corrected.to(out_init_step.dtype)",
        "kv = p2p_comm_buffers[-1]",
        "f16_tensors = (q_f16, kv_f16, out_f16)",
        "dq_buffer = torch.empty_like(q)",
        "torch.empty((2, *kv.shape), dtype=kv.dtype, device=kv.device)",
    )
    for tag in ("v2.9", "v2.18")
}


class _AttentionP2P(torch.autograd.Function):
    """``AttnFuncWithCPAndKVP2P`` outside FP8, sbhd, causal: its allocations and saved tensors (module docstring)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int) -> torch.Tensor:
        sq, b, heads, _ = q.shape
        rank = cp - 1  # the traced role: module docstring
        buffers = [torch.cat((k.reshape(-1), v.reshape(-1)))]
        for _ in range(cp - 1):
            buffers.append(torch.empty_like(buffers[-1]))
        outs, stats, rng_states = [], [], []
        for i in range(cp):
            rows = sq if i <= rank else sq // 2  # upper-triangle steps run the second half of q
            outs.append(q.new_empty(rows, b, heads, v.shape[-1]))
            stats.append(q.new_empty(b, heads, rows, 1, dtype=torch.float32))
            rng_states.append(q.new_empty(2, dtype=torch.int64))
        lse = stats[0].squeeze(-1).clone()
        out = q.new_empty(sq, b, heads, v.shape[-1])  # out_corrected, in q's dtype
        del outs, stats  # the lists die with the forward's frame
        kv = buffers[-1]
        del buffers
        ctx.save_for_backward(q, kv, out, lse, *rng_states)
        ctx.k_shape, ctx.v_shape = k.shape, v.shape
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, kv, *_ = ctx.saved_tensors
        dq = torch.empty_like(q)  # dq_buffer
        ring = [kv.new_empty(2, *kv.shape), kv.new_empty(2, *kv.shape)]  # [KV chunk, its gradient] each
        step = (torch.empty_like(q), torch.empty_like(ring[0][1]))  # one step's kernel gradients
        del step
        k_numel = ctx.k_shape.numel()
        dkv = ring[0][1]
        dk, dv = dkv[:k_numel].view(ctx.k_shape), dkv[k_numel:].view(ctx.v_shape)
        return dq, dk, dv, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int) -> torch.Tensor:
    """TE's p2p context-parallel attention over the local ``[s/CP, b, heads, dim]`` q, k, v: its output."""
    return _AttentionP2P.apply(q, k, v, cp)
