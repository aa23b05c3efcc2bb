"""``TransformerConfig.__post_init__``'s checks on low-precision flags and MoE settings, which come right after the
query-group check and before the MoE dispatcher checks (both releases), plus the expert-bias router check that
comes after the MoE bias check.

None of them is about offloading, but megatron-core refuses the config on them all the same, so a verdict that
skipped them would call a refused config valid. Values are read as the user wrote them (:func:`given`):
megatron-core's dataclass converts nothing, so ``"4"`` compared with 0 is a ``TypeError`` there
(:func:`upstream_compare` reproduces it, text included).
"""

from __future__ import annotations

import operator
from collections.abc import Callable

from mbridge_offload.config.bridge import mixed_precision
from mbridge_offload.config.rules.base import Context, Match
from mbridge_offload.config.rules.mcore import following, given, mcore_rule, upstream_compare


def _precision(ctx: Context, key: str, default: object) -> object:
    """``model.<key>`` for the low-precision flags as megatron-core gets them: in a Bridge container, the
    ``mixed_precision`` section is copied onto the model first (Bridge's runtime_config_update)."""
    if isinstance(ctx.raw, dict) and isinstance(ctx.raw.get("mixed_precision"), dict):
        body = mixed_precision(ctx.raw).get("model")
        if isinstance(body, dict) and key in body:
            return body[key]
    return given(ctx, key, default)


def _fp8_stage_layers_type(ctx: Context):
    # With FP8, megatron-core computes the BF16 layers a pipeline stage may hold: num_layers // PP, as written.
    if not _precision(ctx, "fp8", None):
        return None
    layers, pp = given(ctx, "num_layers", 0), given(ctx, "pipeline_model_parallel_size", 1)
    return upstream_compare(operator.floordiv, layers, pp)[1]


def _fp8_param(ctx: Context) -> bool:
    return bool(_precision(ctx, "fp8_param", False)) and not _precision(ctx, "fp8", None)


def _fp4_param(ctx: Context) -> bool:
    return bool(_precision(ctx, "fp4_param", False)) and not _precision(ctx, "fp4", None)


def _fp4_and_fp8(ctx: Context) -> bool:
    return bool(_precision(ctx, "fp4", None)) and bool(_precision(ctx, "fp8", None))


def _ep_without_experts(ctx: Context):
    bigger, error = upstream_compare(operator.gt, given(ctx, "expert_model_parallel_size", 1), 1)
    if error is not None:
        return error
    return bool(bigger) and given(ctx, "num_moe_experts", None) is None


def _experts_positive(ctx: Context):
    experts = given(ctx, "num_moe_experts", None)
    if experts is None:
        return None
    not_positive, error = upstream_compare(operator.le, experts, 0)
    return error or bool(not_positive)


def _moe_ffn_without_experts(ctx: Context) -> bool:
    return given(ctx, "num_moe_experts", None) is None and given(ctx, "moe_ffn_hidden_size", None) is not None


def _moe_ffn_without_experts_dense(ctx: Context) -> bool:
    # 0.19 lets a mixed dense/MoE model (moe_layer_freq > 1, or a list holding 0) keep moe_ffn_hidden_size.
    if not _moe_ffn_without_experts(ctx):
        return False
    freq = given(ctx, "moe_layer_freq", 1)
    mixed = (isinstance(freq, list) and 0 in freq) or (isinstance(freq, int) and freq > 1)
    return not mixed


def _flex_deepep_pad(ctx: Context) -> bool:
    return (
        given(ctx, "moe_token_dispatcher_type", "allgather") == "flex"
        and bool(given(ctx, "moe_pad_expert_input_to_capacity", False))
        and (
            bool(given(ctx, "moe_enable_deepep", False))
            or given(ctx, "moe_flex_dispatcher_backend", "deepep") == "deepep"
        )
    )


def _shared_size(ctx: Context):
    size = given(ctx, "moe_shared_expert_intermediate_size", None)
    if size is None:
        return None
    not_positive, error = upstream_compare(operator.le, size, 0)
    return error or (Match({"size": size}) if not_positive else None)


def _shared_overlap(dispatchers: tuple[str, ...]) -> Callable[[Context], bool]:
    def check(ctx: Context) -> bool:
        return (
            given(ctx, "moe_shared_expert_intermediate_size", None) is not None
            and bool(given(ctx, "moe_shared_expert_overlap", False))
            and given(ctx, "moe_token_dispatcher_type", "allgather") not in dispatchers
        )

    return check


_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")


def _capacity_balancing(ctx: Context):
    capacity = given(ctx, "moe_expert_capacity_factor", None)
    if capacity is None:
        return None
    _, error = upstream_compare(operator.lt, capacity, 0)
    if error is not None:
        return error
    balancing = given(ctx, "moe_router_load_balancing_type", "aux_loss")
    kinds = balancing if isinstance(balancing, list) else [balancing]
    return any(kind not in _BALANCING for kind in kinds)


def _pad_without_capacity(ctx: Context) -> bool:
    # A negative capacity factor is reset to None just before this check.
    capacity = given(ctx, "moe_expert_capacity_factor", None)
    negative, error = upstream_compare(operator.lt, capacity, 0) if capacity is not None else (False, None)
    if error is not None:  # MC-MOE-CAPACITY-BALANCING already stops megatron-core at that comparison
        return False
    unset = capacity is None or bool(negative)
    return bool(given(ctx, "moe_pad_expert_input_to_capacity", False)) and unset


_PRECISION_AND_MOE = following(
    "MC-QUERY-GROUPS-TP",
    mcore_rule(
        "MC-FP8-STAGE-LAYERS-TYPE",
        "TypeError",
        "unsupported operand type(s) for //: 'str' and 'int'",
        _fp8_stage_layers_type,
        "With `fp8`, `num_layers` / `pipeline_model_parallel_size` of a type megatron-core cannot divide.",
        ("model.fp8", "model.num_layers", "model.pipeline_model_parallel_size"),
        why="megatron-core's dataclass does not convert types; write the numbers without quotes. The message is "
        "Python's own for the operands given.",
    ),
    mcore_rule(
        "MC-FP8-PARAM",
        "ValueError",
        "fp8_param must be used together with fp8 mode.",
        _fp8_param,
        "`fp8_param` needs `fp8`.",
        ("model.fp8_param", "model.fp8"),
        fix=("model.fp8_param=false",),
    ),
    mcore_rule(
        "MC-FP4-PARAM",
        "ValueError",
        "fp4_param must be used together with fp4 mode.",
        _fp4_param,
        "`fp4_param` needs `fp4`.",
        ("model.fp4_param", "model.fp4"),
        fix=("model.fp4_param=false",),
    ),
    mcore_rule(
        "MC-FP4-AND-FP8",
        "ValueError",
        "fp4 and fp8 cannot be used simultaneously. Please choose one.",
        _fp4_and_fp8,
        "`fp4` and `fp8` are mutually exclusive.",
        ("model.fp4", "model.fp8"),
    ),
    mcore_rule(
        "MC-EP-WITHOUT-EXPERTS",
        "ValueError",
        "num_moe_experts must be non None to use expert-parallel.",
        _ep_without_experts,
        "Expert parallelism (`expert_model_parallel_size` > 1) needs `num_moe_experts`.",
        ("model.expert_model_parallel_size", "model.num_moe_experts"),
        fix=("model.expert_model_parallel_size=1",),
    ),
    mcore_rule(
        "MC-MOE-EXPERTS-POSITIVE",
        "ValueError",
        "num_moe_experts must be non-negative.",
        _experts_positive,
        "`num_moe_experts` must be at least 1 (or null for a dense model).",
        ("model.num_moe_experts",),
    ),
    mcore_rule(
        "MC-MOE-FFN-WITHOUT-EXPERTS",
        "AssertionError",
        "moe_ffn_hidden_size must be None when num_experts is not set.",
        _moe_ffn_without_experts,
        "`moe_ffn_hidden_size` set on a dense model (no `num_moe_experts`).",
        ("model.moe_ffn_hidden_size", "model.num_moe_experts"),
        fix=("model.moe_ffn_hidden_size=null",),
        applies_to="<0.19",
    ),
    mcore_rule(
        "MC-MOE-FFN-WITHOUT-EXPERTS-DENSE",
        "ValueError",
        "moe_ffn_hidden_size is set but num_moe_experts is None. Please set num_moe_experts or remove "
        "moe_ffn_hidden_size.",
        _moe_ffn_without_experts_dense,
        "`moe_ffn_hidden_size` set without `num_moe_experts`, and no dense layers (`moe_layer_freq`) to explain it.",
        ("model.moe_ffn_hidden_size", "model.num_moe_experts", "model.moe_layer_freq"),
        fix=("model.moe_ffn_hidden_size=null",),
        applies_to=">=0.19",
    ),
    mcore_rule(
        "MC-FLEX-DEEPEP-PAD",
        "ValueError",
        "Flex token dispatcher with deepep backend does not support moe_pad_expert_input_to_capacity",
        _flex_deepep_pad,
        "The flex dispatcher's DeepEP backend cannot pad expert inputs to capacity.",
        ("model.moe_token_dispatcher_type", "model.moe_pad_expert_input_to_capacity"),
        fix=("model.moe_pad_expert_input_to_capacity=false",),
    ),
)

_MOE_AFTER_NCCLEP = following(
    "MC-NCCLEP-FLEX",
    mcore_rule(
        "MC-MOE-SHARED-SIZE",
        "ValueError",
        "moe_shared_expert_intermediate_size must be num_shared_experts * ffn_size_of_each_shared_expert, but got "
        "{size}",
        _shared_size,
        "`moe_shared_expert_intermediate_size` must be positive.",
        ("model.moe_shared_expert_intermediate_size",),
    ),
    mcore_rule(
        "MC-MOE-SHARED-OVERLAP",
        "ValueError",
        "moe_shared_expert_overlap only works with alltoall token dispatcher.",
        _shared_overlap(("alltoall",)),
        "`moe_shared_expert_overlap` needs the alltoall dispatcher (0.16).",
        ("model.moe_shared_expert_overlap", "model.moe_token_dispatcher_type"),
        fix=("model.moe_shared_expert_overlap=false",),
        applies_to="<0.19",
    ),
    mcore_rule(
        "MC-MOE-SHARED-OVERLAP-FLEX",
        "ValueError",
        "moe_shared_expert_overlap only works with alltoall or flex token dispatcher.",
        _shared_overlap(("alltoall", "flex")),
        "`moe_shared_expert_overlap` needs the alltoall or flex dispatcher (0.19+).",
        ("model.moe_shared_expert_overlap", "model.moe_token_dispatcher_type"),
        fix=("model.moe_shared_expert_overlap=false",),
        applies_to=">=0.19",
    ),
    mcore_rule(
        "MC-MOE-CAPACITY-BALANCING",
        "ValueError",
        "moe_expert_capacity_factor only works with aux_loss, seq_aux_loss, global_aux_loss or none load balancing",
        _capacity_balancing,
        "An expert capacity factor needs aux-loss (or no) load balancing.",
        ("model.moe_expert_capacity_factor", "model.moe_router_load_balancing_type"),
    ),
    mcore_rule(
        "MC-MOE-PAD-CAPACITY",
        "ValueError",
        "moe_expert_capacity_factor must be set to use moe_pad_expert_input_to_capacity",
        _pad_without_capacity,
        "Padding expert inputs to capacity needs a (non-negative) `moe_expert_capacity_factor`.",
        ("model.moe_pad_expert_input_to_capacity", "model.moe_expert_capacity_factor"),
        fix=("model.moe_pad_expert_input_to_capacity=false",),
    ),
)


def _expert_bias(functions: tuple[str, ...]) -> Callable[[Context], bool]:
    def check(ctx: Context) -> bool:
        return bool(given(ctx, "moe_router_enable_expert_bias", False)) and (
            given(ctx, "moe_router_score_function", "softmax") not in functions
        )

    return check


_ROUTER = following(
    "MC-MOE-BIAS-ETP",
    mcore_rule(
        "MC-MOE-EXPERT-BIAS-SIGMOID",
        "ValueError",
        "Expert bias for aux-loss-free routing only supports sigmoid score function.Please set "
        "--moe-router-score-function sigmoid for sigmoid score function.",
        _expert_bias(("sigmoid",)),
        "Expert bias (aux-loss-free routing) needs the sigmoid score function (0.16).",
        ("model.moe_router_enable_expert_bias", "model.moe_router_score_function"),
        fix=("model.moe_router_score_function=sigmoid",),
        applies_to="<0.19",
    ),
    mcore_rule(
        "MC-MOE-EXPERT-BIAS-SCORE",
        "ValueError",
        "Expert bias for aux-loss-free routing only supports 'sigmoid' and 'sqrtsoftplus' score functions. Please "
        "set --moe-router-score-function to 'sigmoid' or 'sqrtsoftplus', or unset --moe-router-enable-expert-bias.",
        _expert_bias(("sigmoid", "sqrtsoftplus")),
        "Expert bias (aux-loss-free routing) needs the sigmoid or sqrtsoftplus score function (0.19+).",
        ("model.moe_router_enable_expert_bias", "model.moe_router_score_function"),
        fix=("model.moe_router_score_function=sigmoid",),
        applies_to=">=0.19",
    ),
)


def _top1_without_pre_softmax(ctx: Context) -> bool:
    # Checked whether or not the model has experts (both releases).
    return (
        given(ctx, "moe_router_topk", 2) == 1
        and given(ctx, "moe_router_score_function", "softmax") == "softmax"
        and not given(ctx, "moe_router_pre_softmax", False)
        and given(ctx, "moe_router_load_balancing_type", "aux_loss") != "sinkhorn"
    )


TOP1_PRE_SOFTMAX = mcore_rule(
    "MC-MOE-TOP1-PRE-SOFTMAX",
    "ValueError",
    "Please use --moe-router-pre-softmax when topk is 1.",
    _top1_without_pre_softmax,
    "Top-1 softmax routing needs `moe_router_pre_softmax` (softmax over one expert has no gradient).",
    ("model.moe_router_topk", "model.moe_router_pre_softmax", "model.moe_router_score_function"),
    fix=("model.moe_router_pre_softmax=true",),
)

RULES = (*_PRECISION_AND_MOE, *_MOE_AFTER_NCCLEP, *_ROUTER, TOP1_PRE_SOFTMAX)
