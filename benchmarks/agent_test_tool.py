"""Wall time and counts of the agent's test tool: ``mbridge-offload test -k cpu_offload`` (MCP ``run_unit_tests``).

Runs the command an agent runs (the CLI, ``--json``, in a subprocess, from the repository root), times it with a
wall clock, and reports the counts it returned, per file, beside the size of the whole suite (``pytest
--collect-only``) and the machine: cores, and the load average before and after (on a shared machine other jobs
compete for the cores; the load says how much). Prints Markdown; ``--write-docs docs/benchmarks-testtool.md``
writes it into that fragment (``docs/benchmarks.md`` includes it).

    .venv/bin/python benchmarks/agent_test_tool.py                                         # print only
    .venv/bin/python benchmarks/agent_test_tool.py --write-docs docs/benchmarks-testtool.md  # the docs
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.doc_fragment import table, write_section

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ["-m", "mbridge_offload_tools", "test", "-k", "cpu_offload", "--json"]


def _env() -> dict[str, str]:
    roots = [str(ROOT / "offload"), str(ROOT / "tools"), str(ROOT)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(roots)}


def time_tool(timeout: float) -> tuple[float, dict]:
    """Run the test tool once; returns (wall seconds, its JSON answer)."""
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, *COMMAND], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout
    )
    wall = time.monotonic() - start
    return wall, json.loads(done.stdout)


def full_suite_size(timeout: float) -> int | None:
    """How many tests the whole suite has (collected, not run)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    m = re.search(r"(\d+) tests? collected", done.stdout)
    return int(m.group(1)) if m else None


def render(wall: float, answer: dict, full: int | None, loads: tuple, when: str) -> str:
    per_file = Counter(t["nodeid"].split("::")[0] for t in answer["tests"])
    rows = [[f"`{f}`", n] for f, n in sorted(per_file.items())]
    cores = os.cpu_count()
    lines = [
        "### `mbridge-offload test -k cpu_offload` (MCP `run_unit_tests`)",
        "",
        f"**Measured on CPU** ({platform.machine()}, {cores} cores, shared with other jobs: load average "
        f"{loads[0]:.1f} before, {loads[1]:.1f} after), {when}, by `benchmarks/agent_test_tool.py`, Python "
        f"{platform.python_version()}. One run of the command an agent runs, wall clock from start to answer.",
        "",
        table(
            ["what", "value"],
            [
                ["wall time (start to JSON answer)", f"{wall:.1f} s"],
                ["pytest's own duration (`duration_s`)", f"{answer['duration_s']:.1f} s"],
                ["tests run (`selected`)", answer["selected"]],
                [
                    "passed / failed / skipped / errors",
                    f"{answer['passed']} / {answer['failed']} / {answer['skipped']} / {answer['errors']}",
                ],
                ["`ok`", str(answer["ok"]).lower()],
                ["the whole suite (`--all`), collected", full if full is not None else "not counted"],
            ],
        ),
        "",
        "Per file (the files marked `cpu_offload`):",
        "",
        table(["file", "tests"], rows),
        "",
        f"Its `coverage` answer: {answer['coverage']}",
        "",
        "Reproduce: `.venv/bin/python benchmarks/agent_test_tool.py`.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-docs", type=Path, help="fragment to write the section into (default: print only)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per subprocess (default 900)")
    parser.add_argument("--no-full-count", action="store_true", help="skip collecting the whole suite")
    args = parser.parse_args(argv)
    before = os.getloadavg()[0]
    when = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    wall, answer = time_tool(args.timeout)
    after = os.getloadavg()[0]
    full = None if args.no_full_count else full_suite_size(args.timeout)
    text = render(wall, answer, full, (before, after), when)
    print(text)
    if args.write_docs:
        write_section(args.write_docs, "agent_test_tool.py", text)
    return 0 if answer["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
