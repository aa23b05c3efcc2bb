"""Measure the MCP server's latency as a client sees it: start to first ``list_tools``, and tool call times.

A separate client process (this script) starts ``python -m mbridge_offload_tools.server.app`` over stdio, as Claude Code
or Codex would, and times:
- start → first ``list_tools`` answer (process spawn, imports, initialize handshake, tools/list), ``--starts`` times;
- ``validate_config`` and ``recommend_mode`` calls on the example config, after one warm-up call each
  (the first call imports the library: reported separately as ``first_call_ms``).

Targets: start < 2 s, calls < 100 ms. Prints one JSON object; ``--markdown`` prints a table.

Run: ``python benchmarks/mcp_latency.py [--starts 5] [--calls 30] [--markdown]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import anyio
from mcp import Client, StdioServerParameters

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "qwen3_30b_a3b_pretrain.yaml")
CALLS = {
    "validate_config": {"config": EXAMPLE},
    "recommend_mode": {"config": EXAMPLE, "gpu": "h100-80gb", "num_gpus": 16},
}


def _params() -> StdioServerParameters:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return StdioServerParameters(
        command=sys.executable, args=["-m", "mbridge_offload_tools.server.app"], cwd=str(ROOT), env=env
    )


def _summary(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples_s)
    return {
        "median_ms": round(statistics.median(ms), 2),
        "p90_ms": round(ms[min(len(ms) - 1, int(0.9 * len(ms)))], 2),
        "min_ms": round(ms[0], 2),
        "max_ms": round(ms[-1], 2),
        "n": len(ms),
    }


async def measure(starts: int, calls: int) -> dict:
    start_times: list[float] = []
    first_call: dict[str, list[float]] = {name: [] for name in CALLS}
    call_times: dict[str, list[float]] = {name: [] for name in CALLS}
    for i in range(starts):
        t0 = time.perf_counter()
        async with Client(_params()) as client:
            tools = (await client.list_tools()).tools
            start_times.append(time.perf_counter() - t0)
            assert {t.name for t in tools} >= set(CALLS), [t.name for t in tools]
            for name, arguments in CALLS.items():
                t1 = time.perf_counter()
                result = await client.call_tool(name, arguments)
                first_call[name].append(time.perf_counter() - t1)
                assert not result.is_error, result.content
                if i == 0:  # steady-state calls on one warm server
                    for _ in range(calls):
                        t2 = time.perf_counter()
                        result = await client.call_tool(name, arguments)
                        call_times[name].append(time.perf_counter() - t2)
                        assert not result.is_error and result.structured_content
    return {
        "start_to_first_list_tools": _summary(start_times),
        "first_call": {name: _summary(v) for name, v in first_call.items()},
        "calls": {name: _summary(v) for name, v in call_times.items()},
        "targets_ms": {"start": 2000, "call": 100},
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
    }


def markdown(data: dict) -> str:
    rows = [("server start → first list_tools", data["start_to_first_list_tools"], 2000)]
    rows += [(f"{n} (first call, imports the library)", s, None) for n, s in data["first_call"].items()]
    rows += [(f"{n} (warm)", s, 100) for n, s in data["calls"].items()]
    out = ["| measurement | median ms | p90 ms | min ms | max ms | n | target |", "|---|---|---|---|---|---|---|"]
    for label, s, target in rows:
        verdict = "" if target is None else (f"< {target} ms ✓" if s["p90_ms"] < target else f"< {target} ms ✗")
        out.append(
            f"| {label} | {s['median_ms']} | {s['p90_ms']} | {s['min_ms']} | {s['max_ms']} | {s['n']} | {verdict} |"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    data = anyio.run(measure, args.starts, args.calls)
    sys.stdout.write((markdown(data) if args.markdown else json.dumps(data, indent=2)) + "\n")


if __name__ == "__main__":
    main()
