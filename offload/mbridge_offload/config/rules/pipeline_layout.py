"""``TransformerConfig.__post_init__``'s check that ``pipeline_model_parallel_layout`` and the VPP size agree
(both releases), placed right after the fine-grained checks upstream runs before it."""

from __future__ import annotations

import re
from typing import Any

from mbridge_offload.config.rules.base import Context, Match
from mbridge_offload.config.rules.mcore import following, mcore_rule


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

RULES = following("MC-FG-FUSED-GROUP-MLP-PARTIAL", LAYOUT_VPP)
