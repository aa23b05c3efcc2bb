"""megatron-core's own refusals that are not about offloading, but that a pre-flight check must catch.

``ModelParallelConfig.__post_init__`` / ``TransformerConfig.__post_init__`` (``model_parallel_config.py``,
``transformer/transformer_config.py``) and ``OptimizerConfig.__post_init__`` (``optimizer/optimizer_config.py``) of
megatron-core 0.16.1 and 0.19.2, read and run (``tests/config/test_differential.py``). Messages are upstream's,
verbatim, with the values printed as megatron-core prints them (as the user wrote them: ``'false'`` stays a string).
The catalogue (:mod:`mbridge_offload.config.rules.catalogue`) interleaves these groups with the offload rules in
upstream code order: upstream stops at its first failing check.
"""

from __future__ import annotations

import re

from mbridge_offload.config.rules.activation import _fg_valid_modules
from mbridge_offload.config.rules.base import STAGE_OPTIMIZER_CONFIG, STAGE_TRANSFORMER_CONFIG, Context, Match, Rule
from mbridge_offload.config.schema import SECTIONS

TC = STAGE_TRANSFORMER_CONFIG
_MOE_INSIDE = ("expert_fc1", "fused_group_mlp", "moe_act")


def _set_repr(items) -> str:
    return "{" + ", ".join(repr(x) for x in sorted(items)) + "}"


def _rule(id: str, exception: str, message: str, check, summary: str, keys: tuple[str, ...], **kw) -> Rule:
    """An MCore TransformerConfig error rule (most fields are the same for every rule here)."""
    return Rule(
        id=id,
        severity=kw.pop("severity", "error"),
        origin="mcore",
        stage=kw.pop("stage", TC),
        exception=exception,
        summary=summary,
        keys=keys,
        message=message,
        why=kw.pop("why", "megatron-core refuses the config before any training starts."),
        check=check,
        **kw,
    )


# ---------------------------------------------------------------------------------------------- value hygiene

_INTEGER_KEYS = (
    "model.num_layers",
    "model.cpu_offloading_num_layers",
    "model.min_offloaded_tensor_size",
    "model.delta_offload_bytes_across_pp_ranks",
)


def _string_flags(ctx: Context):
    for section, cls in SECTIONS.items():
        body = ctx.raw.get(section) if isinstance(ctx.raw, dict) else None
        for key, value in (body or {}).items() if isinstance(body, dict) else ():
            info = cls.model_fields.get(key)
            if isinstance(value, str) and info is not None and info.annotation is bool:
                dotted = f"{section}.{key}"
                truth = "true" if value else "false"
                yield Match({"key": dotted, "value": value, "truth": truth}, fix=[f"{dotted}={truth}"], keys=[dotted])


def _not_integer(ctx: Context):
    for dotted in _INTEGER_KEYS:
        value = ctx.seen(dotted)
        if isinstance(value, float) and not value.is_integer():
            yield Match({"key": dotted, "value": value}, keys=[dotted])


def _unknown_arguments(ctx: Context):
    raw = ctx.raw if isinstance(ctx.raw, dict) else {}
    for flag in raw.get("unknown_arguments") or ():
        yield Match({"flag": flag, "version": raw.get("megatron_lm_version", "?")}, keys=[])


VALUE_RULES: tuple[Rule, ...] = (
    Rule(
        id="CFG-UNKNOWN-ARGUMENT",
        severity="warning",
        origin="megatron-lm",
        upstream=False,
        summary="A Megatron-LM command-line flag that Megatron-LM's parser does not know.",
        keys=(),
        message="{flag} is not an argument of Megatron-LM {version}; it was not read",
        why="Read with Megatron-LM's full argument set; an unknown flag is a typo or belongs to another release "
        "(Megatron-LM itself exits on it unless the script passes ignore_unknown_args).",
        check=_unknown_arguments,
    ),
    Rule(
        id="CFG-STRING-FLAG",
        severity="warning",
        origin="advisory",
        upstream=False,
        summary="A flag given as a string (`'false'`): megatron-core reads it by truthiness.",
        keys=(),
        message="{key} is the string {value!r}, which megatron-core reads as {truth}",
        why="megatron-core's dataclasses do not convert types, so any non-empty string switches a flag on; "
        "validate reads it the same way. Write true/false without quotes.",
        check=_string_flags,
    ),
    Rule(
        id="CFG-NOT-INTEGER",
        severity="warning",
        origin="advisory",
        upstream=False,
        summary="An integer setting given a fractional number.",
        keys=(),
        message="{key} = {value} is not a whole number; megatron-core's config accepts it, building the model fails",
        why="megatron-core does not convert or check the type when the config is constructed.",
        check=_not_integer,
    ),
)


# ---------------------------------------------------------------------------------------------- early checks


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
    # compares an int with a str first.
    if isinstance(ctx.seen("model.num_layers"), str) and ctx.model.cpu_offloading:
        return Match()
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
    _rule(
        "MC-NCCLEP-FLEX",
        "ValueError",
        "moe_flex_dispatcher_backend='ncclep' requires moe_token_dispatcher_type='flex'.",
        _ncclep_flex,
        "The ncclep dispatcher backend needs the flex token dispatcher (0.19+).",
        ("model.moe_flex_dispatcher_backend", "model.moe_token_dispatcher_type"),
        applies_to=">=0.19",
        fix=("model.moe_token_dispatcher_type=flex",),
    ),
    _rule(
        "MC-RANK-CAPACITY-BACKEND",
        "ValueError",
        "moe_expert_rank_capacity_factor requires moe_flex_dispatcher_backend to be 'hybridep' or 'ncclep'.",
        _rank_capacity_backend,
        "`moe_expert_rank_capacity_factor` (needed by `moe_paged_stash`) needs the hybridep or ncclep backend (0.19+).",
        ("model.moe_expert_rank_capacity_factor", "model.moe_flex_dispatcher_backend"),
        applies_to=">=0.19",
    ),
    _rule(
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


def _layout_stages(layout) -> int | None:
    """The number of PP x VPP stages in ``pipeline_model_parallel_layout``, read as megatron-core reads it
    (``PipelineParallelLayerLayout.parse_str_to_list``: commas dropped, ``(..)*n`` and ``x*n`` unrolled, ``|``
    separates stages); a list counts its rows. None when absent or unreadable (megatron-core's parser decides)."""
    if isinstance(layout, list):
        return len(layout)
    if not isinstance(layout, str) or not layout:
        return None
    text = layout.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        text = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)
    return len(text.split("|"))


def _layout_vpp(ctx: Context):
    m = ctx.model
    stages = _layout_stages(m.extras().get("pipeline_model_parallel_layout"))
    pp = m.pipeline_model_parallel_size
    vpp = m.virtual_pipeline_model_parallel_size
    if stages is None or vpp is None or pp < 1 or stages % pp:
        return None
    detected = stages // pp
    return Match({"vpp": vpp, "detected": detected}) if vpp != detected else None


LAYOUT_VPP = _rule(
    "MC-PP-LAYOUT-VPP",
    "AssertionError",
    "virtual_pipeline_model_parallel_size conflicts with pipeline_model_parallel_layout, "
    "(self.virtual_pipeline_model_parallel_size={vpp},  detected_vpp_size={detected})",
    _layout_vpp,
    "`virtual_pipeline_model_parallel_size` must equal the stages per pipeline rank that "
    "`pipeline_model_parallel_layout` describes.",
    ("model.virtual_pipeline_model_parallel_size", "model.pipeline_model_parallel_layout"),
    fix=("model.virtual_pipeline_model_parallel_size={detected}",),
    why="TransformerConfig parses the layout (stages separated by `|`, `(..)*n` unrolled) and asserts that the "
    "VPP size given equals stages / PP (both releases).",
)


EARLY_RULES: tuple[Rule, ...] = (
    _rule(
        "MC-SEQUENCE-PARALLEL-TP",
        "ValueError",
        "Cannot use sequence parallelism without tensor parallelism",
        _sp_without_tp,
        "`sequence_parallel` needs tensor parallel size > 1 (ModelParallelConfig).",
        ("model.sequence_parallel", "model.tensor_model_parallel_size"),
        fix=("model.sequence_parallel=false",),
    ),
    _rule(
        "MC-FP16-BF16",
        "ValueError",
        "Only one of self.fp16: {fp16} and self.bf16 {bf16} should be True.",
        _fp16_bf16,
        "`fp16` and `bf16` are mutually exclusive.",
        ("model.fp16", "model.bf16"),
        fix=("model.fp16=false",),
        why="megatron-core reads the flags by truthiness: the string 'false' counts as set.",
    ),
    _rule(
        "MC-HEADS-TP",
        "ValueError",
        "num_attention_heads ({heads}) must be a multiple of tensor_model_parallel_size ({tp}).",
        _heads_tp,
        "`num_attention_heads` must be divisible by the tensor parallel size.",
        ("model.num_attention_heads", "model.tensor_model_parallel_size"),
    ),
    _rule(
        "MC-QUERY-GROUPS-TP",
        "ValueError",
        "num_query_groups ({groups}) must be a multiple or divisor of tensor_model_parallel_size ({tp}).",
        _groups_tp,
        "`num_query_groups` (default: the head count) must divide or be divisible by the tensor parallel size.",
        ("model.num_query_groups", "model.tensor_model_parallel_size"),
    ),
    *_MOE_RULES,
    _rule(
        "MC-NUM-LAYERS-TYPE",
        "TypeError",
        "'>=' not supported between instances of 'int' and 'str'",
        _num_layers_string,
        "`num_layers` given as a string (megatron-core compares it as given).",
        ("model.num_layers",),
        why="megatron-core's dataclass does not convert types; write the number without quotes.",
    ),
)


def _num_layers_string_init(ctx: Context) -> bool:
    # Without offloading, the string reaches the output-layer init method (`multiplier * num_layers`, a float times
    # a str), just before the CUDA-graph checks.
    return isinstance(ctx.seen("model.num_layers"), str) and not ctx.model.cpu_offloading


NUM_LAYERS_TYPE_INIT = _rule(
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


MOE_BIAS_ETP = _rule(
    "MC-MOE-BIAS-ETP",
    "AssertionError",
    "Bias in Moe is only supported when ETP==1",
    _moe_bias_etp,
    "MoE with linear biases (`add_bias_linear`, on by default) needs expert tensor parallel size 1.",
    ("model.num_moe_experts", "model.add_bias_linear", "model.expert_tensor_parallel_size"),
    fix=("model.add_bias_linear=false",),
    why="The expert tensor parallel size defaults to the tensor parallel size.",
)

# ---------------------------------------------------------------------------------------------- recompute


def _granularity(ctx: Context) -> str | None:
    return ctx.model.recompute_granularity


def _bad_granularity(ctx: Context):
    g = _granularity(ctx)
    return Match({"g": g}) if g is not None and g not in ("full", "selective") else None


def _bad_method(ctx: Context):
    method = ctx.model.recompute_method
    if _granularity(ctx) is not None and method is not None and method not in ("block", "uniform"):
        return Match({"method": method})
    return None


def _missing_method(ctx: Context):
    g = _granularity(ctx)
    if g is not None and ctx.model.recompute_method is None and g != "selective":
        return Match({"g": g})
    return None


def _full_without_layers(ctx: Context):
    m = ctx.model
    g = _granularity(ctx)
    if g is None or g == "selective" or m.recompute_num_layers is not None or m.num_layers is None:
        return None
    if isinstance(ctx.seen("model.num_layers"), str):
        return None  # building the message itself fails first (MC-RECOMPUTE-NUM-LAYERS-TYPE)
    return Match({"g": g, "per_rank": m.num_layers // m.pipeline_model_parallel_size})


def _full_without_layers_str(ctx: Context) -> bool:
    m = ctx.model
    g = _granularity(ctx)
    return (
        g is not None
        and g != "selective"
        and m.recompute_num_layers is None
        and isinstance(ctx.seen("model.num_layers"), str)
    )


def _selective_with_layers(ctx: Context) -> bool:
    return _granularity(ctx) == "selective" and ctx.model.recompute_num_layers is not None


def _distribute_sp(ctx: Context):
    m = ctx.model
    if _granularity(ctx) is not None and m.distribute_saved_activations and m.sequence_parallel:
        return Match({"d": ctx.seen("model.distribute_saved_activations"), "sp": ctx.seen("model.sequence_parallel")})
    return None


def _recompute_modules(ctx: Context) -> list[str]:
    return list(ctx.model.recompute_modules) if ctx.model.recompute_modules is not None else ["core_attn"]


def _allowed_recompute(ctx: Context) -> set[str]:
    allowed = {"core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"}
    return allowed | {"gdn_norm_out"} if ctx.target.version >= (0, 19, 0) else allowed


def _bad_recompute_modules(ctx: Context):
    if _granularity(ctx) != "selective":
        return None
    invalid = set(_recompute_modules(ctx)) - _allowed_recompute(ctx)
    if invalid:
        return Match({"invalid": _set_repr(invalid), "allowed": _set_repr(_allowed_recompute(ctx))})
    return None


def _moe_act_gemm(ctx: Context) -> bool:
    return _granularity(ctx) == "selective" and "moe_act" in _recompute_modules(ctx) and not ctx.model.moe_grouped_gemm


def _mla_up_proj(ctx: Context) -> bool:
    return (
        _granularity(ctx) == "selective"
        and "mla_up_proj" in _recompute_modules(ctx)
        and not ctx.model.multi_latent_attention
    )


RECOMPUTE_RULES: tuple[Rule, ...] = (
    _rule(
        "MC-RECOMPUTE-GRANULARITY",
        "ValueError",
        'When using recompute_granuarlity: {g} must be "full"or "selective".',
        _bad_granularity,
        '`recompute_granularity` must be null, "full" or "selective" (the strings "none"/"null" are refused).',
        ("model.recompute_granularity",),
        fix=("model.recompute_granularity=null",),
        why="Only YAML's null (no quotes) switches recomputation off; megatron-core keeps a string as given.",
    ),
    _rule(
        "MC-RECOMPUTE-METHOD",
        "ValueError",
        'recompute_method: {method} must be "block" or "uniform".',
        _bad_method,
        '`recompute_method` must be "block" or "uniform".',
        ("model.recompute_method",),
    ),
    _rule(
        "MC-RECOMPUTE-METHOD-MISSING",
        "ValueError",
        'Using recompute_granularity: {g} so recompute_method must be "block" or "uniform"',
        _missing_method,
        "Full recomputation needs `recompute_method`.",
        ("model.recompute_granularity", "model.recompute_method"),
        fix=("model.recompute_method=uniform",),
    ),
    _rule(
        "MC-RECOMPUTE-NUM-LAYERS",
        "ValueError",
        "When using recompute_granularity: {g} recompute_num_layers must be between 1 and "
        "num_layers_per_pipeline_rank: {per_rank}",
        _full_without_layers,
        "Full recomputation needs `recompute_num_layers`.",
        ("model.recompute_granularity", "model.recompute_num_layers"),
        fix=("model.recompute_num_layers=1",),
    ),
    _rule(
        "MC-RECOMPUTE-NUM-LAYERS-TYPE",
        "TypeError",
        "unsupported operand type(s) for //: 'str' and 'int'",
        _full_without_layers_str,
        "Full recomputation without `recompute_num_layers`, with `num_layers` given as a string.",
        ("model.recompute_num_layers", "model.num_layers"),
        why="megatron-core computes num_layers // pipeline size for its message; write the number without quotes.",
    ),
    _rule(
        "MC-RECOMPUTE-SELECTIVE-LAYERS",
        "ValueError",
        "When using recompute_granularity: selective recompute_num_layers must be None.",
        _selective_with_layers,
        "Selective recomputation takes no `recompute_num_layers`.",
        ("model.recompute_granularity", "model.recompute_num_layers"),
        fix=("model.recompute_num_layers=null",),
    ),
    _rule(
        "MC-RECOMPUTE-DISTRIBUTE-SP",
        "ValueError",
        "distribute_saved_activations: {d} must be false when sequence parallel is enabled: {sp}",
        _distribute_sp,
        "`distribute_saved_activations` excludes sequence parallelism.",
        ("model.distribute_saved_activations", "model.sequence_parallel"),
    ),
    _rule(
        "MC-RECOMPUTE-MODULES",
        "AssertionError",
        "Invalid choices for recompute_modules: {invalid}. Allowed modules are: {allowed}",
        _bad_recompute_modules,
        "`recompute_modules` entries must be from the release's set.",
        ("model.recompute_modules",),
    ),
    _rule(
        "MC-RECOMPUTE-MOE-ACT",
        "ValueError",
        "moe_act in recompute_modules is only supported with moe_grouped_gemm.",
        _moe_act_gemm,
        "Recomputing `moe_act` needs `moe_grouped_gemm`.",
        ("model.recompute_modules", "model.moe_grouped_gemm"),
    ),
    _rule(
        "MC-RECOMPUTE-MLA-UP-PROJ",
        "ValueError",
        "mla_up_proj in recompute_modules is only supported with multi_latent_attention.",
        _mla_up_proj,
        "Recomputing `mla_up_proj` needs multi-latent attention.",
        ("model.recompute_modules", "model.multi_latent_attention"),
    ),
)


# ---------------------------------------------------------------------------------------------- offload extras (0.19)


def _fg_on(ctx: Context) -> bool:
    return _fg_valid_modules(ctx)


def _fg_moe_recompute(ctx: Context):
    if not _fg_on(ctx) or _granularity(ctx) != "selective" or "moe" not in _recompute_modules(ctx):
        return None
    inside = set(_MOE_INSIDE) & set(ctx.model.offload_modules)
    return Match({"inside": _set_repr(inside)}) if inside else None


def _fg_fused_partial(ctx: Context):
    m = ctx.model
    if not _fg_on(ctx) or "fused_group_mlp" not in m.offload_modules or not m.use_transformer_engine_op_fuser:
        return None
    partial = {"expert_fc1", "moe_act"} & set(m.offload_modules)
    return Match({"partial": _set_repr(partial)}) if partial else None


def _paged_capacity(ctx: Context) -> bool:
    m = ctx.model
    return bool(m.moe_paged_stash) and not m.cpu_offloading and m.moe_expert_rank_capacity_factor is None


def _paged_modules(ctx: Context):
    m = ctx.model
    if not m.moe_paged_stash or m.cpu_offloading or m.moe_expert_rank_capacity_factor is None:
        return None
    conflict = set(_MOE_INSIDE) & set(m.offload_modules)
    return Match({"conflict": _set_repr(conflict)}) if conflict else None


FG_MOE_RECOMPUTE = _rule(
    "MC-FG-MOE-RECOMPUTE",
    "AssertionError",
    "Cannot offload {inside} while recomputing the entire MoE layer. 'moe' in recompute_modules wraps the full MoE "
    "forward in a checkpoint, so offloading activations inside it is redundant and will cause errors. Either remove "
    "'moe' from --recompute-modules or remove {inside} from --offload-modules.",
    _fg_moe_recompute,
    "Fine-grained offloading inside the MoE layer excludes recomputing the whole MoE layer (0.19+).",
    ("model.offload_modules", "model.recompute_modules"),
    applies_to=">=0.19",
)
FG_FUSED_PARTIAL = _rule(
    "MC-FG-FUSED-GROUP-MLP-PARTIAL",
    "ValueError",
    "fused_group_mlp offloads the whole fused grouped MLP and cannot be combined with expert_fc1 or moe_act. "
    "Remove: {partial}",
    _fg_fused_partial,
    "`fused_group_mlp` in `offload_modules` excludes `expert_fc1` and `moe_act` (0.19+).",
    ("model.offload_modules",),
    applies_to=">=0.19",
)
PAGED_STASH_RULES: tuple[Rule, ...] = (
    _rule(
        "MC-PAGED-STASH-CAPACITY",
        "ValueError",
        "moe_paged_stash requires moe_expert_rank_capacity_factor to be set; there is no need to use paged stashing "
        "without it.",
        _paged_capacity,
        "`moe_paged_stash` needs `moe_expert_rank_capacity_factor` (0.19+).",
        ("model.moe_paged_stash", "model.moe_expert_rank_capacity_factor"),
        applies_to=">=0.19",
    ),
    _rule(
        "MC-PAGED-STASH-MODULES",
        "ValueError",
        "When moe_paged_stash is enabled, offload_modules must not include expert_fc1, moe_act, or fused_group_mlp "
        "(paged stash covers those activations). Remove: {conflict}",
        _paged_modules,
        "`moe_paged_stash` excludes offloading the MoE activations it already stashes (0.19+).",
        ("model.moe_paged_stash", "model.offload_modules"),
        applies_to=">=0.19",
    ),
)


# ---------------------------------------------------------------------------------------------- CUDA graphs


def _enable_and_external(ctx: Context) -> bool:
    m = ctx.model
    return m.cuda_graph_impl == "none" and bool(m.enable_cuda_graph) and bool(m.external_cuda_graph)


def _graph_full_recompute(ctx: Context) -> bool:
    impl, g = ctx.cuda_graph_impl, _granularity(ctx)
    if impl in (None, "none") or impl not in ctx.allowed_cuda_graph_impls or not g or g == "selective":
        return False
    if ctx.model.cpu_offloading and impl != "full_iteration":
        return False  # "CUDA graphs not supported with CPU offloading." comes first
    if ctx.target.version >= (0, 19, 0):
        return impl != "full_iteration"
    scope = ctx.model.cuda_graph_scope
    return scope not in ("full_iteration", ["full_iteration"])


def _fg_graph(ctx: Context) -> bool:
    """0.19 checks fine-grained offloading against the CUDA-graph implementation (any NVTE_CPU_OFFLOAD_V1)."""
    impl = ctx.cuda_graph_impl
    return (
        ctx.target.version >= (0, 19, 0)
        and bool(ctx.model.fine_grained_activation_offloading)
        and _fg_on(ctx)
        and impl not in (None, "none")
        and impl in ctx.allowed_cuda_graph_impls
        and not ctx.model.cpu_offloading
        and not _graph_full_recompute(ctx)
    )


_LOCAL_FG = {"expert_fc1", "moe_act", "fused_group_mlp"}


def _fg_local_modules(ctx: Context):
    if not _fg_graph(ctx) or ctx.cuda_graph_impl != "local":
        return None
    unsupported = set(ctx.model.offload_modules) - _LOCAL_FG
    return Match({"unsupported": sorted(unsupported)}) if unsupported else None


def _fg_local_whole_layer(ctx: Context) -> bool:
    return (
        _fg_graph(ctx)
        and ctx.cuda_graph_impl == "local"
        and not set(ctx.model.offload_modules) - _LOCAL_FG
        and not ctx.cuda_graph_modules
    )


def _fg_graph_impl(ctx: Context) -> bool:
    if not _fg_graph(ctx) or ctx.cuda_graph_impl != "local":
        return False
    # Reached only when the two local checks above pass; then `moe` in cuda_graph_modules is what is left.
    modules = ctx.cuda_graph_modules
    return bool(modules) and not set(ctx.model.offload_modules) - _LOCAL_FG and "moe" in modules


def _fg_graph_passed(ctx: Context) -> bool:
    """The three implementation checks and the token-drop MoE check passed (the warm-up checks come next)."""
    impl, modules = ctx.cuda_graph_impl, ctx.cuda_graph_modules
    if impl == "local":
        ok = not set(ctx.model.offload_modules) - _LOCAL_FG and bool(modules)
    else:
        ok = impl in ("transformer_engine", "full_iteration")
    return ok and "moe" not in modules


def _fg_warmup(ctx: Context) -> bool:
    return _fg_graph(ctx) and _fg_graph_passed(ctx) and ctx.model.cuda_graph_warmup_steps <= 0


def _fg_inflight(ctx: Context) -> bool:
    inflight = ctx.model.fine_grained_offloading_max_inflight_offloads
    return (
        _fg_graph(ctx)
        and _fg_graph_passed(ctx)
        and ctx.cuda_graph_impl == "full_iteration"
        and ctx.model.cuda_graph_warmup_steps > 0
        and (inflight is None or inflight < 0)
    )


GRAPH_ENABLE_AND_EXTERNAL = _rule(
    "MC-CUDA-GRAPH-ENABLE-AND-EXTERNAL",
    "AssertionError",
    "enable_cuda_graph and external_cuda_graph cannot be enabled at the same time.",
    _enable_and_external,
    "The deprecated `enable_cuda_graph` and `external_cuda_graph` exclude each other.",
    ("model.enable_cuda_graph", "model.external_cuda_graph"),
    fix=("model.external_cuda_graph=false",),
)
GRAPH_FULL_RECOMPUTE = _rule(
    "MC-CUDA-GRAPH-FULL-RECOMPUTE",
    "AssertionError",
    "full recompute is only supported with full iteration CUDA graph.",
    _graph_full_recompute,
    "Full recomputation with CUDA graphs needs the full-iteration graph.",
    ("model.recompute_granularity", "model.cuda_graph_impl", "model.cuda_graph_scope"),
)
_FG = "fine-grained activation offloading with cuda_graph_impl='local' "
FG_GRAPH_RULES: tuple[Rule, ...] = (
    _rule(
        "MC-FG-CUDA-GRAPH-LOCAL-MODULES",
        "AssertionError",
        _FG + "only supports offload_modules 'expert_fc1', 'moe_act', and 'fused_group_mlp'. "
        "Unsupported offload_modules: {unsupported}.",
        _fg_local_modules,
        "Fine-grained offloading with a local CUDA graph only allows the MoE modules (0.19+).",
        ("model.offload_modules", "model.cuda_graph_impl"),
        applies_to=">=0.19",
        why="0.19 checks this whatever NVTE_CPU_OFFLOAD_V1 says (transformer_config.py, CUDA-graph block).",
    ),
    _rule(
        "MC-FG-CUDA-GRAPH-LOCAL-WHOLE-LAYER",
        "AssertionError",
        _FG + "is not supported with whole-layer CUDA graph capture.",
        _fg_local_whole_layer,
        "Fine-grained offloading with a local CUDA graph needs `cuda_graph_modules` (not the whole layer) (0.19+).",
        ("model.cuda_graph_impl", "model.cuda_graph_modules"),
        applies_to=">=0.19",
    ),
    _rule(
        "MC-FG-CUDA-GRAPH-IMPL",
        "AssertionError",
        "fine-grained activation offloading is only supported with transformer_engine CUDA graph implementation or "
        "local CUDA graph implementation with partial MoE offload. Local partial CUDA graphs are supported only for "
        "expert_fc1, moe_act, or fused_group_mlp offload when the full MoE module is not captured.",
        _fg_graph_impl,
        "Fine-grained offloading with a local CUDA graph must not capture the whole MoE module (0.19+).",
        ("model.cuda_graph_impl", "model.cuda_graph_modules"),
        applies_to=">=0.19",
    ),
    _rule(
        "MC-FG-CUDA-GRAPH-WARMUP",
        "AssertionError",
        "cuda_graph_warmup_steps must be greater than 0 when enabling fine-grained activation offloading.",
        _fg_warmup,
        "Fine-grained offloading with CUDA graphs needs `cuda_graph_warmup_steps` > 0 (0.19+).",
        ("model.cuda_graph_warmup_steps",),
        applies_to=">=0.19",
        fix=("model.cuda_graph_warmup_steps=3",),
    ),
    _rule(
        "MC-FG-CUDA-GRAPH-INFLIGHT",
        "AssertionError",
        "fine_grained_offloading_max_inflight_offloads must be a non-negative integer when using fine-grained "
        "activation offloading with full-iteration CUDA graphs",
        _fg_inflight,
        "Fine-grained offloading with the full-iteration graph needs `fine_grained_offloading_max_inflight_offloads`.",
        ("model.fine_grained_offloading_max_inflight_offloads", "model.cuda_graph_impl"),
        applies_to=">=0.19",
        fix=("model.fine_grained_offloading_max_inflight_offloads=1",),
    ),
)


# ---------------------------------------------------------------------------------------------- OptimizerConfig


def _dtype_not_fp32(key: str):
    def check(ctx: Context) -> bool:
        return not ctx.opt.use_precision_aware_optimizer and getattr(ctx.opt, key) not in (None, "fp32")

    return check


OPTIMIZER_DTYPE_RULES: tuple[Rule, ...] = tuple(
    _rule(
        f"MC-OPT-{key.upper().replace('_', '-')}",
        "AssertionError",
        f"{key} can only be fp32 when not using precision-aware optimizer",
        _dtype_not_fp32(key),
        f"`{key}` other than fp32 needs the precision-aware optimizer.",
        (f"optimizer.{key}", "optimizer.use_precision_aware_optimizer"),
        stage=STAGE_OPTIMIZER_CONFIG,
        fix=(f"optimizer.{key}=fp32",),
    )
    for key in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
)
