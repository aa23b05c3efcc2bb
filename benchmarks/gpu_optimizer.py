"""GPU benchmark: HybridDeviceOptimizer vs plain GPU AdamW, one command, one table (< 5 min on one H100/H200).

For offload fractions 0 / 0.25 / 0.5 / 1.0, with and without overlap, it measures per optimizer step the wall time
(synchronized), the host time until ``step()`` returns, ``max_memory_allocated`` during the step phase, and
parity with plain GPU AdamW on the same parameters and gradients. When megatron-core is importable it also trains
a small model through Megatron's own ``DistributedOptimizer`` with our optimizer as the inner one and compares it
with the same run without offload.

    python benchmarks/gpu_optimizer.py            # on a CUDA machine
    python benchmarks/gpu_optimizer.py --quick    # tiny sizes (what runs when there is no GPU)

Without CUDA it falls back to the CPU with tiny sizes and says so; the numbers are then only a smoke test.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from mbridge_offload.runtime import device
from mbridge_offload.runtime.optimizer.hybrid import HybridDeviceOptimizer

HYPER = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
SMALL = (1024, 4096, 16384)


def make_params(dev: torch.device, n_small: int, n_large: int, large: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(SMALL[i % len(SMALL)],) for i in range(n_small)] + [(large,)] * n_large
    params = []
    for s in shapes:
        p = torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(dev))
        p.grad = (torch.randn(s, generator=gen) * 1e-3).to(dev)
        params.append(p)
    return params


def bench(make_opt, dev, sizes, steps: int) -> dict:
    params = make_params(dev, *sizes)
    device.synchronize()
    base = device.memory_counters(dev).allocated
    device.reset_peak(dev)
    opt = make_opt(params)
    opt.step()  # warm-up: materializes the state
    device.synchronize()
    wall, host = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        host.append(time.perf_counter() - t0)
        device.synchronize()
        wall.append(time.perf_counter() - t0)
    peak = device.memory_counters(dev).max_allocated - base
    out = {"wall": statistics.median(wall), "host": statistics.median(host), "peak": peak, "params": params}
    out["fraction"] = getattr(opt, "offloaded_fraction", 0.0)
    return out


def megatron_check(dev: torch.device, quick: bool) -> str:
    """Train a small model through Megatron's DistributedOptimizer with our HDO inside; compare with no offload."""
    if not device.has_cuda():
        return "skipped: Megatron's DistributedOptimizer needs CUDA"
    try:
        import megatron.core.optimizer as mopt
        import megatron.core.optimizer.distrib_optimizer as mdist
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer import TransformerConfig
    except Exception as exc:  # megatron-core absent or broken: report, do not fail the benchmark
        return f"skipped: megatron-core not importable ({type(exc).__name__}: {exc})"
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29571")
            dist.init_process_group("nccl", rank=0, world_size=1)
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)
        # Megatron picks its HDO class by these module-level names; point them at ours.
        mopt.HybridDeviceOptimizer = HybridDeviceOptimizer
        mdist.HybridDeviceOptimizer = HybridDeviceOptimizer

        def run(offload: bool) -> list[torch.Tensor]:
            torch.manual_seed(0)
            width = 64 if quick else 1024
            module = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)]).to(dev)
            cfg = TransformerConfig(num_layers=1, hidden_size=width, num_attention_heads=1)
            ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=True)
            model = DistributedDataParallel(cfg, ddp_cfg, module)
            ocfg = OptimizerConfig(
                optimizer="adam",
                lr=1e-3,
                weight_decay=0.1,
                use_distributed_optimizer=True,
                optimizer_cpu_offload=offload,
                optimizer_offload_fraction=0.5 if offload else 0.0,
                overlap_cpu_optimizer_d2h_h2d=offload,
            )
            opt = get_megatron_optimizer(ocfg, [model])
            gen = torch.Generator(device=dev).manual_seed(1)
            for _ in range(5):
                model.zero_grad_buffer()
                opt.zero_grad()
                module(torch.randn(8, width, device=dev, generator=gen)).pow(2).mean().backward()
                model.finish_grad_sync()
                opt.step()
            inner = getattr(opt, "optimizer", None)
            if offload:
                assert isinstance(inner, HybridDeviceOptimizer), f"inner optimizer is {type(inner).__name__}"
                opt.state_dict()  # the save path that asserted upstream on the per-param `step`
            return [p.detach().float().clone() for p in module.parameters()]

        diff = max((a - b).abs().max().item() for a, b in zip(run(True), run(False), strict=True))
        verdict = "OK" if diff <= 1e-5 else "MISMATCH"
        return f"{verdict}: DistributedOptimizer(HybridDeviceOptimizer) vs no offload, 5 steps, max |diff| = {diff:.2e}"
    except Exception as exc:
        tb = traceback.format_exc(limit=3).strip().splitlines()
        return f"ERROR: {type(exc).__name__}: {exc} | {' / '.join(tb[-3:])}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    dev = device.compute_device()
    quick = args.quick or not device.has_cuda()
    sizes = (300, 2, 100_000) if quick else (3000, 12, 8_000_000)  # ~100 M params on a GPU
    total = sum(SMALL[i % len(SMALL)] for i in range(sizes[0])) + sizes[1] * sizes[2]
    name = torch.cuda.get_device_name() if device.has_cuda() else "no CUDA: CPU fallback, tiny sizes (smoke test only)"
    print(f"# GPU optimizer benchmark — {datetime.date.today().isoformat()}")
    print(f"device: {name}; host: {platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__}")
    print(
        f"params: {sizes[0]} small + {sizes[1]} x {sizes[2] / 1e6:.1f} M = {total / 1e6:.1f} M fp32;"
        f" median of {args.steps} steps\n"
    )

    ref = bench(lambda ps: torch.optim.AdamW(ps, fused=device.has_cuda(), **HYPER), dev, sizes, args.steps)
    rows = [("plain GPU AdamW", "-", "-", ref, 0.0)]
    for fraction in (0.0, 0.25, 0.5, 1.0):
        for overlap in (False, True):
            r = bench(
                lambda ps, f=fraction, o=overlap: HybridDeviceOptimizer(
                    ps, offload_fraction=f, overlap_cpu_optimizer_d2h_h2d=o, **HYPER
                ),
                dev,
                sizes,
                args.steps,
            )
            diff = max((a - b).abs().max().item() for a, b in zip(r["params"], ref["params"], strict=True))
            rows.append((f"HDO {fraction:.2f}", f"{r['fraction']:.3f}", "on" if overlap else "off", r, diff))
            del r["params"]
    print(
        "| optimizer | achieved fraction | overlap | step s (synced) | host s | vs plain | peak MiB"
        " | max diff vs plain |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label, frac, ov, r, diff in rows:
        print(
            f"| {label} | {frac} | {ov} | {r['wall']:.4f} | {r['host']:.4f} | {r['wall'] / ref['wall']:.2f}x | "
            f"{r['peak'] / 2**20:.1f} | {diff:.1e} |"
        )
    worst = max(d for *_, d in rows)
    print(f"\nparity: {'OK' if worst <= 1e-5 else 'FAIL'} (worst {worst:.1e}, tolerance 1e-5, same steps and grads)")
    print(f"megatron: {megatron_check(dev, quick)}")


if __name__ == "__main__":
    main()
