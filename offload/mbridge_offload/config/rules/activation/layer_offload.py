"""Activation-offloading rules of megatron-core's ``TransformerConfig.__post_init__`` (0.16.1 and 0.19.2, read and
run), in upstream code order; later checks (TE, Bridge, Megatron-LM) and advice are in :mod:`.build`."""

from __future__ import annotations

from mbridge_offload.config.overrides import format_override
from mbridge_offload.config.rules.activation.recompute import granularity
from mbridge_offload.config.rules.base import Context, Match, Rule
from mbridge_offload.config.rules.mcore import mcore_rule, set_repr
from mbridge_offload.upstream_layers import ALLOWED_OFFLOAD_MODULES


def safe_layers(num_layers: int) -> int:
    # Leave at least two layers on the GPU so TE v2 can overlap transfers with compute.
    return max(1, num_layers - 2) if num_layers >= 2 else 0


# ---------------------------------------------------------------------------------------------- MCore, code order


def _num_layers(ctx: Context):
    m = ctx.model
    if not m.cpu_offloading or m.num_layers is None:
        return None
    if m.cpu_offloading_num_layers < 0 or m.cpu_offloading_num_layers >= m.num_layers:
        # upstream's f-string prints num_layers as written (a YAML `true` reads "less than True")
        return Match({"num_layers": ctx.seen("model.num_layers"), "fix_layers": safe_layers(m.num_layers)})
    return None


def _pp(ctx: Context):
    m = ctx.model
    # megatron-core compares the size as written: 4.5 (which our typed field does not keep) is > 1 too; a text or
    # null size has failed ModelParallelConfig's own comparison before this check (validate's upstream run).
    pp = ctx.seen("model.pipeline_model_parallel_size")
    if not isinstance(pp, int | float):
        pp = m.pipeline_model_parallel_size
    if m.cpu_offloading and pp > 1:
        fix = ["model.pipeline_model_parallel_size=1"]
        if m.virtual_pipeline_model_parallel_size is not None:
            fix.append("model.virtual_pipeline_model_parallel_size=null")
        return Match(fix=fix)
    return None


def activation_mode_edits(model) -> list[tuple[str, object, str]]:
    """What layer-level activation offloading needs besides its switch: ``(dotted key, new value, why)``; one home
    for ``validate``'s fixes and ``apply --mode activation``, so the two never disagree."""
    edits: list[tuple[str, object, str]] = []
    if not model.cpu_offloading_activations and not model.cpu_offloading_weights:
        edits.append(
            (
                "model.cpu_offloading_activations",
                True,
                "with activations and weights both off, Transformer Engine raises 'CPU Offloading is enabled while "
                "it is not mentioned what to offload'",
            )
        )
    if model.recompute_granularity is not None:
        why = "'CPU offloading does not work when activation recomputation is enabled' (activation memory rises "
        why += "for the layers kept on the GPU)"
        edits.append(("model.recompute_granularity", None, why))
        for key in ("recompute_method", "recompute_num_layers"):
            if getattr(model, key) is not None:
                edits.append((f"model.{key}", None, "only meaningful with recomputation, which is now off"))
    if model.cuda_graph_impl not in ("none", "full_iteration"):
        edits.append(("model.cuda_graph_impl", "none", "'CUDA graphs not supported with CPU offloading.'"))
    for key in ("enable_cuda_graph", "external_cuda_graph"):
        if getattr(model, key):
            edits.append((f"model.{key}", False, "CUDA graphs are not supported with CPU offloading"))
    if model.fine_grained_activation_offloading:
        why = "'fine_grained_activation_offloading cannot be enabled with cpu_offloading.'"
        edits.append(("model.fine_grained_activation_offloading", False, why))
    if model.moe_paged_stash:
        edits.append(("model.moe_paged_stash", False, "'moe_paged_stash cannot be enabled with cpu_offloading.'"))
    return edits


def _mode_fix(ctx: Context, prefix: str) -> list[str]:
    return [format_override(k, v) for k, v, _ in activation_mode_edits(ctx.model) if k.startswith(prefix)]


def _recompute(ctx: Context):
    if ctx.model.cpu_offloading and granularity(ctx) is not None:
        # A granularity of another type (true) is dropped from the typed section: its fix is switching it off.
        return Match(fix=_mode_fix(ctx, "model.recompute_") or ["model.recompute_granularity=null"])
    return None


def _fine_grained(ctx: Context) -> bool:
    return ctx.model.fine_grained_activation_offloading and ctx.model.cpu_offloading


def _fg_modules_empty(ctx: Context) -> bool:
    return ctx.model.fine_grained_activation_offloading and not ctx.model.offload_modules


def _allowed_modules(ctx: Context) -> set[str]:
    # The one list is 0.19.2's (upstream_layers); 0.16 lacks fused_group_mlp, main adds gdp_qkv.
    allowed = set(ALLOWED_OFFLOAD_MODULES)
    if ctx.target.version < (0, 19, 0):
        allowed.discard("fused_group_mlp")
    if ctx.target.version >= (0, 20, 0):
        allowed.add("gdp_qkv")
    return allowed


def _fg_modules_invalid(ctx: Context):
    m = ctx.model
    if not m.fine_grained_activation_offloading or not m.offload_modules:
        return None
    allowed = _allowed_modules(ctx)
    invalid = set(m.offload_modules) - allowed
    if not invalid:
        return None
    keep = [x for x in m.offload_modules if x in allowed] or ["core_attn"]
    return Match(
        {"invalid": set_repr(invalid), "allowed": set_repr(allowed)},
        fix=["model.offload_modules=[" + ",".join(keep) + "]"],
    )


def _fg_valid_modules(ctx: Context) -> bool:
    m = ctx.model
    return bool(
        m.fine_grained_activation_offloading
        and m.offload_modules
        and not set(m.offload_modules) - _allowed_modules(ctx)
    )


def _fg_attn_proj(ctx: Context):
    m = ctx.model
    if _fg_valid_modules(ctx) and "attn_proj" in m.offload_modules and "core_attn" not in m.offload_modules:
        return Match(fix=["model.offload_modules=[" + ",".join(["core_attn", *m.offload_modules]) + "]"])
    return None


def _fg_min_size(ctx: Context) -> bool:
    return _fg_valid_modules(ctx) and ctx.model.min_offloaded_tensor_size < 0


def _fg_fraction(ctx: Context):
    f = ctx.model.activation_offload_fraction
    if _fg_valid_modules(ctx) and not 0 <= f <= 1:
        return Match({"clamped": min(max(f, 0.0), 1.0)})
    return None


def _fg_delta(ctx: Context) -> bool:
    return _fg_valid_modules(ctx) and ctx.model.delta_offload_bytes_across_pp_ranks < 0


def _fg_fused_group_mlp(ctx: Context) -> bool:
    m = ctx.model
    return _fg_valid_modules(ctx) and "fused_group_mlp" in m.offload_modules and not m.use_transformer_engine_op_fuser


def _paged_stash(ctx: Context) -> bool:
    return ctx.model.moe_paged_stash and ctx.model.cpu_offloading


def _enable_deprecated(ctx: Context):
    m = ctx.model
    if m.cuda_graph_impl != "none" or (m.enable_cuda_graph and m.external_cuda_graph):
        return None
    if m.enable_cuda_graph:
        return Match({"old": "enable_cuda_graph", "impl": "local"})
    if m.external_cuda_graph:
        return Match({"old": "external_cuda_graph", "impl": "transformer_engine"})
    return None


def _impl_invalid(ctx: Context):
    impl = ctx.cuda_graph_impl
    if impl != "none" and impl not in ctx.allowed_cuda_graph_impls:
        return Match({"impl": impl}, fix=["model.cuda_graph_impl=none"])
    return None


def _cuda_graph(ctx: Context):
    impl = ctx.cuda_graph_impl
    if not ctx.model.cpu_offloading or impl == "none" or impl not in ctx.allowed_cuda_graph_impls:
        return None
    if impl == "full_iteration":  # exempt since 0.19 (and only valid there)
        return None
    fix = ["model.cuda_graph_impl=none"]
    if ctx.model.cuda_graph_impl == "none":  # a deprecated spelling switched the graphs on
        fix = [f"model.{k}=false" for k in ("enable_cuda_graph", "external_cuda_graph") if getattr(ctx.model, k)]
    return Match(fix=fix)


_OFFLOAD = "model.cpu_offloading"
_K = "model.cpu_offloading_num_layers"

ACTIVATION_RULES: tuple[Rule, ...] = (
    mcore_rule(
        id="ACT-NUM-LAYERS",
        exception="ValueError",
        summary="`cpu_offloading_num_layers` must be in 0 … num_layers − 1 when activation offloading is on.",
        keys=(_OFFLOAD, _K, "model.num_layers"),
        message="CPU offloading can be done only for layers less than {num_layers}",
        why="MCore compares the count with the model's total num_layers (not per pipeline stage); the valid range "
        "is 0…num_layers−1 inclusive (the skill's `[0, num_layers-1)` wording is off by one). TE v2 also wants "
        "at least one layer, better two, left on the GPU.",
        fix=(_K + "={fix_layers}",),
        check=_num_layers,
    ),
    mcore_rule(
        id="ACT-PP",
        exception="ValueError",
        summary="Layer-level activation offloading needs pipeline parallel size 1.",
        keys=(_OFFLOAD, "model.pipeline_model_parallel_size"),
        message="Currently there is no support for Pipeline parallelism with CPU offloading",
        why="Both TE offload schedulers assume all forwards then all backwards of one micro-batch; a pipeline "
        "interleaves them. If the model needs PP > 1 to fit, use optimizer offloading "
        "(optimizer.optimizer_cpu_offload=true) or fine-grained activation offloading instead. Note: on real "
        "MCore `pipeline_dtype must be specified` fires first when pipeline_dtype is unset; Bridge's "
        "mixed-precision setup fills it in, so Bridge users see this message.",
        fix=("model.pipeline_model_parallel_size=1",),
        check=_pp,
    ),
    mcore_rule(
        id="ACT-RECOMPUTE",
        exception="ValueError",
        summary="Layer-level activation offloading cannot be combined with activation recomputation.",
        keys=(_OFFLOAD, "model.recompute_granularity"),
        message="CPU offloading does not work when activation recomputation is enabled",
        why="Recomputed layers discard activations that the offload hooks expect to move; upstream forbids the "
        "combination outright (any granularity, full or selective).",
        fix=("model.recompute_granularity=null",),
        check=_recompute,
    ),
    mcore_rule(
        id="ACT-FINE-GRAINED",
        exception="AssertionError",
        summary="Layer-level and fine-grained activation offloading are mutually exclusive.",
        keys=(_OFFLOAD, "model.fine_grained_activation_offloading"),
        message="fine_grained_activation_offloading cannot be enabled with cpu_offloading.",
        why="Both install saved-tensor hooks around overlapping regions and count groups differently; upstream "
        "asserts. Pick one: fine-grained works with PP > 1, layer-level needs PP = 1.",
        fix=("model.fine_grained_activation_offloading=false",),
        check=_fine_grained,
    ),
    mcore_rule(
        id="ACT-FG-MODULES-EMPTY",
        exception="AssertionError",
        summary="Fine-grained offloading needs a non-empty `offload_modules`.",
        keys=("model.fine_grained_activation_offloading", "model.offload_modules"),
        message="model.offload_modules is empty (upstream: bare `assert self.offload_modules is not None and "
        "len(self.offload_modules) > 0`, no message)",
        upstream=False,
        upstream_text="",
        why="Fine-grained offloading offloads the inputs of the listed submodules; with none listed upstream "
        "fails a bare assert whose message is empty.",
        fix=("model.offload_modules=[core_attn]",),
        check=_fg_modules_empty,
    ),
    mcore_rule(
        id="ACT-FG-MODULES-INVALID",
        exception="AssertionError",
        summary="`offload_modules` entries must be from the allowed set (grows by release).",
        keys=("model.fine_grained_activation_offloading", "model.offload_modules"),
        message="Invalid choices for offload_modules: {invalid}. Allowed modules are: {allowed}",
        why="0.16 allows attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm, expert_fc1, moe_act; 0.19 adds "
        "fused_group_mlp; main adds gdp_qkv. (Upstream prints Python sets, whose order varies run to run; we "
        "print them sorted.)",
        fix=None,
        check=_fg_modules_invalid,
    ),
    mcore_rule(
        id="ACT-FG-ATTN-PROJ",
        exception="ValueError",
        summary="Offloading `attn_proj` requires offloading `core_attn` too.",
        keys=("model.offload_modules",),
        message="attn_proj cannot be set to offload_modules alone without core_attn because the input of "
        "attn_proj is the output of core_attn, which is needed in core_attn.backward().",
        why="The tensor would be needed on the GPU by core_attn's backward anyway.",
        fix=None,
        check=_fg_attn_proj,
    ),
    mcore_rule(
        id="ACT-FG-MIN-TENSOR-SIZE",
        exception="AssertionError",
        summary="`min_offloaded_tensor_size` must be ≥ 0 (checked from 0.19).",
        keys=("model.min_offloaded_tensor_size",),
        message="min_offloaded_tensor_size must be non-negative.",
        why="0.16.1 does not check it (a negative value simply offloads every tensor).",
        fix=("model.min_offloaded_tensor_size=1048576",),
        applies_to=">=0.19",
        check=_fg_min_size,
    ),
    mcore_rule(
        id="ACT-FG-FRACTION-RANGE",
        exception="AssertionError",
        summary="`activation_offload_fraction` must be in [0, 1] (field exists from 0.19).",
        keys=("model.activation_offload_fraction",),
        message="activation_offload_fraction must be in range [0, 1].",
        why="It is the fraction of eligible offload groups (in execution order), not of bytes.",
        fix=("model.activation_offload_fraction={clamped}",),
        applies_to=">=0.19",
        check=_fg_fraction,
    ),
    mcore_rule(
        id="ACT-FG-DELTA-BYTES",
        exception="AssertionError",
        summary="`delta_offload_bytes_across_pp_ranks` must be ≥ 0 (field exists from 0.19).",
        keys=("model.delta_offload_bytes_across_pp_ranks",),
        message="delta_offload_bytes_across_pp_ranks must be non-negative.",
        why="It reduces the offloaded bytes on later pipeline ranks; a negative delta is meaningless.",
        fix=("model.delta_offload_bytes_across_pp_ranks=0",),
        applies_to=">=0.19",
        check=_fg_delta,
    ),
    mcore_rule(
        id="ACT-FG-FUSED-GROUP-MLP",
        exception="ValueError",
        summary="Offloading `fused_group_mlp` needs `use_transformer_engine_op_fuser`.",
        keys=("model.offload_modules", "model.use_transformer_engine_op_fuser"),
        message="fused_group_mlp requires use_transformer_engine_op_fuser.",
        why="The fused grouped MLP only exists with TE's op fuser.",
        fix=("model.use_transformer_engine_op_fuser=true",),
        applies_to=">=0.19",
        check=_fg_fused_group_mlp,
    ),
    mcore_rule(
        id="ACT-PAGED-STASH",
        exception="ValueError",
        summary="`moe_paged_stash` cannot be combined with layer-level activation offloading (0.19+).",
        keys=(_OFFLOAD, "model.moe_paged_stash"),
        message="moe_paged_stash cannot be enabled with cpu_offloading.",
        why="Paged stashing manages the MoE activations itself; the field does not exist in 0.16.",
        fix=("model.moe_paged_stash=false",),
        applies_to=">=0.19",
        check=_paged_stash,
    ),
    # Two megatron-core CUDA-graph checks stay rules although they concern no offload: the deprecation is a
    # warning (validate's megatron-core run reports errors only), and the implementation check decides per release
    # whether full_iteration, the one graph ACT-CUDA-GRAPH allows beside offloading, exists at all.
    mcore_rule(
        id="ACT-CUDA-GRAPH-DEPRECATED",
        severity="warning",
        exception=None,
        summary="`enable_cuda_graph` / `external_cuda_graph` are deprecated spellings of `cuda_graph_impl`.",
        keys=("model.enable_cuda_graph", "model.external_cuda_graph"),
        message="{old} is deprecated, use cuda_graph_impl={impl} instead.",
        why="The CUDA-graph rules below then apply as for that cuda_graph_impl (external_cuda_graph → "
        "transformer_engine).",
        fix=("model.{old}=false", "model.cuda_graph_impl={impl}"),
        check=_enable_deprecated,
    ),
    mcore_rule(
        id="ACT-CUDA-GRAPH-IMPL",
        exception="AssertionError",
        summary="`cuda_graph_impl` must be one of the release's implementations (`full_iteration` only from 0.19).",
        keys=("model.cuda_graph_impl",),
        message="Invalid cuda graph implementation: {impl}",
        why="0.16 knows none / local / transformer_engine; 0.19 adds full_iteration. So `full_iteration` with "
        "activation offloading is fine on 0.19 and an AssertionError on 0.16.",
        fix=("model.cuda_graph_impl=none",),
        check=_impl_invalid,
    ),
    mcore_rule(
        id="ACT-CUDA-GRAPH",
        exception="ValueError",
        summary="Activation offloading is incompatible with CUDA graphs (except `full_iteration` on 0.19+).",
        keys=(_OFFLOAD, "model.cuda_graph_impl", "model.enable_cuda_graph"),
        message="CUDA graphs not supported with CPU offloading.",
        why="Per-layer graph capture cannot contain the offload hooks' stream syncs. On 0.19+ the whole-iteration "
        "graph (cuda_graph_impl=full_iteration) is the one allowed combination. Optimizer offloading has no "
        "CUDA-graph restriction.",
        fix=("model.cuda_graph_impl=none",),
        check=_cuda_graph,
    ),
)
