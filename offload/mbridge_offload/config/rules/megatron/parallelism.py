"""The first checks of ``ModelParallelConfig`` / ``TransformerConfig.__post_init__``: parallel sizes, precision,
MoE dispatch, and the type of ``num_layers``; they open the TransformerConfig stage."""

from __future__ import annotations

import operator

from mbridge_offload.config.rules.base import Context, Match, Rule
from mbridge_offload.config.rules.mcore import first_failure, following, given, mcore_rule, upstream_compare, written


def _sp_without_tp(ctx: Context):
    if not given(ctx, "sequence_parallel", False):
        return None
    small, error = upstream_compare(operator.le, given(ctx, "tensor_model_parallel_size", 1), 1)
    return error or bool(small)


def _parallel_sizes_type(ctx: Context):
    # ModelParallelConfig.__post_init__ computes with the sizes as written (after the sequence-parallel check).
    tp = given(ctx, "tensor_model_parallel_size", 1)
    steps: list = []
    if ctx.target.version >= (0, 19, 0):  # resolve_tensor_parallel_weight_shards: tp * gtp_weight_remat_size
        etp = given(ctx, "expert_tensor_parallel_size", None)  # None: ModelParallelConfig sets it to tp first
        steps += [(operator.mul, tp, 1), (operator.mul, tp if etp is None else etp, 1)]
    steps.append((operator.gt, given(ctx, "pipeline_model_parallel_size", 1), 1))
    ep = given(ctx, "expert_model_parallel_size", 1)
    steps.append((operator.gt, ep, 1))
    failure = first_failure(steps)
    if failure is None and upstream_compare(operator.gt, ep, 1)[0]:
        failure = first_failure([(operator.gt, tp, 1)])
    return failure


def _fp16_bf16(ctx: Context):
    if ctx.model.fp16 and ctx.model.bf16:
        return Match({"fp16": ctx.seen("model.fp16"), "bf16": ctx.seen("model.bf16")})
    return None


def _heads_tp(ctx: Context):
    heads, tp = given(ctx, "num_attention_heads", None), given(ctx, "tensor_model_parallel_size", 1)
    if heads is None and not written(ctx, "num_attention_heads"):
        return None  # not given: a partial config (upstream's placeholder 0 would pass)
    rest, error = upstream_compare(operator.mod, heads, tp)
    if error is not None:
        return error
    return Match({"heads": heads, "tp": tp}) if rest != 0 else None


def _sizes_type(ctx: Context):
    # The derived sizes, computed from the values as written: ffn_hidden_size = 4 * hidden_size and
    # kv_channels = hidden_size // num_attention_heads, when not given.
    hidden, heads = given(ctx, "hidden_size", None), given(ctx, "num_attention_heads", None)
    if not written(ctx, "hidden_size") or heads is None:
        return None
    steps: list = []
    if given(ctx, "ffn_hidden_size", None) is None:
        steps.append((operator.mul, 4, hidden))
    if given(ctx, "kv_channels", None) is None:
        steps.append((operator.floordiv, hidden, heads))
    return first_failure(steps)


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


def _moe_extra(ctx: Context, key: str, default: str) -> str:
    return str(ctx.model.extras().get(key, default))


def _ncclep_flex(ctx: Context) -> bool:
    return (
        _moe_extra(ctx, "moe_flex_dispatcher_backend", "deepep") == "ncclep"
        and _moe_extra(ctx, "moe_token_dispatcher_type", "allgather") != "flex"
    )


def _rank_capacity_backend(ctx: Context) -> bool:
    backend = _moe_extra(ctx, "moe_flex_dispatcher_backend", "deepep")
    return ctx.model.moe_expert_rank_capacity_factor is not None and backend not in ("hybridep", "ncclep")


def _rank_capacity_fuser(ctx: Context) -> bool:
    backend = _moe_extra(ctx, "moe_flex_dispatcher_backend", "deepep")
    return (
        ctx.model.moe_expert_rank_capacity_factor is not None
        and backend == "hybridep"
        and not ctx.model.use_transformer_engine_op_fuser
    )


_MOE_RULES: tuple[Rule, ...] = (
    mcore_rule(
        "MC-NCCLEP-FLEX",
        "ValueError",
        "moe_flex_dispatcher_backend='ncclep' requires moe_token_dispatcher_type='flex'.",
        _ncclep_flex,
        "The ncclep dispatcher backend needs the flex token dispatcher (0.19+).",
        ("model.moe_flex_dispatcher_backend", "model.moe_token_dispatcher_type"),
        applies_to=">=0.19",
        fix=("model.moe_token_dispatcher_type=flex",),
    ),
    mcore_rule(
        "MC-RANK-CAPACITY-BACKEND",
        "ValueError",
        "moe_expert_rank_capacity_factor requires moe_flex_dispatcher_backend to be 'hybridep' or 'ncclep'.",
        _rank_capacity_backend,
        "`moe_expert_rank_capacity_factor` (needed by `moe_paged_stash`) needs the hybridep or ncclep backend (0.19+).",
        ("model.moe_expert_rank_capacity_factor", "model.moe_flex_dispatcher_backend"),
        applies_to=">=0.19",
    ),
    mcore_rule(
        "MC-RANK-CAPACITY-OP-FUSER",
        "ValueError",
        "moe_expert_rank_capacity_factor with the 'hybridep' backend requires use_transformer_engine_op_fuser to be "
        "enabled.",
        _rank_capacity_fuser,
        "`moe_expert_rank_capacity_factor` with hybridep needs `use_transformer_engine_op_fuser` (0.19+).",
        ("model.moe_expert_rank_capacity_factor", "model.use_transformer_engine_op_fuser"),
        applies_to=">=0.19",
        fix=("model.use_transformer_engine_op_fuser=true",),
    ),
)


EARLY_RULES: tuple[Rule, ...] = (
    mcore_rule(
        "MC-SEQUENCE-PARALLEL-TP",
        "ValueError",
        "Cannot use sequence parallelism without tensor parallelism",
        _sp_without_tp,
        "`sequence_parallel` needs tensor parallel size > 1 (ModelParallelConfig).",
        ("model.sequence_parallel", "model.tensor_model_parallel_size"),
        fix=("model.sequence_parallel=false",),
    ),
    mcore_rule(
        "MC-PARALLEL-SIZES-TYPE",
        "TypeError",
        "'>' not supported between instances of 'str' and 'int'",
        _parallel_sizes_type,
        "A parallel size given as text, a list or null (ModelParallelConfig computes with it as written).",
        (
            "model.tensor_model_parallel_size",
            "model.pipeline_model_parallel_size",
            "model.expert_model_parallel_size",
            "model.expert_tensor_parallel_size",
        ),
        why="megatron-core's dataclass does not convert types; write the number without quotes. The message is "
        "Python's own for the operands given (this one: a string compared with 1).",
    ),
    mcore_rule(
        "MC-FP16-BF16",
        "ValueError",
        "Only one of self.fp16: {fp16} and self.bf16 {bf16} should be True.",
        _fp16_bf16,
        "`fp16` and `bf16` are mutually exclusive.",
        ("model.fp16", "model.bf16"),
        fix=("model.fp16=false",),
        why="megatron-core reads the flags by truthiness: the string 'false' counts as set.",
    ),
    mcore_rule(
        "MC-HEADS-TP",
        "ValueError",
        "num_attention_heads ({heads}) must be a multiple of tensor_model_parallel_size ({tp}).",
        _heads_tp,
        "`num_attention_heads` must be divisible by the tensor parallel size.",
        ("model.num_attention_heads", "model.tensor_model_parallel_size"),
    ),
    mcore_rule(
        "MC-SIZES-TYPE",
        "TypeError",
        "unsupported operand type(s) for //: 'str' and 'int'",
        _sizes_type,
        "`hidden_size` (or `num_attention_heads`) of a type megatron-core cannot derive the FFN / KV sizes from.",
        ("model.hidden_size", "model.num_attention_heads", "model.ffn_hidden_size", "model.kv_channels"),
        why="megatron-core computes ffn_hidden_size = 4 * hidden_size and kv_channels = hidden_size // "
        "num_attention_heads from the values as written. The message is Python's own for the operands given.",
    ),
    mcore_rule(
        "MC-QUERY-GROUPS-TP",
        "ValueError",
        "num_query_groups ({groups}) must be a multiple or divisor of tensor_model_parallel_size ({tp}).",
        _groups_tp,
        "`num_query_groups` (default: the head count) must divide or be divisible by the tensor parallel size.",
        ("model.num_query_groups", "model.tensor_model_parallel_size"),
    ),
    *_MOE_RULES,
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


def _cp_type(ctx: Context):
    return upstream_compare(operator.gt, given(ctx, "context_parallel_size", 1), 1)[1]


CP_TYPE = mcore_rule(
    "MC-CP-TYPE",
    "TypeError",
    "'>' not supported between instances of 'str' and 'int'",
    _cp_type,
    "`context_parallel_size` given as text, a list or null (compared with 1 as written).",
    ("model.context_parallel_size",),
    why="megatron-core's dataclass does not convert types; write the number without quotes. The message is Python's "
    "own for the operands given.",
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

# EARLY_RULES open the stage (they follow no other check); the context-parallel comparison and the pipeline size
# assert close it.
RULES = (*EARLY_RULES, *following("MC-FG-CUDA-GRAPH-INFLIGHT", CP_TYPE, PP_POSITIVE))
