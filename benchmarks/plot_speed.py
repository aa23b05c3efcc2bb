"""Time ``plot`` of a 5-point sweep, warm: in-process and over MCP (a real stdio client). Target: under 2 s.

Both ways are the real paths: in-process ``mbridge_offload_tools.plot.run.make_plot`` (what the CLI's ``plot``
calls after parsing: five ``estimate`` calls through ``plan.service.plan``, the drawing, SVG or PNG bytes) and the
MCP tool ``plot_offload`` through ``python -m mbridge_offload_tools.server.app`` on stdio (arguments validated, the
picture returned base64 as image content with the points as structured content). The first call of each is reported
apart (it imports matplotlib and the planner); then ``--calls`` warm calls: median, 90th percentile and worst.

The sweep is the one the issue asks for: the upstream card's run (Qwen3-30B-A3B, TP2 PP2 EP4 on 16 x H100),
``optimizer_offload_fraction=0:1:0.25``.

Writes the fragment ``docs/benchmarks-plot.md`` (``--output`` elsewhere; ``--json`` prints the numbers instead).
Run: ``python benchmarks/plot_speed.py [--calls 10] [--json] [--output FILE]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for sub in ("offload", "tools"):  # this tree's code, never an installed copy
    sys.path.insert(0, str(ROOT / sub))

FRAGMENT = ROOT / "docs" / "benchmarks-plot.md"
INPUTS = {"model": "qwen3-30b-a3b"}
SWEEP = "optimizer_offload_fraction=0:1:0.25"
TARGET_S = 2.0


def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_s": round(statistics.median(ordered), 3),
        "p90_s": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 3),
        "max_s": round(ordered[-1], 3),
        "n": len(ordered),
    }


def in_process(calls: int, fmt: str) -> dict[str, Any]:
    from mbridge_offload_tools.plot.points import Source
    from mbridge_offload_tools.plot.run import make_plot

    def once() -> float:
        t0 = time.perf_counter()
        result, data = make_plot("sweep", Source(dict(INPUTS)), SWEEP, fmt, None, False, [])
        elapsed = time.perf_counter() - t0
        assert len(result.points) == 5 and data
        return elapsed

    first = once()
    return {"first_s": round(first, 3), "warm": _summary([once() for _ in range(calls)])}


async def over_mcp(calls: int) -> dict[str, Any]:
    from mcp import Client, StdioServerParameters

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "offload"), str(ROOT / "tools")])}
    with tempfile.TemporaryDirectory() as cwd:  # the server's root: nothing is written (no output)
        params = StdioServerParameters(
            command=sys.executable, args=["-m", "mbridge_offload_tools.server.app"], cwd=cwd, env=env
        )
        async with Client(params) as client:

            async def once() -> float:
                t0 = time.perf_counter()
                result = await client.call_tool("plot_offload", {**INPUTS, "sweep": SWEEP})
                elapsed = time.perf_counter() - t0
                assert not result.is_error and len(result.structured_content["points"]) == 5, result.content
                assert result.content[0].type == "image"
                return elapsed

            first = await once()
            warm = [await once() for _ in range(calls)]
    return {"first_s": round(first, 3), "warm": _summary(warm)}


def measure(calls: int) -> dict[str, Any]:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None  # the machine may be shared: say how busy
    import anyio
    import matplotlib
    import mcp

    from mbridge_offload import __version__

    return {
        "in_process_svg": in_process(calls, "svg"),
        "in_process_png": in_process(calls, "png"),
        "mcp_png": anyio.run(over_mcp, calls),
        "target_s": TARGET_S,
        "sweep": SWEEP,
        "inputs": INPUTS,
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "matplotlib": matplotlib.__version__,
            "mcp": getattr(mcp, "__version__", None) or _version("mcp"),
            "mbridge_offload": __version__,
            "load_average_1min_at_start": round(load, 1) if load is not None else None,
        },
        "measured_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def markdown(data: dict[str, Any]) -> str:
    m = data["machine"]
    rows = [
        ("in-process, SVG (what `mbridge-offload plot` runs after parsing)", data["in_process_svg"]),
        ("in-process, PNG", data["in_process_png"]),
        ("MCP `plot_offload` over stdio, PNG image content + points", data["mcp_png"]),
    ]
    lines = [
        "# `plot` speed: a 5-point sweep, warm",
        "",
        f"Measured on {data['measured_at']} by `benchmarks/plot_speed.py`, in one run. Machine: {m['cpus']} CPUs "
        f"({m['platform']}), no GPU, shared with other jobs (1-minute load average {m['load_average_1min_at_start']} "
        f"when it started); Python {m['python']}, matplotlib {m['matplotlib']}, mcp {m['mcp']}.",
        "",
        "Reproduce (about half a minute):",
        "",
        "```bash",
        ".venv/bin/python benchmarks/plot_speed.py --calls 10   # --json prints the numbers instead of this page",
        "```",
        "",
        f"The sweep: `plot --model {data['inputs']['model']} --sweep {data['sweep']}` (the upstream card's run, "
        "five `estimate` calls) drawn and encoded. The first call of each way imports matplotlib and the planner "
        "and is shown apart; warm calls follow on the same process or server.",
        "",
        "| way | first call s | warm median s | warm p90 s | warm max s | n | target (warm p90) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for label, r in rows:
        w = r["warm"]
        verdict = f"< {data['target_s']:g} s " + ("✓" if w["p90_s"] < data["target_s"] else "✗")
        lines.append(
            f"| {label} | {r['first_s']} | {w['median_s']} | {w['p90_s']} | {w['max_s']} | {w['n']} | {verdict} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=10, help="warm calls per way (default 10)")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON; write nothing")
    parser.add_argument("--output", default=str(FRAGMENT), help=f"where the page goes (default {FRAGMENT})")
    args = parser.parse_args(argv)
    data = measure(args.calls)
    if args.json:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        return
    Path(args.output).write_text(markdown(data), encoding="utf-8")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
