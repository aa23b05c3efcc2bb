"""``TransformerConfig.__post_init__``'s checks after the pipeline-split ones and before the CUDA-graph ones: the
output layer's init method (``num_layers`` / ``init_method_std`` of the wrong type) and MoE linear biases."""

from __future__ import annotations

import math
import operator

from mbridge_offload.config.rules.base import Context, Match
from mbridge_offload.config.rules.mcore import following, given, mcore_rule, upstream_compare, written


def _init_method_type(ctx: Context):
    # The output layer's init method: `init_method_std / math.sqrt(multiplier * num_layers)` on the values as
    # written (multiplier 2.0, 1.0 for a hybrid model), just before the CUDA-graph checks. With offloading on, a
    # num_layers of the wrong type has already failed the offload check (this rule is shadowed then).
    if not written(ctx, "num_layers") and not written(ctx, "init_method_std"):
        return None
    multiplier = 1.0 if given(ctx, "is_hybrid_model", False) else 2.0
    product, error = upstream_compare(operator.mul, multiplier, given(ctx, "num_layers", 0))
    if error is not None:
        return error
    try:
        root = math.sqrt(product)
    except (TypeError, ValueError) as exc:
        return Match(message=str(exc), exception=type(exc).__name__)
    return upstream_compare(operator.truediv, given(ctx, "init_method_std", 0.02), root)[1]


NUM_LAYERS_TYPE_INIT = mcore_rule(
    "MC-NUM-LAYERS-TYPE-INIT",
    "TypeError",
    "can't multiply sequence by non-int of type 'float'",
    _init_method_type,
    "`num_layers` or `init_method_std` of a type megatron-core cannot compute the output layer's init method "
    "from (a string, a list, null).",
    ("model.num_layers", "model.init_method_std"),
    why="megatron-core's dataclass does not convert types; write the number without quotes. The message is "
    "Python's own for the operands given (this one: a string).",
    shadowed_by=("MC-NUM-LAYERS-TYPE", "MC-CPU-OFFLOAD-LAYERS-TYPE", "ACT-NUM-LAYERS"),
)


def _moe_bias_etp(ctx: Context) -> bool:
    # Values as written: a float expert count (4.5) is still an expert count there.
    etp = given(ctx, "expert_tensor_parallel_size", None)
    etp = given(ctx, "tensor_model_parallel_size", 1) if etp is None else etp
    experts = given(ctx, "num_moe_experts", None)
    return experts is not None and bool(given(ctx, "add_bias_linear", True)) and etp != 1


MOE_BIAS_ETP = mcore_rule(
    "MC-MOE-BIAS-ETP",
    "AssertionError",
    "Bias in Moe is only supported when ETP==1",
    _moe_bias_etp,
    "MoE with linear biases (`add_bias_linear`, on by default) needs expert tensor parallel size 1.",
    ("model.num_moe_experts", "model.add_bias_linear", "model.expert_tensor_parallel_size"),
    fix=("model.add_bias_linear=false",),
    why="The expert tensor parallel size defaults to the tensor parallel size.",
)


RULES = following("MC-PP-UNEVEN-MIDDLE-VPP", NUM_LAYERS_TYPE_INIT, MOE_BIAS_ETP)
