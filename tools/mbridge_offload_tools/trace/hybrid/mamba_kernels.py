"""mamba_ssm's kernels as megatron-core's ``MambaMixer`` calls them in training: what they allocate and save.

mamba_ssm (state-spaces/mamba) and causal_conv1d are CUDA/Triton packages; without them megatron-core refuses to
build a ``MambaMixer`` (``HAVE_MAMBA_SSM``). Training (``use_mamba_mem_eff_path``, the default; 0.16.1 and 0.19.2
alike, ``ssm/mamba_mixer.py`` ``_ssm_training``) runs two of them:

- ``mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, ...,
  headdim=, ngroups=, norm_before_gate=False)`` without ``rmsnorm_weight`` or ``outproj_weight``: the autograd
  function ``MambaSplitConv1dScanCombinedFn`` (``mamba_ssm/ops/triton/ssd_combined.py``). Its forward saves
  ``zxbcdt`` (megatron-core's contiguous ``[b, l, d]`` copy of ``in_proj``'s output), the conv weight and bias,
  ``out_x`` (the scan's output before the ``silu(z)`` gate, ``[b, l, heads, headdim]``), ``A``, ``D`` and
  ``dt_bias`` (``rmsnorm_weight``, ``rstd``, ``outproj_*``, ``initial_states`` and ``seq_idx`` are None here).
  The convolution output, the chunk states and the fp32 cumulative decays are transients of the forward and
  recomputed in backward (``FACTS["split_conv1d_scan"]``). It returns the gated output ``out = y · silu(z)``.
- the gated RMSNorm ``RMSNorm`` (``mamba_ssm/ops/triton/layernorm_gated.py``, imported as ``RMSNormGated``; the
  mixer calls it with ``z=None``): ``LayerNormFn`` saves its input (reshaped to 2-D, the same storage when
  contiguous), the weight and the fp32 ``rstd`` per token and group (``FACTS["rmsnorm_gated"]``).

The saved tensors follow the source at v2.2.4 and v2.3.2.post1 (megatron-core 0.16.1 asks for ``mamba-ssm~=2.2``;
Bridge 0.6.2's ``ssm`` extra resolves to 2.3.2.post1; megatron-core 0.19.2 passes ``state_dtype`` only where the
installed release takes it, and neither does): ``tests/tools/test_trace_hybrid.py`` checks them against a checkout
(``MBRIDGE_OFFLOAD_MAMBA_SRC``) and on tensors. The transients follow the same functions' allocation order
(``_mamba_chunk_scan_combined_fwd`` / ``_bwd``: the convolution output, ``B`` and ``C`` made contiguous, ``dt`` and
``dA_cumsum`` in fp32 ``[b, heads, chunks, chunk]``, the fp32 chunk states ``[b, chunks, heads, headdim, state]``
then the passed states in the input dtype, ``CB`` in fp32 ``[b, chunks, groups, chunk, chunk]``); backward's
approximately (the recomputed convolution, ``dzxbcdt``, ``dxBC``, the recomputed fp32 decays, ``CB`` and states,
the fp32 state gradients, the gated output's gradient). Imported by the child only (torch).
"""

from __future__ import annotations

import math
from typing import Any

import torch

MAMBA_SSM_FILES = {
    "split_conv1d_scan": "mamba_ssm/ops/triton/ssd_combined.py",
    "rmsnorm_gated": "mamba_ssm/ops/triton/layernorm_gated.py",
}
# mamba_ssm's source, per stand-in and release: the autograd function and what its forward hands to
# save_for_backward (checked against state-spaces/mamba's tags by tests/tools/test_trace_hybrid.py).
FACTS: dict[str, dict[str, Any]] = {
    "split_conv1d_scan": {
        "file": MAMBA_SSM_FILES["split_conv1d_scan"],
        "function": "MambaSplitConv1dScanCombinedFn",
        "saves": {
            tag: (
                "zxbcdt",
                "conv1d_weight",
                "conv1d_bias",
                "out_x",
                "A",
                "D",
                "dt_bias",
                "initial_states",
                "seq_idx",
                "rmsnorm_weight",
                "rstd",
                "outproj_weight",
                "outproj_bias",
            )
            for tag in ("v2.2.4", "v2.3.2.post1")
        },
        "meaning": "zxbcdt, the conv weight and bias, out_x (the scan output before the z gate), A, D, dt_bias; "
        "the others are None as megatron-core calls it (no initial states, no packing, no fused norm or out_proj)",
    },
    "rmsnorm_gated": {
        "file": MAMBA_SSM_FILES["rmsnorm_gated"],
        "function": "LayerNormFn",
        "saves": {tag: ("x", "weight", "bias", "mean", "rstd", "z") for tag in ("v2.2.4", "v2.3.2.post1")},
        "meaning": "the input as 2-D, the weight and the fp32 rstd (ngroups x tokens); bias, mean (RMSNorm) and z "
        "(the mixer passes none) are None",
    },
}

# The lines of ssd_combined.py the stand-in's transients follow (forward, then backward), the same at both tags:
# checked by tests/tools/test_trace_hybrid.py where a checkout is given.
LINES: tuple[str, ...] = (
    "B = B.contiguous()",
    "states = _chunk_state_fwd(B, x, dt, dA_cumsum, seq_idx=seq_idx, states_in_fp32=True)",
    "seq_idx=seq_idx, chunk_size=chunk_size, out_dtype=C.dtype)",
    "CB = _bmm_chunk_fwd(C, B, chunk_size, seq_idx=seq_idx, output_dtype=torch.float32)",
    "dzxbcdt = torch.empty_like(zxbcdt)",
    "dxBC = torch.empty_like(xBC)",
    "dt_in = dt.clone()",
    "dstates = _chunk_scan_bwd_dstates(C, dA_cumsum, dout, seq_idx=seq_idx, dtype=states.dtype)",
    "dstates_dtype=x.dtype,",
    "states_dtype=x.dtype,",
)


def _dims(zxbcdt: torch.Tensor, conv1d_weight: torch.Tensor, D: torch.Tensor, headdim: int, ngroups: int) -> Any:
    heads = D.shape[0]
    dim = heads * headdim
    state = (conv1d_weight.shape[0] - dim) // ngroups // 2
    return heads, dim, state


def _chunk_scan_forward(
    x_like: torch.Tensor, b: int, s: int, heads: int, headdim: int, groups: int, state: int, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_mamba_chunk_scan_combined_fwd`` with ``z``: its allocations in order; returns ``out``, ``out_x``."""
    chunks = math.ceil(s / chunk)
    f32 = torch.float32
    B = x_like.new_empty(b, s, groups * state)  # B.contiguous(), C.contiguous(): split views of the conv output
    C = x_like.new_empty(b, s, groups * state)
    dA_cumsum = x_like.new_empty(b, heads, chunks, chunk, dtype=f32)  # _chunk_cumsum_fwd
    dt = x_like.new_empty(b, heads, chunks, chunk, dtype=f32)
    states = x_like.new_empty(b, chunks, heads, headdim, state, dtype=f32)  # _chunk_state_fwd, states_in_fp32
    passed = x_like.new_empty(b, chunks, heads, headdim * state)  # _state_passing_fwd, out_dtype=C.dtype
    final = x_like.new_empty(b, heads, headdim * state, dtype=f32)
    del states  # rebound to the passed states
    CB = x_like.new_empty(b, chunks, groups, chunk, chunk, dtype=f32)  # _bmm_chunk_fwd, fp32
    out = x_like.new_empty(b, s, heads, headdim)  # _chunk_scan_fwd: out (gated) and out_x
    out_x = x_like.new_empty(b, s, heads, headdim)
    del B, C, dA_cumsum, dt, passed, final, CB
    return out, out_x


class _SplitConv1dScan(torch.autograd.Function):
    """``MambaSplitConv1dScanCombinedFn`` as megatron-core calls it (module docstring): ``FACTS`` saved."""

    @staticmethod
    def forward(
        ctx: Any,
        zxbcdt: torch.Tensor,
        conv1d_weight: torch.Tensor,
        conv1d_bias: torch.Tensor | None,
        dt_bias: torch.Tensor,
        A: torch.Tensor,
        D: torch.Tensor,
        chunk_size: int,
        headdim: int,
        ngroups: int,
    ) -> torch.Tensor:
        b, s, _ = zxbcdt.shape
        heads, dim, state = _dims(zxbcdt, conv1d_weight, D, headdim, ngroups)
        # causal_conv1d_fwd over xBC as [b, d, s]: a new tensor, read through split views
        xbc_conv = zxbcdt.new_empty(b, conv1d_weight.shape[0], s)
        out, out_x = _chunk_scan_forward(zxbcdt, b, s, heads, headdim, ngroups, state, chunk_size)
        del xbc_conv
        ctx.save_for_backward(zxbcdt, conv1d_weight, conv1d_bias, out_x, A, D, dt_bias)
        ctx.dims = (heads, headdim, ngroups, state, chunk_size)
        return out.view(b, s, dim)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        zxbcdt, conv1d_weight, conv1d_bias, _out_x, A, D, dt_bias = ctx.saved_tensors
        heads, headdim, groups, state, chunk = ctx.dims
        b, s, _ = zxbcdt.shape
        chunks = math.ceil(s / chunk)
        f32 = torch.float32
        conv_dim = conv1d_weight.shape[0]
        xbc_conv = zxbcdt.new_empty(b, conv_dim, s)  # the convolution recomputed
        dzxbcdt = torch.empty_like(zxbcdt)
        dxbc = zxbcdt.new_empty(b, s, conv_dim)
        # _mamba_chunk_scan_combined_bwd: dt_in = dt.clone(), the decays, CB and the states recomputed (fp32)
        dt_in = zxbcdt.new_empty(b, s, heads)
        dA_cumsum = zxbcdt.new_empty(b, heads, chunks, chunk, dtype=f32)
        dt = zxbcdt.new_empty(b, heads, chunks, chunk, dtype=f32)
        CB = zxbcdt.new_empty(b, chunks, groups, chunk, chunk, dtype=f32)
        states = zxbcdt.new_empty(b, chunks, heads, headdim * state, dtype=f32)
        dout_x = zxbcdt.new_empty(b, s, heads, headdim)  # _chunk_scan_bwd_dz: the gradient through the z gate
        dstates = zxbcdt.new_empty(b, chunks, heads, headdim * state, dtype=f32)  # _chunk_scan_bwd_dstates
        # _state_passing_bwd: the state gradients and states again, in the input dtype
        dstates_x = zxbcdt.new_empty(b, chunks, heads, headdim * state)
        states_x = zxbcdt.new_empty(b, chunks, heads, headdim * state)
        del dstates, states
        dCB = zxbcdt.new_empty(b, chunks, groups, chunk, chunk, dtype=f32)  # _chunk_scan_bwd_dcb
        ddA = zxbcdt.new_empty(b, heads, chunks, chunk, dtype=f32)
        del dCB, ddA, dstates_x, states_x, dout_x, CB, dt, dA_cumsum, dt_in, xbc_conv
        # causal_conv1d_bwd into dxBC's slice of dzxbcdt, through a [b, d, s] tensor copied back
        dxbc_update = zxbcdt.new_empty(b, conv_dim, s)
        del dxbc_update, dxbc
        dweight = torch.empty_like(conv1d_weight)
        dbias = torch.empty_like(conv1d_bias) if conv1d_bias is not None else None
        return (
            dzxbcdt,
            dweight,
            dbias,
            torch.empty_like(dt_bias),
            torch.empty_like(A),
            torch.empty_like(D),
            None,
            None,
            None,
        )


def mamba_split_conv1d_scan_combined(
    zxbcdt: torch.Tensor,
    conv1d_weight: torch.Tensor,
    conv1d_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    chunk_size: int,
    initial_states: Any = None,
    seq_idx: Any = None,
    *args: Any,
    headdim: int | None = None,
    ngroups: int = 1,
    rmsnorm_weight: Any = None,
    outproj_weight: Any = None,
    **kwargs: Any,
) -> torch.Tensor:
    """mamba_ssm's function of that name, as megatron-core's training path calls it (module docstring)."""
    if initial_states is not None or seq_idx is not None or rmsnorm_weight is not None or outproj_weight is not None:
        raise NotImplementedError("the Mamba stand-in follows megatron-core's training call only")
    if D.dim() != 1 or headdim is None:
        raise NotImplementedError("the Mamba stand-in takes D per head (megatron-core's default D_has_hdim=False)")
    return _SplitConv1dScan.apply(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, headdim, ngroups)


class _RMSNormGated(torch.autograd.Function):
    """``LayerNormFn`` with ``is_rms_norm`` and no ``z``: ``FACTS["rmsnorm_gated"]`` saved."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        rstd = x2.new_empty(groups * x2.shape[0], dtype=torch.float32)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = shape
        return torch.empty_like(x2).reshape(shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x2, weight, _rstd = ctx.saved_tensors
        return torch.empty_like(x2).reshape(ctx.shape), torch.empty_like(weight), None


class RMSNormGated(torch.nn.Module):
    """In place of mamba_ssm's gated ``RMSNorm`` (megatron-core's ``ExtendedRMSNorm`` subclasses it): its weight,
    its saved tensors. The sharded state dict megatron-core adds is not needed by the trace."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        group_size: int | None = None,
        norm_before_gate: bool = True,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.groups = hidden_size // (group_size or hidden_size)

    def forward(self, x: torch.Tensor, z: Any = None) -> torch.Tensor:
        if z is not None:
            raise NotImplementedError("the gated-norm stand-in follows megatron-core's call (z=None)")
        return _RMSNormGated.apply(x, self.weight, self.groups)


# The einops patterns megatron-core's training path reads (``_ssm_training``: the two layout swaps around the kernel
# and the conv weight's unit axis), as torch views: einops is not installed here, and its ``rearrange`` makes these
# same views (``.contiguous()`` after it, in megatron-core, makes the copies).
_REARRANGE = {
    "l b d -> b l d": lambda t: t.transpose(0, 1),
    "b l d -> l b d": lambda t: t.transpose(0, 1),
    "d 1 w -> d w": lambda t: t.squeeze(1),
}


def rearrange(tensor: torch.Tensor, pattern: str, **sizes: Any) -> torch.Tensor:
    """einops' ``rearrange`` for the patterns of megatron-core's Mamba training path (``_REARRANGE``)."""
    if pattern not in _REARRANGE:
        raise NotImplementedError(f"the einops stand-in has no pattern {pattern!r} (training path only)")
    return _REARRANGE[pattern](tensor)


def apply() -> None:
    """Make megatron-core's ``MambaMixer`` build and run with the stand-ins (the child only): its module's names for
    mamba_ssm's kernels, the gated norm and einops' ``rearrange``, and the ``HAVE_MAMBA_SSM`` / ``HAVE_EINOPS``
    flags its constructor reads."""
    from megatron.core.ssm import mamba_context_parallel, mamba_mixer

    # its constructor checks the flag; with CP 1 (the trace refuses CP on hybrid stacks) it never rearranges
    mamba_context_parallel.HAVE_EINOPS = True

    class ExtendedRMSNorm(RMSNormGated):
        """megatron-core's subclass, over the stand-in (its sharded state dict is not needed here)."""

    mamba_mixer.HAVE_MAMBA_SSM = True
    mamba_mixer.HAVE_EINOPS = True
    mamba_mixer.rearrange = rearrange
    mamba_mixer.mamba_split_conv1d_scan_combined = mamba_split_conv1d_scan_combined
    mamba_mixer.ExtendedRMSNorm = ExtendedRMSNorm
    mamba_mixer.RMSNormGated = RMSNormGated
