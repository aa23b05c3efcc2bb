"""The user's log as evidence: read it (a path or the text), parse every figure, refuse a log with none.

``--measured-log`` / MCP ``measured_log`` (and diagnose's log) is a log file or the log text; a file is read through
the one bounded reader (regular files only, its last ``MBRIDGE_OFFLOAD_MAX_CONFIG_BYTES`` bytes, inside the server's
roots). :func:`parse_log` is the library call: text in, :class:`~mbridge_offload.plan.evidence.figures.Evidence`
out (figures with their lines; no stage yet: the planner attributes them with the job's layout). Never imports
torch.

Example:
    >>> ev = parse_log("[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.00 GiB. GPU 3 has "
    ...     "a total capacity of 79.11 GiB of which 1.20 GiB is free. Of the allocated memory 74.12 GiB is allocated "
    ...     "by PyTorch, and 2.05 GiB is reserved by PyTorch but unallocated.")
    >>> ev.bounds[0].value_gib, ev.bounds[0].rank
    (77.12, 3)
"""

from __future__ import annotations

from pathlib import Path

from mbridge_offload.config.errors import InputError
from mbridge_offload.config.reading import read_text_file
from mbridge_offload.plan.evidence import oom, reports, steps
from mbridge_offload.plan.evidence.figures import SOURCES, Evidence
from mbridge_offload.plan.evidence.settings import parse_settings

ACCEPTED = "; ".join(v for k, v in SOURCES.items() if k != "pytorch_oom_unsized")
# A one-line argument longer than this that holds no figure is neither a path nor a log.
MAX_PATH_CHARS = 4096


def parse_log(text: str) -> Evidence:
    """Every figure in a log: out-of-memory bounds, measured peaks (points) and step times, in line order.

    Args:
        text: the log (any number of ranks, iterations and launcher prefixes).

    Returns:
        The figures with their lines, and the settings the log printed about its run (``settings.py``). An
        out-of-memory error without sizes is kept only when no sized message is
        in the log (the same failure is usually printed both ways).
    """
    lines = text.splitlines()
    lowered = [line.lower() for line in lines]
    pick = lambda test: [i for i, low in enumerate(lowered) if test(low)]  # noqa: E731
    ev = Evidence()
    bounds = oom.parse_ooms(lines, pick(oom.is_candidate))
    if any(f.value_gib is not None for f in bounds):
        bounds = [f for f in bounds if f.value_gib is not None]
    oom_lines = {f.line_number for f in bounds}
    points = reports.parse_reports(lines, [i for i in pick(reports.is_candidate) if i + 1 not in oom_lines], ev.notes)
    ev.memory = sorted(bounds + points, key=lambda f: f.line_number)
    ev.steps = steps.parse_steps(lines, pick(steps.is_candidate))
    ev.settings = parse_settings(text)
    return ev


def read_log(source: str) -> str:
    """``source`` is a path to a log file, or the log text itself.

    Text with a line break, or one line that holds a figure, is the log; any other one line is a path, read through
    the bounded reader (a FIFO, a device or a path outside the server's roots is refused, a huge log keeps its
    tail).

    Raises:
        InputError: a path that is missing, not a regular file, unreadable or outside the read roots.
    """
    if "\n" in source or not parse_log(source).empty:
        return source
    if len(source) > MAX_PATH_CHARS:
        raise InputError(
            "measured_log: one line of text with no figure in it and too long for a path",
            f"pass the log file's path or the log's lines; accepted: {ACCEPTED}",
        )
    return read_text_file(Path(source).expanduser(), what="measured log", tail=True)


def read_evidence(source: str) -> Evidence:
    """The evidence in a log path or text.

    Raises:
        InputError: an unreadable path, or a log with no figure this reader knows (the message lists them).
    """
    text = read_log(source)
    ev = parse_log(text)
    if ev.empty:
        lines = len(text.splitlines())
        raise InputError(
            f"measured_log: nothing measured in it ({lines} line{'s' if lines != 1 else ''} read, none with a memory "
            "figure or a step time)",
            f"pass a log with one of: {ACCEPTED}; or give the numbers as measured_peak_gib / measured_step_s / ooms",
        )
    return ev
