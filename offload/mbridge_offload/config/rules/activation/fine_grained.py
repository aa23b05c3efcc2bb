"""``TransformerConfig.__post_init__``'s fine-grained offloading and paged-stash checks (0.19) that are not in the
activation rules' files, each placed after the activation check upstream runs just before it. All of them concern
offloading (``offload_modules``; paged stashing of what offloading would move); paged stashing's own MoE
prerequisites are megatron-core's alone (validate's upstream run reports them)."""

from __future__ import annotations

from mbridge_offload.config.overrides import format_override
from mbridge_offload.config.rules.activation.layer_offload import _fg_valid_modules
from mbridge_offload.config.rules.activation.recompute import granularity, recompute_modules
from mbridge_offload.config.rules.base import Context, Match, Rule
from mbridge_offload.config.rules.mcore import MOE_INSIDE, following, mcore_rule, set_repr


def fg_on(ctx: Context) -> bool:
    return _fg_valid_modules(ctx)


def _without(key: str, items: list[str], drop: set[str]) -> str | None:
    """``key=[items minus drop]``, or None when nothing would be left (an empty list is no fix here)."""
    kept = [x for x in items if x not in drop]
    return format_override(key, kept) if kept else None


def _fg_moe_recompute(ctx: Context):
    if not fg_on(ctx) or granularity(ctx) != "selective" or "moe" not in recompute_modules(ctx):
        return None
    inside = set(MOE_INSIDE) & set(ctx.model.offload_modules)
    if not inside:
        return None
    # Keep recomputing the MoE layer (it saves more) and offload what lies outside it; else stop recomputing 'moe'.
    fix = _without("model.offload_modules", list(ctx.model.offload_modules), inside) or _without(
        "model.recompute_modules", recompute_modules(ctx), {"moe"}
    )
    return Match({"inside": set_repr(inside)}, fix=[fix or "model.recompute_granularity=null"])


def _fg_fused_partial(ctx: Context):
    m = ctx.model
    if not fg_on(ctx) or "fused_group_mlp" not in m.offload_modules or not m.use_transformer_engine_op_fuser:
        return None
    partial = {"expert_fc1", "moe_act"} & set(m.offload_modules)
    if not partial:
        return None
    fix = _without("model.offload_modules", list(m.offload_modules), partial)
    return Match({"partial": set_repr(partial)}, fix=[fix] if fix else None)  # fused_group_mlp stays: never None


def _paged_modules(ctx: Context):
    m = ctx.model
    if not m.moe_paged_stash or m.cpu_offloading or m.moe_expert_rank_capacity_factor is None:
        return None
    conflict = set(MOE_INSIDE) & set(m.offload_modules)
    if not conflict:
        return None
    fix = _without("model.offload_modules", list(m.offload_modules), conflict)
    return Match({"conflict": set_repr(conflict)}, fix=[fix or "model.fine_grained_activation_offloading=false"])


FG_MOE_RECOMPUTE = mcore_rule(
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
FG_FUSED_PARTIAL = mcore_rule(
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
    mcore_rule(
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


RULES = (
    *following("ACT-FG-ATTN-PROJ", FG_MOE_RECOMPUTE),
    *following("ACT-FG-FUSED-GROUP-MLP", FG_FUSED_PARTIAL),
    *following("ACT-PAGED-STASH", *PAGED_STASH_RULES),
)
