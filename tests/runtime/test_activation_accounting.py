"""The per-pass accounting, checked against tensors the test tracks itself.

Each toy layer records (nbytes, storage weak reference) of the five bases offloading copies (its input ``x``,
``h``, ``m``, ``r``, ``u``). A probe at the start of each layer's forward records which earlier layers'
storages are still alive, so the release points are observed, not just reported.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

from mbridge_offload_runtime.activation.context import get_cpu_offload_context
from mbridge_offload_runtime.activation.layers import offload_layers
from mbridge_offload_runtime.activation.schedule import Schedule
from tests.runtime.test_activation import MIN_SIZE, B, D, S, make_layers, run

L = 6


@pytest.fixture(autouse=True)
def _quiet_last_layer_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Offloading num_layers == model_layers - 1")
        yield


def alive(layer, skip_input: bool) -> list[bool]:
    refs = layer.tracked[1:] if skip_input else layer.tracked
    return [not ref.expired() for _, ref in refs]


@pytest.mark.parametrize("k", range(L))
def test_offloaded_storages_are_gone_from_the_device_after_release(k: int) -> None:
    layers = make_layers(n=L)
    handle = offload_layers(layers, num_layers=k, min_tensor_size=MIN_SIZE)
    seen: dict[int, dict[int, list[bool]]] = {}

    def probe(at: int) -> None:
        # layer 0's input is the test's own tensor, so it is left out
        seen[at] = {i: alive(layers[i], skip_input=i == 0) for i in range(at)}

    for layer in layers:
        layer.probe = probe
    run(layers, torch.randn(B, S, D, requires_grad=True)).sum().backward()
    schedule = Schedule(L, k)
    for at, layers_alive in seen.items():
        for i, flags in layers_alive.items():
            released = schedule.is_offloaded(i) and schedule.release_at(i) <= at
            assert flags == [not released] * len(flags), (at, i)
    handle.remove()


@pytest.mark.parametrize("k", range(L))
def test_residency_invariant_at_most_l_minus_k_layers(k: int) -> None:
    layers = make_layers(n=L)
    handle = offload_layers(layers, num_layers=k, min_tensor_size=MIN_SIZE)
    for _ in range(3):
        run(layers, torch.randn(B, S, D, requires_grad=True)).sum().backward()
        stats = handle.stats
        per_layer = sum(n for n, _ in layers[1].tracked)
        assert stats.peak_resident_layers <= L - k
        assert stats.peak_resident_bytes <= (L - k) * per_layer
        if k:
            assert stats.peak_resident_layers == L - k  # and the bound is reached: nothing is over-offloaded
    handle.remove()


@pytest.mark.parametrize("k", range(1, L))
def test_release_and_reload_points_follow_the_schedule(k: int) -> None:
    layers = make_layers(n=L)
    handle = offload_layers(layers, num_layers=k, min_tensor_size=MIN_SIZE)
    for _ in range(3):
        run(layers, torch.randn(B, S, D, requires_grad=True)).sum().backward()
        stats = handle.stats
        assert stats.points("offload_start") == {i: i for i in range(k)}
        assert stats.points("release") == {i: L - k + i for i in range(k)}
        assert stats.points("reload_start") == {i: L - 1 - k + i for i in range(k)}
        assert stats.points("free") == {i: i - 1 for i in range(k)}  # -1: the end of backward
        assert not stats.points("reload_late")
    handle.remove()


@pytest.mark.parametrize("k", [1, 3, 5])
def test_bytes_offloaded_and_reloaded_match_the_tracked_tensors(k: int) -> None:
    layers = make_layers(n=L)
    handle = offload_layers(layers, num_layers=k, min_tensor_size=MIN_SIZE)
    run(layers, torch.randn(B, S, D, requires_grad=True)).sum().backward()
    expected = sum(n for layer in layers[:k] for n, _ in layer.tracked)
    assert handle.stats.bytes_offloaded == expected
    assert handle.stats.bytes_reloaded == expected
    handle.remove()


def test_every_saved_tensor_is_accounted_for() -> None:
    layers = make_layers(n=L)
    saved = [0]

    def count(t: torch.Tensor) -> torch.Tensor:
        saved[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        run(layers, torch.randn(B, S, D, requires_grad=True))
    handle = offload_layers(layers, num_layers=2, min_tensor_size=MIN_SIZE)
    run(layers, torch.randn(B, S, D, requires_grad=True)).sum().backward()
    stats = handle.stats
    assert stats.tensors_offloaded + stats.tensors_resident + sum(stats.skipped.values()) == saved[0]
    handle.remove()


def test_nothing_stays_alive_after_backward_without_gc() -> None:
    layers = make_layers(n=L)
    handle = offload_layers(layers, num_layers=3, min_tensor_size=MIN_SIZE)
    gc.disable()  # reference cycles would keep storages alive until a collection
    try:
        run(layers, torch.randn(B, S, D, requires_grad=True)).sum().backward()
        assert not any(any(alive(layer, skip_input=False)) for layer in layers)
        out = run(layers, torch.randn(B, S, D, requires_grad=True))  # a forward whose backward never runs
        del out
        assert not any(any(alive(layer, skip_input=False)) for layer in layers)
    finally:
        gc.enable()
    handle.remove()


def test_reload_without_sync_fn_happens_late_and_is_reported() -> None:
    context, _ = get_cpu_offload_context(True, 1, 2, min_tensor_size=1)
    x = torch.randn(32, requires_grad=True)
    with context:
        y = x.exp()
    with context:  # no sync_fn between the layers: the schedule never hears about backward
        z = y.sin()
    z.sum().backward()
    stats = context.stats
    assert stats.points("reload_late") == {0: 2}
    assert torch.equal(x.grad, (y.cos() * x.exp()).detach())


def test_skip_reasons_are_counted_per_pass() -> None:
    layers = make_layers(n=L)
    handle = offload_layers(layers, num_layers=2, min_tensor_size=10**9)  # everything is too small
    run(layers, torch.randn(B, S, D, requires_grad=True)).sum().backward()
    stats = handle.stats
    assert stats.bytes_offloaded == 0
    assert stats.skipped["small"] == (9 + 2) * L
    assert stats.skipped["parameter"] == 3 * L and stats.skipped["buffer"] == L
    handle.remove()
