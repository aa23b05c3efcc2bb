"""Exception safety of the activation offload context: a fault at every hook point, then normal steps.

For each point, one step raises there (a one-shot injected error); the next steps must offload exactly as a
context that never failed does — same gradients as without offload, same bytes offloaded and reloaded, the same
release and reload points — with stream ordering checked. Points: the pack and unpack hooks, the offload copy and
host-buffer pool, layer enter and exit, ``sync_fn``, the backward pre-hook, the scheduled release, reload and
free, the end-of-backward callback, the layer itself, and user code between two offloaded layers.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn

from mbridge_offload_runtime.activation.context import get_cpu_offload_context
from mbridge_offload_runtime.activation.layers import offload_layers
from mbridge_offload_runtime.activation.passes import BackwardStep, LayerStore, Pass
from mbridge_offload_runtime.activation.pool import HostBufferPool
from mbridge_offload_runtime.ordering import recording

L, K, D = 4, 2, 16


class Injected(RuntimeError):
    """The fault raised at the chosen point."""


POINTS = {
    "pack": (Pass, "push"),
    "offload_copy": (LayerStore, "_copy_out"),
    "host_pool": (HostBufferPool, "acquire"),
    "layer_enter": (Pass, "enter_layer"),
    "layer_exit": (torch.autograd.graph.saved_tensors_hooks, "__exit__"),
    "sync_fn": (BackwardStep, "__init__"),
    "backward_hook": (BackwardStep, "__call__"),
    "release": (LayerStore, "release"),
    "reload": (LayerStore, "start_reload"),
    "unpack": (LayerStore, "load"),
    "free": (LayerStore, "free"),
    "backward_end": (Pass, "backward_end"),
}
EXTRA = ["inside_layer", "between_layers"]


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, 2 * D) / D**0.5)
        self.v = nn.Parameter(torch.randn(2 * D, D) / D**0.5)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            self.fail = False
            raise Injected("inside the layer")
        return x + torch.tanh(x @ self.w) @ self.v


def _layers() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(Layer() for _ in range(L))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(2, 8, D, generator=torch.Generator().manual_seed(step), requires_grad=True)


def _step(layers, step: int, ctx=None, sync=None, between: bool = False) -> list[torch.Tensor]:
    """One forward and backward; ``between`` raises after layer 1's output is synced (outside the context)."""
    for p in layers.parameters():
        p.grad = None
    x = _batch(step)
    for i, layer in enumerate(layers):
        if ctx is not None:
            with ctx:
                x = layer(x)
            x = sync(x)
        else:
            x = layer(x)
        if between and i == 1:
            raise Injected("between layers")
    x.pow(2).mean().backward()
    return [p.grad.clone() for p in layers.parameters()]


def _once(cls: type, name: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make ``cls.name`` raise the first time it is called (after running, for ``__exit__``); returns a counter."""
    original = getattr(cls, name)
    fired = [0]

    def faulty(self, *args, **kwargs):
        if fired[0]:
            return original(self, *args, **kwargs)
        fired[0] = 1
        if name == "__exit__":
            original(self, *args, **kwargs)  # exit for real, then fail: the context must still recover
        raise Injected(f"{cls.__name__}.{name}")

    monkeypatch.setattr(cls, name, faulty)
    return fired


def _summary(stats) -> tuple:
    return (stats.bytes_offloaded, stats.bytes_reloaded, stats.points("release"), stats.points("reload_start"))


@pytest.fixture(scope="module")
def reference() -> dict[int, tuple[list[torch.Tensor], tuple]]:
    """Per step: gradients without offload, and the stats of a context that never failed."""
    layers = _layers()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ctx, sync = get_cpu_offload_context(True, K, L, min_tensor_size=64)
    out = {}
    for step in (1, 2):
        grads = _step(layers, step)
        _step(layers, step, ctx, sync)
        out[step] = (grads, _summary(ctx.stats))
    return out


def _inject(point: str, layers: nn.ModuleList, monkeypatch: pytest.MonkeyPatch) -> list[int] | None:
    if point == "inside_layer":
        layers[1].fail = True
        return None
    if point == "between_layers":
        return None
    return _once(*POINTS[point], monkeypatch)


@pytest.mark.parametrize("point", [*POINTS, *EXTRA])
def test_a_fault_at_any_point_leaves_the_next_steps_offloading(point: str, reference, monkeypatch) -> None:
    layers = _layers()
    ctx, sync = get_cpu_offload_context(True, K, L, min_tensor_size=64)
    fired = _inject(point, layers, monkeypatch)
    raised = False
    try:
        _step(layers, 0, ctx, sync, between=point == "between_layers")
    except Injected:
        raised = True  # the frames of the failed step are gone once this block ends, as in a training loop
    assert raised and (fired is None or fired[0] == 1), f"the fault at {point} was never reached"
    assert not ctx.inside_context
    for step in (1, 2):
        with recording():
            grads = _step(layers, step, ctx, sync)
        expected_grads, expected_stats = reference[step]
        assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads, strict=True)), point
        assert _summary(ctx.stats) == expected_stats, point
        assert ctx.stats.bytes_offloaded > 0


@pytest.mark.parametrize("point", ["pack", "layer_enter", "layer_exit", "unpack", "reload", "inside_layer"])
def test_offload_layers_hooks_recover_too(point: str, reference, monkeypatch) -> None:
    """The hook-based wrapper (``offload_layers``) goes through the same context: same recovery."""
    layers = _layers()
    with offload_layers(layers, K, min_tensor_size=64) as handle:
        _inject(point, layers, monkeypatch)
        with pytest.raises(Injected):
            _step(layers, 0)
        grads = _step(layers, 1)
        assert _summary(handle.stats) == reference[1][1]
    assert all(torch.equal(a, b) for a, b in zip(grads, reference[1][0], strict=True))


def test_a_fault_in_gradient_accumulation_drops_only_the_failed_microbatch(reference) -> None:
    layers = _layers()
    ctx, sync = get_cpu_offload_context(True, K, L, min_tensor_size=64)
    with contextlib.suppress(Injected):
        _step(layers, 0, ctx, sync, between=True)
    grads = _step(layers, 1, ctx, sync)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference[1][0], strict=True))
    assert len(ctx.history) == 1  # the abandoned pass never finished; only the good one is accounted
