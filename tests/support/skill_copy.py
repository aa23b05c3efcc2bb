"""A copy of the skill folder set up the way an agent host would: ``scripts/setup --light`` on a plain Python.

The copy holds what an installer takes (the files git tracks or would track: no ``.venv``, no caches) and is set up by
its own ``scripts/setup --light`` with the Python this test venv was built from (``sys.base_prefix``), which has neither
this package nor pytest nor torch. So what runs from the copy runs without the checkout's editable install, and the
``test`` command there really lacks pytest and torch. Built once per test session (about 15 s, pip from the index).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from tests.support import tree

ROOT = Path(__file__).resolve().parents[2]
_BUILT: dict[str, Path] = {}


def base_python() -> str:
    """The interpreter this venv was made from (not the venv's, which has the package installed)."""
    for name in ("python3", "python"):
        candidate = Path(sys.base_prefix) / "bin" / name
        if candidate.is_file():
            return str(candidate)
    raise FileNotFoundError(f"no python in {sys.base_prefix}/bin")


def clean_env() -> dict[str, str]:
    """The environment without this venv, PYTHONPATH or the user site (so nothing of the checkout leaks in)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PYTHONNOUSERSITE"] = "1"
    # Bounded waits on the package index: an unreachable index fails in about a minute instead of hanging.
    env["PIP_DEFAULT_TIMEOUT"] = "30"
    env["PIP_RETRIES"] = "1"
    venv_bin = str(Path(sys.prefix) / "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    return env


def copy_tree(dest: Path, root: Path = ROOT) -> Path:
    """The installer's view of the repository (:func:`tests.support.tree.shipped`) copied to ``dest``."""
    listed = tree.shipped(root)
    dest.mkdir(parents=True, exist_ok=True)
    if listed is not None:
        for rel in listed:
            src = root / rel
            if src.is_file():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / rel)
    else:  # not a git checkout (an unpacked archive): everything but the build outputs
        with tempfile.TemporaryDirectory() as tmp:
            archive = Path(tmp) / "tree.tar"
            skip = {".venv", ".mcore", ".bridge", ".git", "__pycache__", "dist"}
            with tarfile.open(archive, "w") as tar:
                for child in root.iterdir():
                    if child.name not in skip:
                        tar.add(child, arcname=child.name, filter=lambda t: None if "__pycache__" in t.name else t)
            with tarfile.open(archive) as tar:
                tar.extractall(dest, filter="data")
    return dest


def light_skill_copy(base: Path) -> Path:
    """``base/mbridge-offload``: a copy of the skill folder after ``scripts/setup --light`` (cached per session).

    Raises:
        AssertionError: the base Python has this package (the check would prove nothing), or the setup failed.
    """
    if "light" in _BUILT:
        return _BUILT["light"]
    python = base_python()
    probe = subprocess.run(
        [python, "-c", "import importlib.util as u; print(u.find_spec('mbridge_offload') is None)"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.stdout.strip() == "True", (
        f"{python} already has mbridge_offload installed; the copy test needs one without"
    )
    skill = copy_tree(base / "mbridge-offload")
    done = subprocess.run(
        [str(skill / "scripts" / "setup"), "--light", "--python", python],
        cwd=skill,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "done (light)" in done.stdout, done.stdout
    _BUILT["light"] = skill
    return skill
