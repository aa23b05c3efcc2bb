"""Host buffers for offloaded activations, and the optional persistent device buffers for reload.

``HostBufferPool`` hands out (pinned, where CUDA is present) host tensors keyed by ``(shape, dtype)``. With
``retain=True`` the buffers come back to the pool after backward and are reused next iteration, so their
addresses stay stable (what CUDA-graph capture needs) and no page-locked allocation happens in steady state;
each ``(layer, slot)`` must then see the same shape every iteration, as in Transformer Engine.

``ReloadBuffers`` is ``double_buffering``: two persistent device buffer sets, used by alternate offloaded
layers for their reload, so backward does not allocate per layer.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from mbridge_offload_runtime import device

_Key = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]
_Spec = tuple[torch.Size, tuple[int, ...], torch.dtype]


class HostBufferPool:
    """Host buffers keyed by ``(shape, stride, dtype)`` (strides are kept so dense permuted layouts survive).

    Args:
        retain: keep buffers after backward and reuse them next iteration (``retain_pinned_cpu_buffers``).
        pin: page-lock the buffers where CUDA is present.
    """

    def __init__(self, retain: bool = False, pin: bool = True) -> None:
        self.retain = retain
        self.pin = pin
        self._free: dict[_Key, list[torch.Tensor]] = defaultdict(list)
        self._layout: dict[tuple[int, int], _Key] = {}
        self.allocated = 0

    def acquire(
        self, layer: int, slot: int, shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[torch.Tensor, bool]:
        """A host buffer for copy ``slot`` of ``layer``; returns ``(buffer, newly_allocated)``.

        Raises:
            ValueError: with ``retain``, when this ``(layer, slot)`` had another shape or dtype last iteration.
        """
        key = (tuple(shape), tuple(stride), dtype)
        if self.retain:
            self._check_layout(layer, slot, key)
        free = self._free.get(key)
        if free:
            return free.pop(), False
        self.allocated += 1
        return device.empty_host_strided(shape, stride, dtype, pin=self.pin), True

    def give_back(self, buffers: list[torch.Tensor]) -> None:
        """Return buffers after backward: kept for reuse with ``retain``, else dropped (freed)."""
        if not self.retain:
            return
        for buf in buffers:
            self._free[(tuple(buf.shape), buf.stride(), buf.dtype)].append(buf)

    def free_buffers(self) -> int:
        return sum(len(v) for v in self._free.values())

    def clear(self) -> None:
        self._free.clear()
        self._layout.clear()

    def _check_layout(self, layer: int, slot: int, key: _Key) -> None:
        old = self._layout.setdefault((layer, slot), key)
        if old != key:
            raise ValueError(
                f"CPU buffer shape does not match the offloaded tensor shape: {list(old[0])} ({old[2]}) != "
                f"{list(key[0])} ({key[2]}) for layer {layer}, saved tensor {slot}. Make sure that tensor shapes "
                "do not change between iterations if retain_pinned_cpu_buffers is True (or call "
                "context.reset_buffers() when they must)."
            )


class ReloadBuffers:
    """Two persistent device buffer sets for reloads (``double_buffering``).

    Offloaded layer ``i`` reloads into set ``i % 2`` when that set is free and its shapes match the layer's
    copies; otherwise into fresh memory (a miss). A set is busy from its reload until its layer's backward
    is over, so with more than two reloaded layers alive at once (``min(k, L − k) > 2``) some reloads miss.
    """

    def __init__(self, compute_device: torch.device) -> None:
        self._device = compute_device
        self._sets: list[list[torch.Tensor] | None] = [None, None]
        self._busy: list[bool] = [False, False]

    def take(self, layer: int, specs: list[_Spec]) -> list[torch.Tensor] | None:
        """The buffer set for ``layer`` if usable now, marked busy; ``None`` means allocate fresh."""
        index = layer % 2
        if self._busy[index]:
            return None
        current = self._sets[index]
        if current is None or [(t.shape, t.stride(), t.dtype) for t in current] != list(specs):
            current = [empty_strided(spec, self._device) for spec in specs]
            self._sets[index] = current
        self._busy[index] = True
        return current

    def give_back(self, layer: int) -> None:
        self._busy[layer % 2] = False


def empty_strided(spec: _Spec, on: torch.device) -> torch.Tensor:
    shape, stride, dtype = spec
    return torch.empty_strided(shape, stride, dtype=dtype, device=on)
