"""docs/benchmarks.md: one page that gathers the benchmark fragments the other parts write.

Each fragment (``docs/benchmarks-<part>.md``) verbatim, headings shifted two levels down, and every plot under
``docs/img/``; nothing here computes or rounds a number.
"""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[4] / "docs"

# (fragment, what it measures), in reading order.
FRAGMENTS: list[tuple[str, str]] = [
    ("benchmarks-optimizer.md", "Optimizer offload runtime (`offload/mbridge_offload_runtime/optimizer/hybrid.py`)"),
    (
        "benchmarks-activation.md",
        "Activation offload runtime (`offload/mbridge_offload_runtime/activation/context.py`)",
    ),
    ("benchmarks-memory-gpu.md", "Memory by phase of a step in real megatron-core (`benchmarks/gpu_memory_phases.py`)"),
    ("benchmarks-validate.md", "`validate` latency"),
    ("benchmarks-mcp.md", "MCP server latency"),
    ("benchmarks-recommend.md", "`recommend` with every lever and a measured log (`benchmarks/recommend_levers.py`)"),
    ("benchmarks-robustness.md", "Bad-input robustness (`benchmarks/bad_inputs.py`)"),
    ("benchmarks-testtool.md", "The agent's test tool (`mbridge-offload test`, MCP `run_unit_tests`)"),
    ("benchmarks-plot.md", "`plot` speed (`benchmarks/plot_speed.py`)"),
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
            "this project; plot_*: one picture of each kind `mbridge-offload plot` draws); see "
            "[planner.md](planner.md).",
            "",
        ]
        for image in images:
            parts.append(f"![{image.stem}](img/{image.name})")
            parts.append("")
    else:
        parts.append("_No plot under `docs/img/` yet._")
    return "\n".join(parts).rstrip("\n")


# ---------------------------------------------------------------------------------------------- test counts
# The counts of tests the docs quote, from pytest's own collection of the suite (``pytest --collect-only tests``):
# tests/conftest.py writes each collected test's markers to the file named by COUNT_ENV, and hands the same to
# :data:`COLLECTED` when its own session collected the whole suite (then ``make test`` pays nothing for the check).
COUNT_ENV = "MBRIDGE_OFFLOAD_COLLECTED_OUT"
SUITE_MARKERS = ("cpu_offload", "slow", "megatron", "ordering")
COLLECTED: dict[str, list[str]] | None = None


def collected(root: Path = DOCS.parent) -> dict[str, list[str]]:
    """Test id → its marker names, for every test ``pytest --collect-only tests`` collects (about 30 s; cached)."""
    global COLLECTED
    if COLLECTED is None:
        import json
        import os
        import subprocess
        import sys
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "collected.json"
            done = subprocess.run(
                [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
                cwd=root,
                env={**os.environ, COUNT_ENV: str(out)},
                capture_output=True,
                text=True,
                timeout=600,
            )
            if not out.is_file():
                raise RuntimeError(f"pytest --collect-only tests failed: {(done.stdout + done.stderr)[-600:]}")
            COLLECTED = json.loads(out.read_text())
    return COLLECTED


def _counts(items: dict[str, list[str]], marker: str | None = None) -> tuple[int, int]:
    chosen = [nodeid for nodeid, marks in items.items() if marker is None or marker in marks]
    return len(chosen), len({nodeid.split("::")[0] for nodeid in chosen})


def render_test_counts() -> str:
    """The table of docs/benchmarks-testtool.md: the whole suite, the offload suite, each marker."""
    items = collected()
    total, files = _counts(items)
    offload, offload_files = _counts(items, "cpu_offload")
    rows = [
        "| suite | tests | files |",
        "|---|---:|---:|",
        f"| the whole suite (`make test`; `mbridge-offload test --all`) | {total} | {files} |",
        f"| the offload suite (`mbridge-offload test -k cpu_offload`) | {offload} | {offload_files} |",
        f"| not in the offload suite | {total - offload} | {files - offload_files} |",
    ]
    for marker in SUITE_MARKERS[1:]:
        count, in_files = _counts(items, marker)
        rows.append(f"| marker `{marker}` | {count} | {in_files} |")
    return "\n".join(rows)


def render_test_summary() -> str:
    """The README's sentence with the same counts."""
    total, files = _counts(collected())
    offload, offload_files = _counts(collected(), "cpu_offload")
    return (
        f"The suite has {total} tests in {files} files; the offload suite (`mbridge-offload test -k cpu_offload`) "
        f"{offload} of them in {offload_files} files (counted by `pytest --collect-only`)."
    )
