"""GPU benchmark: HybridDeviceOptimizer vs no offload and vs megatron-core's own HDO (< 10 min on one H100/H200).

For offload fractions 0 / 0.25 / 0.5 / 0.75 / 1.0, with and without overlap, it measures per optimizer step the
wall time (synchronized), the host time until ``step()`` returns, ``max_memory_allocated`` during the step phase,
and parity with plain GPU AdamW on the same parameters and gradients; the same for the peers as they run in
production (``benchmarks/optimizer_peers.py``): megatron-core's ``HybridDeviceOptimizer`` at each fraction built as
``get_megatron_optimizer`` builds it (fused CPU AdamW, TE's FusedAdam or megatron-core's torch fallback,
``param_update_in_fp32``; its fraction read from its own state) and torchao's ``CPUOffloadOptimizer`` where it
imports (``PYTHONPATH=.peers``); a 5-step training run through
``get_megatron_optimizer`` + ``DistributedOptimizer`` with ours installed (:func:`install_optimizer_offload`),
compared with the same run without offload; and forward + backward + step of an MLP at fraction 1.0 with overlap off
vs on, where the gradient copies start in backward hooks. It prints the table and writes it to ``--output``
(default: a file in the temp directory, never a tracked file unless asked).

    python benchmarks/gpu_optimizer.py --output docs/benchmarks-optimizer-gpu.md   # on a CUDA machine: the docs
    python benchmarks/gpu_optimizer.py --quick                      # tiny sizes (what runs without a GPU)

Without CUDA it falls back to the CPU with tiny sizes and says so in the table; the numbers are then a smoke test.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(1, os.path.join(os.path.dirname(__file__), "..", "offload"))  # this checkout's runtime package
from benchmarks import optimizer_peers as peers
from mbridge_offload_runtime import device
from mbridge_offload_runtime.optimizer.hybrid import HybridDeviceOptimizer
from mbridge_offload_runtime.optimizer.megatron import install_optimizer_offload

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


def bench(make_opt, dev, sizes, steps: int, fraction_of=None) -> dict:
    """Median step time, host time and peak memory of one optimizer; ``fraction_of(opt)`` reads its split."""
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
    out["fraction"] = fraction_of(opt) if fraction_of is not None else getattr(opt, "offloaded_fraction", 0.0)
    return out


def megatron_check(dev: torch.device, quick: bool) -> str:
    """Train a small model through Megatron's DistributedOptimizer with our HDO inside; compare with no offload."""
    if not device.has_cuda():
        return "skipped: Megatron's DistributedOptimizer needs CUDA"
    try:
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
        installed = install_optimizer_offload()  # Megatron's factory and DistributedOptimizer now build ours

        def run(offload: bool) -> list[torch.Tensor]:
            torch.manual_seed(0)
            width = 64 if quick else 1024
            # bf16 weights: the DistributedOptimizer then gives the HDO fp32 main shards (leaf tensors); with fp32
            # weights it would pass views of the model params, which no torch optimizer accepts (upstream's neither).
            bf16 = torch.bfloat16
            module = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)]).to(dev, bf16)
            cfg = TransformerConfig(
                num_layers=1, hidden_size=width, num_attention_heads=1, bf16=True, params_dtype=bf16
            )
            ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
            model = DistributedDataParallel(cfg, ddp_cfg, module)
            ocfg = OptimizerConfig(
                optimizer="adam",
                lr=1e-3,
                weight_decay=0.1,
                bf16=True,
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
                module(torch.randn(8, width, device=dev, generator=gen, dtype=bf16)).float().pow(2).mean().backward()
                model.finish_grad_sync()
                opt.step()
            inner = getattr(opt, "chained_optimizers", [opt])[0].optimizer
            if offload:
                assert isinstance(inner, HybridDeviceOptimizer), f"inner optimizer is {type(inner).__name__}"
                opt.state_dict()  # the save path that asserted upstream on the per-param `step`
            return [p.detach().float().clone() for p in module.parameters()]

        try:
            ours, plain = run(True), run(False)
        finally:
            installed.remove()
        diff = max((a - b).abs().max().item() for a, b in zip(ours, plain, strict=True))
        # Megatron's plain path runs TE's FusedAdam on a GPU, ours torch's fused AdamW: the fp32 updates may differ
        # in the last bits, which can flip a bf16 rounding. Allow 4 bf16 ulps of the largest weight.
        tol = 4 * torch.finfo(torch.bfloat16).eps * max(p.abs().max().item() for p in plain)
        verdict = "OK" if diff <= tol else "MISMATCH"
        return (
            f"{verdict}: DistributedOptimizer(HybridDeviceOptimizer) vs no offload, bf16, 5 steps, "
            f"max |diff| = {diff:.2e} (tolerance {tol:.1e})"
        )
    except Exception as exc:
        tb = traceback.format_exc(limit=3).strip().splitlines()
        return f"ERROR: {type(exc).__name__}: {exc} | {' / '.join(tb[-3:])}"


def backward_overlap_check(dev: torch.device, quick: bool, steps: int) -> str:
    """Forward + backward + step of an MLP at fraction 1.0, overlap off vs on (gradient copies in backward hooks)."""
    width, layers = (64, 4) if quick else (4096, 8)  # ~134 M params on a GPU

    def run(overlap: bool) -> tuple[float, list[torch.Tensor]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(dev)
        opt = HybridDeviceOptimizer(
            model.parameters(), offload_fraction=1.0, overlap_cpu_optimizer_d2h_h2d=overlap, **HYPER
        )
        gen = torch.Generator(device=dev).manual_seed(1)
        times = []
        for _ in range(steps + 1):  # the first iteration warms up
            x = torch.randn(64, width, device=dev, generator=gen)
            device.synchronize()
            t0 = time.perf_counter()
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            device.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:]), [p.detach().clone() for p in model.parameters()]

    (off, ref), (on, ours) = run(False), run(True)
    same = all(torch.equal(a, b) for a, b in zip(ref, ours, strict=True))
    return (
        f"fraction 1.0, forward+backward+step: overlap off {off:.4f} s, on {on:.4f} s ({off / on:.2f}x); "
        f"weights {'bit-identical' if same else 'DIFFER'}"
    )


def measure_rows(dev: torch.device, sizes: tuple, steps: int) -> tuple[list, dict]:
    """Plain AdamW, ours at every fraction (overlap off/on), and the peers as they run in production (CUDA only):
    megatron-core's HDO as ``get_megatron_optimizer`` builds it (its fraction read from its own state) and torchao's
    CPUOffloadOptimizer (everything offloaded; it has no fraction)."""
    ref = bench(lambda ps: torch.optim.AdamW(ps, fused=True, **HYPER), dev, sizes, steps)
    rows = [("no offload: fused AdamW", "-", "-", ref, 0.0)]
    candidates: list[tuple] = []
    for fraction in (0.0, 0.25, 0.5, 0.75, 1.0):
        for overlap in (False, True):
            make = lambda ps, f=fraction, o=overlap: HybridDeviceOptimizer(  # noqa: E731
                ps, offload_fraction=f, overlap_cpu_optimizer_d2h_h2d=o, **HYPER
            )
            candidates.append((f"ours {fraction:.2f}", "on" if overlap else "off", make, None))
    if device.has_cuda() and peers.megatron_hdo_classes() is not None:
        for fraction in (0.0, 0.25, 0.5, 0.75, 1.0):
            make = lambda ps, f=fraction: peers.megatron_hdo(ps, f, overlap=True)  # noqa: E731
            candidates.append((f"megatron-core HDO {fraction:.2f}", "on", make, peers.megatron_hdo_fraction))
    if device.has_cuda() and peers.torchao_offload([torch.nn.Parameter(torch.zeros(1, device=dev))]) is not None:
        candidates.append(("torchao CPUOffloadOptimizer", "on", peers.torchao_offload, lambda _opt: 1.0))
    for label, overlap, make, fraction_of in candidates:
        r = bench(make, dev, sizes, steps, fraction_of)
        diff = max((a - b).abs().max().item() for a, b in zip(r["params"], ref["params"], strict=True))
        rows.append((label, f"{r['fraction']:.3f}", overlap, r, diff))
        del r["params"]
    return rows, ref


def render(rows: list, ref: dict, header: list[str], megatron: str, upstream_note: str, hooks: str) -> str:
    lines = [*header, ""]
    lines.append(
        "| optimizer | achieved fraction | overlap | step s (synced) | host s | vs no offload | peak MiB"
        " | max diff vs no offload |"
    )
    lines.append("|---|---|---|---|---|---|---|---|")
    for label, frac, ov, r, diff in rows:
        lines.append(
            f"| {label} | {frac} | {ov} | {r['wall']:.4f} | {r['host']:.4f} | {r['wall'] / ref['wall']:.2f}x | "
            f"{r['peak'] / 2**20:.1f} | {diff:.1e} |"
        )
    worst = max(d for *_, d in rows)
    lines += ["", f"parity: {'OK' if worst <= 1e-5 else 'FAIL'} (worst {worst:.1e}, tolerance 1e-5, same grads)"]
    lines += [f"megatron-core HDO: {upstream_note}", f"megatron: {megatron}", f"backward hooks: {hooks}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on whatever device is there (as --quick)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per row (median; default 5)")
    ap.add_argument(
        "--output",
        default=os.path.join(tempfile.gettempdir(), "benchmarks-optimizer-gpu.md"),
        help="Markdown table to write (default: in the temp directory; docs/benchmarks-optimizer-gpu.md for the docs)",
    )
    args = ap.parse_args(argv)
    dev = device.compute_device()
    quick = args.quick or args.dry_run or not device.has_cuda()
    sizes = (300, 2, 100_000) if quick else (3000, 12, 8_000_000)  # ~100 M params on a GPU
    total = sum(SMALL[i % len(SMALL)] for i in range(sizes[0])) + sizes[1] * sizes[2]
    where = (
        f"**GPU-measured** on {torch.cuda.get_device_name()}"
        if device.has_cuda()
        else "**No CUDA device: CPU fallback, tiny sizes (smoke test only, not a GPU measurement)**"
    )
    header = [
        f"# GPU optimizer benchmark — {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "",
        f"{where}; host: {platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__}.",
        f"Parameters: {sizes[0]} small + {sizes[1]} x {sizes[2] / 1e6:.1f} M = {total / 1e6:.1f} M fp32; median of"
        f" {args.steps} steps after one warm-up step. Written by `benchmarks/gpu_optimizer.py`.",
    ]
    rows, ref = measure_rows(dev, sizes, args.steps)
    if peers.megatron_hdo_classes() is None:
        upstream_note = "not installed"
    elif device.has_cuda():
        upstream_note = f"measured above, built as get_megatron_optimizer builds it ({peers.megatron_hdo_note()})"
    else:
        upstream_note = "skipped: it needs CUDA streams"
    upstream_note += f"; peers: {peers.peer_status()}"
    hooks = backward_overlap_check(dev, quick, args.steps)
    text = render(rows, ref, header, megatron_check(dev, quick), upstream_note, hooks)
    with open(args.output, "w") as fh:
        fh.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
