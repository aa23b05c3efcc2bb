"""PyTorch's CUDA out-of-memory message, read as a lower bound on the peak.

The caching allocator raises it (``c10/cuda/CUDACachingAllocator.cpp``, ``DeviceCachingAllocator::malloc``) when
neither its cache nor ``cudaMalloc`` can serve a request. Two forms, every size through ``format_size``:

- since PyTorch 2.1: "CUDA out of memory. Tried to allocate R. GPU D has a total capacity of T of which F is free.
  [Process P has X memory in use. ...][Including non-PyTorch memory, this process has X memory in use. ][M allowed; ]
  Of the allocated memory A is allocated by PyTorch, [with P allocated in private pools (e.g., CUDA Graphs), ]and U
  is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True ..." (2.1-2.2 spelled "capacty" and advised max_split_size_mb);
- before: "CUDA out of memory. Tried to allocate R (GPU D; T total capacity; A already allocated; F free;
  [M allowed; ]S reserved in total by PyTorch)", where U = S − A.

A (private pools included) + R is what the process needed at that moment: the peak of the step is at least that
(``bound``). U is memory the allocator holds in blocks it cannot hand out (fragmentation): with
``expandable_segments:True`` segments grow in place and that slack is usable. ROCm builds print "HIP" for "CUDA".
Never imports torch.
"""

from __future__ import annotations

import re

from mbridge_offload.plan.evidence.figures import Figure, cut
from mbridge_offload.plan.evidence.ranks import rank_of, strip_prefixes
from mbridge_offload.plan.evidence.sizes import SIZE, size_bytes

GiB = 2**30
# Lines a wrapped message may span (a message pasted from a terminal or re-flowed by hand), and its longest form.
WRAP_LINES = 24
WINDOW_CHARS = 4000


def _flexible(pattern: str) -> re.Pattern[str]:
    """``pattern`` with every space matching any run of white space (a message may be wrapped anywhere)."""
    return re.compile(pattern.replace(" ", r"\s+"))


_SIZE = SIZE.replace(" ", r"\s+")
_START = _flexible(r"(?:CUDA|HIP) out of memory\b")
_CURRENT = _flexible(
    rf"(?:CUDA|HIP) out of memory\. Tried to allocate {_SIZE}\. GPU (\d+) has a total capac(?:i)?ty of {_SIZE} of "
    rf"which {_SIZE} is free\.\s*((?s:.*?))Of the allocated memory {_SIZE} is allocated by PyTorch, (?:with {_SIZE} "
    rf"allocated in private pools \(e\.g\., CUDA Graphs\), )?and {_SIZE} is reserved by PyTorch but unallocated\."
)
_LEGACY = _flexible(
    rf"(?:CUDA|HIP) out of memory\. Tried to allocate {_SIZE} \(GPU (\d+); {_SIZE} total capacity; {_SIZE} already "
    rf"allocated; {_SIZE} free; (?:{_SIZE} allowed; )?{_SIZE} reserved in total by PyTorch\)"
)
_OTHER_PROCESS = _flexible(rf"Process \d+ has {_SIZE} memory in use\.")
_THIS_PROCESS = _flexible(rf"Including non-PyTorch memory, this process has {_SIZE} memory in use\.")
# An out-of-memory failure that carries no sizes: the CUDA runtime's own error, or a message cut before its sizes.
_UNSIZED = re.compile(r"(?:CUDA|HIP) (?:error: )?out of memory|OutOfMemoryError", re.IGNORECASE)


def _gib(number: str, unit: str) -> float:
    return size_bytes(number, unit) / GiB


def _window(lines: list[str], i: int) -> str:
    """Line ``i`` and the next lines (their launcher prefixes stripped), joined by line breaks, so a match's end
    tells how many lines the message took."""
    return "\n".join([lines[i]] + [strip_prefixes(line) for line in lines[i + 1 : i + 1 + WRAP_LINES]])[:WINDOW_CHARS]


def _current(m: re.Match[str]) -> dict[str, float | int | None]:
    g = m.groups()
    requested, device, capacity, free = _gib(g[0], g[1]), int(g[2]), _gib(g[3], g[4]), _gib(g[5], g[6])
    middle, allocated = g[7], _gib(g[8], g[9])
    unallocated = _gib(g[12], g[13])
    others = [_gib(n, u) for n, u in _OTHER_PROCESS.findall(middle)]
    this = _THIS_PROCESS.search(middle)
    return {
        "requested_gib": requested,
        "device": device,
        "capacity_gib": capacity,
        "free_gib": free,
        "allocated_gib": allocated,
        "reserved_unallocated_gib": unallocated,
        "other_processes_gib": sum(others) if others else None,
        "process_gib": _gib(this.group(1), this.group(2)) if this else None,
    }


def _legacy(m: re.Match[str]) -> dict[str, float | int | None]:
    g = m.groups()
    allocated, reserved = _gib(g[5], g[6]), _gib(g[11], g[12])
    return {
        "requested_gib": _gib(g[0], g[1]),
        "device": int(g[2]),
        "capacity_gib": _gib(g[3], g[4]),
        "allocated_gib": allocated,
        "free_gib": _gib(g[7], g[8]),
        "reserved_unallocated_gib": max(0.0, reserved - allocated),
    }


def parse_ooms(lines: list[str], candidates: list[int]) -> list[Figure]:
    """Every out-of-memory failure that starts on a ``candidates`` line (indexes into ``lines``), in line order.

    A sized message is a ``bound`` (allocated + requested); an unsized one (``CUDA error: out of memory``, or a
    message cut before its sizes) is a bound with no value: the settings failed, by how much is not said.
    """
    out: list[Figure] = []
    done = -1  # the last line a message already read spans
    for i in candidates:
        if i <= done:
            continue
        line = lines[i]
        if not _starts_here(lines, i):
            continue
        who = rank_of(line)
        rank = {"rank": who.rank, "rank_source": who.source} if who else {}
        text = _window(lines, i)
        found = False
        for start in _START.finditer(text):
            if start.start() >= len(line):
                break  # it starts on a later line: that line's own turn
            found = True
            m = _CURRENT.match(text, start.start()) or _LEGACY.match(text, start.start())
            if m is None:
                out.append(
                    Figure(source="pytorch_oom_unsized", kind="bound", line=cut(line), line_number=i + 1, **rank)
                )
                continue
            fields = _current(m) if m.re is _CURRENT else _legacy(m)
            bound = float(fields["allocated_gib"] or 0.0) + float(fields["requested_gib"] or 0.0)
            out.append(
                Figure(
                    source="pytorch_oom",
                    kind="bound",
                    value_gib=bound,
                    line=cut(line),
                    line_number=i + 1,
                    **rank,
                    **fields,
                )
            )
            done = max(done, i + text.count("\n", 0, m.end()))
        if not found and _UNSIZED.search(line):
            out.append(Figure(source="pytorch_oom_unsized", kind="bound", line=cut(line), line_number=i + 1, **rank))
    return out


def _starts_here(lines: list[str], i: int) -> bool:
    """Whether a message may start on line ``i``: it says "out of memory" itself, or the words run on into the next
    lines (a cheap look at their ends before the whole window is joined)."""
    line = lines[i]
    low = line.lower()
    if "out of memory" in low or "outofmemoryerror" in low:
        return True
    ahead = [line[-24:]] + [strip_prefixes(nxt)[:24] for nxt in lines[i + 1 : i + 4]]
    return _START.search("\n".join(ahead)) is not None


def is_candidate(lower: str) -> bool:
    """A cheap test on a lower-cased line before the regular expressions run (a message wrapped right after
    "CUDA" starts on a line that says no more)."""
    return (
        "out of memory" in lower or "outofmemoryerror" in lower or lower.rstrip().endswith(("cuda", "hip", "out", "of"))
    )
