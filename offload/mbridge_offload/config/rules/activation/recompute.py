"""``TransformerConfig.__post_init__``'s recomputation checks, right after layer-level offloading's."""

from __future__ import annotations

from typing import Any

from mbridge_offload.config.overrides import format_override
from mbridge_offload.config.rules.base import Context, Match, Rule
from mbridge_offload.config.rules.mcore import following, given, mcore_rule, set_repr


def granularity(ctx: Context) -> Any:
    """``recompute_granularity`` as megatron-core sees it: a value of another type (``true``, ``1``) is kept as
    written, and ``if self.recompute_granularity is not None`` then refuses it (the typed section drops it)."""
    seen = ctx.seen("model.recompute_granularity")
    return ctx.model.recompute_granularity if seen is None or isinstance(seen, str) else seen


def _bad_granularity(ctx: Context):
    g = granularity(ctx)
    return Match({"g": g}) if g is not None and g not in ("full", "selective") else None


def _bad_method(ctx: Context):
    method = ctx.model.recompute_method
    if granularity(ctx) is not None and method is not None and method not in ("block", "uniform"):
        return Match({"method": method})
    return None


def _missing_method(ctx: Context):
    g = granularity(ctx)
    if g is not None and ctx.model.recompute_method is None and g != "selective":
        return Match({"g": g})
    return None


def _full_without_layers(ctx: Context):
    m = ctx.model
    g = granularity(ctx)
    if g is None or g == "selective" or m.recompute_num_layers is not None or m.num_layers is None:
        return None
    if isinstance(ctx.seen("model.num_layers"), str):
        return None  # building the message itself fails first (MC-RECOMPUTE-NUM-LAYERS-TYPE)
    return Match({"g": g, "per_rank": m.num_layers // m.pipeline_model_parallel_size})


def _full_without_layers_str(ctx: Context) -> bool:
    m = ctx.model
    g = granularity(ctx)
    return (
        g is not None
        and g != "selective"
        and m.recompute_num_layers is None
        and isinstance(ctx.seen("model.num_layers"), str)
    )


def _selective_with_layers(ctx: Context) -> bool:
    return granularity(ctx) == "selective" and ctx.model.recompute_num_layers is not None


def _distribute_sp(ctx: Context):
    m = ctx.model
    if granularity(ctx) is not None and m.distribute_saved_activations and m.sequence_parallel:
        return Match({"d": ctx.seen("model.distribute_saved_activations"), "sp": ctx.seen("model.sequence_parallel")})
    return None


def recompute_modules(ctx: Context) -> list[str]:
    return list(ctx.model.recompute_modules) if ctx.model.recompute_modules is not None else ["core_attn"]


def _allowed_recompute(ctx: Context) -> set[str]:
    allowed = {"core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"}
    return allowed | {"gdn_norm_out"} if ctx.target.version >= (0, 19, 0) else allowed


def _bad_recompute_modules(ctx: Context):
    if granularity(ctx) != "selective":
        return None
    invalid = set(recompute_modules(ctx)) - _allowed_recompute(ctx)
    if invalid:
        return Match({"invalid": set_repr(invalid), "allowed": set_repr(_allowed_recompute(ctx))})
    return None


def _moe_act_gemm(ctx: Context) -> bool:
    return granularity(ctx) == "selective" and "moe_act" in recompute_modules(ctx) and not ctx.model.moe_grouped_gemm


def _mla_up_proj(ctx: Context):
    modules = recompute_modules(ctx)
    if granularity(ctx) != "selective" or "mla_up_proj" not in modules or ctx.model.multi_latent_attention:
        return None
    kept = [x for x in modules if x != "mla_up_proj"]
    # With nothing else to recompute, selective recompute has no module left: switch it off.
    return Match(fix=[format_override("model.recompute_modules", kept) if kept else "model.recompute_granularity=null"])


def _selective(ctx: Context, module: str) -> bool:
    return granularity(ctx) == "selective" and module in recompute_modules(ctx)


def _gdn_norm_out(ctx: Context) -> bool:
    # 0.19 only (the module name exists there): it recomputes the gated-delta-net output norm.
    return _selective(ctx, "gdn_norm_out") and given(ctx, "experimental_attention_variant", None) != "gated_delta_net"


def _shared_experts_overlap(ctx: Context) -> bool:
    return (
        _selective(ctx, "shared_experts")
        and given(ctx, "moe_shared_expert_intermediate_size", None) is not None
        and bool(given(ctx, "moe_shared_expert_overlap", False))
    )


def _fp8_norm_recompute(ctx: Context) -> bool:
    # `if self.fp8:` on the value as written (after Bridge's mixed_precision copy), then moe_act or layernorm.
    return bool(given(ctx, "fp8", None)) and (_selective(ctx, "moe_act") or _selective(ctx, "layernorm"))


def _fp8_delayed(ctx: Context):
    if not _fp8_norm_recompute(ctx) or given(ctx, "fp8_recipe", "delayed") != "delayed":
        return None
    kept = [x for x in recompute_modules(ctx) if x not in ("moe_act", "layernorm")]
    return Match(fix=[format_override("model.recompute_modules", kept) if kept else "model.recompute_granularity=null"])


RECOMPUTE_RULES: tuple[Rule, ...] = (
    mcore_rule(
        "MC-RECOMPUTE-GRANULARITY",
        "ValueError",
        'When using recompute_granuarlity: {g} must be "full"or "selective".',
        _bad_granularity,
        '`recompute_granularity` must be null, "full" or "selective" (the strings "none"/"null" are refused).',
        ("model.recompute_granularity",),
        fix=("model.recompute_granularity=null",),
        why="Only YAML's null (no quotes) switches recomputation off; megatron-core keeps a string as given.",
    ),
    mcore_rule(
        "MC-RECOMPUTE-METHOD",
        "ValueError",
        'recompute_method: {method} must be "block" or "uniform".',
        _bad_method,
        '`recompute_method` must be "block" or "uniform".',
        ("model.recompute_method",),
    ),
    mcore_rule(
        "MC-RECOMPUTE-METHOD-MISSING",
        "ValueError",
        'Using recompute_granularity: {g} so recompute_method must be "block" or "uniform"',
        _missing_method,
        "Full recomputation needs `recompute_method`.",
        ("model.recompute_granularity", "model.recompute_method"),
        fix=("model.recompute_method=uniform",),
    ),
    mcore_rule(
        "MC-RECOMPUTE-NUM-LAYERS",
        "ValueError",
        "When using recompute_granularity: {g} recompute_num_layers must be between 1 and "
        "num_layers_per_pipeline_rank: {per_rank}",
        _full_without_layers,
        "Full recomputation needs `recompute_num_layers`.",
        ("model.recompute_granularity", "model.recompute_num_layers"),
        fix=("model.recompute_num_layers=1",),
    ),
    mcore_rule(
        "MC-RECOMPUTE-NUM-LAYERS-TYPE",
        "TypeError",
        "unsupported operand type(s) for //: 'str' and 'int'",
        _full_without_layers_str,
        "Full recomputation without `recompute_num_layers`, with `num_layers` given as a string.",
        ("model.recompute_num_layers", "model.num_layers"),
        why="megatron-core computes num_layers // pipeline size for its message; write the number without quotes.",
    ),
    mcore_rule(
        "MC-RECOMPUTE-SELECTIVE-LAYERS",
        "ValueError",
        "When using recompute_granularity: selective recompute_num_layers must be None.",
        _selective_with_layers,
        "Selective recomputation takes no `recompute_num_layers`.",
        ("model.recompute_granularity", "model.recompute_num_layers"),
        fix=("model.recompute_num_layers=null",),
    ),
    mcore_rule(
        "MC-RECOMPUTE-DISTRIBUTE-SP",
        "ValueError",
        "distribute_saved_activations: {d} must be false when sequence parallel is enabled: {sp}",
        _distribute_sp,
        "`distribute_saved_activations` excludes sequence parallelism.",
        ("model.distribute_saved_activations", "model.sequence_parallel"),
        fix=("model.distribute_saved_activations=false",),
    ),
    mcore_rule(
        "MC-RECOMPUTE-MODULES",
        "AssertionError",
        "Invalid choices for recompute_modules: {invalid}. Allowed modules are: {allowed}",
        _bad_recompute_modules,
        "`recompute_modules` entries must be from the release's set.",
        ("model.recompute_modules",),
    ),
    mcore_rule(
        "MC-RECOMPUTE-MOE-ACT",
        "ValueError",
        "moe_act in recompute_modules is only supported with moe_grouped_gemm.",
        _moe_act_gemm,
        "Recomputing `moe_act` needs `moe_grouped_gemm`.",
        ("model.recompute_modules", "model.moe_grouped_gemm"),
    ),
    mcore_rule(
        "MC-RECOMPUTE-MLA-UP-PROJ",
        "ValueError",
        "mla_up_proj in recompute_modules is only supported with multi_latent_attention.",
        _mla_up_proj,
        "Recomputing `mla_up_proj` needs multi-latent attention.",
        ("model.recompute_modules", "model.multi_latent_attention"),
    ),
    mcore_rule(
        "MC-RECOMPUTE-GDN-NORM-OUT",
        "ValueError",
        "gdn_norm_out in recompute_modules is only supported with experimental_attention_variant='gated_delta_net'.",
        _gdn_norm_out,
        "Recomputing `gdn_norm_out` needs the gated-delta-net attention variant (0.19+).",
        ("model.recompute_modules", "model.experimental_attention_variant"),
        applies_to=">=0.19",
    ),
    mcore_rule(
        "MC-RECOMPUTE-SHARED-EXPERTS-OVERLAP",
        "ValueError",
        "shared_experts recompute cannot work with --moe-shared-expert-overlap.",
        _shared_experts_overlap,
        "Recomputing `shared_experts` excludes `moe_shared_expert_overlap`.",
        ("model.recompute_modules", "model.moe_shared_expert_overlap", "model.moe_shared_expert_intermediate_size"),
        fix=("model.moe_shared_expert_overlap=false",),
    ),
    mcore_rule(
        "MC-RECOMPUTE-FP8-DELAYED",
        "ValueError",
        "Delayed scaling does not support moe_act and layernorm recompute for fp8.",
        _fp8_delayed,
        "Recomputing `moe_act` or `layernorm` under FP8 needs a recipe other than delayed scaling (the default).",
        ("model.recompute_modules", "model.fp8", "model.fp8_recipe"),
        why="megatron-core's default fp8_recipe is 'delayed'. The fix drops the two modules from recompute_modules; "
        "keeping them with another FP8 recipe (tensorwise, mxfp8, blockwise) works too, where Transformer Engine is "
        "2.6 or later (megatron-core's next check).",
    ),
)


RULES = following("ACT-RECOMPUTE", *RECOMPUTE_RULES)
