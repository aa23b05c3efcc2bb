"""Measured peaks in a log: Megatron's and Bridge's memory reports, and prints of ``torch.cuda.max_memory_allocated``.

- Megatron-LM ``report_memory`` (``megatron/training/utils.py``): "[Rank N] (after K iterations) memory (MB) |
  allocated: … | max allocated: … | reserved: … | max reserved: …" (older releases: "cached"/"max cached"), MB =
  bytes / 1024², printed by data-parallel rank 0 of each model-parallel group: one line per (TP, PP, CP) rank.
- Megatron Bridge (``training/utils/train_utils.py``): "[Rank N] (after K iterations) memory (GB) | … |
  mem-max-allocated-gigabytes: … | …", GB = bytes / 10⁹ (five significant digits).
- A user's own print of ``torch.cuda.max_memory_allocated()``: bytes (an integer), or a number with its unit.

Each is a ``point``: the peak allocated memory of that rank so far. Never imports torch.
"""

from __future__ import annotations

import re

from mbridge_offload.plan.evidence.figures import Figure, cut
from mbridge_offload.plan.evidence.ranks import rank_of
from mbridge_offload.plan.evidence.sizes import NUMBER, UNIT, is_decimal_unit, unit_bytes

GiB = 2**30
_MEGATRON = re.compile(rf"memory \(MB\).*?\| max allocated: ({NUMBER})")
_BRIDGE = re.compile(rf"memory \(GB\).*?\| mem-max-allocated-gigabytes: ({NUMBER})")
# "max_memory_allocated: 1234", "torch.cuda.max_memory_allocated() = 74.12 GiB", "max memory allocated (GB): 74.1".
_USER = re.compile(
    rf"max[_ -]?memory[_ -]?allocated(?:\(\))?\s*(?:\((?P<u1>{UNIT})\))?\s*(?:[:=]|is|was)?\s*"
    rf"(?P<n>{NUMBER})(?:\s*(?P<u2>{UNIT})\b)?",
    re.IGNORECASE,
)
# Below this many bytes an integer without a unit is not a training run's peak (a unit was dropped): not read.
MIN_BYTES = 2**20


def parse_reports(lines: list[str], candidates: list[int], notes: list[str]) -> list[Figure]:
    """Every measured peak on the ``candidates`` lines, in line order; what could not be read goes to ``notes``."""
    out: list[Figure] = []
    for i in candidates:
        line = lines[i]
        figure = _report(line, i) or _user(line, i, notes)
        if figure is not None:
            out.append(figure)
    return out


def _report(line: str, i: int) -> Figure | None:
    m = _MEGATRON.search(line)
    source, gib = "megatron_memory_report", None
    if m:
        gib = float(m.group(1)) / 1024  # MB = MiB
    else:
        m = _BRIDGE.search(line)
        if m:
            source, gib = "bridge_memory_report", float(m.group(1)) * 1e9 / GiB
    if gib is None:
        return None
    who = rank_of(line)
    rank = {"rank": who.rank, "rank_source": who.source} if who else {}
    return Figure(source=source, kind="point", value_gib=gib, line=cut(line), line_number=i + 1, **rank)


def _user(line: str, i: int, notes: list[str]) -> Figure | None:
    m = _USER.search(line)
    if not m:
        return None
    unit = m.group("u1") or m.group("u2")
    number = m.group("n")
    if unit is None:
        if not re.fullmatch(r"\d+", number) or int(number) < MIN_BYTES:
            notes.append(
                f"line {i + 1}: {number!r} after max_memory_allocated has no unit: not read (pass measured_peak_gib)"
            )
            return None
        gib = int(number) / GiB
    else:
        gib = float(number) * unit_bytes(unit) / GiB
        if is_decimal_unit(unit):
            notes.append(
                f"line {i + 1}: '{unit}' read as binary (2^30 bytes per GB, PyTorch's and Megatron's convention); if "
                "the print divided by 10^9, pass measured_peak_gib instead"
            )
    who = rank_of(line, inline=True)
    rank = {"rank": who.rank, "rank_source": who.source} if who else {}
    return Figure(source="max_memory_allocated", kind="point", value_gib=gib, line=cut(line), line_number=i + 1, **rank)


def is_candidate(lower: str) -> bool:
    """A cheap test on a lower-cased line before the regular expressions run."""
    return "memory (mb)" in lower or "memory (gb)" in lower or ("max" in lower and "allocated" in lower)
