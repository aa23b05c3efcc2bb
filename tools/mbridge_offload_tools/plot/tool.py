"""The MCP tool ``plot_offload``: the picture as image content, its points as structured content.

Registered by the server (``server/app.py`` calls :func:`register`); its parameters are declared once with the ``plot``
subcommand's flags (``interface.tools.PLOT``: every input ``estimate_memory`` takes, and the picture's own), and
its body is the CLI's (``plot.run.plot_answer``). PNG by default: agent hosts show PNG image content to the model;
SVG on request (``format='svg'`` or an ``output`` named .svg).
"""

from __future__ import annotations

import base64
import json
from typing import Annotated, Any

from mcp.types import CallToolResult, ImageContent, TextContent, ToolAnnotations

from mbridge_offload_tools.interface.build import declared
from mbridge_offload_tools.plot.result import PlotResult
from mbridge_offload_tools.server import guard

DOC = """Draw the planner's answers and return the picture (image content, PNG unless format='svg') with its points
(structured content).

kind='sweep' with sweep='KEY=START:STOP:STEP' (the stop included; or 'KEY=V1,V2,...'), KEY any numeric planner
input (optimizer_offload_fraction, activation_offload_layers, recompute_num_layers, micro_batch_size, ...): peak
memory per pipeline stage and step time at each value, with the budget line; each point is estimate_memory at that
value. kind='phases': the phases of one step per stage and the one that sets the peak. kind='options':
recommend_mode's ranked options beside the config as given. Takes every input of estimate_memory. Writes a file
only with output (.svg or .png, inside the server's roots); an existing one only with overwrite=true (backed up).
"""


def _answer(result: PlotResult, data: bytes) -> CallToolResult:
    structured = result.model_dump(mode="json")
    image = ImageContent(type="image", data=base64.b64encode(data).decode("ascii"), mime_type=result.mime_type)
    text = TextContent(type="text", text=json.dumps(structured))  # for clients that read text content only
    return CallToolResult(content=[image, text], structured_content=structured)


def plot_offload(**v: Any) -> Annotated[CallToolResult, PlotResult]:
    from mbridge_offload_tools.plot.run import plot_answer

    result, data = plot_answer(v, guard.policy().write_roots(), default_format="png", default_file=False)
    return _answer(result, data)


plot_offload.__doc__ = DOC


def register(mcp: Any) -> None:
    """Add ``plot_offload`` to ``mcp`` with its declared parameters (``interface.tools.PLOT``)."""
    mcp.tool(
        title="Plot memory and step time",
        # Writes a file only with output, inside the roots; may replace one with overwrite=true (a backup is kept).
        annotations=ToolAnnotations(
            read_only_hint=False, destructive_hint=True, idempotent_hint=False, open_world_hint=False
        ),
    )(guard.guarded()(declared("plot_offload")(plot_offload)))
