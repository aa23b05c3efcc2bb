"""docs/benchmarks.md: one page that gathers the benchmark fragments the other parts write.

Each part of the project keeps its own measurements in ``docs/benchmarks-<part>.md`` (written by its benchmark
script or by hand from its output). The index includes every fragment verbatim, headings shifted two levels down,
and shows every plot under ``docs/img/``. Nothing here computes or rounds a number.
"""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[3] / "docs"

# (fragment, what it measures), in reading order.
FRAGMENTS: list[tuple[str, str]] = [
    ("benchmarks-optimizer.md", "Optimizer offload runtime (`offload/mbridge_offload/runtime/optimizer/hybrid.py`)"),
    (
        "benchmarks-activation.md",
        "Activation offload runtime (`offload/mbridge_offload/runtime/activation/context.py`)",
    ),
    ("benchmarks-validate.md", "`validate` latency"),
    ("benchmarks-mcp.md", "MCP server latency"),
    ("benchmarks-robustness.md", "Bad-input robustness (`benchmarks/bad_inputs.py`)"),
    ("benchmarks-testtool.md", "The agent's test tool (`mbridge-offload test`, MCP `run_unit_tests`)"),
]


def _shift_headings(text: str) -> str:
    """Every Markdown heading two levels deeper, outside code fences, so a fragment nests under its ``##`` section."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced and re.match(r"#{1,4} ", line):
            line = "##" + line
        out.append(line)
    return "\n".join(out)


def render_index(docs: Path = DOCS) -> str:
    parts: list[str] = []
    for name, title in FRAGMENTS:
        parts.append(f"## {title}")
        parts.append("")
        file = docs / name
        if file.exists():
            parts.append(f"From [`{name}`]({name}):")
            parts.append("")
            parts.append(_shift_headings(file.read_text().strip()))
        else:
            parts.append(f"_`{name}` has not been written yet: no measurement to show._")
        parts.append("")
    images = sorted((docs / "img").glob("*.png")) if (docs / "img").is_dir() else []
    parts.append("## Plots")
    parts.append("")
    if images:
        parts += [
            "The planner's predictions (memory_vs_offload: predictions, with the upstream card's measured peaks as "
            "triangles; predicted_vs_measured: every published GPU measurement against the prediction, none run by "
            "this project); see [planner.md](planner.md).",
            "",
        ]
        for image in images:
            parts.append(f"![{image.stem}](img/{image.name})")
            parts.append("")
    else:
        parts.append("_No plot under `docs/img/` yet._")
    return "\n".join(parts).rstrip("\n")
