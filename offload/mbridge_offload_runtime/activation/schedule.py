"""The layer schedule of activation offloading (Transformer Engine v2's default synchronizer), the per-layer state
machine, and what one pass reports; bookkeeping only. With ``L`` layers of which ``k`` are offloaded, layer ``i < k``:

* starts its device→host copy as its tensors are saved (forward of layer ``i``);
* has its device memory released when layer ``L − k + i`` starts forward;
* starts its host→device reload when the gradient reaches layer ``L − 1 − k + i`` (before that layer's backward).

So at most ``L − k`` layers' offloadable activations are on the device at any time.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field

from mbridge_offload_runtime.upstream import TE_MIN_OFFLOAD_NUMEL

# Why TE's: the planner counts what TE's v2 offload would move, and this runtime reproduces it; the runtime does not
# know the job's TE release, so it takes the one Megatron Bridge 0.6.2 pins (2.17). Per release, and per path, see
# mbridge_offload_runtime.upstream.TE_OFFLOAD_THRESHOLDS (2.10 and 2.11 had no floor; callers pass min_tensor_size).
DEFAULT_MIN_TENSOR_SIZE = TE_MIN_OFFLOAD_NUMEL
"""Elements; TE 2.12-2.18's v2 threshold (about 1 MB in fp32). Smaller saved tensors stay on the device."""


class LayerPhase(enum.Enum):
    """Where one offloaded layer is in its round trip (TE v2's ``OffloadableLayerState`` plus ``reloaded``)."""

    NOT_OFFLOADED = "not_offloaded"
    OFFLOAD_STARTED = "offload_started"
    RELEASED = "released"
    RELOAD_STARTED = "reload_started"
    RELOADED = "reloaded"


# Legal transitions; anything else is a bug in the schedule and raises.
_TRANSITIONS: dict[LayerPhase, tuple[LayerPhase, ...]] = {
    LayerPhase.NOT_OFFLOADED: (LayerPhase.OFFLOAD_STARTED,),
    LayerPhase.OFFLOAD_STARTED: (LayerPhase.RELEASED,),
    LayerPhase.RELEASED: (LayerPhase.RELOAD_STARTED,),
    LayerPhase.RELOAD_STARTED: (LayerPhase.RELOADED, LayerPhase.RELEASED),
    # After the layer's backward the device copies go; the host copies stay for a retained graph.
    LayerPhase.RELOADED: (LayerPhase.RELEASED,),
}


def check_transition(layer: int, old: LayerPhase, new: LayerPhase) -> None:
    """Raise ``RuntimeError`` unless ``old → new`` is a legal step of the state machine."""
    if new not in _TRANSITIONS[old]:
        allowed = ", ".join(p.value for p in _TRANSITIONS[old]) or "none"
        raise RuntimeError(
            f"activation offload: layer {layer} cannot go from {old.value} to {new.value} (allowed: {allowed})"
        )


@dataclass(frozen=True)
class Schedule:
    """When each of the first ``num_layers`` (``k``) of ``model_layers`` (``L``) is released and reloaded."""

    model_layers: int
    num_layers: int
    manual: bool = False  # TE's manual_synchronization: every layer is tracked, the caller starts each step

    def is_offloaded(self, layer: int) -> bool:
        return self.manual or layer < self.num_layers

    def release_at(self, layer: int) -> int:
        """Forward layer at whose start ``layer``'s device copy is dropped."""
        return self.model_layers - self.num_layers + layer

    def reload_at(self, layer: int) -> int:
        """Backward layer at whose start ``layer``'s reload is issued."""
        return self.model_layers - 1 - self.num_layers + layer

    def releases_when_entering(self, layer: int) -> list[int]:
        return self._due(layer - self.release_at(0))

    def reloads_when_backward_reaches(self, layer: int) -> list[int]:
        return self._due(layer - self.reload_at(0))

    def _due(self, offloaded: int) -> list[int]:
        return [offloaded] if not self.manual and 0 <= offloaded < self.num_layers else []


@dataclass(frozen=True)
class ScheduleEvent:
    """One point of the schedule as it happened: ``action`` on ``layer`` while ``phase`` was at layer ``at``."""

    phase: str  # "fwd" or "bwd"
    action: str  # "offload_start", "release", "reload_start", "reload_late", "free"
    layer: int
    at: int


@dataclass
class OffloadStats:
    """What one pass (one forward and its backward) did."""

    bytes_offloaded: int = 0  # device→host, each base tensor once per layer
    bytes_reloaded: int = 0
    tensors_offloaded: int = 0  # saved tensors answered from a host copy (duplicates and views included)
    copies_offloaded: int = 0  # after de-duplication and view folding
    tensors_deduplicated: int = 0  # saved tensors that shared an earlier copy (same tensor, or a view of its base)
    tensors_resident: int = 0  # eligible tensors saved in layers that are not offloaded
    skipped: Counter[str] = field(default_factory=Counter)  # ineligible saved tensors by reason (``Eligibility``)
    peak_resident_bytes: int = 0  # the most offloadable bytes on the device at once
    peak_resident_layers: int = 0  # the most layers with offloadable bytes on the device at once
    host_buffers_allocated: int = 0  # 0 once a retained pool is warm
    double_buffer_hits: int = 0  # reloads into a persistent buffer set
    double_buffer_misses: int = 0  # reloads into fresh memory
    events: list[ScheduleEvent] = field(default_factory=list)  # the schedule points, in order

    def points(self, action: str) -> dict[int, int]:
        """``{layer: at}`` for every event of ``action`` (e.g. ``"release"``)."""
        return {e.layer: e.at for e in self.events if e.action == action}


class Residency:
    """Running count of offloadable bytes on the device, per layer, with the peaks."""

    def __init__(self, stats: OffloadStats) -> None:
        self._stats = stats
        self._bytes: dict[int, int] = {}
        self._total = 0

    def add(self, layer: int, nbytes: int) -> None:
        self._bytes[layer] = self._bytes.get(layer, 0) + nbytes
        self._total += nbytes
        stats = self._stats
        if self._total > stats.peak_resident_bytes:
            stats.peak_resident_bytes = self._total
        if len(self._bytes) > stats.peak_resident_layers:
            stats.peak_resident_layers = len(self._bytes)

    def drop(self, layer: int) -> None:
        self._total -= self._bytes.pop(layer, 0)

    def layers(self) -> list[int]:
        return sorted(self._bytes)
