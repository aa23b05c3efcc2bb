"""Which tracked files a test run changed: ``git status`` before and after, plus a hash of files already dirty.

A file that was already modified before the run (a developer's uncommitted edit) is caught too: its content hash
is compared, not only its status line. Outside a git checkout (a copy of the skill) there is nothing to compare.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path


def _status(root: Path) -> list[str] | None:
    """``git status --porcelain`` lines of tracked files, or None outside a git checkout."""
    try:
        done = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.splitlines() if done.returncode == 0 else None


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def snapshot(root: Path) -> dict[str, str | None] | None:
    """Path → content hash of every tracked file that is dirty now (``{}`` on a clean tree; None outside git)."""
    lines = _status(root)
    if lines is None:
        return None
    return {line[3:]: _digest(root / line[3:]) for line in lines}


def changed_since(root: Path, before: dict[str, str | None] | None) -> list[str]:
    """The tracked files whose status or content changed since ``snapshot`` returned ``before``."""
    if before is None:
        return []
    after = snapshot(root) or {}
    return sorted(p for p in set(before) | set(after) if before.get(p, "clean") != after.get(p, "clean"))
