"""The one place that knows whether CUDA is there.

Streams, events, pinned allocation and memory counters behind one small interface. On CPU the same calls
run: streams are no-ops, events are always complete, "pinned" tensors are ordinary host tensors, and a
copy is a plain (synchronous) copy, so every schedule built on top is exercised without a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


def has_cuda() -> bool:
    return torch.cuda.is_available()


def compute_device() -> torch.device:
    """The device the model computes on: the current CUDA device, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if has_cuda() else torch.device("cpu")


class _NullEvent:
    """An event that is always complete (CPU work is synchronous)."""

    def record(self, stream: object | None = None) -> None:
        return None

    def wait(self, stream: object | None = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class _NullStream:
    """A stream whose work is already done when it is issued."""

    def wait_stream(self, other: object) -> None:
        return None

    def wait_event(self, event: object) -> None:
        return None

    def record_event(self, event: object | None = None) -> _NullEvent:
        return event if isinstance(event, _NullEvent) else _NullEvent()

    def synchronize(self) -> None:
        return None


Stream = "torch.cuda.Stream | _NullStream"
Event = "torch.cuda.Event | _NullEvent"


def new_stream() -> torch.cuda.Stream | _NullStream:
    return torch.cuda.Stream() if has_cuda() else _NullStream()


def current_stream() -> torch.cuda.Stream | _NullStream:
    return torch.cuda.current_stream() if has_cuda() else _NullStream()


def new_event() -> torch.cuda.Event | _NullEvent:
    return torch.cuda.Event() if has_cuda() else _NullEvent()


@contextlib.contextmanager
def on_stream(stream: torch.cuda.Stream | _NullStream) -> Iterator[None]:
    """Issue the enclosed work on ``stream`` (a no-op on CPU)."""
    if isinstance(stream, _NullStream):
        yield
    else:
        with torch.cuda.stream(stream):
            yield


def record_stream(tensor: torch.Tensor, stream: torch.cuda.Stream | _NullStream) -> None:
    """Tell the caching allocator that ``tensor`` is in use on ``stream`` (no-op on CPU)."""
    if not isinstance(stream, _NullStream) and tensor.is_cuda:
        tensor.record_stream(stream)


def empty_host(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, pin: bool = True) -> torch.Tensor:
    """A host tensor, page-locked when CUDA is present and ``pin`` is set."""
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin and has_cuda())


def is_pinned(tensor: torch.Tensor) -> bool:
    return has_cuda() and tensor.is_pinned()


@dataclass(frozen=True)
class MemoryCounters:
    allocated: int
    max_allocated: int


def memory_counters(device: torch.device | None = None) -> MemoryCounters:
    """Device memory counters; zeros on CPU (CPU tests use the runtime's own accounting instead)."""
    if not has_cuda():
        return MemoryCounters(0, 0)
    return MemoryCounters(torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device))


def reset_peak(device: torch.device | None = None) -> None:
    if has_cuda():
        torch.cuda.reset_peak_memory_stats(device)


def synchronize() -> None:
    if has_cuda():
        torch.cuda.synchronize()


def empty_host_strided(
    shape: torch.Size | tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, pin: bool = True
) -> torch.Tensor:
    """A host tensor with the given strides (to mirror a dense, non-contiguous device tensor), pinned as above."""
    return torch.empty_strided(shape, stride, dtype=dtype, device="cpu", pin_memory=pin and has_cuda())
