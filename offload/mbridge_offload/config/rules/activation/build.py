"""Activation-offloading rules that fire after config construction, and the advisory ones.

Transformer Engine's offload context (checked when MCore builds the model: TE ``cpu_offload.py`` v2 and
``cpu_offload_v1.py``), Megatron Bridge guards (``training/config.py``, ``gpt_full_te_layer_autocast_spec.py``),
Megatron-LM ``validate_args`` (``arguments.py``), then advice upstream does not give.
These are taken from the source, not run: TE cannot be installed on a CPU machine.
"""

from __future__ import annotations

from mbridge_offload.config.rules.activation.layer_offload import safe_layers
from mbridge_offload.config.rules.base import (
    STAGE_BRIDGE,
    STAGE_MLM,
    STAGE_TE,
    TE_VERSION_ASSUMED,
    Context,
    Match,
    Rule,
    advisory,
)

# ---------------------------------------------------------------------------------------------- TE


def _nothing_to_offload(ctx: Context):
    m = ctx.model
    if m.cpu_offloading_activations or m.cpu_offloading_weights:
        return None
    # v1 checks before looking at `enabled`, and MCore calls TE's factory even when offloading is off.
    if m.cpu_offloading or ctx.te_offload_path == "v1":
        return Match({"path": ctx.te_offload_path})
    return None


def _weights_deprecated(ctx: Context):
    m = ctx.model
    if m.cpu_offloading and m.cpu_offloading_weights:
        fix = ["model.cpu_offloading_weights=false"]
        if not m.cpu_offloading_activations:
            fix.append("model.cpu_offloading_activations=true")
        return Match(fix=fix)
    return None


def _te_all_layers(ctx: Context):
    m = ctx.model
    if (
        m.cpu_offloading
        and m.num_layers is not None
        and ctx.te_offload_path == "v2"
        and m.cpu_offloading_activations
        and m.cpu_offloading_num_layers > m.num_layers - 1
    ):
        values = {
            "fix_layers": safe_layers(m.num_layers),
            "k": ctx.seen("model.cpu_offloading_num_layers"),
            "n": ctx.seen("model.num_layers"),
        }
        if ctx.te_version < (2, 14, 0):  # an assert until TE 2.14, then a ValueError that names both numbers
            text = "Cannot offload all layers without manual synchronization - last layer is not offloaded."
            return Match(values, message=text, exception="AssertionError")
        return Match(values)
    return None


def _no_overlap(ctx: Context):
    m = ctx.model
    if (
        m.cpu_offloading
        and m.num_layers is not None
        and m.num_layers >= 2
        and ctx.te_offload_path == "v2"
        and m.cpu_offloading_activations
        and m.cpu_offloading_num_layers == m.num_layers - 1
    ):
        return Match(
            fix=[f"model.cpu_offloading_num_layers={safe_layers(m.num_layers)}"] if m.num_layers >= 3 else None
        )
    return None


def _double_buffering(ctx: Context) -> bool:
    m = ctx.model
    return m.cpu_offloading and m.cpu_offloading_double_buffering and ctx.te_offload_path == "v2"


# ---------------------------------------------------------------------------------------------- Bridge / Megatron-LM


def _bridge_local_cuda_graph(ctx: Context) -> bool:
    m = ctx.model
    scope = m.cuda_graph_scope if isinstance(m.cuda_graph_scope, list) else [m.cuda_graph_scope]
    return (
        ctx.frontend != "megatron-lm"
        and m.cpu_offloading
        and ctx.cuda_graph_impl == "local"
        and "full_iteration" not in scope
    )


def _bridge_cudagraph_assert(ctx: Context) -> bool:
    m = ctx.model
    return ctx.frontend != "megatron-lm" and m.enable_cuda_graph and m.cpu_offloading


def _fg_te_impl(frontend: str):
    def check(ctx: Context):
        m = ctx.model
        if (
            (ctx.frontend == "megatron-lm") == (frontend == "megatron-lm")
            and m.fine_grained_activation_offloading
            and m.transformer_impl != "transformer_engine"
        ):
            return Match({"impl": m.transformer_impl})
        return None

    return check


def _fg_nvte(frontend: str):
    def check(ctx: Context):
        m = ctx.model
        if (ctx.frontend == "megatron-lm") != (frontend == "megatron-lm") or not m.fine_grained_activation_offloading:
            return None
        if m.transformer_impl != "transformer_engine":
            return None  # the transformer_impl check fires first
        if ctx.te_version >= (2, 10, 0) and not ctx.nvte_cpu_offload_v1:
            return Match({"te": ".".join(map(str, ctx.te_version))})
        return None

    return check


# ---------------------------------------------------------------------------------------------- advisory


def _zero_layers(ctx: Context):
    m = ctx.model
    if m.cpu_offloading and m.cpu_offloading_num_layers == 0 and (m.num_layers is None or m.num_layers >= 1):
        return Match(
            {"path": ctx.te_offload_path},
            fix=["model.cpu_offloading_num_layers=1"] if (m.num_layers or 0) >= 2 else None,
        )
    return None


def _num_layers_inert(ctx: Context) -> bool:
    m = ctx.model
    return not m.cpu_offloading and m.cpu_offloading_num_layers != 0


_OFFLOAD = "model.cpu_offloading"
_K = "model.cpu_offloading_num_layers"

BUILD_RULES: tuple[Rule, ...] = (
    # ---- Transformer Engine (runs at model build)
    Rule(
        id="ACT-NOTHING-TO-OFFLOAD",
        severity="error",
        origin="te",
        stage=STAGE_TE,
        exception="ValueError",
        summary="`cpu_offloading_activations` and `cpu_offloading_weights` both off: TE refuses at model build.",
        keys=("model.cpu_offloading_activations", "model.cpu_offloading_weights", _OFFLOAD),
        message="CPU Offloading is enabled while it is not mentioned what to offload (weights/activations)",
        why="MCore does not check this; TE raises deep inside model construction (Megatron-Bridge#2684). On the "
        "legacy v1 path (TE < 2.10 or NVTE_CPU_OFFLOAD_V1=1) it fires even with cpu_offloading off, because "
        "MCore's TransformerBlock always calls TE's factory. The TE version and path come from "
        f"--te-version … / --env NVTE_CPU_OFFLOAD_V1=… (default TE {TE_VERSION_ASSUMED}, v2).",
        fix=("model.cpu_offloading_activations=true",),
        check=_nothing_to_offload,
    ),
    Rule(
        id="ACT-WEIGHTS-DEPRECATED",
        severity="warning",
        origin="te",
        stage=STAGE_TE,
        summary="Weight offloading is deprecated in TE and does nothing.",
        keys=("model.cpu_offloading_weights",),
        message="Offloading weights is deprecated. Using offload_weights=True does not have any effect.",
        why="TE deprecated weight offloading in April 2025 (both v1 and v2). With activations off too, TE returns "
        "a no-op context: nothing at all is offloaded.",
        fix=("model.cpu_offloading_weights=false",),
        check=_weights_deprecated,
    ),
    Rule(
        id="ACT-TE-ALL-LAYERS",
        severity="error",
        origin="te",
        stage=STAGE_TE,
        exception="ValueError",
        summary="TE v2 cannot offload every layer (the last layer is never offloaded).",
        keys=(_K, "model.num_layers"),
        message="Cannot offload all layers without manual synchronization - last layer is not offloaded. "
        "Got num_layers={k}, model_layers={n}.",
        why="TE v2 requires num_layers ≤ model_layers − 1 (TE 2.10-2.13: an assert with the first sentence only; "
        "2.14 and later: this ValueError). MCore's range check rejects the same configs first.",
        fix=(_K + "={fix_layers}",),
        shadowed_by=("ACT-NUM-LAYERS",),
        check=_te_all_layers,
    ),
    Rule(
        id="ACT-NO-OVERLAP",
        severity="warning",
        origin="te",
        stage=STAGE_TE,
        summary="Offloading num_layers − 1 layers leaves no room to overlap transfers with compute (TE v2).",
        keys=(_K, "model.num_layers"),
        message="Offloading num_layers == model_layers - 1 is not recommended, it prevents overlapping of "
        "computation and offload/reload.",
        why="TE v2 keeps at most model_layers − k activation sets on the GPU and stalls to enforce it; with one "
        "layer left every offload/reload waits. Use num_layers − 2 or fewer.",
        fix=None,
        check=_no_overlap,
    ),
    Rule(
        id="ACT-DOUBLE-BUFFERING",
        severity="warning",
        origin="te",
        stage=STAGE_TE,
        upstream=False,
        summary="`cpu_offloading_double_buffering` is ignored by TE ≥ 2.10 (v2 path).",
        keys=("model.cpu_offloading_double_buffering",),
        message="model.cpu_offloading_double_buffering=true has no effect: TE's default (v2) offload path ignores "
        "double buffering (documented as deprecated); only the legacy v1 path (NVTE_CPU_OFFLOAD_V1=1) uses it.",
        why="TE v2 documents the argument as deprecated and never reads it; MCore still passes it through.",
        fix=("model.cpu_offloading_double_buffering=false",),
        check=_double_buffering,
    ),
    # ---- Megatron Bridge guards
    Rule(
        id="ACT-BRIDGE-LOCAL-CUDA-GRAPH",
        severity="error",
        origin="bridge",
        stage=STAGE_BRIDGE,
        exception="ValueError",
        applies_to=">=0.19",
        summary="Bridge 0.6+ accepts cuda_graph_impl=local only for full-iteration capture.",
        keys=("model.cuda_graph_impl", "model.cuda_graph_scope", _OFFLOAD),
        message='Megatron Bridge supports model.cuda_graph_impl="local" only for full-iteration CUDA graphs. Use '
        'model.cuda_graph_impl="transformer_engine" for scoped CUDA graph capture such as "attn" or "mlp".',
        why="Bridge 0.6 checks this in ConfigContainer.validate before MCore builds the model, so with activation "
        "offloading this is the message a Bridge user sees first (reported here for offload configs only).",
        fix=("model.cuda_graph_impl=none",),
        check=_bridge_local_cuda_graph,
    ),
    Rule(
        id="ACT-BRIDGE-CUDAGRAPH-ASSERT",
        severity="error",
        origin="bridge",
        stage=STAGE_BRIDGE,
        exception="AssertionError",
        summary="Bridge's TE-autocast layer asserts no activation offloading under the local CUDA-graph manager.",
        keys=("model.enable_cuda_graph", _OFFLOAD),
        message="Cudagraphs not supported",
        why="gpt_full_te_layer_autocast_spec.py asserts `not config.cpu_offloading and "
        "config.recompute_granularity is None` when enable_cuda_graph is set in training; MCore's config check "
        "rejects the same configs earlier, so this is listed for completeness.",
        fix=("model.enable_cuda_graph=false",),
        shadowed_by=("ACT-CUDA-GRAPH",),
        check=_bridge_cudagraph_assert,
    ),
    Rule(
        id="ACT-FG-TE-IMPL",
        severity="error",
        origin="bridge",
        stage=STAGE_BRIDGE,
        exception="ValueError",
        summary="Fine-grained offloading needs transformer_impl=transformer_engine (Bridge).",
        keys=("model.fine_grained_activation_offloading", "model.transformer_impl"),
        message="Fine-grained activation offloading is only supported with transformer_engine implementation. "
        "Current transformer_impl: {impl}",
        why="Bridge's `_validate_fine_grained_activation_offloading`; the offload boundaries live in TE modules.",
        fix=("model.transformer_impl=transformer_engine",),
        check=_fg_te_impl("bridge"),
    ),
    Rule(
        id="ACT-FG-NVTE-V1",
        severity="error",
        origin="bridge",
        stage=STAGE_BRIDGE,
        exception="ValueError",
        summary="Fine-grained offloading on TE ≥ 2.10 needs NVTE_CPU_OFFLOAD_V1=1 (Bridge).",
        keys=("model.fine_grained_activation_offloading", "env_vars.NVTE_CPU_OFFLOAD_V1", "env.te_version"),
        message="For fine-grained activation offloading with TE >= 2.10.0, NVTE_CPU_OFFLOAD_V1 environment variable "
        "should be set to 1 to avoid offloading weights.",
        why="Bridge's `_validate_fine_grained_activation_offloading` raises it in ConfigContainer.validate() at "
        "start-up when the process environment lacks NVTE_CPU_OFFLOAD_V1=1. Bridge first copies the config's "
        "`env_vars` into the environment (os.environ.setdefault), so either one sets it: the config's env_vars (as "
        "NVIDIA's fine-grained perf recipes do) or the job's environment (--env NVTE_CPU_OFFLOAD_V1=1 tells "
        "validate). The TE version is an assumption (--te-version X.Y; default "
        f"{TE_VERSION_ASSUMED}, pinned by Bridge 0.6.2).",
        fix=("++env_vars.NVTE_CPU_OFFLOAD_V1=1",),
        check=_fg_nvte("bridge"),
    ),
    Rule(
        id="ACT-MLM-FG-TE-IMPL",
        severity="error",
        origin="megatron-lm",
        stage=STAGE_MLM,
        exception="AssertionError",
        summary="Fine-grained offloading needs --transformer-impl transformer_engine (Megatron-LM).",
        keys=("model.fine_grained_activation_offloading", "model.transformer_impl"),
        message="Fine-grained activation offloading is only supported with transformer_engine implementation",
        why="Megatron-LM's validate_args, same rule as Bridge's with its own text.",
        fix=("model.transformer_impl=transformer_engine",),
        check=_fg_te_impl("megatron-lm"),
    ),
    Rule(
        id="ACT-MLM-FG-NVTE-V1",
        severity="warning",
        origin="megatron-lm",
        stage=STAGE_MLM,
        exception="AssertionError",
        summary="Fine-grained offloading on TE ≥ 2.10 needs NVTE_CPU_OFFLOAD_V1=1 (Megatron-LM).",
        keys=("model.fine_grained_activation_offloading", "env.NVTE_CPU_OFFLOAD_V1", "env.te_version"),
        message="For fine-grained activation offloading with TE >= 2.10.0, NVTE_CPU_OFFLOAD_V1 should be set to 1 "
        "to avoid offloading weights.",
        why="Megatron-LM's validate_args reads the variable from the launching environment.",
        fix=None,
        check=_fg_nvte("megatron-lm"),
    ),
    # ---- advisory
    advisory(
        id="ACT-ZERO-LAYERS",
        severity="warning",
        summary="Activation offloading on with `cpu_offloading_num_layers: 0` offloads nothing.",
        keys=(_OFFLOAD, _K),
        message="model.cpu_offloading is on but model.cpu_offloading_num_layers is 0: no layer is offloaded.",
        why="MCore accepts 0 (the range is inclusive); TE v2 then offloads nothing, and the legacy v1 scheduler "
        "indexes an empty layer window on the first commit (KeyError, from reading the code). Upstream does "
        "not flag it.",
        fix=None,
        check=_zero_layers,
    ),
    advisory(
        id="ACT-NUM-LAYERS-INERT",
        severity="info",
        summary="`cpu_offloading_num_layers` set while `cpu_offloading` is off has no effect in Bridge.",
        keys=(_OFFLOAD, _K),
        message="model.cpu_offloading_num_layers is set but model.cpu_offloading is off: nothing is offloaded.",
        why="Megatron-LM switches cpu_offloading on when --cpu-offloading-num-layers > 0; Bridge does not, and "
        "MCore only validates the count when offloading is on (e.g. Bridge's gpt_oss perf recipe sets 95 "
        "layers without enabling it). Set model.cpu_offloading=true to enable it.",
        fix=None,
        check=_num_layers_inert,
    ),
)
