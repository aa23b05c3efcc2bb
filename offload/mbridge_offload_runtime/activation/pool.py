"""Host buffers for offloaded activations, and the optional persistent device buffers for reload."""

from __future__ import annotations

from collections import defaultdict

import torch

from mbridge_offload_runtime import device

_Key = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]
_Spec = tuple[torch.Size, tuple[int, ...], torch.dtype]


class HostBufferPool:
    """Host buffers keyed by ``(shape, stride, dtype)`` (strides kept, so dense permuted layouts survive).

    With ``retain`` (``retain_pinned_cpu_buffers``) buffers come back after backward and are reused next
    iteration: stable addresses (what CUDA-graph capture needs), no page-locked allocation in steady state; each
    ``(layer, slot)`` must then keep its shape, as in Transformer Engine.
    """

    def __init__(self, retain: bool = False, pin: bool = True) -> None:
        self.retain = retain
        self.pin = pin
        self._free: dict[_Key, list[torch.Tensor]] = defaultdict(list)
        self._layout: dict[tuple[int, int], _Key] = {}

    def acquire(
        self, layer: int, slot: int, shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[torch.Tensor, bool]:
        """``(buffer, newly_allocated)`` for copy ``slot`` of ``layer``."""
        key = (tuple(shape), tuple(stride), dtype)
        if self.retain:
            self._check_layout(layer, slot, key)
        free = self._free.get(key)
        if free:
            return free.pop(), False
        return device.empty_host(shape, dtype, pin=self.pin, stride=stride), True

    def give_back(self, buffers: list[torch.Tensor]) -> None:
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
    """``double_buffering``: offloaded layer ``i`` reloads into persistent device set ``i % 2`` when it is free and
    of the same shapes, else into fresh memory (a miss). A set is busy from its reload until its layer's backward
    is over, so with more than two reloaded layers alive at once (``min(k, L − k) > 2``) some reloads miss.
    """

    def __init__(self, compute_device: torch.device) -> None:
        self._device = compute_device
        self._sets: list[list[torch.Tensor] | None] = [None, None]
        self._busy: list[bool] = [False, False]

    def take(self, layer: int, specs: list[_Spec]) -> list[torch.Tensor] | None:
        """The buffer set for ``layer``, marked busy, or ``None`` (allocate fresh)."""
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
