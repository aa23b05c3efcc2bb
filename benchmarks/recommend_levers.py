"""Time a full-lever ``recommend`` (every lever allowed: recompute, the three offloads, CP, TP, MBS), warm.

Two ways, both real: in-process through ``plan.service.plan`` (what the CLI and the MCP tool call), and over MCP
through the server's in-memory client (``recommend_mode``, pydantic validation and structured output included).
Each is called once to warm up (imports, catalogue caches), then ``--calls`` times; the median and the worst are
printed with the number of options the answer ranks. Target: well under 1 s warm.

The setup is the question users bring: Llama 3.1 8B SFT at 16k tokens on one 8 x H100 node (MBS 2 so that the MBS
lever has a smaller value to try, global batch 64).

Run: ``python benchmarks/recommend_levers.py [--calls 10] [--json]``.
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

ROOT = Path(__file__).resolve().parents[1]
for sub in ("offload", "tools"):  # this tree's code, never an installed copy
    sys.path.insert(0, str(ROOT / sub))

FLAGS = {
    "model": "llama3-8b",
    "gpu": "h100-80gb",
    "num_gpus": 8,
    "seq_length": 16384,
    "micro_batch_size": 2,
    "global_batch_size": 64,
    "levers": ["recompute,activation,fine-grained,optimizer,cp,tp,mbs"],
}


def _in_process(calls: int) -> dict[str, float]:
    from mbridge_offload.plan.service import plan

    times, options = [], 0
    plan("recommend", FLAGS)  # warm-up
    for _ in range(calls):
        start = time.perf_counter()
        rec = plan("recommend", FLAGS)
        times.append(time.perf_counter() - start)
        options = len(getattr(rec, "options", []))
    return {"median_s": statistics.median(times), "max_s": max(times), "options": options}


async def _over_mcp(calls: int) -> dict[str, float]:
    from mcp import Client

    from mbridge_offload_tools.server import mcp

    times, options = [], 0
    async with Client(mcp, raise_exceptions=True) as client:
        await client.call_tool("recommend_mode", FLAGS)  # warm-up
        for _ in range(calls):
            start = time.perf_counter()
            result = await client.call_tool("recommend_mode", FLAGS)
            times.append(time.perf_counter() - start)
            if result.is_error:
                raise SystemExit(f"recommend_mode failed: {result.content[0].text}")
            options = len(result.structured_content["options"])
    return {"median_s": statistics.median(times), "max_s": max(times), "options": options}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    import anyio

    result = {
        "setup": dict(FLAGS),
        "in_process": _in_process(args.calls),
        "mcp": anyio.run(_over_mcp, args.calls),
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
    }
    if args.json:
        print(json.dumps(result))
        return
    for way in ("in_process", "mcp"):
        r = result[way]
        print(
            f"{way:10s} full-lever recommend: median {r['median_s'] * 1e3:.0f} ms, worst {r['max_s'] * 1e3:.0f} ms, "
            f"{r['options']} options"
        )
    print(f"host: {result['host']}")


if __name__ == "__main__":
    main()
