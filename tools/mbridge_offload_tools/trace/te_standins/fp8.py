"""TE's FP8 linears as a stand-in: what ``_Linear`` and ``_GroupedLinear`` allocate and save under an FP8 recipe.

Every Bridge FP8 run builds its decoder linears from Transformer Engine (``TELinear``, ``TELayerNormColumnParallel-
Linear``, ``TEGroupedLinear``); megatron-core's output layer, embedding and router stay bf16. Under FP8 TE quantizes a
GEMM's input itself and keeps the quantized copy for the weight gradient, not the bf16 input. What it allocates and
saves (TE v2.17, the release Megatron Bridge 0.6.2 pins, and the same at v2.9 and v2.18: ``FACTS``, checked against
TE's tags by ``tests/tools/test_trace_fp8.py``), by recipe (``delayed``: ``Float8Quantizer``; ``tensorwise``, current
scaling: ``Float8CurrentScalingQuantizer``; ``mxfp8``: ``MXFP8Quantizer``; ``blockwise``: ``Float8BlockQuantizer``):

- the input, quantized: one byte per element per *usage* (``rowwise`` data for the forward GEMM, ``columnwise`` for
  the weight-gradient GEMM: a transpose on Hopper for the two per-tensor recipes, a second copy scaled along the other
  axis for MXFP8 and blockwise) plus its scales (per tensor: one fp32; MXFP8: one e8m0 byte per 32 elements per usage;
  blockwise: one fp32 per 1x128 tile per usage for activations, per 128x128 tile for weights);
- saved for backward (``module/linear.py``, "Discard unneeded data in input tensor"; ``layernorm_linear.py`` for
  ``ln_out`` the same): one usage. Columnwise where the input is not all-gathered (row-parallel linears, no SP);
  under SP a column-parallel linear gathers its input in backward, which the per-tensor recipes do from rowwise data
  (``supports_only_rowwise_all_gather``: rowwise kept, the shard) and MXFP8 / blockwise from columnwise data
  (columnwise kept, the shard). So one byte per element of the local input, whatever the recipe, plus scales;
- under SP the forward all-gathers the quantized shard (rowwise, one byte per element of the whole sequence: a
  transient), not a bf16 copy;
- the weight, quantized once per step and cached in the module (``_fp8_workspaces["weight"]``: megatron-core passes
  ``is_first_microbatch``, so later micro-batches reuse it, ``update_workspace`` only on the first) with both usages
  (the input needs a gradient: ``columnwise_usage``), kept from the first forward on: two bytes per weight element on
  Hopper with the per-tensor recipes (data and transpose), as with MXFP8 and blockwise (two copies) plus scales;
- backward: the output gradient quantized with both usages (one byte each) beside the bf16 input gradient over the
  whole sequence; under SP the saved shard gathered again (one byte per element of the sequence, and its transpose
  for the per-tensor recipes).

FP8 primary weights (``fp8_param``, ``fp8_model_init``): no workspace, the parameter is the quantized tensor; the
trace keeps its parameters in bf16, two bytes per element as TE's Float8Tensor keeps on Hopper with the per-tensor
recipes (one byte of data and one of its cached transpose; MXFP8: two copies and scales, 3 % more), with the
distributed optimizer's fp32 shards and bf16 gradients as megatron-core keeps them: the planner's reading too.
Not stood in: the FP8 parameter all-gather (``fp8_param_gather``: one byte per element moved, not kept), FP8 attention
(``fp8_dot_product_attention``), Blackwell's per-tensor recipes without a transpose (one byte less per weight
element: the trace follows Hopper), the bf16 first/last layers of a recipe. Imported by the child only (torch).
"""

from __future__ import annotations

import math
from typing import Any

import torch

RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")
# The run's recipe (``None``: bf16 compute) and FP8 primary weights (``fp8_param``); set for each traced spec by
# trace/step.py.
RECIPE: str | None = None
PRIMARY = False

# TE's source, per release: the file and lines this stand-in follows (tests/tools/test_trace_fp8.py finds them at
# each tag where a TransformerEngine checkout is given).
_COMMON = {
    "transformer_engine/pytorch/module/layernorm_linear.py": (
        # ln_out keeps columnwise data only, except the per-tensor recipes' rowwise data where SP gathers it
        "isinstance(ln_out, (MXFP8TensorStorage, Float8BlockwiseQTensorStorage))",
        "ln_out.update_usage(rowwise_usage=False)",
    ),
    "transformer_engine/pytorch/module/grouped_linear.py": (
        "inputmat.update_usage(rowwise_usage=False, columnwise_usage=True)",
    ),
    "transformer_engine/pytorch/tensor/float8_tensor.py": ("def supports_only_rowwise_all_gather(self) -> bool",),
    "transformer_engine/pytorch/tensor/mxfp8_tensor.py": ("MXFP8_BLOCK_SCALING_SIZE",),
}
# The saved input keeps one usage (rowwise where the per-tensor recipes gather it in backward), and the quantized
# weight is cached across micro-batches when megatron-core passes is_first_microbatch (v2.9 in the forward, from
# v2.17 in the module's forward path).
_LINEAR_FROM_V2_17 = (
    "inputmat.update_usage(rowwise_usage=True, columnwise_usage=False)",
    "inputmat.update_usage(rowwise_usage=False, columnwise_usage=True)",
    'cache_name = None if (is_first_microbatch is None or self.is_fsdp2) else "weight"',
    "update_workspace=update_ws,",
)
FACTS: dict[str, dict[str, tuple[str, ...]]] = {
    "v2.9": {
        **_COMMON,
        "transformer_engine/pytorch/module/linear.py": (
            "inputmat.update_usage(rowwise_usage=True, columnwise_usage=False)",
            "inputmat.update_usage(rowwise_usage=False, columnwise_usage=True)",
            'cache_name=(None if is_first_microbatch is None else "weight")',
            "update_workspace = is_first_microbatch is None or is_first_microbatch",
        ),
    },
    "v2.17": {**_COMMON, "transformer_engine/pytorch/module/linear.py": _LINEAR_FROM_V2_17},
    "v2.18": {**_COMMON, "transformer_engine/pytorch/module/linear.py": _LINEAR_FROM_V2_17},
}

MXFP8_BLOCK = 32  # elements per e8m0 scale (TE's MXFP8_BLOCK_SCALING_SIZE)
BLOCK_1D = 128  # blockwise: activations and gradients scaled per 1x128 tile (fp32)
BLOCK_2D = 128 * 128  # blockwise: weights scaled per 128x128 tile (fp32)

# Each cached FP8 weight (TE's _fp8_workspaces), by the parameter's id: kept for the run, emptied by reset().
_WEIGHTS: dict[int, list[torch.Tensor]] = {}


def reset(recipe: str | None, fp8_param: bool = False) -> None:
    """The recipe of the next traced spec (and whether its weights are FP8 primary weights); forget the cached
    weights of the previous one."""
    global RECIPE, PRIMARY
    RECIPE = recipe if recipe in RECIPES else None
    PRIMARY = fp8_param
    _WEIGHTS.clear()


def _block() -> bool:
    return RECIPE in ("mxfp8", "blockwise")


def _scales(like: torch.Tensor, numel: int, usages: int, weight: bool = False) -> list[torch.Tensor]:
    if RECIPE == "mxfp8":
        return [like.new_empty(math.ceil(numel / MXFP8_BLOCK), dtype=torch.uint8) for _ in range(usages)]
    if RECIPE == "blockwise":
        tile = BLOCK_2D if weight else BLOCK_1D
        return [like.new_empty(math.ceil(numel / tile), dtype=torch.float32) for _ in range(usages)]
    return [like.new_empty(1, dtype=torch.float32)]  # one scale_inv per tensor, shared by data and transpose


def quantize(like: torch.Tensor, shape: tuple[int, ...], usages: int, weight: bool = False) -> list[list[torch.Tensor]]:
    """A quantized tensor of ``shape`` with ``usages`` (1 or 2) copies: per usage, its one-byte data and scales."""
    numel = math.prod(shape)
    data = [like.new_empty(shape, dtype=torch.uint8) for _ in range(usages)]
    scales = _scales(like, numel, usages, weight)
    if len(scales) == 1 and usages == 2:  # the per-tensor recipes' one scale serves both usages
        return [[data[0], scales[0]], [data[1], scales[0]]]
    return [[d, sc] for d, sc in zip(data, scales, strict=True)]


def weight_cache(weight: torch.Tensor) -> list[torch.Tensor]:
    """The weight's FP8 workspace, both usages, made at its first forward and reused after (TE's cache). None for
    FP8 primary weights: the parameter is the quantized tensor (``quantize_weight`` returns it, no workspace)."""
    if PRIMARY:
        return []
    key = id(weight)
    if key not in _WEIGHTS:
        kept = {id(t): t for usage in quantize(weight, tuple(weight.shape), 2, weight=True) for t in usage}
        _WEIGHTS[key] = list(kept.values())
    return _WEIGHTS[key]


def saved_input(inp: torch.Tensor, gathered_in_backward: bool) -> list[torch.Tensor]:
    """Quantize a GEMM's local input as TE does and return the one usage it keeps for backward (the other is freed
    when the forward returns)."""
    rows = tuple(inp.shape)
    if gathered_in_backward and not _block():
        return quantize(inp, rows, 1)[0]  # rowwise only: the per-tensor recipes gather rowwise data
    return quantize(inp, rows, 2)[1]  # rowwise for the GEMM, columnwise kept


class _Fp8Linear(torch.autograd.Function):
    """megatron-core's ``LinearWithGradAccumulationAndAsyncCommunication`` arguments, TE's ``_Linear`` FP8 memory
    (module docstring). The extra trailing arguments of newer releases (0.19.2's ``gtp_remat_size``) are taken and
    handed back as ``None``."""

    @staticmethod
    def forward(
        ctx: Any,
        inp: torch.Tensor,
        weight: torch.Tensor,
        bias: Any,
        gradient_accumulation_fusion: bool,
        allreduce_dgrad: bool,
        sequence_parallel: bool,
        grad_output_buffer: Any,
        wgrad_deferral_limit: Any,
        tp_group: Any,
        *extra: Any,
    ) -> torch.Tensor:
        tp = tp_group.size() if sequence_parallel and tp_group is not None else 1
        gather = sequence_parallel and tp > 1
        keep = saved_input(inp, gather)
        rows = (inp.shape[0] * tp, *inp.shape[1:-1])
        total = None  # under SP the quantized shard all-gathered (rowwise): the GEMM's input, freed on return
        if gather:
            total = quantize(inp, (*rows, inp.shape[-1]), 1)
        weight_cache(weight)
        out = inp.new_empty(*rows, weight.shape[0])
        ctx.save_for_backward(*keep, weight)
        ctx.origin_weight, ctx.keep = weight, len(keep)
        ctx.shape, ctx.gather, ctx.tp, ctx.extra = tuple(inp.shape), gather, tp, len(extra)
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.use_bias = bias is not None
        del total
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        saved = ctx.saved_tensors
        weight = ctx.origin_weight
        rows = grad.shape[:-1]
        gq = quantize(grad, tuple(grad.shape), 2)  # the output gradient: rowwise (dgrad) and columnwise (wgrad)
        dgrad = grad.new_empty(*rows, ctx.shape[-1])
        if ctx.gather:  # the saved shard gathered again for wgrad (per-tensor recipes: and its transpose)
            again = quantize(grad, (*rows, ctx.shape[-1]), 1 if _block() else 2)
            sub = grad.new_empty(ctx.shape)  # the reduce-scattered input gradient
            del again
            dgrad = sub
        del gq, saved
        if ctx.gradient_accumulation_fusion and hasattr(weight, "grad_added_to_main_grad"):
            from standins import _dummy_wgrad

            weight.grad_added_to_main_grad = True
            wgrad = _dummy_wgrad(grad, list(weight.main_grad.shape), weight.dtype)
        else:
            wgrad = torch.empty_like(weight)
        bgrad = grad.new_empty(grad.shape[-1]) if ctx.use_bias else None
        return (dgrad, wgrad, bgrad, *([None] * (6 + ctx.extra)))


def fp8_apply(original: Any) -> Any:
    """megatron-core's linear autograd function with FP8 weights routed to the stand-in (decoder linears, marked by
    :func:`mark`); the output layer and the rest stay megatron-core's bf16 path."""

    class Dispatch(original):
        @staticmethod
        def apply(*args: Any) -> Any:
            if RECIPE is not None and getattr(args[1], "_trace_fp8", False):
                return _Fp8Linear.apply(*args)
            return original.apply(*args)

    return Dispatch


def install() -> None:
    """Route megatron-core's linears through :func:`fp8_apply` (once per child; inert while ``RECIPE`` is None)."""
    from megatron.core.tensor_parallel import layers

    current = layers.LinearWithGradAccumulationAndAsyncCommunication
    if getattr(current, "_trace_fp8_dispatch", False):
        return
    dispatch = fp8_apply(current)
    dispatch._trace_fp8_dispatch = True
    layers.LinearWithGradAccumulationAndAsyncCommunication = dispatch


def mark(chunks: list[Any]) -> None:
    """Mark the weights TE would run in FP8: every megatron-core linear of the decoder and the MTP depths (TE's
    linears in a TE spec); not the output layer (megatron-core's own ``ColumnParallelLinear`` in every spec).

    And make TE's dummy weight gradients now (``module/base.py`` ``get_dummy_wgrad``: one bf16 tensor per weight shape
    and dtype, made at the first backward and kept in a module global for the run): from the second iteration on, the
    steady state a run spends its time in, they exist in every phase; the trace runs one."""
    if RECIPE is None:
        return
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from standins import GroupedLinearStandIn, _dummy_wgrad

    for chunk in chunks:
        for name, module in chunk.named_modules():
            linear = isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and "output_layer" not in name
            if linear and getattr(module, "weight", None) is not None:
                module.weight.__dict__["_trace_fp8"] = True
                _dummy_wgrad(module.weight, list(module.weight.shape), module.weight.dtype)
            if isinstance(module, GroupedLinearStandIn):
                for w in module.weights():
                    _dummy_wgrad(w, list(w.shape), w.dtype)


def linear(inp: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """TE's duplicated linear (MLA's down projections) under FP8: no TP communication, the input not gathered."""
    return _Fp8Linear.apply(inp, weight, None, True, False, False, None, 0, None)


def grouped_saved_input(inp_view: torch.Tensor) -> list[torch.Tensor]:
    """``_GroupedLinear`` under FP8 (``grouped_linear.py``): the input split-quantized with both usages, columnwise
    kept for backward (the splits are views of one buffer per usage), and each weight cached as ``_Linear``'s."""
    return saved_input(inp_view, gathered_in_backward=False)
