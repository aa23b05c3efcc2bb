"""Where the measured CPU AdamW throughput is stored, and reading it back for the time model.

``mbridge-offload calibrate`` measures (``mbridge_offload.runtime.adam_throughput``) and saves here; the time model
(``mbridge_offload.plan.timing``) reads the file when present, else uses the default figure documented there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ENV_VAR = "MBRIDGE_OFFLOAD_CALIBRATION"


def calibration_path(path: str | os.PathLike[str] | None = None) -> Path:
    """``path``, else ``$MBRIDGE_OFFLOAD_CALIBRATION``, else ``~/.cache/mbridge-offload/calibration.json``."""
    if path:
        return Path(path).expanduser()
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    return Path("~/.cache/mbridge-offload/calibration.json").expanduser()


def save(result: dict[str, Any], path: str | os.PathLike[str] | None = None) -> Path:
    """Write the calibration atomically; returns the path."""
    target = calibration_path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(target)
    return target


def load(path: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """The stored calibration, or None when there is none (or it is unreadable)."""
    target = calibration_path(path)
    try:
        data = json.loads(target.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("cpu_adam_params_per_s_per_core") else None
