"""Time a full-lever ``recommend`` (every lever allowed: recompute, the three offloads, CP, TP, MBS), warm, with and
without the user's log as evidence.

Two ways, both real: in-process through ``plan.service.plan`` (what the CLI and the MCP tool call), and over MCP
through the server's in-memory client (``recommend_mode``, pydantic validation and structured output included).
Each is called once to warm up (imports, catalogue caches), then ``--calls`` times; the median and the worst are
printed with the number of options the answer ranks. Target: under 1 s warm over MCP, the log included.

The setup is the question users bring: Llama 3.1 8B SFT at 16k tokens on one 8 x H100 node (MBS 2 so that the MBS
lever has a smaller value to try, global batch 64). The log (``measured_log``, passed as its text) is a
training log of 2,000 iteration lines, a memory report of each of the 8 ranks, then the out-of-memory message of
every rank, each line behind torchrun's ``[rankN]:`` prefix (~0.5 MB): every parser and the stage attribution run.

Run: ``python benchmarks/recommend_levers.py [--calls 10] [--json | --markdown]``; ``--markdown`` prints the
fragment ``docs/benchmarks-recommend.md`` holds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for sub in ("offload", "tools"):  # this tree's code, never an installed copy
    sys.path.insert(0, str(ROOT / sub))

FLAGS: dict[str, Any] = {
    "model": "llama3-8b",
    "gpu": "h100-80gb",
    "num_gpus": 8,
    "seq_length": 16384,
    "micro_batch_size": 2,
    "global_batch_size": 64,
    "levers": ["recompute,activation,fine-grained,optimizer,cp,tp,mbs"],
}
TARGET_S = 1.0


def training_log(iterations: int = 2000, ranks: int = 8) -> str:
    """A Megatron training log as torchrun prints it: iterations, memory reports, then an OOM on every rank."""
    lines = []
    for i in range(1, iterations + 1):
        lines.append(
            f"[rank{ranks - 1}]: [2026-12-04 10:{i // 60 % 60:02d}:{i % 60:02d}] iteration {i:8d}/{iterations:8d} | "
            f"consumed samples: {64 * i:12d} | elapsed time per iteration (ms): {2480.0 + (i % 7):.1f} | "
            f"throughput per GPU (TFLOP/s/GPU): 412.3 | learning rate: 3.000000E-06 | global batch size:    64 |"
        )
        if i == 2:
            lines += [
                f"[rank{r}]: [Rank {r}] (after 2 iterations) memory (MB) | allocated: 51234.50 | max allocated: "
                f"{70000 + r:.2f} | reserved: 75000.00 | max reserved: 76000.00"
                for r in range(ranks)
            ]
    lines += [
        f"[rank{r}]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.00 GiB. GPU {r} has a total "
        "capacity of 79.11 GiB of which 1.20 GiB is free. Including non-PyTorch memory, this process has 77.90 GiB "
        "memory in use. Of the allocated memory 74.12 GiB is allocated by PyTorch, and 2.05 GiB is reserved by "
        "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
        for r in range(ranks)
    ]
    return "\n".join(lines) + "\n"


def _in_process(calls: int, flags: dict[str, Any]) -> dict[str, float]:
    from mbridge_offload.plan.service import plan

    times, options = [], 0
    plan("recommend", flags)  # warm-up
    for _ in range(calls):
        start = time.perf_counter()
        rec = plan("recommend", flags)
        times.append(time.perf_counter() - start)
        options = len(getattr(rec, "options", []))
    return {"median_s": statistics.median(times), "max_s": max(times), "options": options}


async def _over_mcp(calls: int, flags: dict[str, Any]) -> dict[str, float]:
    from mcp import Client

    from mbridge_offload_tools.server.app import mcp

    times, options = [], 0
    async with Client(mcp, raise_exceptions=True) as client:
        await client.call_tool("recommend_mode", flags)  # warm-up
        for _ in range(calls):
            start = time.perf_counter()
            result = await client.call_tool("recommend_mode", flags)
            times.append(time.perf_counter() - start)
            if result.is_error:
                raise SystemExit(f"recommend_mode failed: {result.content[0].text}")
            options = len(result.structured_content["options"])
    return {"median_s": statistics.median(times), "max_s": max(times), "options": options}


def measure(calls: int) -> dict[str, Any]:
    import anyio

    log = training_log()
    cases = {"every lever": dict(FLAGS), "every lever + measured_log": {**FLAGS, "measured_log": log}}
    return {
        "setup": dict(FLAGS),
        "log_bytes": len(log.encode()),
        "log_lines": log.count("\n"),
        "calls": calls,
        "cases": {
            name: {"in_process": _in_process(calls, flags), "mcp": anyio.run(_over_mcp, calls, flags)}
            for name, flags in cases.items()
        },
        "host": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}",
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "measured_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d (%H:%M UTC)"),
    }


def markdown(data: dict[str, Any]) -> str:
    """The fragment ``docs/benchmarks-recommend.md``: the numbers of one run, nothing rounded by hand."""
    lines = [
        "# `recommend` with every lever and the user's log",
        "",
        f"Measured on {data['measured_at']} by `benchmarks/recommend_levers.py`, in one run. Machine: {data['host']}, "
        f"shared with other jobs (load average {data['load_average']:.1f} at the end); no GPU.",
        "",
        "```bash",
        f".venv/bin/python benchmarks/recommend_levers.py --calls {data['calls']} --markdown",
        "```",
        "",
        "Llama 3.1 8B SFT at 16k tokens on one 8 x H100 node (MBS 2, global batch 64), every lever allowed "
        "(`recompute,activation,fine-grained,optimizer,cp,tp,mbs`); with the log, `measured_log` is the text of a "
        f"training log of {data['log_lines']:,} lines ({data['log_bytes'] / 1e6:.2f} MB): 2,000 iteration lines, a "
        "memory report of each of the 8 ranks, the out-of-memory message of every rank, each behind torchrun's "
        "`[rankN]:` prefix. Warm: the first call of each way is not counted.",
        "",
        "| case | way | median, ms | worst, ms | options | target |",
        "|---|---|---|---|---|---|",
    ]
    for name, ways in data["cases"].items():
        for way, r in ways.items():
            ok = "✓" if r["median_s"] < TARGET_S else "✗"
            target = f"< {TARGET_S * 1000:.0f} ms {ok}" if way == "mcp" else ""
            lines.append(
                f"| {name} | {way.replace('_', '-')} | {r['median_s'] * 1e3:.0f} | {r['max_s'] * 1e3:.0f} | "
                f"{r['options']} | {target} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10)
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument("--markdown", action="store_true", help="print the docs/benchmarks-recommend.md fragment")
    args = parser.parse_args()
    data = measure(args.calls)
    if args.json:
        print(json.dumps(data))
        return
    if args.markdown:
        sys.stdout.write(markdown(data))
        return
    for name, ways in data["cases"].items():
        for way, r in ways.items():
            print(
                f"{name:28s} {way:10s}: median {r['median_s'] * 1e3:.0f} ms, worst {r['max_s'] * 1e3:.0f} ms, "
                f"{r['options']} options"
            )
    print(f"host: {data['host']}")


if __name__ == "__main__":
    main()
