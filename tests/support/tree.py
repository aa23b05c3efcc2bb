"""This checkout's source roots for the subprocesses the tests start: they import this tree, never an installed copy."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The same roots as pytest's ``pythonpath`` (pyproject.toml); ROOT itself for ``tests.support``.
SOURCE_ROOTS = (ROOT / "offload", ROOT / "tools", ROOT)


def pythonpath(*extra: str | os.PathLike[str], inherit: bool = False) -> str:
    """A ``PYTHONPATH`` value: the tree's roots, then ``extra``, then (``inherit``) the caller's own."""
    tail = [os.environ.get("PYTHONPATH", "")] if inherit else []
    return os.pathsep.join(str(p) for p in [*SOURCE_ROOTS, *extra, *tail] if str(p))
