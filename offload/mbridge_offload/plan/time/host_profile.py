"""Named host profiles: the CPU AdamW rate ``mbridge-offload calibrate`` measured, used only when the caller names it.

A profile is a small JSON file: ``name``, ``cpu_model``, ``threads``, ``torch_version``, ``measured_at`` and
``cpu_adam_params_per_s_per_core`` (plus the raw measurement). ``calibrate`` writes it to ``--output PATH`` or to
``.mbridge-offload/host-profiles/NAME.json`` in the working directory (the project, where the MCP server can read
it too). ``estimate`` / ``recommend`` use one only with ``--host-profile NAME|FILE`` (MCP ``host_profile``; the
older ``--calibration FILE`` is the same with a file): a NAME is looked up in that folder of each directory the
reader may use, a FILE is read as given. Nothing in HOME or the environment is consulted: a file there changes no
answer unless named. Every read goes through the bounded reader and the server's roots.

No torch import here: the measurement itself lives in ``mbridge_offload_runtime.adam_throughput``.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mbridge_offload.config.errors import InputError
from mbridge_offload.config.reading import read_roots, read_text_file

PROFILE_DIR = Path(".mbridge-offload") / "host-profiles"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
RATE_KEY = "cpu_adam_params_per_s_per_core"


@dataclass(frozen=True)
class HostProfile:
    """A loaded profile: its rate, what it was measured on, and where it came from."""

    name: str
    rate_per_core: float
    path: Path
    cpu_model: str | None = None
    threads: int | None = None
    torch_version: str | None = None
    measured_at: str | None = None

    def describe(self) -> str:
        """One line for the assumptions: ``host profile 'x' (CPU, threads, torch, date) from PATH``."""
        facts = [
            self.cpu_model,
            f"{self.threads} thread{'s' if self.threads != 1 else ''}" if self.threads else None,
            f"torch {self.torch_version}" if self.torch_version else None,
            self.measured_at,
        ]
        shown = ", ".join(f for f in facts if f)
        return f"host profile {self.name!r}{f' ({shown})' if shown else ''} from {self.path}"


def is_name(ref: str) -> bool:
    """A bare profile name (``dgx-h100``), as opposed to a path (``./x.json``, ``/p/x.json``)."""
    return bool(NAME.fullmatch(ref)) and not ref.endswith(".json")


def default_path(name: str, base: str | os.PathLike[str] | None = None) -> Path:
    """Where ``calibrate --name NAME`` stores a profile: ``BASE/.mbridge-offload/host-profiles/NAME.json``.

    Raises:
        InputError: ``name`` is not a plain name (letters, digits, ``._-``; at most 64).
    """
    if not is_name(name):
        raise InputError(
            f"host profile name {name!r} is not a plain name", "use letters, digits, '.', '_' or '-' (at most 64)"
        )
    return Path(base if base is not None else Path.cwd()) / PROFILE_DIR / f"{name}.json"


def _search_dirs() -> list[Path]:
    roots = read_roots()
    return list(roots) if roots is not None else [Path.cwd()]


def locate(ref: str, search: Iterable[Path] | None = None) -> Path:
    """The file a ``--host-profile`` value names: a NAME looked up in the profile folder of each search
    directory (default: the reader's roots, else the working directory), or a FILE path as given.

    Raises:
        InputError: a NAME that no search directory holds.
    """
    if not is_name(ref):
        return Path(ref).expanduser()
    dirs = list(search) if search is not None else _search_dirs()
    for base in dirs:
        candidate = default_path(ref, base)
        if candidate.is_file():
            return candidate
    looked = ", ".join(str(base / PROFILE_DIR) for base in dirs)
    raise InputError(
        f"host profile {ref!r}: no {ref}.json in {looked}",
        f"run `mbridge-offload calibrate --name {ref}` in the project, or pass the profile's file path",
    )


def load(ref: str, search: Iterable[Path] | None = None) -> HostProfile:
    """Read the profile ``ref`` names (bounded reader, read roots) and check its rate.

    Raises:
        InputError: not found, not a regular file, too large, outside the roots, not JSON, or without a positive
            finite ``cpu_adam_params_per_s_per_core``.
    """
    path = locate(ref, search)
    text = read_text_file(path, what="host profile")
    try:
        data = json.loads(text, parse_constant=lambda c: None)
    except ValueError as exc:
        raise InputError(f"{path}: not a JSON host profile ({exc})", "run `mbridge-offload calibrate` again") from None
    rate = data.get(RATE_KEY) if isinstance(data, dict) else None
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
        raise InputError(
            f"{path}: {RATE_KEY} is {rate!r}, not a positive number", "run `mbridge-offload calibrate` again"
        )
    assert isinstance(data, dict)
    return HostProfile(
        name=str(data.get("name") or path.stem),
        rate_per_core=float(rate),
        path=path.resolve(),
        cpu_model=_text(data.get("cpu_model")),
        threads=data["threads"] if isinstance(data.get("threads"), int) else None,
        torch_version=_text(data.get("torch_version")),
        measured_at=_text(data.get("measured_at") or data.get("date")),
    )


def _text(value: Any) -> str | None:
    return str(value)[:200] if value is not None else None


def make(name: str, measured: dict[str, Any], cpu_model: str | None) -> dict[str, Any]:
    """The profile ``calibrate`` writes: the name and host facts first, then the measurement as measured."""
    default_path(name)  # the name check
    return {
        "name": name,
        "cpu_model": cpu_model,
        "threads": measured.get("threads"),
        "torch_version": measured.get("torch_version"),
        "measured_at": measured.get("measured_at"),
        **measured,
    }
