"""The MCP tool ``plot_offload``: the picture as image content, its points as structured content.

Registered by the server (``server.py`` calls :func:`register` with its planner parameters and its config loader,
so the tool takes every input ``estimate_memory`` takes, read the same way). PNG by default: agent hosts show PNG
image content to the model; SVG on request (``format='svg'`` or an ``output`` named .svg).
"""

from __future__ import annotations

import base64
import inspect
import json
from collections.abc import Callable
from typing import Annotated, Any, Literal

from mcp.types import CallToolResult, ImageContent, TextContent, ToolAnnotations
from pydantic import Field

from mbridge_offload_tools import guard
from mbridge_offload_tools.plot.result import PlotResult

DOC = """Draw the planner's answers and return the picture (image content, PNG unless format='svg') with its points
(structured content).

kind='sweep' with sweep='KEY=START:STOP:STEP' (the stop included; or 'KEY=V1,V2,...'), KEY any numeric planner
input (optimizer_offload_fraction, activation_offload_layers, recompute_num_layers, micro_batch_size, ...): peak
memory per pipeline stage and step time at each value, with the budget line; each point is estimate_memory at that
value. kind='phases': the phases of one step per stage and the one that sets the peak. kind='options':
recommend_mode's ranked options beside the config as given. Takes every input of estimate_memory. Writes a file
only with output (.svg or .png, inside the server's roots); an existing one only with overwrite=true (backed up).
"""

# Loads config / overrides / megatron_args out of the call's arguments: (config, raw, source), or Nones.
Loader = Callable[[dict[str, Any]], tuple[Any, Any, Any]]


def _parameters(plan_parameters: list[inspect.Parameter]) -> list[inspect.Parameter]:
    kw = inspect.Parameter.KEYWORD_ONLY
    own: list[tuple[str, Any, Any]] = [
        (
            "kind",
            None,
            Annotated[
                Literal["sweep", "phases", "options"] | None,
                Field(description="what to draw (default: sweep when sweep is given)"),
            ],
        ),
        (
            "sweep",
            None,
            Annotated[
                str | None,
                Field(
                    description="KEY=START:STOP:STEP (stop included) or KEY=V1,V2,..., e.g. "
                    "'optimizer_offload_fraction=0:1:0.25'",
                    max_length=4096,
                ),
            ],
        ),
        ("output", None, Annotated[str | None, Field(description="also write the picture here (.svg or .png)")]),
        (
            "overwrite",
            False,
            Annotated[bool, Field(description="allow output to replace an existing file (a .bak backup is kept)")],
        ),
        (
            "format",
            None,
            Annotated[
                Literal["svg", "png"] | None, Field(description="png (default here) or svg; output's extension decides")
            ],
        ),
    ]
    return [inspect.Parameter(n, kw, default=d, annotation=a) for n, d, a in own] + plan_parameters


def _answer(result: PlotResult, data: bytes) -> CallToolResult:
    structured = result.model_dump(mode="json")
    image = ImageContent(type="image", data=base64.b64encode(data).decode("ascii"), mime_type=result.mime_type)
    text = TextContent(type="text", text=json.dumps(structured))  # for clients that read text content only
    return CallToolResult(content=[image, text], structured_content=structured)


def register(mcp: Any, plan_parameters: list[inspect.Parameter], load: Loader) -> None:
    """Add ``plot_offload`` to ``mcp`` with the planner's parameters and the server's config loader."""

    def plot_offload(**kwargs: Any) -> CallToolResult:
        from mbridge_offload.config.errors import InputError
        from mbridge_offload_tools.plot import output
        from mbridge_offload_tools.plot.points import Source
        from mbridge_offload_tools.plot.run import make_plot

        kind, spec = kwargs.pop("kind"), kwargs.pop("sweep")
        target, consent, fmt = kwargs.pop("output"), kwargs.pop("overwrite"), kwargs.pop("format")
        kind = kind or ("sweep" if spec else None)
        if kind is None:
            raise InputError(
                "plot_offload: say what to draw",
                "pass sweep='KEY=START:STOP:STEP' (e.g. optimizer_offload_fraction=0:1:0.25), kind='phases' or "
                "kind='options'",
            )
        fmt = output.choose_format(target, fmt, "png")
        loaded = load(kwargs)  # takes config, overrides and megatron_args out: the rest are planner inputs
        src = Source(kwargs, *loaded)
        result, data = make_plot(kind, src, spec, fmt, target, consent, guard.policy().write_roots())
        return _answer(result, data)

    plot_offload.__doc__ = DOC
    plot_offload.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        _parameters(plan_parameters), return_annotation=Annotated[CallToolResult, PlotResult]
    )
    mcp.tool(
        title="Plot memory and step time",
        # Writes a file only with output, inside the roots; may replace one with overwrite=true (a backup is kept).
        annotations=ToolAnnotations(
            read_only_hint=False, destructive_hint=True, idempotent_hint=False, open_world_hint=False
        ),
    )(guard.guarded()(plot_offload))
