"""``TransformerConfig.__post_init__``'s CUDA-graph checks that are not in the activation rules' files, last in
upstream's order.

Kept although validate's megatron-core run makes them too: the fine-grained offloading ones are offload semantics,
and the recompute ones (full recompute, graphed dropout) refuse what the planner's recompute lever may propose beside
a CUDA graph, vetted without torch (``plan.search.advice.Vetter``). The other CUDA-graph checks (the deprecated
spellings and scopes) are megatron-core's alone: its run in validate reports them.
"""

from __future__ import annotations

from mbridge_offload.config.rules.activation.fine_grained import fg_on
from mbridge_offload.config.rules.activation.recompute import granularity
from mbridge_offload.config.rules.base import Context, Match, Rule
from mbridge_offload.config.rules.mcore import following, given, mcore_rule


def _graph_full_recompute(ctx: Context) -> bool:
    impl, g = ctx.cuda_graph_impl, granularity(ctx)
    if impl in (None, "none") or impl not in ctx.allowed_cuda_graph_impls or not g or g == "selective":
        return False
    if ctx.model.cpu_offloading and impl != "full_iteration":
        return False  # "CUDA graphs not supported with CPU offloading." comes first
    if ctx.target.version >= (0, 19, 0):
        return impl != "full_iteration"
    scope = ctx.model.cuda_graph_scope
    return scope not in ("full_iteration", ["full_iteration"])


def _graphed_selective(ctx: Context) -> tuple[bool, list[str], list[str]] | None:
    """``(full_cudagraph, graphed parts, recompute_modules)`` when selective recompute meets CUDA graphs and the
    earlier graph checks pass (upstream then checks that no recomputed module that draws random numbers is
    graphed); None otherwise."""
    impl = ctx.cuda_graph_impl
    if impl in (None, "none") or impl not in ctx.allowed_cuda_graph_impls or granularity(ctx) != "selective":
        return None
    if ctx.model.cpu_offloading:
        return None  # "CUDA graphs not supported with CPU offloading." comes first
    modules = ctx.model.recompute_modules
    modules = ["core_attn"] if modules is None else [str(x) for x in modules]
    if ctx.target.version >= (0, 19, 0):
        parts = ctx.cuda_graph_modules
        return impl == "full_iteration" or not parts, parts, modules
    parts = [p for p in ctx._scopes() if p and p != "full"]
    return not parts or "full_iteration" in parts, parts, modules


def _attention_dropout_graphed(ctx: Context) -> bool:
    graphed = _graphed_selective(ctx)
    if graphed is None or given(ctx, "attention_dropout", 0.1) == 0.0:
        return False
    full, parts, modules = graphed
    return "core_attn" in modules and (full or "attn" in parts)


def _hidden_dropout_graphed(ctx: Context) -> bool:
    graphed = _graphed_selective(ctx)
    if graphed is None or _attention_dropout_graphed(ctx) or given(ctx, "hidden_dropout", 0.1) == 0.0:
        return False
    full, parts, modules = graphed
    return any(name in modules and (full or name in parts) for name in ("mlp", "moe"))


def _fg_graph(ctx: Context) -> bool:
    """0.19 checks fine-grained offloading against the CUDA-graph implementation (any NVTE_CPU_OFFLOAD_V1)."""
    impl = ctx.cuda_graph_impl
    return (
        ctx.target.version >= (0, 19, 0)
        and bool(ctx.model.fine_grained_activation_offloading)
        and fg_on(ctx)
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


GRAPH_FULL_RECOMPUTE = mcore_rule(
    "MC-CUDA-GRAPH-FULL-RECOMPUTE",
    "AssertionError",
    "full recompute is only supported with full iteration CUDA graph.",
    _graph_full_recompute,
    "Full recomputation with CUDA graphs needs the full-iteration graph.",
    ("model.recompute_granularity", "model.cuda_graph_impl", "model.cuda_graph_scope"),
)
_FG = "fine-grained activation offloading with cuda_graph_impl='local' "
DROPOUT_RULES: tuple[Rule, ...] = (
    mcore_rule(
        "MC-CUDA-GRAPH-RECOMPUTE-ATTN-DROPOUT",
        "AssertionError",
        "attention dropout is not supported with graphed attention recomputation.",
        _attention_dropout_graphed,
        "Selective recompute of `core_attn` inside a CUDA graph needs `attention_dropout` 0.",
        ("model.recompute_modules", "model.attention_dropout", "model.cuda_graph_impl", "model.cuda_graph_scope"),
        fix=("model.attention_dropout=0.0",),
        why="A graphed module replays fixed random numbers, so a recomputed dropout would not match the original.",
    ),
    mcore_rule(
        "MC-CUDA-GRAPH-RECOMPUTE-HIDDEN-DROPOUT",
        "AssertionError",
        "hidden dropout is not supported with graphed MLP/MoE recomputation.",
        _hidden_dropout_graphed,
        "Selective recompute of `mlp` / `moe` inside a CUDA graph needs `hidden_dropout` 0.",
        ("model.recompute_modules", "model.hidden_dropout", "model.cuda_graph_impl", "model.cuda_graph_scope"),
        fix=("model.hidden_dropout=0.0",),
        why="A graphed module replays fixed random numbers, so a recomputed dropout would not match the original.",
    ),
)

FG_GRAPH_RULES: tuple[Rule, ...] = (
    mcore_rule(
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
    mcore_rule(
        "MC-FG-CUDA-GRAPH-LOCAL-WHOLE-LAYER",
        "AssertionError",
        _FG + "is not supported with whole-layer CUDA graph capture.",
        _fg_local_whole_layer,
        "Fine-grained offloading with a local CUDA graph needs `cuda_graph_modules` (not the whole layer) (0.19+).",
        ("model.cuda_graph_impl", "model.cuda_graph_modules"),
        applies_to=">=0.19",
    ),
    mcore_rule(
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
    mcore_rule(
        "MC-FG-CUDA-GRAPH-WARMUP",
        "AssertionError",
        "cuda_graph_warmup_steps must be greater than 0 when enabling fine-grained activation offloading.",
        _fg_warmup,
        "Fine-grained offloading with CUDA graphs needs `cuda_graph_warmup_steps` > 0 (0.19+).",
        ("model.cuda_graph_warmup_steps",),
        applies_to=">=0.19",
        fix=("model.cuda_graph_warmup_steps=3",),
    ),
    mcore_rule(
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


RULES = following("ACT-CUDA-GRAPH", GRAPH_FULL_RECOMPUTE, *DROPOUT_RULES, *FG_GRAPH_RULES)
