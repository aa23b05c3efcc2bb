"""The trace's figure for the NVIDIA-measured memory rows it can build, stored in ``data/nvidia_runs_traced.yaml``.

A trace of one row takes 10-120 s, too slow for the docs table, so the figures are computed once by
``python -m mbridge_offload_tools.evidence.traced_rows`` (with the megatron-core release and the date written beside
them) and ``tests/tools/test_nvidia_runs.py`` re-traces one row against its stored figure. The rows are those of
``evidence/nvidia_runs.py`` whose run the trace accepts (``trace.spec.unsupported``); the others say why in the table.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path
from typing import Any

from mbridge_offload_tools.evidence import data_files

DATA = Path(__file__).with_name("data") / "nvidia_runs_traced.yaml"


def traceable() -> dict[str, tuple[Any, Any]]:
    """``{row id: (model, setup)}`` for every memory row the trace can build: the rows given as planner inputs (the
    recipe docstrings', the CPU-offloading card's points) and the memory rows given as the planner's model and
    settings (``nvidia_runs.yaml``)."""
    from mbridge_offload.plan.inputs.resolve import resolve
    from mbridge_offload_tools.evidence.nvidia_runs import load, memory_model, memory_setup, planner_inputs
    from mbridge_offload_tools.trace.spec import unsupported

    runs = {row_id: (r.model, r.setup) for row_id, r in ((i, resolve(v)) for i, v in planner_inputs().items())}
    for row in load().get("memory_rows", []):
        runs[row["id"]] = (memory_model(row["model"]), memory_setup(row))
    return {row_id: run for row_id, run in runs.items() if not unsupported(*run)}


def trace_peaks(runs: dict[str, tuple[Any, Any]], release: str) -> dict[str, float]:
    """The trace's peak (GiB, allocated by tensors, no workspaces) of the planner's worst stage of each run."""
    from mbridge_offload.plan.memory.stage import estimate_memory
    from mbridge_offload.plan.model.architecture import GiB
    from mbridge_offload_tools.trace import spec as specs
    from mbridge_offload_tools.trace.run import spawn_batch

    ids = list(runs)
    worst = [estimate_memory(m, s).worst for m, s in runs.values()]
    batch = [specs.build_run(m, s, w.stage, gpu=w.gpu) for (m, s), w in zip(runs.values(), worst, strict=True)]
    out = {}
    for row_id, got in zip(ids, spawn_batch(release, batch), strict=True):
        if "error" in got:
            raise RuntimeError(f"{row_id}: {got['error']}")
        out[row_id] = round(max(p["total"] for p in got["phases"].values()) / GiB, 4)
    return out


def stored() -> dict[str, Any]:
    """The data file, parsed."""
    return data_files.load("nvidia_runs_traced")


def main() -> int:
    """Trace every traceable row and rewrite the data file (its header kept)."""
    from mbridge_offload_tools.trace.run import DEFAULT_RELEASE

    peaks = trace_peaks(traceable(), DEFAULT_RELEASE)
    header = [ln for ln in DATA.read_text().splitlines() if ln.startswith("#")]
    lines = [
        *header,
        f"megatron_core: {DEFAULT_RELEASE}",
        f"date: {datetime.date.today().isoformat()}",
        "rows:",
        *(f'  "{k}": {{peak_gib: {v}}}' for k, v in peaks.items()),
    ]
    DATA.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(peaks)} rows to {DATA}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
