"""``TransformerConfig.__post_init__``'s pipeline-split checks (both releases), placed right after the
fine-grained offloading and (0.19) paged-stash checks upstream runs before them: a ``pipeline_model_parallel_layout``
read as megatron-core reads it (``PipelineParallelLayerLayout``: parsed, split over the PP ranks, its VPP size
compared with the one given, then ``validate_layer_layout``), or else (no layout) uneven first / last stages leave a
middle that divides evenly. Values are judged as written: megatron-core converts nothing."""

from __future__ import annotations

import copy
import operator
import re
from typing import Any

from mbridge_offload.config.rules.base import Context, Match, Rule
from mbridge_offload.config.rules.mcore import following, given, mcore_rule, upstream_compare

# megatron-core's LayerType members (transformer/enums.py, both releases) and the layout string's letters.
_LAYER_TYPES = ("embedding", "loss", "encoder", "decoder", "mtp")
_CHARS = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}
_MAX_UNROLLED = 1_000_000  # a layout that unrolls past this is not judged (upstream would build it; we do not)


def _unroll(text: str) -> str | None:
    """``parse_str_to_list``'s unrolling: commas dropped, ``(..)*n`` then ``x*n`` repeated; None when too long."""
    text = text.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        grown = sum(len(m.group(1)) * int(m.group(2)) for m in re.finditer(pattern, text))
        if len(text) + grown > _MAX_UNROLLED:
            return None
        text = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)
    return text


def _error(exception: str, message: str) -> Match:
    return Match(message=message, exception=exception)


def _conflict(ctx: Context) -> Match | None:
    names = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")
    flags = ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
    values = {k: given(ctx, k, None) for k in names} | {k: given(ctx, k, False) for k in flags}
    if not any(values[k] is not None for k in names) and not any(values[k] for k in flags):
        return None
    # upstream's f-string prints each as `self.<name>=<repr>`
    return Match({k: repr(v) for k, v in values.items()})


def _rows(layout: Any) -> tuple[list | None, Match | None]:
    """``PipelineParallelLayerLayout.__init__``'s reading of the layout into rows of layer names."""
    if isinstance(layout, list):
        return copy.deepcopy(layout), None
    text = _unroll(layout)
    if text is None:
        return None, None
    rows: list[list[str]] = []
    for stage in text.split("|"):
        rows.append([])
        for char in stage:
            if char not in _CHARS:
                return None, _error(
                    "AssertionError",
                    f"Invalid layer character: {char} (stage={stage!r}, layout_str={text!r}), known layer "
                    f"characters: {list(_CHARS)}",
                )
            rows[-1].append(_CHARS[char])
    return rows, None


def _element_error(grid: list) -> Match | None:
    """The first element that is not a layer name, in upstream's order (PP rank, then VPP stage)."""
    for stages in grid:
        for stage in stages:
            for layer in stage:
                if not isinstance(layer, str):
                    text = (
                        f"elements in pipeline_model_parallel_layout must be LayerType or str, but got {type(layer)}."
                    )
                    return _error("AssertionError", text)
                if layer.strip().lower() not in _LAYER_TYPES:
                    return _error("AssertionError", f"{layer.strip().lower()} is not a valid LayerType")
    return None


def _grid(rows: list, pp: Any) -> tuple[list | None, Any, tuple[str, Match] | None]:
    """Rows split over the PP ranks (``[pp_rank][vpp_rank]``), the VPP size, or the first check that fails."""
    if not all(isinstance(row, list) for row in rows):
        kinds = [type(row) for row in rows]
        text = f"pipeline_model_parallel_layout must be a list of lists, but got [type(row) for row in layout]={kinds}"
        return None, None, ("parse", _error("AssertionError", text))
    rest, error = upstream_compare(operator.mod, len(rows), pp)
    if error is not None:
        return None, None, ("type", error)
    if rest != 0:
        return None, None, ("divisible", Match({"stages": len(rows), "pp": repr(pp)}))
    vpp = len(rows) // pp
    try:
        grid = [[rows[v * pp + p] for v in range(vpp)] for p in range(pp)]
    except TypeError as exc:  # a float size: range() refuses it
        return None, None, ("type", _error("TypeError", str(exc)))
    element = _element_error(grid)
    if element is not None:
        return None, None, ("parse", element)
    return [[[layer.strip().lower() for layer in stage] for stage in stages] for stages in grid], vpp, None


def _mtp_failure(grid: list, flat: list[str], vpp: int, mtp_layers: Any) -> str | None:
    mtp = flat.count("mtp")
    if not (mtp == mtp_layers or (mtp_layers is None and mtp == 0)):
        return "Number of mtp layers in layout must match mtp_num_layers"
    if "mtp" in flat and "decoder" in flat[flat.index("mtp") :]:
        return "decoder layers must be placed before MTP layers"
    if any("mtp" in stages[v] for stages in grid for v in range(vpp - 1)):
        return "Currently we restrict that the MTP should be always in the last "  # upstream's text ends there
    if any("mtp" in stages[-1] and stages[-1].count("mtp") != mtp_layers for stages in grid):
        return "All of the MTP layers must be in the same one virtual pipeline stage"
    # upstream's next check (no MTP in the first rank's earlier stages) is implied by the one before it
    return None


def _validate_layer_layout(ctx: Context, grid: list, vpp: int) -> tuple[str, Match] | None:
    flat = [layer for v in range(vpp) for stages in grid for layer in stages[v]]
    if not flat:
        return "type", _error("IndexError", "list index out of range")
    for index, name, label in ((0, "embedding", "first"), (-1, "loss", "last")):
        if flat[index] != name:
            text = f"The {label} layer must be {name}, but got LayerType.{flat[index]}"
            return "layers", _error("AssertionError", text)
    for name in ("embedding", "loss"):
        if flat.count(name) != 1:
            return "layers", _error("AssertionError", f"{name.capitalize()} must be specified exactly once")
    num_layers = given(ctx, "num_layers", 0)
    if flat.count("decoder") != num_layers:
        return "decoders", Match({"count": flat.count("decoder"), "num_layers": num_layers})
    mtp = _mtp_failure(grid, flat, vpp, given(ctx, "mtp_num_layers", None))
    if mtp is not None:
        return "mtp", _error("AssertionError", mtp)
    if "encoder" in flat:
        return "encoder", Match()
    return None


def layout_failure(ctx: Context) -> tuple[str, Match] | None:
    """The first failing step of megatron-core's reading of ``pipeline_model_parallel_layout``, in upstream's
    order: ``conflict``, ``parse``, ``type`` (Python's own error for the values given), ``divisible``, ``vpp``,
    ``layers``, ``decoders``, ``mtp``, ``encoder``; None without a layout or when it passes."""
    layout = given(ctx, "pipeline_model_parallel_layout", None)
    if layout is None:
        return None
    conflict = _conflict(ctx)
    if conflict is not None:
        return "conflict", conflict
    if not isinstance(layout, str | list):  # neither branch converts it; the VPP lookup then fails
        kind = type(layout).__name__
        return "type", _error(
            "AttributeError", f"'{kind}' object has no attribute 'virtual_pipeline_model_parallel_size'"
        )
    rows, error = _rows(layout)
    if error is not None:
        return "parse", error
    if rows is None:
        return None
    grid, vpp, failed = _grid(rows, given(ctx, "pipeline_model_parallel_size", 1))
    if failed is not None or grid is None:
        return failed
    given_vpp = given(ctx, "virtual_pipeline_model_parallel_size", None)
    if given_vpp is not None and given_vpp != vpp:
        return "vpp", Match({"vpp": repr(given_vpp), "detected": vpp})
    return _validate_layer_layout(ctx, grid, vpp)


def _layout(step: str):
    def check(ctx: Context) -> Match | None:
        failed = layout_failure(ctx)
        return failed[1] if failed is not None and failed[0] == step else None

    return check


_LAYOUT_KEYS = ("model.pipeline_model_parallel_layout", "model.pipeline_model_parallel_size")


_LAYOUT_WHY = (
    "TransformerConfig reads the layout with PipelineParallelLayerLayout (stages separated by `|`, `(..)*n` and "
    "`x*n` unrolled, E = embedding, t = decoder, m = MTP, L = loss) and asserts that it describes the model "
    "(both releases)."
)


def _layout_rule(step: str, exception: str, message: str, summary: str, keys: tuple[str, ...] = (), **kw) -> Rule:
    kw.setdefault("why", _LAYOUT_WHY)
    return mcore_rule(
        f"MC-PP-LAYOUT-{step.upper()}", exception, message, _layout(step), summary, _LAYOUT_KEYS + keys, **kw
    )


LAYOUT_RULES = (
    _layout_rule(
        "conflict",
        "ValueError",
        "pipeline_model_parallel_layout cannot be set with other pipeline layout arguments. "
        "self.num_layers_in_first_pipeline_stage={num_layers_in_first_pipeline_stage}, "
        "self.num_layers_in_last_pipeline_stage={num_layers_in_last_pipeline_stage}, "
        "self.account_for_embedding_in_pipeline_split={account_for_embedding_in_pipeline_split}, "
        "self.account_for_loss_in_pipeline_split={account_for_loss_in_pipeline_split}.",
        "A `pipeline_model_parallel_layout` excludes the uneven-stage sizes and the embedding/loss split flags.",
        ("model.num_layers_in_first_pipeline_stage", "model.num_layers_in_last_pipeline_stage"),
    ),
    _layout_rule(
        "parse",
        "AssertionError",
        "Invalid layer character: x (stage='Ex', layout_str='Ex|tL'), known layer characters: ['E', 'L', 't', 'm']",
        "`pipeline_model_parallel_layout` must be made of E, t, m and L (a string) or layer names (a list of lists).",
    ),
    _layout_rule(
        "type",
        "TypeError",
        "unsupported operand type(s) for %: 'int' and 'str'",
        "A layout or pipeline size of a type megatron-core cannot split the layout with (Python's own message).",
    ),
    _layout_rule(
        "divisible",
        "AssertionError",
        "pipeline_model_parallel_layout must be divisible by pipeline_model_parallel_size "
        "(len(layout)={stages}, pipeline_model_parallel_size={pp})",
        "The layout's number of stages must be a multiple of the pipeline parallel size.",
    ),
)
LAYOUT_VPP = _layout_rule(
    "vpp",
    "AssertionError",
    "virtual_pipeline_model_parallel_size conflicts with pipeline_model_parallel_layout, "
    "(self.virtual_pipeline_model_parallel_size={vpp},  detected_vpp_size={detected})",
    "`virtual_pipeline_model_parallel_size` must equal the stages per pipeline rank that "
    "`pipeline_model_parallel_layout` describes.",
    ("model.virtual_pipeline_model_parallel_size",),
    fix=("model.virtual_pipeline_model_parallel_size={detected}",),
    why="TransformerConfig parses the layout (stages separated by `|`, `(..)*n` unrolled) and asserts that the "
    "VPP size given equals stages / PP (both releases).",
)
LAYER_RULES = (
    _layout_rule(
        "layers",
        "AssertionError",
        "The first layer must be embedding, but got LayerType.decoder",
        "The layout starts with the embedding (E), ends with the loss (L), and names each exactly once.",
    ),
    _layout_rule(
        "decoders",
        "AssertionError",
        "Number of decoder layers {count}must match num_layers {num_layers}",
        "The layout's decoder layers (t) must number `num_layers`.",
        ("model.num_layers",),
    ),
    _layout_rule(
        "mtp",
        "AssertionError",
        "Number of mtp layers in layout must match mtp_num_layers",
        "The layout's MTP layers (m) must number `mtp_num_layers`, after every decoder, in one last stage.",
        ("model.mtp_num_layers",),
    ),
    _layout_rule(
        "encoder",
        "NotImplementedError",
        "Encoder layer is not supported for flexible pipeline layout",
        "A layout (a list) may not name encoder layers.",
    ),
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
            # upstream's augmented `num_layers -= …` / `pipeline_parallel_size -= 1`: a TypeError reads "-="
            layers = operator.isub(layers, given(ctx, f"num_layers_in_{edge}_pipeline_stage", 0))
            stages = operator.isub(stages, 1)
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

RULES = following(
    "MC-PAGED-STASH-MODULES", *LAYOUT_RULES, LAYOUT_VPP, *LAYER_RULES, *UNEVEN_RULES
)  # 0.19.2: after the paged-stash checks
