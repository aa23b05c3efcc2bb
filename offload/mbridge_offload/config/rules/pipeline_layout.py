"""``TransformerConfig.__post_init__``'s pipeline-split checks (both releases), placed right after the
fine-grained offloading and (0.19) paged-stash checks upstream runs before them: the layout agrees with the VPP
size, or else (no layout) uneven first / last stages leave a middle that divides evenly."""

from __future__ import annotations

import operator
import re
from typing import Any

from mbridge_offload.config.rules.base import Context, Match, Rule
from mbridge_offload.config.rules.mcore import following, given, mcore_rule, upstream_compare


def _layout_stages(layout: Any) -> int | None:
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


LAYOUT_VPP = mcore_rule(
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


def _edge_stage(ctx: Context, edge: str, vpp: Any) -> tuple[str, Match] | None:
    """One edge stage's own checks: ``(failed check, Match)``, or None when it passes."""
    layers = given(ctx, f"num_layers_in_{edge}_pipeline_stage", None)
    not_positive, error = upstream_compare(operator.le, layers, 0)
    if error is not None:
        return "type", error
    if not_positive:
        return f"{edge}-positive", Match()
    if vpp is not None:
        rest, error = upstream_compare(operator.mod, layers, vpp)
        if error is not None:
            return "type", error
        if rest != 0:
            return f"{edge}-vpp", Match({"layers": layers, "vpp": vpp})
    return None


def uneven_pipeline_failure(ctx: Context) -> tuple[str, Match] | None:
    """The first failing check of upstream's uneven-pipeline branch, run on the values as written: which check
    (``first-positive``, ``first-vpp``, ``last-positive``, ``last-vpp``, ``mismatch``, ``middle``, ``middle-vpp``,
    or ``type`` for a TypeError) and its Match; None when the branch is not taken or passes."""
    if ctx.model.extras().get("pipeline_model_parallel_layout") is not None:
        return None
    edges = [e for e in ("first", "last") if given(ctx, f"num_layers_in_{e}_pipeline_stage", None) is not None]
    if not edges:
        return None
    vpp = given(ctx, "virtual_pipeline_model_parallel_size", None)
    layers, stages = given(ctx, "num_layers", 0), given(ctx, "pipeline_model_parallel_size", 1)
    try:
        for edge in edges:
            failed = _edge_stage(ctx, edge, vpp)
            if failed is not None:
                return failed
            layers, stages = layers - given(ctx, f"num_layers_in_{edge}_pipeline_stage", 0), stages - 1
        if bool(layers) != bool(stages):
            return "mismatch", Match({"layers": layers, "stages": stages})
        if stages and layers % stages != 0:
            return "middle", Match({"layers": layers, "stages": stages})
        if stages and vpp is not None and (layers // stages) % vpp != 0:
            return "middle-vpp", Match({"per_rank": layers // stages, "vpp": vpp})
    except (TypeError, ZeroDivisionError) as exc:
        return "type", Match(message=str(exc), exception=type(exc).__name__)
    return None


def _uneven(step: str):
    def check(ctx: Context) -> Match | None:
        failed = uneven_pipeline_failure(ctx)
        return failed[1] if failed is not None and failed[0] == step else None

    return check


_UNEVEN_KEYS = (
    "model.num_layers",
    "model.pipeline_model_parallel_size",
    "model.num_layers_in_first_pipeline_stage",
    "model.num_layers_in_last_pipeline_stage",
    "model.virtual_pipeline_model_parallel_size",
)


def _uneven_rule(step: str, exception: str, message: str, summary: str) -> Rule:
    return mcore_rule(f"MC-PP-UNEVEN-{step.upper()}", exception, message, _uneven(step), summary, _UNEVEN_KEYS)


UNEVEN_RULES = (
    _uneven_rule(
        "type",
        "TypeError",
        "'<=' not supported between instances of 'str' and 'int'",
        "An uneven-pipeline size of a type megatron-core cannot compute the stages with (Python's own message for "
        "the operands given).",
    ),
    _uneven_rule(
        "first-positive",
        "ValueError",
        "num_layers_in_first_pipeline_stage must be larger than 0",
        "`num_layers_in_first_pipeline_stage` must be at least 1.",
    ),
    _uneven_rule(
        "first-vpp",
        "ValueError",
        "number of layers at first stage: {layers}must be divisible by virtual pipelineparallel degree {vpp}",
        "The first stage's layers must divide by the VPP size.",
    ),
    _uneven_rule(
        "last-positive",
        "ValueError",
        "num_layers_in_last_pipeline_stage must be larger than 0",
        "`num_layers_in_last_pipeline_stage` must be at least 1.",
    ),
    _uneven_rule(
        "last-vpp",
        "ValueError",
        "number of layers at last stage: {layers}must be divisible by virtual pipelineparallel degree {vpp}",
        "The last stage's layers must divide by the VPP size.",
    ),
    _uneven_rule(
        "mismatch",
        "ValueError",
        "Mismatch: {layers} middle layers remaining but {stages} middle PP stages available.",
        "The layers left after the first / last stages and the middle stages must both be zero or both not.",
    ),
    _uneven_rule(
        "middle",
        "ValueError",
        "number of layers at middle stage: {layers} must be divisible bythe middle pipeline model parallel size "
        "{stages}",
        "The layers left for the middle stages must divide by their number.",
    ),
    _uneven_rule(
        "middle-vpp",
        "ValueError",
        "number of layers on each middle pipeline rank:{per_rank} must be divisible by virtualpipeline parallel "
        "degree {vpp}",
        "Each middle rank's layers must divide by the VPP size.",
    ),
)

RULES = following("MC-PAGED-STASH-MODULES", LAYOUT_VPP, *UNEVEN_RULES)  # 0.19.2: after the paged-stash checks
