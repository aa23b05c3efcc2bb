"""Measure torch's fused CPU AdamW here and store params/s for the time model.

``mbridge-offload calibrate`` runs the CPU optimizer HybridDeviceOptimizer uses (``torch.optim.AdamW(fused=True)``
on fp32 params, the MCore factory's choice) over a few large tensors and records elements updated per second,
per core and in total. The time model (``offload.timing``) reads the file when present, else uses the default
figure documented there. torch is imported only inside ``measure``.
"""

from __future__ import annotations

import json
import os
import time
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


def measure(
    numel: int = 32 * 1024 * 1024, tensors: int = 4, steps: int = 5, threads: int | None = None
) -> dict[str, Any]:
    """Time ``steps`` fused AdamW steps over ``tensors`` fp32 tensors of ``numel`` elements (after one warm-up).

    Returns:
        ``{"cpu_adam_params_per_s", "cpu_adam_params_per_s_per_core", "threads", "numel", "seconds_per_step",
        "torch_version", "fused"}``.
    """
    import torch

    if threads:
        torch.set_num_threads(threads)
    threads_used = torch.get_num_threads()
    params = [torch.nn.Parameter(torch.randn(numel // tensors)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    try:
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
        fused = True
    except (RuntimeError, TypeError):  # torch < 2.4 has no fused CPU AdamW
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, foreach=True)
        fused = False
    opt.step()  # warm-up: allocates exp_avg / exp_avg_sq
    start = time.perf_counter()
    for _ in range(steps):
        opt.step()
    per_step = (time.perf_counter() - start) / steps
    rate = numel / per_step
    return {
        "cpu_adam_params_per_s": rate,
        "cpu_adam_params_per_s_per_core": rate / threads_used,
        "threads": threads_used,
        "numel": numel,
        "seconds_per_step": per_step,
        "torch_version": torch.__version__,
        "fused": fused,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


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
