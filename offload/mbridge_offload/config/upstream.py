"""The upstream facts under their old config-room name (``mbridge_offload.upstream`` holds them now)."""

from __future__ import annotations

# Kept while plan/memory.py still imports from here; new code imports mbridge_offload.upstream.
from mbridge_offload.upstream import TE_MIN_OFFLOAD_NUMEL, hdo_offload_mask

__all__ = ["TE_MIN_OFFLOAD_NUMEL", "hdo_offload_mask"]
