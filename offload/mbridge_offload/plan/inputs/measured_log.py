"""Calibration from the user's own run: the peak memory and step time a Megatron training log reports.

``--measured-log`` / MCP ``measured_log`` is a log file or the log text; a file is read through the one bounded
reader (regular files only, its last ``MBRIDGE_OFFLOAD_MAX_CONFIG_BYTES`` bytes, inside the server's roots).
The measured CPU AdamW rate of a host is a named host profile: ``plan/time/host_profile.py``.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Any

from mbridge_offload.config.errors import InputError
from mbridge_offload.config.reading import read_text_file

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
    """``source`` is a path to a log file, or the log text itself.

    One line that holds none of the lines :func:`parse_megatron_log` reads is taken as a path: read through the
    bounded reader (a FIFO, a device or a path outside the server's roots is refused, a huge log keeps its tail).

    Raises:
        InputError: a path that is missing, not a regular file, unreadable or outside the read roots.
    """
    if "\n" in source or _MAX_ALLOCATED.search(source) or _ITERATION_MS.search(source):
        return source
    if len(source) > 4096:
        raise InputError(
            "measured_log: one line of text with no 'max allocated' or 'elapsed time per iteration (ms)'",
            "pass the log file's path or the log's lines",
        )
    return read_text_file(Path(source).expanduser(), what="measured log", tail=True)
