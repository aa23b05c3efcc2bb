"""FP8 compute in the planner's activations: what Transformer Engine saves and keeps under an FP8 recipe.

The saved tensors (``fp8_saved``: GEMM inputs in one byte, the output projection's own FP8 copy of the attention
output, MXFP8's block scales) and what TE keeps for the whole step beside them under megatron-core's DDP: the cached
FP8 weights (``fp8_weight_cache_bytes``) and the dummy weight gradients (``te_dummy_wgrad_bytes``). Each held to the
trace's FP8 stand-in (``tools/mbridge_offload_tools/trace/te_standins/fp8.py``, which cites TE's source) by
``tests/plan/test_trace_differential.py`` (the FP8 set) and ``tests/tools/test_trace_fp8.py``. Never imports torch.
"""

from __future__ import annotations

from dataclasses import replace

from mbridge_offload.plan.model.architecture import ModelSpec
from mbridge_offload.plan.model.params import Tensor, stage_params
from mbridge_offload.plan.model.run import Setup

# GEMM inputs TE saves for the weight gradient: quantized (one byte per element) under FP8. The norm inputs, the
# attention's q/k/v/output (flash attention keeps bf16 unless fp8_dot_product_attention), the SwiGLU input and the
# router stay bf16.
FP8_GEMM_INPUTS = frozenset(
    {"qkv_in", "fc1_in", "act_out", "expert_fc1_in", "expert_act_out", "shared_act_out", "q_up_in", "kv_up_in"}
)
MXFP8_BLOCK = 32  # one e8m0 scale byte per 32 elements


def fp8_saved(acts: list[Tensor], s: Setup) -> list[Tensor]:
    """The saved tensors under FP8 compute: GEMM inputs in one byte, plus the output projection's own FP8 copy of
    the attention output (flash attention keeps its bf16 output for its backward); MXFP8 adds its block scales."""
    if not s.fp8_recipe:
        return acts
    out = [replace(t, nbytes_per=1) if t.name in FP8_GEMM_INPUTS else t for t in acts]
    attn = next((t for t in acts if t.name == "attn_out"), None)
    if attn is not None:
        out.append(Tensor("proj_in_fp8", attn.numel, nbytes_per=1))
    if s.fp8_recipe == "mxfp8":
        quantized = sum(t.numel for t in out if t.nbytes_per == 1 and t.name != "attn_dropout_mask")
        out.append(Tensor("mxfp8_scales", quantized // MXFP8_BLOCK, nbytes_per=1))
    return out


# Linear weights TE runs in FP8 (by the planner's parameter names): the decoder's and the MTP depths' GEMMs; not the
# norms, biases, router, embedding or output layer (megatron-core's own bf16 linears in every spec).
_FP8_WEIGHT = ("linear_qkv", "linear_proj", "q_down_proj", "q_up_proj", "q_proj", "kv_down_proj", "kv_up_proj")
_FP8_WEIGHT_SUFFIX = ("fc1", "fc2", "proj", "in_proj", "out_proj")


def fp8_weight_cache_bytes(m: ModelSpec, s: Setup, stage: int) -> int:
    """TE's cached FP8 weights on one GPU of ``stage`` (``module/linear.py``: megatron-core passes
    ``is_first_microbatch``, so each linear quantizes its weight on the first micro-batch into
    ``_fp8_workspaces["weight"]`` and keeps it): both usages, since the input needs a gradient (Hopper's transpose for
    the per-tensor recipes, a second scaled copy for MXFP8 and blockwise), two bytes per weight element, plus MXFP8's
    e8m0 scale per 32 elements per copy (blockwise's 128x128 fp32 tiles and the per-tensor scales are negligible).
    Held from the first forward on, through the optimizer step (the trace, ``trace/te_standins/fp8.py``, shows it).
    None with FP8 primary weights (``fp8_param``: the parameter is the quantized tensor)."""
    if not s.fp8_recipe or s.fp8_param or s.use_megatron_fsdp:  # Megatron-FSDP: not traced yet, not counted
        return 0
    names = [t for t in stage_params(m, s, stage) if not t.name.endswith("_bias")]
    numel = sum(t.numel for t in names if t.name in _FP8_WEIGHT or t.name.endswith(_FP8_WEIGHT_SUFFIX))
    per = 2 + (2 / MXFP8_BLOCK if s.fp8_recipe == "mxfp8" else 0)
    return int(numel * per)


def te_dummy_wgrad_bytes(m: ModelSpec, s: Setup, stage: int) -> int:
    """TE's dummy weight gradients on one GPU of ``stage`` under FP8 (``module/base.py`` ``get_dummy_wgrad``): with
    megatron-core's fused wgrad accumulation TE writes each weight gradient into ``main_grad`` and hands autograd a
    dummy, one tensor in the parameter dtype per weight shape, kept in a module global for the run (made at the first
    backward: resident from the second iteration on). One per distinct shape of the stage's FP8 linears: a layer's
    worth for a dense stage, plus each expert and shared-expert shape on MoE. The same TE fact holds for bf16 runs;
    the trace stands in TE's ``_Linear`` under FP8 only (megatron-core's local linears otherwise), so the planner
    counts it under FP8 only, for now."""
    if not s.fp8_recipe or s.use_megatron_fsdp:  # Megatron-FSDP: not traced yet, not counted
        return 0
    shapes: set[tuple[str, int]] = set()
    for t in stage_params(m, s, stage):
        if t.name.endswith("_bias"):
            continue
        kind = next((k for k in ("fc1", "fc2") if t.name.endswith(k)), t.name)
        if t.name in _FP8_WEIGHT or t.name.endswith(_FP8_WEIGHT_SUFFIX):
            shapes.add((kind, t.numel))
    return sum(numel for _, numel in shapes) * (4 if s.params_dtype == "fp32" else 2)
