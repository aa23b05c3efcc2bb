"""Upstream facts that the runtime and the planner both need, each stated once, with where upstream states it.

Plain Python (no torch, no project imports), inside the runtime package so that the runtime needs nothing from the
agent side; the planner (``mbridge_offload.plan``) imports it too, so its model and our runtime cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class TeOffloadThreshold(NamedTuple):
    """Which saved tensors one range of Transformer Engine releases offloads by size, on one offload code path.

    A tensor is offloaded only if ``numel >= min_numel`` (TE 2.12+ v2: ``if t.numel() < 256 * 1024: return False``);
    ``min_numel == 0`` means that release's path has no size check at all (``line`` then names what decides).
    ``line`` is the exact source line (whitespace aside) inside ``function`` of ``file`` (under
    ``transformer_engine/pytorch/``) at every release tag from ``first`` to ``last``; ``numel_check`` says whether
    that function compares ``numel()`` at all, so a test reading TE's source can confirm both directions.
    """

    path: str  # "v1" (TE < 2.10, or NVTE_CPU_OFFLOAD_V1=1 from 2.10) or "v2" (the 2.10+ default)
    first: tuple[int, int]
    last: tuple[int, int]
    file: str
    function: str
    min_numel: int
    line: str
    numel_check: bool


# Read from TransformerEngine's release tags v1.3 (the first with cpu_offload.py) to v2.18, every tag in between.
# The v1 path offloads what the modules mark (``activation_offloading``), whatever its size. The v2 path (2.10+)
# offloaded every eligible tensor in 2.10 and 2.11; the 256 Ki-element floor came with TE PR #2535 (v2.12).
# Two development-branch values never reached a release tag: ``MIN_TENSOR_SIZE_TO_OFFLOAD = 1000`` (commit
# ba3a4e4b3, 2025-05) and ``DEFAULT_MIN_TENSOR_SIZE_TO_OFFLOAD = 2**20`` (removed by 6f99c577c, 2025-09).
TE_OFFLOAD_THRESHOLDS: tuple[TeOffloadThreshold, ...] = (
    TeOffloadThreshold(
        "v1", (1, 3), (2, 9), "cpu_offload.py", "tensor_need_offloading_checker_activations", 0,
        'return hasattr(tensor, "activation_offloading")', False,
    ),
    TeOffloadThreshold(
        "v1", (2, 10), (2, 18), "cpu_offload_v1.py", "tensor_need_offloading_checker_activations", 0,
        'return hasattr(tensor, "activation_offloading")', False,
    ),
    TeOffloadThreshold(
        "v2", (2, 10), (2, 11), "cpu_offload.py", "_check_if_offload", 0,
        't.device.type == "cuda"', False,
    ),
    TeOffloadThreshold(
        "v2", (2, 12), (2, 18), "cpu_offload.py", "_check_if_offload", 256 * 1024,
        "if t.numel() < 256 * 1024:", True,
    ),
)  # fmt: skip


def _major_minor(te_version: str) -> tuple[int, int]:
    parts = te_version.strip().lstrip("v").split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise ValueError(f"te_version {te_version!r} is not X.Y or X.Y.Z") from None


def te_offload_threshold(te_version: str, v1: bool = False) -> TeOffloadThreshold:
    """The ``TE_OFFLOAD_THRESHOLDS`` row of Transformer Engine ``te_version`` (``X.Y`` or ``X.Y.Z``), on the path
    the job takes (``v1``: ``NVTE_CPU_OFFLOAD_V1=1``, which matters from 2.10). Releases after the last one read
    take the newest row on their path: an assumption until the table is extended. ``ValueError`` for a bad
    version or one older than 1.3 (no ``cpu_offload.py``).
    """
    version = _major_minor(te_version)
    path = "v1" if v1 or version < (2, 10) else "v2"
    rows = [r for r in TE_OFFLOAD_THRESHOLDS if r.path == path]
    if version < rows[0].first:
        raise ValueError(f"Transformer Engine {te_version} has no CPU offload (it came with 1.3)")
    return next((r for r in rows if r.first <= version <= r.last), rows[-1])


def te_min_offload_numel(te_version: str, v1: bool = False) -> int:
    """Smallest element count ``te_version`` offloads (a tensor goes when ``numel >= this``); 0: no size check."""
    return te_offload_threshold(te_version, v1).min_numel


# The release Megatron Bridge 0.6.2 pins (the config side's TE_VERSION_ASSUMED; a test holds the two together), v2
# path: what the runtime's default and the planner use when nobody names another release.
TE_MIN_OFFLOAD_NUMEL = te_min_offload_numel("2.17")


def hdo_offload_mask(numels: Sequence[int], offload_fraction: float) -> list[bool]:
    """Which tensors ``HybridDeviceOptimizer`` puts on the host: a greedy prefix over whole tensors.

    In param_groups order, each tensor is offloaded while the offloaded element count is still below
    ``offload_fraction × sum(numels)``; the one that crosses goes whole (0.0 offloads nothing, 1.0 everything).
    Source: megatron-core 0.16.1 and 0.19.2, ``cpu_offloading/hybrid_optimizer.py``,
    ``_get_sub_optimizer_param_groups``.
    """
    threshold = offload_fraction * sum(numels)
    offloaded, mask = 0, []
    for n in numels:
        take = offloaded < threshold
        offloaded += n if take else 0
        mask.append(take)
    return mask
