"""Memory sizes as PyTorch, Megatron and users print them, read back into bytes.

PyTorch's out-of-memory message formats every size with ``format_size`` (``c10/cuda/CUDACachingAllocator.cpp``):
up to 1024 bytes as ``N bytes``, then ``KiB``, ``MiB``, ``GiB`` with two decimals (binary units; a size above 1 TiB
still prints in GiB). Megatron-LM's memory report prints "MB" meaning bytes / 1024² (``report_memory``); Megatron
Bridge's prints decimal gigabytes (bytes / 10⁹, ``mem-*-gigabytes``). A user's own print of
``torch.cuda.max_memory_allocated()`` is bytes, or carries its unit; "GB"/"MB"/"KB" there are read as binary, the
convention of PyTorch's and Megatron's own prints (an answer says so). Never imports torch.
"""

from __future__ import annotations

import re

# One number as these logs print it (no sign: sizes are never negative; 1e9-style exponents from a %g print).
NUMBER = r"\d+(?:\.\d+)?(?:[eE][+-]?\d+)?"
# ``format_size``'s units, and the plain ones a user may print.
_UNITS: dict[str, int] = {
    "bytes": 1,
    "byte": 1,
    "b": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 2**10,
    "mb": 2**20,
    "gb": 2**30,
    "tb": 2**40,
}
# A size with its unit, as ``format_size`` prints it ("3.00 GiB", "512 bytes").
SIZE = rf"({NUMBER}) (bytes|KiB|MiB|GiB|TiB)"
UNIT = r"(?:bytes|byte|B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)"
SIZE_RE = re.compile(SIZE)


def unit_bytes(unit: str) -> int:
    """Bytes per ``unit`` (case-insensitive; ``KB``/``MB``/``GB`` binary, see the module docstring).

    Raises:
        KeyError: a unit these logs never print.
    """
    return _UNITS[unit.lower()]


def size_bytes(number: str, unit: str) -> float:
    """``"3.00", "GiB"`` → 3 × 2³⁰."""
    return float(number) * unit_bytes(unit)


def is_decimal_unit(unit: str) -> bool:
    """``GB``-style units that a user may have meant as 10⁹ (read as binary here; said in the answer)."""
    return unit.lower() in ("kb", "mb", "gb", "tb")
