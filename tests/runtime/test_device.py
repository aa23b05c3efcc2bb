"""The device layer's waits and syncs, each one seen by a test (the mutation check removes them one by one).

On CPU, ``device`` hands out ``ordering`` streams and events, and the host-side syncs are checked by running a
side-stream copy into a host buffer inside ``ordering.recording()``: the host may read the buffer only after a sync
that tells it the copy is done. The CUDA branches (``torch.cuda.synchronize``, ``Tensor.record_stream``) cannot run
here; they are checked as calls: CUDA is faked as present and the call must reach the CUDA function.
"""

from __future__ import annotations

import pytest
import torch

from mbridge_offload_runtime import device, ordering
from mbridge_offload_runtime.ordering import CpuEvent, CpuStream, OrderingError, recording


def _side_copy_into_host() -> tuple[torch.Tensor, CpuStream, torch.Tensor]:
    """A D2H copy issued on a side stream into a fresh host buffer; the host has not waited for it.

    Returns the host buffer, the side stream and the source (kept alive: freeing it early is another error)."""
    side = CpuStream("d2h")
    host = device.empty_host((16,), torch.float32)
    x = torch.randn(16) * 2
    side.wait_stream(device.current_stream())
    with device.on_stream(side):
        host.copy_(x, non_blocking=True)
    return host, side, x


def test_device_synchronize_lets_the_host_read_what_a_side_stream_copied() -> None:
    with recording() as rec:
        host, _side, _x = _side_copy_into_host()
        device.synchronize()
        host.sum()
    assert rec.violations == []


def test_without_a_sync_the_host_read_of_a_side_stream_copy_fails() -> None:
    with recording(), pytest.raises(OrderingError, match="on host reads host buffer"):
        host, _side, _x = _side_copy_into_host()
        host.sum()


@pytest.mark.parametrize("how", ["stream.query", "event.query", "event.synchronize", "stream.synchronize"])
def test_query_and_synchronize_tell_the_host_the_work_is_done(how: str) -> None:
    with recording() as rec:
        host, side, _x = _side_copy_into_host()
        event = side.record_event()
        {
            "stream.query": side.query,
            "event.query": event.query,
            "event.synchronize": event.synchronize,
            "stream.synchronize": side.synchronize,
        }[how]()
        host.sum()
    assert rec.violations == []


def test_event_wait_orders_the_waiting_stream_after_the_recorded_work() -> None:
    with recording() as rec:
        side = CpuStream("h2d")
        host = device.empty_host((16,), torch.float32)
        host.fill_(1.0)
        dst = torch.empty(16)
        side.wait_stream(device.current_stream())
        with device.on_stream(side):
            dst.copy_(host, non_blocking=True)
        event = CpuEvent()
        event.record(side)
        event.wait(device.current_stream())
        dst * 2
    assert rec.violations == []


def test_synchronize_on_cuda_calls_cuda_synchronize(monkeypatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(device, "has_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("cuda"))
    monkeypatch.setattr(ordering, "synchronize", lambda: calls.append("cpu"))
    device.synchronize()
    assert calls == ["cuda"]


class _CudaTensorDouble:
    """Stands in for a CUDA tensor (none exists on this machine): only what ``device.record_stream`` touches."""

    is_cuda = True

    def __init__(self) -> None:
        self.streams: list[object] = []

    def record_stream(self, stream: object) -> None:
        self.streams.append(stream)


def test_record_stream_on_cuda_reaches_the_tensor() -> None:
    tensor, stream = _CudaTensorDouble(), object()
    device.record_stream(tensor, stream)  # type: ignore[arg-type]
    assert tensor.streams == [stream]


def test_record_stream_on_cpu_is_booked_by_the_recorder() -> None:
    with recording() as rec:
        side = CpuStream("d2h")
        x = torch.randn(8) * 2
        device.record_stream(x, side)
        assert side.id in rec._access(x).recorded
