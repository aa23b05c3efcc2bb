"""mbridge_offload_runtime.megatron: our activation offload inside a real megatron-core GPTModel, on CPU.

Real megatron-core 0.16.1 (local layer spec) under the two labelled shims of ``cpu_compat_shims``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.tensor_parallel import layers as mcore_layers
from megatron.core.transformer import transformer_block

from mbridge_offload_runtime.activation.context import OffloadContext
from mbridge_offload_runtime.megatron import (
    build_tiny_gpt,
    cpu_compat_shims,
    install_activation_offload,
    tiny_batch,
)

pytestmark = pytest.mark.megatron

L, HIDDEN, HEADS, VOCAB, SEQ, BATCH = 4, 64, 4, 128, 32, 2
MIN_SIZE = 1024  # elements: the tiny model's activations (2 x 32 x 64 = 4096) qualify, the biases do not


@pytest.fixture(autouse=True)
def _shims(request: pytest.FixtureRequest):
    if getattr(request.function, "without_shims", False):
        yield
        return
    with cpu_compat_shims(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Offloading num_layers == model_layers - 1")
        yield


def gpt(**kw: object) -> torch.nn.Module:
    return build_tiny_gpt(L, HIDDEN, HEADS, VOCAB, SEQ, min_tensor_size=MIN_SIZE, **kw)


def train(model: torch.nn.Module, iterations: int = 3) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for it in range(iterations):
        loss = model(**tiny_batch(BATCH, SEQ, VOCAB, seed=it)).mean()
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        opt.step()
        opt.zero_grad()
    return out


def test_without_install_megatron_refuses_cpu_offloading_without_te() -> None:
    with pytest.raises(AssertionError, match="CPU Offloading is enabled when TE is not present"):
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer import TransformerConfig

        from mbridge_offload_runtime.megatron import ensure_model_parallel

        ensure_model_parallel()
        cfg = TransformerConfig(
            num_layers=2,
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            use_cpu_initialization=True,
            transformer_impl="local",
            cpu_offloading=True,
            cpu_offloading_num_layers=1,
        )
        GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ)


def test_install_patches_the_block_and_remove_restores_it() -> None:
    factory, init = transformer_block.get_cpu_offload_context, transformer_block.TransformerBlock.__init__
    assert factory is None  # no TE here
    with install_activation_offload(min_tensor_size=MIN_SIZE) as installed:
        assert transformer_block.get_cpu_offload_context == installed._factory
        assert transformer_block.TransformerBlock.__init__ is not init  # clears the TE-v1 marker context
    assert transformer_block.get_cpu_offload_context is factory
    assert transformer_block.TransformerBlock.__init__ is init


@pytest.mark.parametrize("k", [1, L - 1])
def test_gpt_trains_3_iterations_with_offload_bitwise_equal(k: int) -> None:
    reference = gpt()
    model = gpt(cpu_offloading=True, cpu_offloading_num_layers=k)
    for (name, a), (_, b) in zip(reference.state_dict().items(), model.state_dict().items(), strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name
    context = model.decoder.offload_context
    assert isinstance(context, OffloadContext)
    assert model.config._cpu_offloading_context is None  # layers.py would assert without TE
    for (loss_a, grads_a), (loss_b, grads_b) in zip(train(reference), train(model), strict=True):
        assert torch.equal(loss_a, loss_b)
        assert len(grads_a) == len(grads_b) > 0
        for ga, gb in zip(grads_a, grads_b, strict=True):
            assert torch.equal(ga, gb)
    history = list(context.history)
    assert len(history) == 3
    for stats in history:
        assert stats.bytes_offloaded > 0
        assert stats.bytes_reloaded == stats.bytes_offloaded
        assert stats.peak_resident_layers <= L - k
        assert stats.points("release") == {i: L - k + i for i in range(k)}
        assert stats.points("reload_start") == {i: L - 1 - k + i for i in range(k)}
        assert stats.skipped["parameter"] > 0
    # every iteration offloads the same bytes: k of the L identical layers
    assert len({s.bytes_offloaded for s in history}) == 1
    per_layer = history[0].bytes_offloaded // k
    assert history[0].bytes_offloaded == k * per_layer
    assert history[0].peak_resident_bytes <= (L - k) * per_layer


def test_gpt_with_te_default_threshold_offloads_nothing_from_a_tiny_model() -> None:
    model = build_tiny_gpt(L, HIDDEN, HEADS, VOCAB, SEQ, cpu_offloading=True, cpu_offloading_num_layers=1)
    model(**tiny_batch(BATCH, SEQ, VOCAB)).mean().backward()
    stats = model.decoder.offload_context.stats
    assert stats.bytes_offloaded == 0 and stats.skipped["small"] > 0


def test_gpt_eval_under_no_grad_is_untouched() -> None:
    reference = gpt()
    model = gpt(cpu_offloading=True, cpu_offloading_num_layers=2)
    batch = tiny_batch(BATCH, SEQ, VOCAB)
    with torch.no_grad():
        assert torch.equal(reference(**batch), model(**batch))
    assert model.decoder.offload_context.current is None


def test_installed_without_cpu_offloading_builds_a_disabled_context() -> None:
    with install_activation_offload(min_tensor_size=MIN_SIZE):
        model = gpt()
    assert not isinstance(model.decoder.offload_context, OffloadContext)
    assert model.decoder.offload_context.inside_context is False


def test_cpu_compat_shims_restore_torch_cuda() -> None:
    # the autouse fixture holds the shims: nested use is re-entrant and the outer shims stay in place
    shimmed = torch.cuda.current_device
    with cpu_compat_shims():
        assert torch.cuda.current_device() == "cpu"
        assert torch.equal(torch.cuda.get_rng_state(), torch.get_rng_state())
    assert torch.cuda.current_device is shimmed


def test_cpu_compat_shims_are_removed_on_exit() -> None:
    if torch.cuda.is_available():
        pytest.skip("the shims are a no-op where CUDA is present")
    original = torch.cuda.current_device, torch.cuda.get_rng_state, torch.cuda.random.get_rng_state
    with cpu_compat_shims():
        assert torch.cuda.current_device() == "cpu"
    assert (torch.cuda.current_device, torch.cuda.get_rng_state, torch.cuda.random.get_rng_state) == original


test_cpu_compat_shims_are_removed_on_exit.without_shims = True  # type: ignore[attr-defined]


def test_megatron_linear_layers_never_see_a_live_context() -> None:
    assert mcore_layers.HAVE_TE is False
    model = gpt(cpu_offloading=True, cpu_offloading_num_layers=2)
    # the linear layers read config._cpu_offloading_context; it is cleared so their TE assert cannot fire
    linear = model.decoder.layers[0].mlp.linear_fc1
    assert linear.config._cpu_offloading_context is None
    model(**tiny_batch(BATCH, SEQ, VOCAB)).mean().backward()


# ---------------------------------------------------------------------------------------------------------
# Megatron's call shape: 0.16.1 (six positional arguments) and 0.19.2 (seven, retain_pinned_cpu_buffers last)
# ---------------------------------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[2]
MCORE_NEW = ROOT / ".mcore" / "0.19.2"


def _run_in_mcore(pythonpath: Path | None) -> dict:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "support" / "mcore_activation.py")],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("pythonpath", "version", "positional"),
    [
        pytest.param(None, "0.16.1", 6, id="0.16.1"),
        pytest.param(
            MCORE_NEW, "0.19.2", 7, id="0.19.2",
            marks=pytest.mark.skipif(not MCORE_NEW.exists(), reason="make setup installs .mcore/0.19.2"),
        ),
    ],
)  # fmt: skip
def test_each_megatron_core_calls_the_adapter_in_its_own_shape(pythonpath, version, positional) -> None:
    """A real GPTModel of each version builds our context from its own call and trains equal to no offload."""
    report = _run_in_mcore(pythonpath)
    assert report["version"].startswith(version)
    for result in report["results"]:
        (call,) = result["calls"]
        assert call["positional"] == positional
        assert (call["enabled"], call["num_layers"], call["model_layers"]) == (True, 2, 4)
        assert result["equal_to_no_offload"] and result["bytes_offloaded"] > 0
        assert result["retain"] is call["retain_pinned_cpu_buffers"] is (result["case"] == "retain")
    assert [r["case"] for r in report["results"]] == (["default", "retain"] if version == "0.19.2" else ["default"])


def test_adapter_binds_megatrons_seventh_argument_as_retain_not_manual() -> None:
    with install_activation_offload(min_tensor_size=MIN_SIZE) as installed:
        context, _ = installed._factory(True, 1, 2, True, False, False, True)  # MCore 0.19.2's shape
        assert isinstance(context, OffloadContext) and context.pool.retain and not context.schedule.manual
        context, _ = installed._factory(True, 1, 2, True, False, False)  # MCore 0.16.1's shape
        assert not context.pool.retain
        with pytest.raises(TypeError):
            installed._factory(True, 1, 2, True, False, False, False, None)  # not a shape MCore uses


def test_gpt_step_is_stream_ordered() -> None:
    """Every copy of a real GPTModel's offloaded step is ordered (``ordering.recording`` raises otherwise)."""
    from mbridge_offload_runtime.ordering import recording

    model, reference = gpt(cpu_offloading=True, cpu_offloading_num_layers=2), gpt()
    with recording() as rec:
        model(**tiny_batch(BATCH, SEQ, VOCAB)).mean().backward()
    reference(**tiny_batch(BATCH, SEQ, VOCAB)).mean().backward()
    assert rec.operations > 100 and model.decoder.offload_context.stats.bytes_reloaded > 0
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
