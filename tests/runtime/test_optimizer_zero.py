"""A real sharded engine: ZeroRedundancyOptimizer(optimizer_class=HybridDeviceOptimizer) + DDP on 2 gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from mbridge_offload_runtime.optimizer.hybrid import HybridDeviceOptimizer
from tests.runtime.test_optimizer import HYPER, make_model

STEPS = 5


def batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(21)
    return [torch.randn(8, 8, generator=gen) for _ in range(STEPS)]


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    model = DDP(make_model())
    opt = ZeroRedundancyOptimizer(
        model.parameters(),
        optimizer_class=HybridDeviceOptimizer,
        offload_fraction=0.5,
        bucket_size_numel=300,
        **HYPER,
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    norms = []
    for x in batches():
        opt.zero_grad()
        model(x.chunk(world)[rank]).pow(2).mean().backward()  # DDP averages: equals the full-batch mean
        full_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        # each rank's inner optimizer holds one shard: the global norm needs the sum over ranks
        norms.append((opt.optim.clip_grad_norm_(1e9, process_group=dist.group.WORLD), full_norm))
        opt.step()
        sched.step()
    local = opt.optim
    torch.save(
        {
            "params": [p.detach() for p in model.module.parameters()],
            "offloaded": local.offloaded_numel,
            "total": local.total_numel,
            "type": type(local).__name__,
            "norms": norms,
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    dist.destroy_process_group()


@pytest.mark.slow
def test_zero_with_hybrid_inner_optimizer_matches_single_process(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    ref = make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    for x in batches():
        ref_opt.zero_grad()
        ref(x).pow(2).mean().backward()
        ref_opt.step()
        sched.step()
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert all(r["type"] == "HybridDeviceOptimizer" for r in results)
    # each rank owns a shard, and each shard is split by the inner optimizer
    assert sum(r["total"] for r in results) == sum(p.numel() for p in ref.parameters())
    assert all(0 < r["offloaded"] <= r["total"] for r in results)
    for r in results:
        for sharded, full in r["norms"]:
            torch.testing.assert_close(sharded, full)
    for r in results:
        for p, q in zip(r["params"], ref.parameters(), strict=True):
            torch.testing.assert_close(p, q.detach(), atol=1e-6, rtol=1e-5)
