"""``TransformerConfig.__post_init__``'s checks after the offload ones and before the CUDA-graph ones: the output
layer's init method (``num_layers`` as text) and MoE linear biases."""

from __future__ import annotations

from mbridge_offload.config.rules.base import Context
from mbridge_offload.config.rules.mcore import following, mcore_rule


def _num_layers_string_init(ctx: Context) -> bool:
    # Without offloading, the string reaches the output-layer init method (`multiplier * num_layers`, a float times
    # a str), just before the CUDA-graph checks.
    return isinstance(ctx.seen("model.num_layers"), str) and not ctx.model.cpu_offloading


NUM_LAYERS_TYPE_INIT = mcore_rule(
    "MC-NUM-LAYERS-TYPE-INIT",
    "TypeError",
    "can't multiply sequence by non-int of type 'float'",
    _num_layers_string_init,
    "`num_layers` given as a string, without offloading (megatron-core fails computing the init method).",
    ("model.num_layers",),
    why="megatron-core's dataclass does not convert types; write the number without quotes.",
)


def _moe_bias_etp(ctx: Context) -> bool:
    m = ctx.model
    etp = m.expert_tensor_parallel_size if m.expert_tensor_parallel_size is not None else m.tensor_model_parallel_size
    return m.num_moe_experts is not None and bool(m.add_bias_linear) and etp != 1


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


RULES = following("MC-PAGED-STASH-MODULES", NUM_LAYERS_TYPE_INIT, MOE_BIAS_ETP)
