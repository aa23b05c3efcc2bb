"""mbridge_offload_runtime.activation.context: the context, its sync function, eligibility, pools, and bad input.

The toy model saves every kind of tensor the runtime must handle: views of one base (a transpose, two
slices), a tensor saved twice (``a * a``), parameters saved by matmul (and a slice of one), a registered
buffer, a permuted (dense, non-contiguous) product, and tensors below the size threshold.
"""

from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from mbridge_offload_runtime.activation.context import OffloadContext, get_cpu_offload_context
from mbridge_offload_runtime.activation.eligibility import keep_on_device
from mbridge_offload_runtime.activation.layers import offload_layers
from mbridge_offload_runtime.activation.schedule import DEFAULT_MIN_TENSOR_SIZE, LayerPhase, check_transition

# The offload suite (`mbridge-offload test -k cpu_offload`, `pytest -k cpu_offload`): see pyproject.toml.
pytestmark = pytest.mark.cpu_offload

L = 4
MIN_SIZE = 100  # elements; the sigmoid gate (32 elements) stays below, everything else is above
B, S, D = 2, 8, 16


class Block(nn.Module):
    """One layer of the toy model; ``probe`` (if set) is called at the start of each forward."""

    def __init__(self, d: int = D, s: int = S) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(d, 2 * d) / d**0.5)
        self.w2 = nn.Parameter(torch.randn(2 * d, d) / d**0.5)
        self.register_buffer("scale", torch.rand(s, d) + 0.5)
        self.index = 0
        self.probe = None
        self.tracked: list[tuple[int, StorageWeakRef]] = []  # (nbytes, storage) of the bases offloading copies

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.probe is not None:
            self.probe(self.index)
        h = torch.tanh(x @ self.w1)  # matmul saves x (via a view) and w1 (a parameter); tanh saves h
        a = h.view(*h.shape[:-1], 2, -1).transpose(-2, -3)  # a view of h
        m = a * a  # the same tensor saved twice; m is dense but not contiguous
        g = torch.sigmoid(m.sum(-1, keepdim=True))  # small: stays
        half = h.shape[-1] // 2
        u = h[..., :half] * h[..., half:]  # two partial views of h
        r = (m * g).transpose(-2, -3).reshape(h.shape)
        out = x + (r @ self.w2) * self.scale + u @ self.w2[:half]  # a buffer, and a slice of a parameter
        self.tracked = [(t.numel() * t.element_size(), StorageWeakRef(t.untyped_storage())) for t in (x, h, m, r, u)]
        return out


def make_layers(seed: int = 0, n: int = L) -> nn.ModuleList:
    torch.manual_seed(seed)
    layers = nn.ModuleList(Block() for _ in range(n))
    for i, layer in enumerate(layers):
        layer.index = i
    return layers


def run(layers: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def train(layers: nn.ModuleList, iterations: int = 3, **offload: object) -> list[tuple[torch.Tensor, list]]:
    """Outputs and grads (params and input) per iteration, with an SGD step after each."""
    handle = offload_layers(layers, **offload) if offload else None
    results = []
    opt = torch.optim.SGD(layers.parameters(), lr=0.1)
    for it in range(iterations):
        x = torch.randn(B, S, D, generator=torch.Generator().manual_seed(it), requires_grad=True)
        out = run(layers, x)
        (out * out).mean().backward()
        results.append((out.detach(), [p.grad.clone() for p in layers.parameters()] + [x.grad]))
        opt.step()
        opt.zero_grad()
    if handle is not None:
        handle.remove()
    return results


def assert_bitwise(a: list, b: list) -> None:
    for (out_a, grads_a), (out_b, grads_b) in zip(a, b, strict=True):
        assert torch.equal(out_a, out_b)
        for ga, gb in zip(grads_a, grads_b, strict=True):
            assert torch.equal(ga, gb)


@pytest.fixture(autouse=True)
def _quiet_last_layer_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Offloading num_layers == model_layers - 1")
        yield


# --- parity --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, 1, L - 2, L - 1])
@pytest.mark.parametrize("options", [{}, {"double_buffering": True}, {"retain_pinned_cpu_buffers": True}])
def test_outputs_and_grads_bitwise_equal_to_no_offload(k: int, options: dict) -> None:
    layers = make_layers()
    reference = train(copy.deepcopy(layers))
    assert_bitwise(train(layers, num_layers=k, min_tensor_size=MIN_SIZE, **options), reference)


def test_toy_model_exercises_every_eligibility_case() -> None:
    layers = make_layers()
    handle = offload_layers(layers, num_layers=2, min_tensor_size=MIN_SIZE)
    run(layers, torch.randn(B, S, D, requires_grad=True)).sum().backward()
    stats = handle.stats
    # per layer: w1, w2 (matmul), a slice of w2; the buffer; the gate, saved by sigmoid and by mul
    assert stats.skipped == {"parameter": 3 * L, "buffer": L, "small": 2 * L}
    # per offloaded layer: 9 saved tensors (x, h, a twice, m, two slices of h, r, u) from 5 distinct bases
    assert stats.tensors_offloaded == 9 * 2
    assert stats.copies_offloaded == 5 * 2
    assert stats.tensors_deduplicated == 4 * 2
    handle.remove()


def test_same_tensor_saved_twice_is_copied_once() -> None:
    context, sync = get_cpu_offload_context(True, 1, 2, min_tensor_size=1)
    x = torch.randn(64, requires_grad=True)
    with context:
        y = x * x
    y = sync(y)
    with context:
        z = y.exp()
    sync(z).sum().backward()
    assert context.stats.tensors_offloaded == 2
    assert context.stats.copies_offloaded == 1
    assert context.stats.bytes_offloaded == 64 * 4
    expected = x.detach().clone().requires_grad_()
    (expected * expected).exp().sum().backward()
    assert torch.equal(x.grad, expected.grad)


def test_view_is_rebuilt_from_its_base() -> None:
    context, sync = get_cpu_offload_context(True, 1, 2, min_tensor_size=1)
    base = torch.randn(6, 8, requires_grad=True)
    expected = None
    for offload in (False, True):
        base.grad = None
        h = base * 1.0
        if offload:
            with context:
                v = h[2:, 1:5].t() * h[:4, 3:7].t()  # two views of one base, with offsets, transposed
            v = sync(v)
            with context:
                w = v.tanh()
            sync(w).sum().backward()
        else:
            (h[2:, 1:5].t() * h[:4, 3:7].t()).tanh().sum().backward()
        expected = base.grad.clone() if expected is None else expected
    assert torch.equal(base.grad, expected)
    assert context.stats.copies_offloaded == 1  # the base once, for both views
    assert context.stats.bytes_offloaded == 6 * 8 * 4


# --- modes ---------------------------------------------------------------------------------------------
def test_no_grad_forward_passes_through_untouched() -> None:
    layers = make_layers()
    handle = offload_layers(layers, num_layers=2, min_tensor_size=MIN_SIZE)
    x = torch.randn(B, S, D)
    with torch.no_grad():
        out = run(layers, x)
    assert handle.context.current is None and handle.stats is None
    handle.remove()
    with torch.no_grad():
        assert torch.equal(out, run(layers, x))


def test_eval_forward_between_training_steps_keeps_the_layer_count() -> None:
    layers = make_layers()
    reference = copy.deepcopy(layers)
    handle = offload_layers(layers, num_layers=2, min_tensor_size=MIN_SIZE)
    x = torch.randn(B, S, D, requires_grad=True)
    with torch.no_grad():
        run(layers, x)
    run(layers, x).sum().backward()
    run(reference, x.detach().requires_grad_()).sum().backward()
    assert handle.stats.points("release") == {0: 2, 1: 3}
    for p, q in zip(layers.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    handle.remove()


def test_gradient_accumulation_several_forwards_before_backward() -> None:
    layers = make_layers()
    reference = copy.deepcopy(layers)
    handle = offload_layers(layers, num_layers=3, min_tensor_size=MIN_SIZE)
    xs = [torch.randn(B, S, D, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    losses = [run(layers, x).pow(2).mean() for x in xs]  # three passes in flight
    losses[1].backward()
    (losses[0] + losses[2]).backward()
    ref_losses = [run(reference, x).pow(2).mean() for x in xs]
    ref_losses[1].backward()
    (ref_losses[0] + ref_losses[2]).backward()
    for p, q in zip(layers.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert len(handle.context.history) == 3
    assert all(s.bytes_reloaded == s.bytes_offloaded > 0 for s in handle.context.history)
    handle.remove()


def test_keep_on_device_opts_a_region_out() -> None:
    context, sync = get_cpu_offload_context(True, 1, 2, min_tensor_size=1)
    x = torch.randn(32, requires_grad=True)
    with context:
        y = x.exp()
        with keep_on_device():
            z = y.sin()
    z = sync(z)
    with context:
        w = z.cos()
    sync(w).sum().backward()
    stats = context.stats
    assert stats.skipped["opt_out"] == 1
    assert stats.tensors_offloaded == 1  # only exp's output
    expected = -torch.sin(torch.sin(x.exp())) * torch.cos(x.exp()) * x.exp()
    assert torch.allclose(x.grad, expected.detach())


def test_context_exposes_inside_context_like_te() -> None:
    context, _ = get_cpu_offload_context(True, 1, 3, min_tensor_size=1)
    assert context.inside_context is False
    with context:
        assert context.inside_context is True
    assert context.inside_context is False


def test_disabled_returns_a_no_op_pair() -> None:
    context, sync = get_cpu_offload_context(False, 1, 3)
    x = torch.randn(4, requires_grad=True)
    with context:
        y = x.exp()
    assert sync(y) is y
    assert context.inside_context is False
    assert not isinstance(context, OffloadContext)


def test_default_threshold_is_te_s() -> None:
    context, _ = get_cpu_offload_context(True, 1, 2)
    assert context.eligibility.min_tensor_size == DEFAULT_MIN_TENSOR_SIZE == 256 * 1024


def test_retained_host_buffers_are_reused_next_iteration() -> None:
    layers = make_layers()
    handle = offload_layers(layers, num_layers=2, min_tensor_size=MIN_SIZE, retain_pinned_cpu_buffers=True)
    for _ in range(3):
        run(layers, torch.randn(B, S, D)).sum().backward()
    allocated = [s.host_buffers_allocated for s in handle.context.history]
    assert allocated == [10, 0, 0]
    assert handle.context.pool.free_buffers() == 10
    handle.remove()


def test_without_retain_host_buffers_are_fresh_each_iteration() -> None:
    layers = make_layers()
    handle = offload_layers(layers, num_layers=2, min_tensor_size=MIN_SIZE)
    for _ in range(2):
        run(layers, torch.randn(B, S, D)).sum().backward()
    assert [s.host_buffers_allocated for s in handle.context.history] == [10, 10]
    assert handle.context.pool.free_buffers() == 0
    handle.remove()


def test_double_buffering_reloads_into_two_persistent_sets() -> None:
    layers = make_layers()
    handle = offload_layers(layers, num_layers=2, min_tensor_size=MIN_SIZE, double_buffering=True)
    for _ in range(2):
        run(layers, torch.randn(B, S, D)).sum().backward()
    assert [(s.double_buffer_hits, s.double_buffer_misses) for s in handle.context.history] == [(2, 0), (2, 0)]
    handle.remove()


def test_double_buffering_falls_back_when_more_than_two_reloads_are_alive() -> None:
    layers = make_layers(n=8)
    handle = offload_layers(layers, num_layers=4, min_tensor_size=MIN_SIZE, double_buffering=True)
    run(layers, torch.randn(B, S, D)).sum().backward()
    stats = handle.stats
    assert stats.double_buffer_hits + stats.double_buffer_misses == 4
    assert stats.double_buffer_misses > 0
    handle.remove()


def test_a_layer_that_raises_resets_the_layer_count() -> None:
    layers = make_layers()
    handle = offload_layers(layers, num_layers=2, min_tensor_size=MIN_SIZE)
    with pytest.raises(RuntimeError):
        layers[0](torch.randn(B, S, D))
        layers[1](torch.randn(B, S, D + 1))  # shape error inside layer 1
    run(layers, torch.randn(B, S, D)).sum().backward()
    assert handle.stats.points("release") == {0: 2, 1: 3}
    handle.remove()


def test_remove_uninstalls_the_hooks() -> None:
    layers = make_layers()
    handle = offload_layers(layers, num_layers=2, min_tensor_size=MIN_SIZE)
    run(layers, torch.randn(B, S, D)).sum().backward()
    handle.remove()
    run(layers, torch.randn(B, S, D)).sum().backward()
    assert len(handle.context.history) == 1


# --- bad input -----------------------------------------------------------------------------------------
def test_offloading_all_layers_is_refused_with_te_message() -> None:
    with pytest.raises(ValueError, match="Cannot offload all layers without manual synchronization - last layer"):
        get_cpu_offload_context(True, 4, 4)
    with pytest.raises(ValueError, match="Cannot offload all layers"):
        offload_layers(make_layers(), num_layers=L)


def test_negative_num_layers_is_refused() -> None:
    with pytest.raises(ValueError, match="num_layers is -1"):
        get_cpu_offload_context(True, -1, 4)


def test_nothing_to_offload_is_refused_with_te_message() -> None:
    with pytest.raises(
        ValueError, match=r"CPU Offloading is enabled while it is not mentioned what to offload \(weights/activations\)"
    ):
        get_cpu_offload_context(True, 1, 4, offload_activations=False, offload_weights=False)


def test_offload_weights_is_deprecated_like_te() -> None:
    with pytest.warns(DeprecationWarning, match="Offloading weights is deprecated"):
        context, _ = get_cpu_offload_context(True, 1, 4, offload_weights=True)
    assert isinstance(context, OffloadContext)
    with pytest.warns(DeprecationWarning):
        context, _ = get_cpu_offload_context(True, 1, 4, offload_activations=False, offload_weights=True)
    assert not isinstance(context, OffloadContext)


def test_last_layer_minus_one_warns_like_te() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        get_cpu_offload_context(True, 3, 4)
    assert any("prevents overlapping" in str(w.message) for w in caught)


def test_entering_the_context_twice_is_refused() -> None:
    context, _ = get_cpu_offload_context(True, 1, 3)
    with context, pytest.raises(RuntimeError, match="entered twice"):
        context.__enter__()
    with context:  # and it still works after the error
        pass


def test_changed_shapes_with_retained_buffers_are_refused() -> None:
    layers = make_layers()
    handle = offload_layers(layers, num_layers=2, min_tensor_size=MIN_SIZE, retain_pinned_cpu_buffers=True)
    run(layers, torch.randn(B, S, D)).sum().backward()
    with pytest.raises(ValueError, match="CPU buffer shape does not match the offloaded tensor shape"):
        run(layers, torch.randn(B + 1, S, D))
    handle.context.reset_buffers()  # the documented way out (the failed forward already reset the layer count)
    run(layers, torch.randn(B + 1, S, D)).sum().backward()
    handle.remove()


def test_second_backward_with_retained_buffers_is_refused() -> None:
    layers = make_layers()
    handle = offload_layers(layers, num_layers=2, min_tensor_size=MIN_SIZE, retain_pinned_cpu_buffers=True)
    loss = run(layers, torch.randn(B, S, D)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_pinned_cpu_buffers=True a second backward"):
        loss.backward()
    handle.remove()


def test_second_backward_reloads_late_from_the_kept_host_copies() -> None:
    layers = make_layers()
    reference = copy.deepcopy(layers)
    handle = offload_layers(layers, num_layers=2, min_tensor_size=MIN_SIZE)
    x = torch.randn(B, S, D)
    for model in (layers, reference):
        loss = run(model, x).sum()
        loss.backward(retain_graph=True)
        loss.backward()
    for p, q in zip(layers.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    stats = handle.stats
    assert set(stats.points("reload_late")) == {0, 1}  # the second backward reloads both layers on demand
    assert stats.bytes_reloaded == 2 * stats.bytes_offloaded
    handle.remove()


def test_illegal_state_transition_raises() -> None:
    check_transition(0, LayerPhase.NOT_OFFLOADED, LayerPhase.OFFLOAD_STARTED)
    with pytest.raises(RuntimeError, match="cannot go from not_offloaded to reload_started"):
        check_transition(0, LayerPhase.NOT_OFFLOADED, LayerPhase.RELOAD_STARTED)


def test_negative_min_size_is_refused() -> None:
    with pytest.raises(ValueError, match="min_tensor_size is -1"):
        get_cpu_offload_context(True, 1, 2, min_tensor_size=-1)


def test_double_backward_matches_no_offload() -> None:
    layers = make_layers()
    grads = []
    for k in (None, 2):
        handle = offload_layers(layers, num_layers=k, min_tensor_size=MIN_SIZE) if k is not None else None
        x = torch.randn(B, S, D, generator=torch.Generator().manual_seed(0), requires_grad=True)
        (gx,) = torch.autograd.grad(run(layers, x).pow(2).sum(), x, create_graph=True)
        (ggx,) = torch.autograd.grad(gx.pow(2).sum(), x)
        grads.append((gx.detach(), ggx))
        if handle is not None:
            handle.remove()
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_gpu_benchmark_falls_back_to_a_tiny_cpu_run(tmp_path, capsys, monkeypatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("on a GPU machine the script runs the real configuration")
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_activation.py"
    spec = importlib.util.spec_from_file_location("gpu_activation", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_activation", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    doc = tmp_path / "fragment.md"
    doc.write_text("# hand-written intro\n")
    assert module.main(["--json", str(tmp_path / "out.json"), "--write-docs", str(doc)]) == 0
    assert "No CUDA device" in capsys.readouterr().out
    rows = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert set(rows) == {
        "none", "ours k=0", "ours k=1", "ours k=3", "ours-te-shape k=1", "ours-te-shape k=3", "save_on_cpu"
    }  # fmt: skip
    text = doc.read_text()
    assert text.startswith("# hand-written intro") and "NOT a measurement" in text and "GPU-measured" not in text
    assert text.count("<!-- begin: gpu_activation.py") == 1 and "`ours-te-shape k=3`" in text
    assert rows["ours-te-shape k=3"]["offloaded_bytes"] == rows["ours k=3"]["offloaded_bytes"]
    assert all(row["loss_bitwise_equal"] for row in rows.values())
    assert rows["ours k=3"]["offloaded_bytes"] == 3 * rows["ours k=1"]["offloaded_bytes"] > 0
