"""Ordering as a contract: the CPU model of streams and events, and the runtime's copies checked against it.

Part 1 shows the checker fails on each kind of hazard (and passes the correct schedule). Parts 2 and 3 run the
activation offload and ``HybridDeviceOptimizer`` inside ``ordering.recording()``: every saved-tensor reload,
host-buffer read, overwrite and free must be ordered after the copy it depends on. ``test_mutation.py`` removes
each wait/record of the runtime in turn and requires one of these tests to fail.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mbridge_offload_runtime import device
from mbridge_offload_runtime.activation.context import get_cpu_offload_context
from mbridge_offload_runtime.activation.layers import offload_layers
from mbridge_offload_runtime.ordering import CpuEvent, CpuStream, OrderingError, recording

pytestmark = pytest.mark.ordering


# ---------------------------------------------------------------------------------------------------------
# 1. the checker
# ---------------------------------------------------------------------------------------------------------
def _d2h(src: torch.Tensor, side: CpuStream, wait_ready: bool = True) -> tuple[torch.Tensor, CpuEvent]:
    """An offload copy of ``src`` on ``side``; returns the host buffer and the event after the copy."""
    host = device.empty_host(src.shape, src.dtype)
    if wait_ready:
        side.wait_stream(device.current_stream())
    with device.on_stream(side):
        host.copy_(src, non_blocking=device.is_pinned(host))
    return host, side.record_event()


def test_the_correct_round_trip_passes_and_is_booked() -> None:
    with recording() as rec:
        side = CpuStream("d2h")
        x = torch.randn(64) * 2
        host, done = _d2h(x, side)
        done.synchronize()
        assert host.sum().item() == pytest.approx(x.sum().item())
        back = torch.empty(64)
        side.wait_stream(device.current_stream())
        with device.on_stream(side):
            back.copy_(host, non_blocking=True)
        device.current_stream().wait_event(side.record_event())
        assert torch.equal(back * 1, x)
    assert rec.operations > 5 and rec.violations == []


def test_side_stream_reading_before_the_producer_is_waited_fails() -> None:
    with recording(), pytest.raises(OrderingError, match="reads device buffer"):
        x = torch.randn(64) * 2  # produced on the compute stream
        _d2h(x, CpuStream("d2h"), wait_ready=False)


def test_host_reading_a_d2h_buffer_before_its_event_fails() -> None:
    with recording(), pytest.raises(OrderingError, match="on host reads host buffer"):
        x = torch.randn(64) * 2
        host, _ = _d2h(x, CpuStream("d2h"))
        host.sum()


def test_compute_reading_a_reload_before_waiting_on_its_event_fails() -> None:
    with recording(), pytest.raises(OrderingError, match="on compute reads device buffer"):
        side = CpuStream("h2d")
        x = torch.randn(64) * 2
        host, done = _d2h(x, side)
        done.synchronize()
        dst = torch.empty(64)
        side.wait_stream(device.current_stream())
        with device.on_stream(side):
            dst.copy_(host, non_blocking=True)
        dst * 2  # no wait on the H2D copy's event


def test_overwriting_a_buffer_another_stream_still_reads_fails() -> None:
    with recording(), pytest.raises(OrderingError, match="overwrites"):
        side = CpuStream("h2d")
        host = device.empty_host((64,), torch.float32)
        dst = torch.empty(64)
        side.wait_stream(device.current_stream())
        with device.on_stream(side):
            dst.copy_(host, non_blocking=True)
        host.fill_(1.0)  # the host writes while the H2D copy may still read


def test_waiting_on_an_event_never_recorded_orders_nothing() -> None:
    with recording(), pytest.raises(OrderingError):
        side = CpuStream("d2h")
        x = torch.randn(64) * 2
        host, _ = _d2h(x, side)
        CpuEvent().synchronize()
        host.sum()


@pytest.mark.parametrize("record", [True, False], ids=["record_stream", "no_record_stream"])
def test_freeing_a_buffer_a_side_stream_still_copies_fails_unless_recorded(record: bool) -> None:
    def run() -> None:
        with recording():
            side = CpuStream("d2h")
            x = torch.randn(64) * 2
            _host, _ = _d2h(x, side)
            if record:
                device.record_stream(x, side)
            del x  # the allocator may hand the memory to the next kernel on the compute stream
            torch.zeros(1) + 1

    if record:
        run()
    else:
        with pytest.raises(OrderingError, match="freed on compute while work on d2h"):
            run()


def test_blocking_copy_and_item_synchronise_the_host() -> None:
    with recording() as rec:
        side = CpuStream("d2h")
        host = device.empty_host((64,), torch.float32)
        side.wait_stream(device.current_stream())
        with device.on_stream(side):
            host.copy_(torch.ones(64), non_blocking=False)
        host.sum()
        with device.on_stream(side):
            y = torch.ones(4) * 3
            y.sum().item()  # the host waits for the side stream, and later compute work is issued after that
        y * 2
    assert rec.violations == []


def test_recording_refuses_to_run_with_cuda(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="cannot run with CUDA"), recording():
        pass


# ---------------------------------------------------------------------------------------------------------
# 2. activation offload
# ---------------------------------------------------------------------------------------------------------
class Layer(nn.Module):
    """Saves several tensors above the threshold; with ``side`` it also saves one autograd never unpacks."""

    def __init__(self, d: int = 16, side: bool = False) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(d, 2 * d) / d**0.5)
        self.w2 = nn.Parameter(torch.randn(2 * d, d) / d**0.5)
        self.side = side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.w1)
        out = x + (h * h) @ self.w2
        if self.side:
            # A saved tensor on a branch outside the loss: it is reloaded, but backward never unpacks it.
            ignored = torch.sigmoid(h * 2)
            return out + 0 * ignored.detach()[..., : x.shape[-1]]
        return out


def _layers(n: int = 4, side: bool = False, seed: int = 0) -> nn.ModuleList:
    torch.manual_seed(seed)
    return nn.ModuleList(Layer(side=side) for _ in range(n))


def _grads(layers: nn.ModuleList, steps: int = 2, microbatches: int = 1) -> list[torch.Tensor]:
    for p in layers.parameters():
        p.grad = None
    for step in range(steps):
        losses = []
        for mb in range(microbatches):
            x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(10 * step + mb), requires_grad=True)
            for layer in layers:
                x = layer(x)
            losses.append(x.pow(2).mean())
        sum(losses).backward()
    return [p.grad.clone() for p in layers.parameters()]


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize(
    "options",
    [{}, {"double_buffering": True}, {"retain_pinned_cpu_buffers": True}],
    ids=["plain", "double_buffering", "retain"],
)
def test_activation_offload_is_ordered_and_exact(k: int, options: dict) -> None:
    reference = _grads(_layers())
    layers = _layers()
    warns = pytest.warns(UserWarning) if k == 3 else _nothing()
    with warns, offload_layers(layers, k, min_tensor_size=64, **options), recording() as rec:
        grads = _grads(layers)
    assert rec.operations > 100
    assert all(torch.equal(a, b) for a, b in zip(grads, reference, strict=True))


def test_activation_gradient_accumulation_is_ordered() -> None:
    reference = _grads(_layers(), microbatches=3)
    layers = _layers()
    with offload_layers(layers, 2, min_tensor_size=64) as handle, recording():
        grads = _grads(layers, microbatches=3)
    assert handle.stats.bytes_offloaded > 0
    assert all(torch.equal(a, b) for a, b in zip(grads, reference, strict=True))


def test_a_reload_backward_never_unpacks_is_kept_for_its_stream() -> None:
    """The H2D copy of a tensor nobody waits for must be ``record_stream``-ed before its memory is freed."""
    layers = _layers(side=True)
    with offload_layers(layers, 2, min_tensor_size=64) as handle, recording():
        _grads(layers, steps=1)
    assert handle.stats.bytes_reloaded > 0


def test_second_backward_reloads_late_in_order() -> None:
    layers = _layers()
    context, sync = get_cpu_offload_context(True, 2, 4, min_tensor_size=64)
    with recording():
        x = torch.randn(2, 8, 16, requires_grad=True)
        for layer in layers:
            with context:
                x = layer(x)
            x = sync(x)
        loss = x.pow(2).mean()
        first = torch.autograd.grad(loss, list(layers.parameters()), retain_graph=True)
        second = torch.autograd.grad(loss, list(layers.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# ---------------------------------------------------------------------------------------------------------
# 3. HybridDeviceOptimizer
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(params=[1, None], ids=["per_tensor_copies", "batched_copies"])
def copy_path(request, monkeypatch) -> None:
    """Both copy paths of the buckets: one copy per member (and a backward hook each, with overlap), and the
    default, where the toy's small members move in runs through a device staging buffer."""
    from mbridge_offload_runtime.optimizer import buckets

    if request.param is not None:
        monkeypatch.setattr(buckets, "SMALL_COPY_NUMEL", request.param)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 3, skip_last: bool = False) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(6, 8, generator=gen)).pow(2).mean()
        loss.backward()
        if skip_last:
            model[-1].weight.grad = None
        opt.step()


@pytest.mark.usefixtures("copy_path")
@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
def test_hdo_step_is_ordered_and_matches_adamw(fraction: float, overlap: bool) -> None:
    from mbridge_offload_runtime.optimizer.hybrid import HybridDeviceOptimizer

    reference = _model()
    _train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2))
    model = _model()
    with recording() as rec:
        opt = HybridDeviceOptimizer(
            model.parameters(), offload_fraction=fraction, overlap_cpu_optimizer_d2h_h2d=overlap, lr=1e-2
        )
        _train(model, opt)
        # The next forward reads the weights the H2D copies wrote, on the compute stream.
        out = model(torch.ones(1, 8)).sum().item()
        state = [v.clone() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    assert rec.violations == [] and state
    assert out == pytest.approx(reference(torch.ones(1, 8)).sum().item(), rel=1e-5, abs=1e-6)


@pytest.mark.usefixtures("copy_path")
def test_hdo_dummy_step_and_refresh_are_ordered() -> None:
    from mbridge_offload_runtime.optimizer.hybrid import HybridDeviceOptimizer

    model = _model()
    with recording():
        opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=1.0, lr=1e-2)
        opt.dummy_step()
        states = [v.sum() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        _train(model, opt, steps=2)
    assert states


@pytest.mark.usefixtures("copy_path")
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
def test_hdo_grad_dropped_between_backward_and_step_is_zeroed_in_order(overlap: bool) -> None:
    """A member whose grad is set to None after backward is skipped: its host gradient slot is rewritten only
    after any copy into it (e.g. one started by a backward hook) is ordered before the host's write."""
    from mbridge_offload_runtime.optimizer.hybrid import HybridDeviceOptimizer

    model = _model()
    with recording():
        opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=1.0, overlap_cpu_optimizer_d2h_h2d=overlap,
                                    lr=1e-2)  # fmt: skip
        before = model[-1].weight.detach().clone()
        _train(model, opt, steps=2, skip_last=True)
        assert torch.equal(model[-1].weight, before)  # skipped, as torch skips a param without grad


@pytest.mark.usefixtures("copy_path")
def test_bucket_step_waits_for_its_previous_h2d_copy() -> None:
    """A bucket steps again only after its last H2D copy (which reads the host master) is done."""
    from mbridge_offload_runtime.optimizer.hybrid import HybridDeviceOptimizer

    model = _model()
    with recording():
        opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=1.0, lr=1e-2)
        _train(model, opt, steps=1)
        bucket = opt._buckets[0]
        d2h, h2d = CpuStream("d2h-only"), CpuStream("h2d-only")
        for _ in range(2):  # no compute-stream round trip in between: only the bucket's own events order it
            d2h.wait_stream(device.current_stream())  # the gradients were written on the compute stream
            with device.on_stream(d2h):
                missing = bucket.copy_grads_in([p.grad for p in bucket.members], d2h)
            with torch.no_grad():
                bucket.step_and_copy_back(missing, h2d)


@pytest.mark.usefixtures("copy_path")
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
def test_hdo_grads_changed_in_place_after_backward_are_copied_after_the_change(overlap: bool) -> None:
    """Clipping-like in-place writes on the compute stream between backward and step: the copy the step makes
    (or re-makes) of each gradient must be ordered after them, and the result matches AdamW on the same grads."""
    from mbridge_offload_runtime.optimizer.hybrid import HybridDeviceOptimizer

    def train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        gen = torch.Generator().manual_seed(3)
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(6, 8, generator=gen)).pow(2).mean().backward()
            for p in model.parameters():
                p.grad.mul_(0.5)
            opt.step()

    reference = _model()
    train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2))
    model = _model()
    with recording():
        opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=1.0, overlap_cpu_optimizer_d2h_h2d=overlap,
                                    lr=1e-2)  # fmt: skip
        train(model, opt)
        got = [p.detach().clone() for p in model.parameters()]
    for a, b in zip(got, reference.parameters(), strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)


def test_a_speculative_copy_may_race_with_a_later_write_but_not_with_an_earlier_one() -> None:
    with recording() as rec:
        side = CpuStream("d2h")
        grad = torch.randn(64) * 2
        host = device.empty_host((64,), torch.float32)
        side.wait_stream(device.current_stream())
        with device.on_stream(side), device.speculative():
            host.copy_(grad, non_blocking=True)
        grad.mul_(0.5)  # the owner sees the version change and copies again
        side.wait_stream(device.current_stream())
        with device.on_stream(side):
            host.copy_(grad, non_blocking=True)
        side.synchronize()
        host.sum()
    assert rec.violations == []
    with recording(), pytest.raises(OrderingError, match="reads device buffer"):
        side = CpuStream("d2h")
        grad = torch.randn(64) * 2
        host = device.empty_host((64,), torch.float32)
        with device.on_stream(side), device.speculative():
            host.copy_(grad, non_blocking=True)  # not ordered after the kernel that wrote grad
