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


def shipped(root: Path = ROOT) -> list[str] | None:
    """The files an installer takes from ``root``, relative and sorted: what git tracks, plus new files not yet added
    inside the repository's folders (``git ls-files -co --exclude-standard``), but never an untracked file in the
    root itself. The root is where the README's commands put a user's ``my_run.yaml`` and what ``apply --output``
    writes: the user's files, not the skill's. None outside a git checkout.
    """
    import subprocess

    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, capture_output=True, text=True, timeout=60
    )
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True, timeout=60)
    if listed.returncode != 0 or tracked.returncode != 0:
        return None
    known = set(filter(None, tracked.stdout.split("\0")))
    return sorted(rel for rel in filter(None, listed.stdout.split("\0")) if rel in known or "/" in rel)
