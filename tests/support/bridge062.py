"""Megatron Bridge 0.6.2 on this CPU machine (Python 3.11), offline — for tests only.

`make bridge-env` installs Bridge 0.6.2 into ``.bridge/0.6.2`` (no dependencies, ``--ignore-requires-python``: it
declares Python >= 3.12 but its source runs on 3.11) and its pure-Python dependencies into ``.bridge/deps-0.6.2``;
megatron-core 0.19.2 (Bridge 0.6.2's release) is in ``.mcore/0.19.2`` (``scripts/setup``).

``activate()`` puts them on ``sys.path`` and installs two LABELLED SHIMS, neither of which changes what Bridge checks:

- SHIM 1: ``typing.override = typing_extensions.override`` (Python 3.12's ``typing.override``, used by Bridge's
  source at import time).
- SHIM 2: the Transformer Engine import stub of ``tests/support/te_stub.py`` with ``__version__`` "2.17.1", the TE
  release Bridge 0.6.2 pins (TE cannot be installed on a CPU machine). megatron-core is imported first, so it keeps
  ``HAVE_TE = False``; Bridge's TE-version checks follow the stubbed version.
- SHIM 3: the stub's ``transformer_engine.pytorch.optimizers.FusedAdam`` has TE 2.17's constructor signature
  (megatron-core's precision-aware-optimizer check reads only the parameter names), so that check judges the
  TE Bridge pins, not the stub.

``hub_cache(dir)`` lays out a Hugging Face hub cache holding only the ``config.json`` files under
``tests/data/hf-configs/<org>/<name>/`` (public model-card facts), for ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MCORE = ROOT / ".mcore" / "0.19.2"
BRIDGE = ROOT / ".bridge" / "0.6.2"
DEPS = ROOT / ".bridge" / "deps-0.6.2"
HF_CONFIGS = ROOT / "tests" / "data" / "hf-configs"
TE_VERSION = "2.17.1"  # the Transformer Engine release Bridge 0.6.2 pins (its release branch's uv.lock)
# A fixed snapshot name: the cache's layout only needs one, and a fixed one keeps generated files reproducible.
_SNAPSHOT = "0" * 40


def available() -> bool:
    """Whether Bridge 0.6.2, its dependencies and megatron-core 0.19.2 are installed here (`make bridge-env`)."""
    return (MCORE / "megatron" / "core").is_dir() and (BRIDGE / "megatron" / "bridge").is_dir() and DEPS.is_dir()


def search_path() -> list[str]:
    """The import roots, in order: megatron-core 0.19.2 first (before the venv's 0.16.1), Bridge, its dependencies.

    The dependency folder goes last so that the venv's own packages (torch, pydantic, numpy) win over the copies
    pip put there."""
    return [str(MCORE), str(BRIDGE), str(DEPS)]


def hub_cache(directory: Path) -> Path:
    """A Hugging Face hub cache at ``directory`` serving the shipped ``config.json`` files; returns it."""
    for config in sorted(HF_CONFIGS.glob("*/*/config.json")):
        org, name = config.parent.parent.name, config.parent.name
        repo = directory / f"models--{org}--{name}"
        snapshot = repo / "snapshots" / _SNAPSHOT
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / "config.json").write_bytes(config.read_bytes())
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(_SNAPSHOT)
    return directory


def offline_env(cache: Path) -> dict[str, str]:
    """Environment variables for an offline hub served from ``cache``, with any network access failing at once."""
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_CACHE": str(cache),
        "HF_HOME": str(cache.parent / "hf-home"),
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "HTTP_PROXY": "http://127.0.0.1:9",
        "NO_PROXY": "",
    }


class _FusedAdam:
    """SHIM 3: Transformer Engine 2.17's ``FusedAdam`` constructor signature (parameter names only; no optimizer)."""

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        amsgrad=False,
        *,
        adam_w_mode=True,
        capturable=False,
        master_weights=False,
        master_weight_dtype=None,
        exp_avg_dtype=None,
        exp_avg_sq_dtype=None,
        use_decoupled_grad=False,
        store_param_remainders=False,
    ):
        raise RuntimeError("SHIM 3: a signature for megatron-core's check, not an optimizer")


def activate() -> None:
    """Make ``import megatron.bridge`` work here: the paths and the two labelled shims (see the module docstring)."""
    import typing

    import typing_extensions

    for i, path in enumerate(search_path()[:2]):
        if path not in sys.path:
            sys.path.insert(i, path)
    if str(DEPS) not in sys.path:
        sys.path.append(str(DEPS))
    if not hasattr(typing, "override"):
        typing.override = typing_extensions.override  # type: ignore[attr-defined]  # SHIM 1
    from tests.support import te_stub

    te_stub.install(TE_VERSION)  # SHIM 2 (imports megatron.core first)
    import transformer_engine.pytorch.optimizers as te_optimizers

    te_optimizers.FusedAdam = _FusedAdam  # SHIM 3
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
