"""The first checks of ``ModelParallelConfig`` / ``TransformerConfig.__post_init__``: parallel sizes, precision,
MoE dispatch, and the type of ``num_layers``; they open the TransformerConfig stage."""

from __future__ import annotations

from mbridge_offload.config.rules.base import Context, Match, Rule
from mbridge_offload.config.rules.mcore import mcore_rule


def _sp_without_tp(ctx: Context) -> bool:
    return bool(ctx.model.sequence_parallel) and ctx.model.tensor_model_parallel_size <= 1


def _fp16_bf16(ctx: Context):
    if ctx.model.fp16 and ctx.model.bf16:
        return Match({"fp16": ctx.seen("model.fp16"), "bf16": ctx.seen("model.bf16")})
    return None


def _heads_tp(ctx: Context):
    heads, tp = ctx.model.num_attention_heads, ctx.model.tensor_model_parallel_size
    if heads is not None and heads % tp != 0:
        return Match({"heads": heads, "tp": tp})
    return None


def _groups_tp(ctx: Context):
    m = ctx.model
    groups = m.num_query_groups if m.num_query_groups is not None else m.num_attention_heads
    tp = m.tensor_model_parallel_size
    if groups is None or (m.num_attention_heads is not None and m.num_attention_heads % tp != 0):
        return None
    if groups % tp != 0 and tp % groups != 0:
        return Match({"groups": groups, "tp": tp})
    return None


def _num_layers_string(ctx: Context):
    # megatron-core keeps num_layers as given; with offloading on, `cpu_offloading_num_layers >= num_layers`
    # compares an int with a str -- unless `cpu_offloading_num_layers < 0` already short-circuits to the ValueError.
    if isinstance(ctx.seen("model.num_layers"), str) and ctx.model.cpu_offloading:
        return None if ctx.model.cpu_offloading_num_layers < 0 else Match()
    return None


def _offload_layers_type(ctx: Context):
    # `cpu_offloading_num_layers < 0` is megatron-core's first comparison of it: a string or null fails right there.
    value = ctx.seen("model.cpu_offloading_num_layers")
    if ctx.model.cpu_offloading and (value is None or isinstance(value, str)):
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


RULES = EARLY_RULES  # first in the stage: follows no other check
