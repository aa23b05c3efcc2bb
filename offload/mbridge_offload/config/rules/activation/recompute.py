"""``TransformerConfig.__post_init__``'s recomputation checks that a recompute change the planner proposes can trip.

Kept although megatron-core's own run in validate makes them too: the planner's recompute lever (selective modules,
full recompute; ``plan.search.sweeps``) vets each candidate with this catalogue, without torch
(``plan.search.advice.Vetter``). The other recompute checks (granularity, method, layer counts, module names) are
megatron-core's alone: validate's upstream run reports them with megatron-core's message.
"""

from __future__ import annotations

from typing import Any

from mbridge_offload.config.overrides import format_override
from mbridge_offload.config.rules.base import Context, Match, Rule
from mbridge_offload.config.rules.mcore import following, given, mcore_rule


def granularity(ctx: Context) -> Any:
    """``recompute_granularity`` as megatron-core sees it: a value of another type (``true``, ``1``) is kept as
    written, and ``if self.recompute_granularity is not None`` then refuses it (the typed section drops it)."""
    seen = ctx.seen("model.recompute_granularity")
    return ctx.model.recompute_granularity if seen is None or isinstance(seen, str) else seen


def _distribute_sp(ctx: Context):
    m = ctx.model
    if granularity(ctx) is not None and m.distribute_saved_activations and m.sequence_parallel:
        return Match({"d": ctx.seen("model.distribute_saved_activations"), "sp": ctx.seen("model.sequence_parallel")})
    return None


def recompute_modules(ctx: Context) -> list[str]:
    return list(ctx.model.recompute_modules) if ctx.model.recompute_modules is not None else ["core_attn"]


def _moe_act_gemm(ctx: Context) -> bool:
    return granularity(ctx) == "selective" and "moe_act" in recompute_modules(ctx) and not ctx.model.moe_grouped_gemm


def _selective(ctx: Context, module: str) -> bool:
    return granularity(ctx) == "selective" and module in recompute_modules(ctx)


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
        "MC-RECOMPUTE-DISTRIBUTE-SP",
        "ValueError",
        "distribute_saved_activations: {d} must be false when sequence parallel is enabled: {sp}",
        _distribute_sp,
        "`distribute_saved_activations` excludes sequence parallelism.",
        ("model.distribute_saved_activations", "model.sequence_parallel"),
        fix=("model.distribute_saved_activations=false",),
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
