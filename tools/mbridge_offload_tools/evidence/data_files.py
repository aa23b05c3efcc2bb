"""The published figures' data files (``evidence/data/*.yaml``), read once each."""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any


@cache
def load(name: str) -> dict[str, Any]:
    """``data/<name>.yaml``, parsed (safe YAML)."""
    from ruamel.yaml import YAML

    text = resources.files("mbridge_offload_tools.evidence").joinpath(f"data/{name}.yaml").read_text()
    return YAML(typ="safe").load(text)
