"""The first checks of ``ModelParallelConfig`` / ``TransformerConfig.__post_init__`` that stay rules; they open the
TransformerConfig stage.

Kept although validate's megatron-core run makes them too: the heads / query groups / pipeline size checks are what
the planner's layout checks and levers ask without torch (``config.validate.model_errors``, the Vetter), and
``config.parallel_sizes`` leaves a TP or PP below 1 to them; the two type checks concern the offloaded layer count.
The other checks of this part of upstream (sequence parallelism, fp16/bf16, the types of the sizes, MoE dispatch)
are megatron-core's alone: its run in validate reports them.
"""

from __future__ import annotations

import operator

from mbridge_offload.config.rules.base import Context, Match, Rule
from mbridge_offload.config.rules.mcore import following, given, mcore_rule, upstream_compare, written


def _heads_tp(ctx: Context):
    heads, tp = given(ctx, "num_attention_heads", None), given(ctx, "tensor_model_parallel_size", 1)
    if heads is None and not written(ctx, "num_attention_heads"):
        return None  # not given: a partial config (upstream's placeholder 0 would pass)
    rest, error = upstream_compare(operator.mod, heads, tp)
    if error is not None:
        return error
    return Match({"heads": heads, "tp": tp}) if rest != 0 else None


def _groups_tp(ctx: Context):
    heads, tp = given(ctx, "num_attention_heads", None), given(ctx, "tensor_model_parallel_size", 1)
    groups = given(ctx, "num_query_groups", None)
    groups = heads if groups is None else groups
    if groups is None:
        return None
    by_tp, error = upstream_compare(operator.mod, groups, tp)
    if error is not None:
        return error
    if by_tp == 0:
        return None
    of_tp, error = upstream_compare(operator.mod, tp, groups)
    if error is not None:
        return error
    return Match({"groups": groups, "tp": tp}) if of_tp != 0 else None


def _num_layers_string(ctx: Context):
    # megatron-core keeps num_layers as given; with offloading on, `cpu_offloading_num_layers >= num_layers`
    # compares an int with a str -- unless `cpu_offloading_num_layers < 0` already short-circuits to the ValueError.
    if not ctx.model.cpu_offloading or upstream_compare(operator.lt, ctx.seen("model.cpu_offloading_num_layers"), 0)[1]:
        return None
    offloaded = ctx.seen("model.cpu_offloading_num_layers")
    if offloaded < 0:
        return None
    return upstream_compare(operator.ge, offloaded, given(ctx, "num_layers", 0))[1]


def _offload_layers_type(ctx: Context):
    # `cpu_offloading_num_layers < 0` is megatron-core's first comparison of it: a string, a list or null fails
    # right there.
    value = ctx.seen("model.cpu_offloading_num_layers")
    if ctx.model.cpu_offloading and upstream_compare(operator.lt, value, 0)[1] is not None:
        return Match({"type": type(value).__name__})
    return None


EARLY_RULES: tuple[Rule, ...] = (
    mcore_rule(
        "MC-HEADS-TP",
        "ValueError",
        "num_attention_heads ({heads}) must be a multiple of tensor_model_parallel_size ({tp}).",
        _heads_tp,
        "`num_attention_heads` must be divisible by the tensor parallel size.",
        ("model.num_attention_heads", "model.tensor_model_parallel_size"),
    ),
    mcore_rule(
        "MC-QUERY-GROUPS-TP",
        "ValueError",
        "num_query_groups ({groups}) must be a multiple or divisor of tensor_model_parallel_size ({tp}).",
        _groups_tp,
        "`num_query_groups` (default: the head count) must divide or be divisible by the tensor parallel size.",
        ("model.num_query_groups", "model.tensor_model_parallel_size"),
    ),
    mcore_rule(
        "MC-CPU-OFFLOAD-LAYERS-TYPE",
        "TypeError",
        "'<' not supported between instances of '{type}' and 'int'",
        _offload_layers_type,
        "`cpu_offloading_num_layers` given as a string or null (megatron-core compares it as given).",
        ("model.cpu_offloading_num_layers",),
        why="megatron-core's dataclass does not convert types: with offloading on it compares the value with 0.",
    ),
    mcore_rule(
        "MC-NUM-LAYERS-TYPE",
        "TypeError",
        "'>=' not supported between instances of 'int' and 'str'",
        _num_layers_string,
        "`num_layers` given as a string (megatron-core compares it as given).",
        ("model.num_layers",),
        why="megatron-core's dataclass does not convert types; write the number without quotes.",
    ),
)


def _pp_not_positive(ctx: Context) -> bool:
    # ModelParallelConfig's `pp > 1` let a 0 (or False) through; this assert, right after the context-parallel
    # comparison, stops it.
    positive, error = upstream_compare(operator.gt, given(ctx, "pipeline_model_parallel_size", 1), 0)
    return error is None and not positive


PP_POSITIVE = mcore_rule(
    "MC-PP-POSITIVE",
    "AssertionError",
    "Pipeline model parallel size must be larger than 0             when enable --standalone-embedding-stage and "
    "--standalone-loss-stage",
    _pp_not_positive,
    "`pipeline_model_parallel_size` must be at least 1.",
    ("model.pipeline_model_parallel_size",),
    fix=("model.pipeline_model_parallel_size=1",),
    why="The message's run of spaces is upstream's (a line continuation inside its f-string).",
)

# EARLY_RULES open the stage (they follow no other check); the pipeline size assert closes it.
RULES = (*EARLY_RULES, *following("MC-FG-CUDA-GRAPH-INFLIGHT", PP_POSITIVE))
