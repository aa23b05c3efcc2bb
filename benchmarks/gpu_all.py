"""Both GPU benchmarks in one call (≤ 10 minutes on one H100/H200), each writing its GPU-measured docs section.

    .venv/bin/python benchmarks/gpu_all.py                 # on the lent GPU machine
    .venv/bin/python benchmarks/gpu_all.py --allow-cpu --docs /tmp/docs   # CPU smoke run (tests)

Runs ``benchmarks/gpu_activation.py`` (memory and step time vs k, ours vs no offload vs Transformer Engine where
installed), ``benchmarks/gpu_optimizer.py`` (HybridDeviceOptimizer at each fraction vs plain AdamW and the peers as
they run in production, and megatron-core's DistributedOptimizer where it imports) and
``benchmarks/gpu_offload_sweep.py`` (the HDO step against its floor, overlap on/off by fraction and model size, the
planner's rates against the measured ones; its table stays in ``benchmarks/results/``), one subprocess each with
its share of the time budget; and ``benchmarks/gpu_trace_check.py`` (megatron-core's real step by phase against
``trace`` and ``estimate``, six settings: ``docs/benchmarks-trace-gpu.md``; a dry run on the CPU).
The activation script writes its own section of ``docs/benchmarks-activation.md``; the optimizer script's
Markdown output goes into a section of ``docs/benchmarks-optimizer.md`` (or the script writes it itself if it
takes ``--write-docs``). Every section says whether it was GPU-measured. Results (JSON, logs) go to
``benchmarks/results/``. Exit code: 0 when all ran, 1 when one failed or ran out of time (its log says why),
2 when there is no GPU and ``--allow-cpu`` was not given.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.doc_fragment import DOCS, write_section

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# Seconds each script may take (their sum stays under the 10-minute call limit, leaving time for start-up).
BUDGET = {"gpu_activation.py": 150, "gpu_optimizer.py": 150, "gpu_offload_sweep.py": 150, "gpu_trace_check.py": 120}


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _run(script: str, args: list[str], timeout: float, log: Path) -> tuple[int, str]:
    """Run one benchmark script; returns (exit code, stdout). A timeout is exit code 124, as with timeout(1)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), *args]
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        code, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        code, out, err = 124, _text(exc.stdout), _text(exc.stderr) + f"\ntimed out after {timeout:.0f} s"
    log.write_text(f"$ {' '.join(cmd)}\n# {time.monotonic() - start:.1f} s, exit {code}\n{out}\n--- stderr\n{err}")
    return code, out


def _text(value: bytes | str | None) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


def _takes(script: str, flag: str) -> bool:
    return flag in (ROOT / "benchmarks" / script).read_text()


def run_all(docs: Path, results: Path, cuda: bool) -> dict[str, int]:
    """Run both scripts; returns their exit codes by name."""
    results.mkdir(parents=True, exist_ok=True)
    codes = {}
    act_args = ["--json", str(results / "gpu_activation.json"), "--write-docs", str(docs / "benchmarks-activation.md")]
    codes["gpu_activation.py"], _ = _run(
        "gpu_activation.py", act_args, BUDGET["gpu_activation.py"], results / "gpu_activation.log"
    )
    opt_doc = docs / "benchmarks-optimizer.md"
    own = _takes("gpu_optimizer.py", "--write-docs")
    # The table file goes with the results, never into a tracked file (the section lands in --docs below).
    opt_args = ["--write-docs", str(opt_doc)] if own else ["--output", str(results / "gpu_optimizer.md")]
    code, out = _run("gpu_optimizer.py", opt_args, BUDGET["gpu_optimizer.py"], results / "gpu_optimizer.log")
    codes["gpu_optimizer.py"] = code
    if code == 0 and not own:
        label = "GPU-measured" if cuda else "CPU smoke run of the GPU script: NOT a measurement"
        body = f"### GPU: optimizer step ({label})\n\n**{label}**, by `benchmarks/gpu_all.py`:\n\n"
        write_section(opt_doc, "gpu_optimizer.py", body + re.sub(r"^# ", "#### ", out, count=1, flags=re.M))
    sweep = ["--output", str(results / "gpu_offload_sweep.md"), "--json", str(results / "gpu_offload_sweep.json")]
    codes["gpu_offload_sweep.py"], _ = _run(
        "gpu_offload_sweep.py", sweep if cuda else [*sweep, "--dry-run"], BUDGET["gpu_offload_sweep.py"],
        results / "gpu_offload_sweep.log",
    )  # fmt: skip
    check = ["--output", str(docs / "benchmarks-trace-gpu.md"), "--json", str(results / "gpu_trace_check.json")]
    codes["gpu_trace_check.py"], _ = _run(
        "gpu_trace_check.py", check if cuda else ["--dry-run"], BUDGET["gpu_trace_check.py"],
        results / "gpu_trace_check.log",
    )  # fmt: skip
    (results / "gpu_all.json").write_text(json.dumps({"cuda": cuda, "exit_codes": codes}, indent=2))
    return codes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--allow-cpu", action="store_true", help="run the CPU fallbacks (a smoke test)")
    parser.add_argument("--docs", type=Path, default=DOCS, help="where the docs fragments are (default docs/)")
    parser.add_argument(
        "--results", type=Path, default=RESULTS, help="where the JSON, logs and tables go (default benchmarks/results)"
    )
    args = parser.parse_args(argv)
    cuda = _has_cuda()
    if not cuda and not args.allow_cpu:
        print(json.dumps({"error": "no CUDA device; pass --allow-cpu for the CPU smoke run"}))
        return 2
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    codes = run_all(args.docs, args.results, cuda)
    print(json.dumps({"cuda": cuda, "exit_codes": codes}))
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
