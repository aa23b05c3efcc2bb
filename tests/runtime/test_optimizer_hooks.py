"""Gradient copies start in backward (post-accumulate-grad hooks) with overlap on; the CPU runs the same order."""

from __future__ import annotations

import gc

import pytest
import torch

from mbridge_offload_runtime.optimizer import buckets
from mbridge_offload_runtime.optimizer.hybrid import HybridDeviceOptimizer
from tests.runtime.test_optimizer import make_model

HYPER = {"lr": 1e-2, "weight_decay": 0.1}


@pytest.fixture(autouse=True)
def every_member_hooked(monkeypatch):
    """The toy model's tensors are all below ``SMALL_COPY_NUMEL``: lower it so that each gets its backward hook."""
    monkeypatch.setattr(buckets, "SMALL_COPY_NUMEL", 1)


def hdo(model: torch.nn.Module, fraction: float = 1.0, overlap: bool = True) -> HybridDeviceOptimizer:
    return HybridDeviceOptimizer(
        model.parameters(),
        offload_fraction=fraction,
        bucket_size_numel=300,
        overlap_cpu_optimizer_d2h_h2d=overlap,
        **HYPER,
    )


def hook_count(model: torch.nn.Module) -> int:
    return sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())


def xs(n: int, seed: int = 2) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 8, generator=gen) for _ in range(n)]


def same_bits(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_backward_itself_copies_each_offloaded_grad_into_its_bucket():
    model = make_model()
    opt = hdo(model, fraction=0.5)
    assert hook_count(model) == sum(len(b.members) for b in opt._buckets) > 0
    model(xs(1)[0]).pow(2).mean().backward()
    for bi, b in enumerate(opt._buckets):
        grads = [p.grad for p in b.members]
        for view, g in zip(b.grad_views, grads, strict=True):
            assert torch.equal(view, g)  # on the host before step() was called
        assert opt._hook_copied(bi, grads) == set(range(len(b.members)))  # step() will not copy them again


def test_each_copy_starts_as_its_grad_is_ready_not_all_at_the_end():
    model = make_model()
    opt = hdo(model)
    order = []
    for i, p in enumerate(model.parameters()):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: order.append((i, len(opt._hooks.copied))))
    model(xs(1)[0]).pow(2).mean().backward()
    # Our hook (registered first) has copied param i by the time the spy on param i runs: in firing order the
    # spies see 1, 2, 3, ... copies done, i.e. each copy is issued while backward is still computing the rest.
    assert len(order) == 6
    assert [n for _, n in order] == list(range(1, 7))
    assert order[0][0] >= 4  # backward starts at the last layer


def test_in_place_change_after_the_hook_copy_is_seen_by_step():
    ref, model = make_model(), make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, **HYPER)
    opt = hdo(model)
    for x in xs(3):
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)  # in place, after every hook copy
            o.step()
    assert same_bits(model, ref)


@pytest.mark.parametrize("use_no_sync", [False, True], ids=["copy_every_micro_batch", "no_sync"])
def test_gradient_accumulation_over_micro_batches_is_exact(use_no_sync):
    ref, model = make_model(), make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, **HYPER)
    opt = hdo(model, fraction=0.6)
    data = xs(8)
    for step in range(2):
        micro = data[4 * step : 4 * step + 4]
        ref_opt.zero_grad()
        for x in micro:
            ref(x).pow(2).mean().backward()
        ref_opt.step()
        opt.zero_grad()
        for j, x in enumerate(micro):
            last = j == len(micro) - 1
            if use_no_sync and not last:
                with opt.no_sync():
                    model(x).pow(2).mean().backward()
                assert not opt._hooks.copied  # held back until the last micro-batch
            else:
                model(x).pow(2).mean().backward()
        assert opt._hooks.copied  # the last micro-batch copied the accumulated sums
        opt.step()
    assert same_bits(model, ref)


def test_remove_hooks_unregisters_and_training_stays_exact():
    ref, model = make_model(), make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, **HYPER)
    opt = hdo(model)
    opt.remove_hooks()
    assert hook_count(model) == 0
    for x in xs(2):
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    assert same_bits(model, ref)


def test_dropped_or_rebuilt_optimizer_leaves_no_hooks_behind():
    torch.optim.AdamW(make_model().parameters())  # torch's one-time lazy init keeps its first optimizer's frames
    model = make_model()
    opt = hdo(model)
    n = hook_count(model)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})  # rebuild: old hooks go, new ones come
    assert hook_count(model) == n
    gc.disable()  # dropped means gone at once (reference count), as when DistributedOptimizer replaces the HDO
    try:
        del opt
        assert hook_count(model) == 0
    finally:
        gc.enable()


def test_overlap_off_registers_no_hooks():
    model = make_model()
    opt = hdo(model, overlap=False)
    assert hook_count(model) == 0 and opt._hooks is None


def test_small_members_get_no_hook_and_step_moves_them_in_one_copy_per_run(monkeypatch):
    monkeypatch.setattr(buckets, "SMALL_COPY_NUMEL", 100)  # the toy's 8x32 / 32x16 weights are large, the rest small
    model = make_model()
    opt = hdo(model)
    large = [p for p in model.parameters() if p.numel() >= 100]
    assert hook_count(model) == len(large) > 0
    opt.reset_transfer_stats()
    model(xs(1)[0]).pow(2).mean().backward()
    opt.step()
    stats = opt.transfer_stats
    runs = sum(len(buckets.transfer_runs(list(range(len(b.members))), b.members)) for b in opt._buckets)
    assert stats.d2h_copies == runs < sum(1 for _ in model.parameters())
    assert stats.h2d_copies == runs
    assert stats.d2h_bytes == stats.h2d_bytes == 4 * opt.offloaded_numel
