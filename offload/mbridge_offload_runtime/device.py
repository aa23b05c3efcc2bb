"""The one place that knows whether CUDA is there: streams, events, pinned allocation and memory counters.

With CUDA these are the ``torch.cuda`` objects. On CPU they are ``ordering.CpuStream`` / ``ordering.CpuEvent``,
which keep CUDA's happens-before; inside ``ordering.recording()`` host buffers count as pinned and their copies as
asynchronous, so a missing wait or record fails a CPU test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch

from mbridge_offload_runtime import ordering


def has_cuda() -> bool:
    return torch.cuda.is_available()


def compute_device() -> torch.device:
    """The device the model computes on: the current CUDA device, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if has_cuda() else torch.device("cpu")


class Event(Protocol):
    """``torch.cuda.Event`` or ``ordering.CpuEvent``; streams are ``Any``: each takes only its own kind, and
    ``device`` hands out one kind per process."""

    def record(self, stream: Any = None, /) -> None: ...
    def wait(self, stream: Any = None, /) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool: ...


class Stream(Protocol):
    """``torch.cuda.Stream`` or ``ordering.CpuStream``."""

    def wait_stream(self, stream: Any, /) -> None: ...
    def wait_event(self, event: Any, /) -> None: ...
    def record_event(self, event: Any = None, /) -> Event: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool: ...


def new_stream(name: str = "side") -> Stream:
    """A side stream; ``name`` names a CPU stream in ordering error messages."""
    return torch.cuda.Stream() if has_cuda() else ordering.CpuStream(name)


def current_stream() -> Stream:
    return torch.cuda.current_stream() if has_cuda() else ordering.current_stream()


def new_event() -> Event:
    return torch.cuda.Event() if has_cuda() else ordering.CpuEvent()


@contextlib.contextmanager
def on_stream(stream: Stream) -> Iterator[None]:
    """Issue the enclosed work on ``stream``."""
    if isinstance(stream, ordering.CpuStream):
        with ordering.on_stream(stream):
            yield
    else:
        with torch.cuda.stream(cast(torch.cuda.Stream, stream)):  # not a CpuStream: a CUDA one
            yield


@contextlib.contextmanager
def speculative() -> Iterator[None]:
    """Copies whose owner detects a racing write and redoes them (``ordering.speculative``; a no-op with CUDA)."""
    if has_cuda():
        yield
    else:
        with ordering.speculative():
            yield


def record_stream(tensor: torch.Tensor, stream: Stream) -> None:
    """Tell the caching allocator that ``tensor`` is in use on ``stream`` (booked by the CPU ordering check)."""
    if isinstance(stream, ordering.CpuStream):
        recorder = ordering.active()
        if recorder is not None:
            recorder.record_stream(tensor, stream)
    elif tensor.is_cuda:
        tensor.record_stream(cast(torch.cuda.Stream, stream))


def empty_host(
    shape: torch.Size | tuple[int, ...], dtype: torch.dtype, pin: bool = True, stride: tuple[int, ...] | None = None
) -> torch.Tensor:
    """A host tensor (``stride``: to mirror a dense, non-contiguous device tensor), page-locked when CUDA is present
    and ``pin`` is set; under the CPU ordering check a pinned one is booked as a host buffer."""
    pinned = pin and has_cuda()
    if stride is None:
        tensor = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pinned)
    else:
        tensor = torch.empty_strided(shape, stride, dtype=dtype, device="cpu", pin_memory=pinned)
    if not pin or has_cuda():
        return tensor
    recorder = ordering.active()
    if recorder is not None:
        recorder.register_host(tensor)
    else:
        ordering.mark_host(tensor)  # a recording started later still knows it is a host buffer
    return tensor


def is_pinned(tensor: torch.Tensor) -> bool:
    """Whether copies to/from ``tensor`` may be asynchronous (pinned; under the CPU ordering check, a host buffer)."""
    if has_cuda():
        return tensor.is_pinned()
    recorder = ordering.active()
    return recorder is not None and recorder.is_host(tensor)


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
    """The host waits for all queued device work."""
    if has_cuda():
        torch.cuda.synchronize()
    else:
        ordering.synchronize()
