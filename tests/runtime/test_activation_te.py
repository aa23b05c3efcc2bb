"""Transformer Engine ≥ 2.10's ``get_cpu_offload_context`` contract, case by case, on CPU.

The cases follow TE's own test file, ``tests/pytorch/test_cpu_offloading.py`` (NVIDIA/TransformerEngine, the
v2 offload of ``transformer_engine/pytorch/cpu_offload.py``, TE 2.10+), rewritten against our public API (the
file needs CUDA and TE's modules, so it cannot be loaded as is): ``TestsOffloadableLayerState`` and
``TestsDefaultOffloadSynchronizer`` become round trips through the context (and the manual controller);
``TestTELayers`` uses ``torch.nn`` layers in place of TE's. TE's memory assertions read CUDA counters; here the
runtime's accounting (``OffloadStats``) and storage lifetimes stand in. Every case also runs under
``ordering.recording()``, so the manual controller's copies are checked for stream order as well.
"""

from __future__ import annotations

import contextlib
import inspect
import random
import warnings

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from mbridge_offload_runtime import device
from mbridge_offload_runtime.activation.context import ManualController, get_cpu_offload_context
from mbridge_offload_runtime.activation.eligibility import mark_not_offload
from mbridge_offload_runtime.ordering import recording

B, S, D = 4, 8, 32  # 1024 elements per activation
MIN = 256

TE_2_10_PARAMETERS = [  # transformer_engine/pytorch/cpu_offload.py, get_cpu_offload_context, TE 2.10
    "enabled",
    "num_layers",
    "model_layers",
    "offload_activations",
    "offload_weights",
    "double_buffering",
    "manual_synchronization",
    "retain_pinned_cpu_buffers",
    "offload_stream",
]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Offloading num_layers == model_layers - 1")
        yield


# ---------------------------------------------------------------------------------------------------------
# signature and returns
# ---------------------------------------------------------------------------------------------------------
def test_positional_parameters_are_te_2_10s_in_order() -> None:
    params = inspect.signature(get_cpu_offload_context).parameters
    positional = [n for n, p in params.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == TE_2_10_PARAMETERS


def test_seventh_positional_argument_is_manual_synchronization() -> None:
    result = get_cpu_offload_context(True, 0, 4, True, False, False, True)
    assert len(result) == 3 and isinstance(result[2], ManualController)
    assert not result[0].pool.retain
    result = get_cpu_offload_context(True, 1, 4, True, False, False, False, True)
    assert len(result) == 2 and result[0].pool.retain


@pytest.mark.parametrize("enabled", [False, True])
def test_manual_mode_returns_three_values_even_when_nothing_is_offloaded(enabled: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        ctx, sync, controller = get_cpu_offload_context(
            enabled, 1, 4, offload_activations=False, offload_weights=True, manual_synchronization=True
        )
    assert controller is None and sync(torch.ones(1)) is not None
    with ctx:
        pass


def test_offload_stream_needs_manual_synchronization() -> None:
    with pytest.raises(ValueError, match="offload_stream can be provided only if manual_synchronization is True"):
        get_cpu_offload_context(True, 1, 4, offload_stream=device.new_stream())


def test_manual_mode_ignores_num_layers() -> None:
    ctx, _, controller = get_cpu_offload_context(True, 6, 6, manual_synchronization=True)
    assert controller is not None and ctx.schedule.manual


def test_num_layers_none_is_accepted_only_with_manual_synchronization() -> None:
    # TE 2.10 types num_layers Optional[int] because manual mode ignores it; its automatic schedule compares it
    # with model_layers, so None there is refused up front instead of failing inside the first `with ctx:`.
    ctx, _, controller = get_cpu_offload_context(True, None, 4, manual_synchronization=True)
    assert controller is not None and ctx.schedule.manual
    with pytest.raises(ValueError, match="num_layers is None"):
        get_cpu_offload_context(True, None, 4)


# ---------------------------------------------------------------------------------------------------------
# TestsOffloadableLayerState / TestsDefaultOffloadSynchronizer, through the public API
# ---------------------------------------------------------------------------------------------------------
class Saver(nn.Module):
    """Saves ``n`` distinct activations (each sigmoid saves its output); the gradient depends on all of them."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.w = nn.Parameter(torch.randn(D, D) / D**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w
        return sum(torch.sigmoid(h + j) for j in range(self.n)) / self.n


def _grads(layers, x: torch.Tensor, ctx=None, sync=None) -> list[torch.Tensor]:
    for p in layers.parameters():
        p.grad = None
    x = x.clone().requires_grad_()
    for layer in layers:
        with ctx if ctx is not None else contextlib.nullcontext():
            x = layer(x)
        x = sync(x) if sync is not None else x
    x.pow(2).mean().backward()
    return [p.grad.clone() for p in layers.parameters()]


@pytest.mark.parametrize("random_num_tensors", [True, False])
def test_manual_round_trip_of_random_tensor_counts(random_num_tensors: bool) -> None:
    """TE: OffloadableLayerState.test_general — push, offload, release, reload, pop; values equal, 10 iterations."""
    rng = random.Random(0)
    for iteration in range(10):
        n = rng.choice([1, 20]) if random_num_tensors else 1
        torch.manual_seed(iteration)
        layers = nn.ModuleList([Saver(n), Saver(1)])
        x = torch.randn(B, S, D)
        reference = _grads(layers, x)
        ctx, sync, manual = get_cpu_offload_context(True, model_layers=2, manual_synchronization=True,
                                                    min_tensor_size=MIN)  # fmt: skip
        with recording():
            out = x.clone().requires_grad_()
            for i, layer in enumerate(layers):
                with ctx:
                    out = layer(out)
                out = sync(out)
                manual.start_offload_layer(i)
            manual.release_activation_forward_gpu_memory(0)
            manual.start_reload_layer(0)
            for p in layers.parameters():
                p.grad = None
            out.pow(2).mean().backward()
        assert ctx.stats.copies_offloaded >= n + 1
        assert all(torch.equal(p.grad, r) for p, r in zip(layers.parameters(), reference, strict=True))


def test_views_of_one_base_are_offloaded_once() -> None:
    """TE: test_offload_base_tensor — saved views ``y[::2]`` and ``y[1::2]`` cost one copy of ``y``."""
    ctx, sync, manual = get_cpu_offload_context(True, model_layers=2, manual_synchronization=True, min_tensor_size=1)
    x = torch.randn(B * 2, S, D, requires_grad=True)
    with recording():
        with ctx:
            y = x * 3
            z = y[::2] * y[1::2]  # mul saves both half-views of y
        z = sync(z)
        manual.start_offload_layer(0)
        stats = ctx.current
        manual.release_activation_forward_gpu_memory(0)
        manual.start_reload_layer(0)
        z.sum().backward()
    assert stats.tensors_offloaded == 2 and stats.copies_offloaded == 1
    assert stats.bytes_offloaded == y.numel() * y.element_size()
    x2 = x.detach().clone().requires_grad_()
    y2 = x2 * 3
    (y2[::2] * y2[1::2]).sum().backward()
    assert torch.equal(x.grad, x2.grad)


@pytest.mark.parametrize("random_num_tensors", [True, False])
def test_default_schedule_offloads_all_but_the_last_layer(random_num_tensors: bool) -> None:
    """TE: DefaultOffloadSynchronizer.test_general — L = 10, k = 9, random tensors per layer, 10 iterations."""
    rng = random.Random(1)
    L = 10
    for iteration in range(3):
        torch.manual_seed(iteration)
        layers = nn.ModuleList(Saver(rng.randint(1, 10) if random_num_tensors else 1) for _ in range(L))
        x = torch.randn(B, S, D)
        reference = _grads(layers, x)
        ctx, sync = get_cpu_offload_context(True, L - 1, L, min_tensor_size=MIN)
        with recording():
            got = _grads(layers, x, ctx, sync)
        assert all(torch.equal(a, b) for a, b in zip(got, reference, strict=True))
        assert ctx.stats.bytes_offloaded > 0 and ctx.stats.peak_resident_layers == 1


@pytest.mark.parametrize("k", [1, 3, 5, 7, 9])
def test_at_most_l_minus_k_layers_resident(k: int) -> None:
    """TE: test_memory — the schedule keeps at most ``L − k`` layers' activations on the device."""
    L = 10
    torch.manual_seed(0)
    layers = nn.ModuleList(Saver(2) for _ in range(L))
    ctx, sync = get_cpu_offload_context(True, k, L, min_tensor_size=MIN)
    _grads(layers, torch.randn(B, S, D), ctx, sync)
    assert ctx.stats.peak_resident_layers == L - k


def test_same_tensor_pushed_three_times_is_copied_once() -> None:
    """TE: test_multiple_tensor_offload — one host copy for a tensor saved three times."""

    class Thrice(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.sigmoid(x)  # saves h
            return h * h + h.exp()  # saves h twice more (mul) and exp's output

    ctx, sync = get_cpu_offload_context(True, 1, 2, min_tensor_size=MIN)
    x = torch.randn(B, S, D, requires_grad=True)
    with recording():
        out = x
        for layer in (Thrice(), nn.Identity()):
            with ctx:
                out = layer(out) * 1
            out = sync(out)
        out.sum().backward()
    nbytes = B * S * D * 4
    assert ctx.stats.tensors_deduplicated >= 2
    assert ctx.stats.bytes_offloaded == ctx.stats.copies_offloaded * nbytes


# ---------------------------------------------------------------------------------------------------------
# TestTELayers, with torch.nn layers in place of TE's
# ---------------------------------------------------------------------------------------------------------
LAYER_TYPES = {
    "linear": lambda: nn.Linear(D, D),
    "layernorm_linear": lambda: nn.Sequential(nn.LayerNorm(D), nn.Linear(D, D)),
    "layernorm_mlp": lambda: nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D)),
    "transformer_layer": lambda: nn.TransformerEncoderLayer(D, 4, 4 * D, dropout=0.0, batch_first=True),
}


@pytest.mark.parametrize("layer_type", list(LAYER_TYPES))
def test_sanity_ten_layers_six_offloaded(layer_type: str) -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(LAYER_TYPES[layer_type]() for _ in range(10))
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=6, model_layers=10, min_tensor_size=MIN)
    with recording():
        _grads(layers, torch.randn(B, S, D), ctx, sync)
    assert ctx.stats.bytes_offloaded > 0


@pytest.mark.parametrize("layer_type", list(LAYER_TYPES))
def test_offloaded_bytes_are_what_the_layer_saved(layer_type: str) -> None:
    """TE: test_memory — host bytes equal the layer's saved activations, so no live pointer was copied."""
    torch.manual_seed(0)
    layer = LAYER_TYPES[layer_type]()
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if not isinstance(base, nn.Parameter) and t.numel() >= MIN:  # weights (and their views) stay
            saved[base.untyped_storage().data_ptr()] = base.numel() * base.element_size()
        return t

    x = torch.randn(B, S, D, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    ctx, sync = get_cpu_offload_context(True, 1, 2, offload_activations=True, offload_weights=False,
                                        min_tensor_size=MIN)  # fmt: skip
    with ctx:
        out = layer(x)
    out = sync(out)
    with ctx:
        out = out + 1
    out = sync(out)
    assert ctx.current.bytes_offloaded == sum(saved.values()) > 0
    out.sum().backward()


@pytest.mark.parametrize("layer_type", list(LAYER_TYPES))
def test_manual_synchronization_two_independent_layers(layer_type: str) -> None:
    """TE: test_manual_synchronization — model_layers=6, two layers run, offloaded and reloaded by hand."""
    torch.manual_seed(0)
    layer_1, layer_2 = LAYER_TYPES[layer_type](), LAYER_TYPES[layer_type]()
    ctx, sync, manual = get_cpu_offload_context(enabled=True, model_layers=6, offload_activations=True,
                                                manual_synchronization=True, min_tensor_size=MIN)  # fmt: skip
    inp1, inp2 = torch.randn(B, S, D), torch.randn(B, S, D)
    ref1, ref2 = inp1.clone(), inp2.clone()
    with recording():
        with ctx:
            out_1 = layer_1(inp1)
        out_1 = sync(out_1)
        with ctx:
            out_2 = layer_2(inp2)
        out_2 = sync(out_2)
        mark_not_offload(out_1, out_2)
        del inp1, inp2  # as in TE's test: the saved copies are then the only references
        held = [
            StorageWeakRef(s.on_device.untyped_storage())
            for s in ctx.last_pass.store(0)._slots
            if s.on_device is not None
        ]
        manual.start_offload_layer(0)
        manual.release_activation_forward_gpu_memory(0)
        manual.start_offload_layer(1)
        manual.release_activation_forward_gpu_memory(1)
        assert held and any(ref.expired() for ref in held)  # device memory went back (TE: memory drops)
        manual.start_reload_layer(0)
        manual.start_reload_layer(1)
        out_1.sum().backward()
        out_2.sum().backward()
    grads = [p.grad.clone() for p in [*layer_1.parameters(), *layer_2.parameters()]]
    for p in [*layer_1.parameters(), *layer_2.parameters()]:
        p.grad = None
    layer_1(ref1).sum().backward()
    layer_2(ref2).sum().backward()
    assert all(
        torch.equal(g, p.grad) for g, p in zip(grads, [*layer_1.parameters(), *layer_2.parameters()], strict=True)
    )


@pytest.mark.parametrize("retain_pinned_cpu_buffers", [True, False])
@pytest.mark.parametrize("layer_type", list(LAYER_TYPES))
def test_numerics_equal_to_no_offload(layer_type: str, retain_pinned_cpu_buffers: bool) -> None:
    """TE: test_numerics (no CUDA graphs, no attention backends here) — outputs and grads equal, after warm-up."""
    torch.manual_seed(0)
    layers = nn.ModuleList(LAYER_TYPES[layer_type]() for _ in range(2))
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, offload_activations=True,
                                        offload_weights=False, retain_pinned_cpu_buffers=retain_pinned_cpu_buffers,
                                        min_tensor_size=MIN)  # fmt: skip
    x = torch.randn(B, S, D)
    for _ in range(4):
        _grads(layers, x, ctx, sync)
    with recording():
        got = _grads(layers, x, ctx, sync)
    assert all(torch.equal(a, b) for a, b in zip(got, _grads(layers, x), strict=True))
    assert ctx.stats.host_buffers_allocated == (0 if retain_pinned_cpu_buffers else ctx.stats.copies_offloaded)


def test_example_from_doc() -> None:
    """TE's docstring example: every layer offloaded by hand on a caller-given stream, then reloaded."""
    torch.manual_seed(0)
    num_layers = 10
    offload_stream = device.new_stream("offload")
    layers = [LAYER_TYPES["transformer_layer"]() for _ in range(num_layers)]
    inp = [torch.randn(B, S, D) for _ in range(num_layers)]
    out: list[torch.Tensor | None] = [None] * num_layers
    ctx, sync, manual = get_cpu_offload_context(enabled=True, model_layers=num_layers, manual_synchronization=True,
                                                offload_stream=offload_stream, min_tensor_size=MIN)  # fmt: skip
    assert ctx.stream is offload_stream
    with recording():
        for i in range(num_layers):
            with ctx:
                out[i] = layers[i].forward(inp[i])
            out[i] = sync(out[i])
            manual.start_offload_layer(i)
        offload_stream.synchronize()
        for i in range(num_layers):
            manual.release_activation_forward_gpu_memory(i)
        for i in range(num_layers - 1, -1, -1):
            manual.start_reload_layer(i)
        offload_stream.synchronize()
        for i in range(num_layers):
            out[i].sum().backward()
    assert ctx.stats is not None and ctx.stats.bytes_reloaded == ctx.stats.bytes_offloaded > 0


def test_manual_steps_out_of_order_are_refused() -> None:
    ctx, sync, manual = get_cpu_offload_context(True, model_layers=2, manual_synchronization=True, min_tensor_size=MIN)
    with ctx:
        out = Saver(1)(torch.randn(B, S, D, requires_grad=True))
    sync(out)
    with pytest.raises(RuntimeError, match="needs a started offload"):
        manual.release_activation_forward_gpu_memory(0)
    with pytest.raises(RuntimeError, match="needs a released layer"):
        manual.start_reload_layer(0)
    with pytest.raises(ValueError, match="layer_id is 5"):
        manual.start_offload_layer(5)
