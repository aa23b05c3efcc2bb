"""Where the measured CPU AdamW throughput is stored, and reading it back for the time model.

``mbridge-offload calibrate`` measures (``mbridge_offload.runtime.adam_throughput``) and saves here; the time model
(``mbridge_offload.plan.timing``) reads the file when present, else uses the default figure documented there.
"""

from __future__ import annotations

import json
import os
import re
import statistics
from pathlib import Path
from typing import Any

ENV_VAR = "MBRIDGE_OFFLOAD_CALIBRATION"


def calibration_path(path: str | os.PathLike[str] | None = None) -> Path:
    """``path``, else ``$MBRIDGE_OFFLOAD_CALIBRATION``, else ``~/.cache/mbridge-offload/calibration.json``."""
    if path:
        return Path(path).expanduser()
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    return Path("~/.cache/mbridge-offload/calibration.json").expanduser()


def save(result: dict[str, Any], path: str | os.PathLike[str] | None = None) -> Path:
    """Write the calibration atomically; returns the path."""
    target = calibration_path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(target)
    return target


def load(path: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """The stored calibration, or None when there is none (or it is unreadable)."""
    target = calibration_path(path)
    try:
        data = json.loads(target.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("cpu_adam_params_per_s_per_core") else None


# ------------------------------------------------------------------------------------------- the user's run

# Megatron's report_memory (megatron/training/utils.py): "memory (MB) | allocated: … | max allocated: … | …",
# where MB = bytes / 1024² (so "max allocated" / 1024 is GiB); training_log: "elapsed time per iteration (ms): …".
_MAX_ALLOCATED = re.compile(r"max allocated:\s*([0-9]+(?:\.[0-9]+)?)")
_ITERATION_MS = re.compile(r"elapsed time per iteration \(ms\):\s*([0-9]+(?:\.[0-9]+)?)")


def parse_megatron_log(text: str) -> dict[str, Any]:
    """Peak memory and step time from a Megatron training log.

    Args:
        text: the log (any number of ranks and iterations).

    Returns:
        ``peak_gib`` (the largest "max allocated", MB/1024 = GiB, or None), ``step_s`` (the median iteration time
        after the first, which includes warm-up; or None) and ``iterations`` (how many times were read).
    """
    peaks = [float(v) for v in _MAX_ALLOCATED.findall(text)]
    times = [float(v) / 1000 for v in _ITERATION_MS.findall(text)]
    steady = times[1:] if len(times) > 1 else times
    return {
        "peak_gib": max(peaks) / 1024 if peaks else None,
        "step_s": statistics.median(steady) if steady else None,
        "iterations": len(times),
    }


def read_log(source: str) -> str:
    """``source`` is a path to a log file, or the log text itself."""
    if "\n" not in source and len(source) < 4096:
        path = Path(source).expanduser()
        if path.is_file():
            return path.read_text(errors="replace")
    return source
