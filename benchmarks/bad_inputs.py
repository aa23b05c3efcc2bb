"""Benchmark: the bad-input suite as a measurement — cases tried, held, and time per case.

Runs every generated bad input of ``tests/support/bad_inputs.py`` (the same cases as
``tests/tools/test_robustness.py``) against:

    cli   ``mbridge-offload`` in this process (``main([...])``): exit code 2 and exactly one JSON error object
    mcp   one live ``mbridge-offload serve --root SANDBOX`` over stdio (a real MCP client): ``isError``, and a
          normal call answered after each bad one

A case *holds* when it is answered within the deadline with the one error shape and no traceback. Then it
checks that no file in the sandbox changed. Prints a table and writes ``docs/benchmarks-robustness.md``
(``--no-write`` to skip). Run:

    .venv/bin/python benchmarks/bad_inputs.py          # about 40 s on 2 cores
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import anyio

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tests.support import bad_inputs

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _stats(outcomes: list[bad_inputs.Outcome]) -> dict[str, float]:
    times = sorted(o.seconds * 1000 for o in outcomes)
    if not times:
        return {"p50": 0.0, "p95": 0.0, "max": 0.0}
    p95 = times[min(len(times) - 1, round(0.95 * (len(times) - 1)))]
    return {"p50": statistics.median(times), "p95": p95, "max": times[-1]}


async def _mcp(sandbox: Path, cases: list[bad_inputs.Case]) -> list[bad_inputs.Outcome]:
    from mcp import Client

    normal = ("validate_config", {"config": str(sandbox / "good.yaml")})
    async with Client(bad_inputs.server_params(sandbox)) as client:
        return await bad_inputs.run_mcp_cases(client, cases, normal)


def _row(surface: str, outcomes: list[bad_inputs.Outcome]) -> str:
    held = sum(o.held for o in outcomes)
    s = _stats(outcomes)
    return (
        f"| {surface} | {len(outcomes)} | {held} | {len(outcomes) - held} | "
        f"{s['p50']:.1f} | {s['p95']:.1f} | {s['max']:.1f} |"
    )


def render(cli: list[bad_inputs.Outcome], mcp: list[bad_inputs.Outcome], unchanged: bool) -> str:
    """The Markdown fragment for docs/benchmarks.md."""
    failed = [o for o in cli + mcp if not o.held]
    slowest = sorted(cli + mcp, key=lambda o: -o.seconds)[:3]
    lines = [
        "# Bad-input robustness",
        "",
        f"Measured {datetime.date.today().isoformat()} on {platform.machine()} ({os.cpu_count()} CPUs), Python "
        f"{platform.python_version()}, by `benchmarks/bad_inputs.py` (cases: `tests/support/bad_inputs.py`).",
        "CPU only; nothing here depends on a GPU. *held* = answered within "
        f"{bad_inputs.DEADLINE_S:.0f} s with exit code 2 (MCP: `isError`) and exactly one JSON error object, no "
        "traceback; for MCP also a normal call answered right after.",
        "",
        "| surface | cases tried | held | failed | p50 ms | p95 ms | max ms |",
        "|---|---|---|---|---|---|---|",
        _row("CLI (in-process `main`)", cli),
        _row("MCP (one stdio server)", mcp),
        "",
        f"Files in the sandbox unchanged after all cases: **{'yes' if unchanged else 'NO'}**.",
        "",
        f"The run sets the per-call deadline `MBRIDGE_OFFLOAD_DEADLINE_S={bad_inputs.CALL_DEADLINE_S}` (default 60 s), "
        "so an input that is slow to process is stopped by it. Slowest: "
        + ", ".join(f"`{o.surface}` `{o.case}` {o.seconds * 1000:.0f} ms" for o in slowest)
        + ".",
    ]
    if failed:
        lines += ["", "Not held:", ""]
        lines += [f"- `{o.surface}` `{o.case}`: {o.detail[:160]}" for o in failed]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only; do not write docs/")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        outer = Path(tmp)
        sandbox = bad_inputs.build_sandbox(outer)
        cases = bad_inputs.cases(sandbox)
        before = bad_inputs.snapshot(outer)
        cli = [bad_inputs.run_cli_inprocess(c, sandbox) for c in cases if c.cli is not None]
        mcp = anyio.run(_mcp, sandbox, cases)
        unchanged = bad_inputs.snapshot(outer) == before
    text = render(cli, mcp, unchanged)
    sys.stdout.write(text)
    if not args.no_write:
        (DOCS / "benchmarks-robustness.md").write_text(text, encoding="utf-8")
    return 0 if unchanged and all(o.held for o in cli + mcp) else 1


if __name__ == "__main__":
    raise SystemExit(main())
