"""Checkpoints resume bit-exactly at any fraction, with offload turned off, and from a plain AdamW checkpoint.

Both parts of the optimizer run torch's fused AdamW kernel by default (the device part in place, the host part on
flat buckets), so the split does not change a single bit of the update, and a plain ``AdamW(fused=True)`` is the
same arithmetic as the optimizer with offload off. ``state_dict()`` returns references (no copies).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from mbridge_offload_runtime.optimizer.hybrid import HybridDeviceOptimizer
from tests.runtime.test_optimizer import make_model

# The offload suite (`mbridge-offload test -k cpu_offload`, `pytest -k cpu_offload`): see pyproject.toml.
pytestmark = pytest.mark.cpu_offload

FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
LR_ONLY = {"lr": 1e-2}  # the KeyError 'betas' case: every other hyper-parameter left to the defaults


def batches(n: int, seed: int = 5) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 8, generator=gen) for _ in range(n)]


def run(model: torch.nn.Module, opt: torch.optim.Optimizer, xs: list[torch.Tensor]) -> None:
    for x in xs:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def hdo(model: torch.nn.Module, fraction: float) -> HybridDeviceOptimizer:
    return HybridDeviceOptimizer(model.parameters(), offload_fraction=fraction, bucket_size_numel=300, **LR_ONLY)


def plain(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), fused=True, **LR_ONLY)


def same_bits(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def resume(saved_model: torch.nn.Module, saved_opt: torch.optim.Optimizer, make_opt) -> tuple:
    """A new model (other init) and optimizer loaded from a torch.save round trip of the saved pair."""
    import io

    buf = io.BytesIO()
    torch.save({"model": saved_model.state_dict(), "optim": saved_opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model = make_model(seed=77)
    model.load_state_dict(ckpt["model"])
    opt = make_opt(model)
    opt.load_state_dict(ckpt["optim"])
    return model, opt


def test_offload_off_is_bit_identical_to_fused_adamw_at_every_fraction():
    xs = batches(6)
    ref = make_model()
    run(ref, plain(ref), xs)
    for fraction in FRACTIONS:
        model = make_model()
        run(model, hdo(model, fraction), xs)
        assert same_bits(model, ref), fraction


@pytest.mark.parametrize(("saved_at", "resumed_at"), list(itertools.product(FRACTIONS, FRACTIONS)))
def test_resume_at_any_fraction_is_bit_exact(saved_at, resumed_at):
    xs = batches(8)
    full = make_model()
    run(full, hdo(full, saved_at), xs)

    first = make_model()
    opt = hdo(first, saved_at)
    run(first, opt, xs[:4])
    model, opt2 = resume(first, opt, lambda m: hdo(m, resumed_at))
    run(model, opt2, xs[4:])
    assert same_bits(model, full)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_plain_adamw_resumes_an_hdo_checkpoint_bit_exactly(fraction):
    xs = batches(8)
    full = make_model()
    run(full, hdo(full, fraction), xs)

    first = make_model()
    opt = hdo(first, fraction)
    run(first, opt, xs[:4])
    model, opt2 = resume(first, opt, plain)  # offload turned off: before the fix, KeyError 'betas'
    run(model, opt2, xs[4:])
    assert same_bits(model, full)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_hdo_resumes_a_plain_adamw_checkpoint_bit_exactly(fraction):
    xs = batches(8)
    full = make_model()
    run(full, plain(full), xs)

    first = make_model()
    opt = plain(first)
    run(first, opt, xs[:4])
    model, opt2 = resume(first, opt, lambda m: hdo(m, fraction))
    run(model, opt2, xs[4:])
    assert same_bits(model, full)


def _storages(opt: HybridDeviceOptimizer) -> set[int]:
    """data_ptr of every storage that holds live optimizer state or an fp32 master."""
    ptrs = set()
    for sub in opt.sub_optimizers:
        for st in sub.state.values():
            ptrs |= {v.untyped_storage().data_ptr() for v in st.values() if isinstance(v, torch.Tensor)}
    ptrs |= {b.flat_param.untyped_storage().data_ptr() for b in opt._buckets}
    ptrs |= {m.untyped_storage().data_ptr() for m in opt._masters.values()}
    return ptrs


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_returns_references_into_the_live_state(fraction, dtype):
    model = make_model().to(dtype)
    opt = HybridDeviceOptimizer(
        model.parameters(), offload_fraction=fraction, bucket_size_numel=300, param_update_in_fp32=True, **LR_ONLY
    )
    run(model, opt, [x.to(dtype) for x in batches(2)])
    live = _storages(opt)
    saved = opt.state_dict()["state"]
    assert len(saved) == len(list(model.parameters()))
    copied = 0
    for st in saved.values():
        for key, v in st.items():
            if key == "step":
                assert v.numel() == 1  # the one per-parameter copy: 4 bytes
                copied += v.nbytes
                continue
            assert v.untyped_storage().data_ptr() in live, key
    if dtype == torch.bfloat16:
        assert all("master_param" in st for st in saved.values())
    state_bytes = sum(v.nbytes for st in saved.values() for k, v in st.items() if k != "step")
    assert copied < 0.1 * state_bytes


def test_each_parameter_gets_its_own_step_counter():
    model = make_model()
    opt = hdo(model, 1.0)  # one bucket holds several parameters and one step tensor
    run(model, opt, batches(1))
    steps = [st["step"] for st in opt.state_dict()["state"].values()]
    assert len({s.untyped_storage().data_ptr() for s in steps}) == len(steps)


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_writing_state_entries_reaches_the_sub_optimizers(fraction):
    """Megatron's DistributedOptimizer loads by assigning ``optimizer.state[param][key] = tensor``."""
    source, model = make_model(), make_model()
    src_opt, opt = hdo(source, fraction), hdo(model, fraction)
    run(source, src_opt, batches(3))
    run(model, opt, batches(1, seed=9))  # other moments and step count
    model.load_state_dict(source.state_dict())
    opt.refresh_from_model()
    for p, q in zip(model.parameters(), source.parameters(), strict=True):
        for key, value in src_opt.state[q].items():
            opt.state[p][key] = value.clone()
    xs = batches(2, seed=6)
    run(source, src_opt, xs)
    run(model, opt, xs)
    assert same_bits(model, source)
