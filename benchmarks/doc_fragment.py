"""Write one benchmark script's section of a ``docs/benchmarks-*.md`` fragment, leaving the rest as it is.

A section sits between ``<!-- begin: NAME -->`` and ``<!-- end: NAME -->``; the script that measured the numbers
is the only writer of its section, in the same run, so the page never holds a figure no run produced. A missing
section is appended.
"""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def write_section(path: Path, name: str, body: str) -> None:
    """Replace (or append) section ``name`` of the Markdown file at ``path`` with ``body``.

    Args:
        path: the fragment, e.g. ``docs/benchmarks-activation.md`` (created if missing).
        name: the section's marker name, e.g. ``cpu_activation.py``.
        body: Markdown, without the markers.

    Example:
        >>> write_section(DOCS / "benchmarks-activation.md", "cpu_activation.py", "| a | b |\\n|---|---|")
    """
    begin, end = f"<!-- begin: {name} (generated; do not edit by hand) -->", f"<!-- end: {name} -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    text = path.read_text() if path.exists() else ""
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = (text.rstrip() + "\n\n" if text.strip() else "") + block
    path.write_text(text.rstrip() + "\n")


def table(header: list[str], rows: list[list[object]], align: str = "") -> str:
    """A Markdown table; ``align`` holds one of ``l``/``r`` per column (default: first left, rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def with_sections_of(path: Path, text: str) -> str:
    """``text`` followed by the generated sections that the file at ``path`` holds (other scripts' numbers).

    For a script that writes a whole page: its rewrite keeps the sections other scripts measured.
    """
    old = path.read_text() if path.exists() else ""
    kept = re.findall(r"<!-- begin: .*? \(generated; do not edit by hand\) -->.*?<!-- end: [^>]*-->", old, re.DOTALL)
    return "\n\n".join([text.rstrip(), *kept]) + "\n" if kept else text
