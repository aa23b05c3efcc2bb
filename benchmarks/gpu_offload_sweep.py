"""GPU: the HDO step against its floor, overlap on/off by fraction and model size, and the planner's rates.

Three measurements, one run (< 5 min on one H100/H200), every figure from this run:

1. **Floor** (item 1). At fractions 0.25 / 0.5 / 0.75, on two parameter sets — the distributed optimizer's flat
   shards (1-D fp32, one per parameter of a GPT) and many small tensors (3,000 of 1-16 Ki elements + 12 of 8 Mi) —
   one ``HybridDeviceOptimizer.step()`` (overlap on) against its floor, measured in the same run:
   ``floor = GPU part at 1-f + CPU part at f + copies``: fused AdamW over exactly the parameters the HDO keeps on
   the GPU, fused CPU AdamW over one flat pinned buffer of the offloaded elements, and one pinned D2H plus one H2D
   copy of those elements (counted whole, though the pipeline overlaps all but the first and last bucket's, so the
   floor is generous). Target: step / floor <= 1.3. The copies the step issued (``transfer_stats``) are printed.
2. **Overlap advice** (item 3). Forward + backward + step of an MLP at three sizes, fractions 0.25 / 0.5 / 1.0,
   ``overlap_cpu_optimizer_d2h_h2d`` off and on: the ratio says where overlap helps.
3. **The planner's offload terms** (item 5). The CPU AdamW rate per core and the D2H / H2D rates measured in (1),
   beside the planner's preset for this GPU (``plan/inputs/hardware.py``) and its default per-core rate.

    .venv/bin/python benchmarks/gpu_offload_sweep.py --output /tmp/sweep.md --json /tmp/sweep.json   # on a GPU
    .venv/bin/python benchmarks/gpu_offload_sweep.py --dry-run --output /tmp/sweep.md   # CPU, tiny: NOT a measurement

Without CUDA it refuses unless ``--dry-run`` is given; a dry run says so in every output.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(1, os.path.join(os.path.dirname(__file__), "..", "offload"))  # this checkout's runtime package
from mbridge_offload_runtime import device
from mbridge_offload_runtime.optimizer.hybrid import HybridDeviceOptimizer

HYPER = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
FRACTIONS = (0.25, 0.5, 0.75)
TARGET = 1.3
SMALL = (1024, 4096, 16384)


def gpt_numels(hidden: int, layers: int, vocab: int) -> list[int]:
    """Element counts of a GPT's parameters, in Megatron's order: the distributed optimizer's shards at DP 1."""
    per_layer = [hidden, hidden, 3 * hidden * hidden, 3 * hidden, hidden * hidden, hidden]
    per_layer += [hidden, hidden, 4 * hidden * hidden, 4 * hidden, 4 * hidden * hidden, hidden]
    return [vocab * hidden, *(per_layer * layers), hidden, hidden]


def shape_sets(dry: bool) -> dict[str, list[int]]:
    if dry:
        return {
            "flat shards": gpt_numels(64, 2, 1000),
            "many small": [SMALL[i % 3] // 16 for i in range(300)] + [100_000] * 2,
        }
    return {
        "flat shards": gpt_numels(1024, 12, 32000),
        "many small": [SMALL[i % 3] for i in range(3000)] + [8 << 20] * 12,
    }


def make_params(numels: list[int], dev: torch.device) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for n in numels:
        p = torch.nn.Parameter((torch.randn(n, generator=gen) * 0.02).to(dev))
        p.grad = (torch.randn(n, generator=gen) * 1e-3).to(dev)
        params.append(p)
    return params


def timed(fn: Callable[[], object], steps: int) -> float:
    """Median seconds of ``fn`` (synchronized) after one warm-up call."""
    fn()
    device.synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        device.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def floor_parts(params: list[torch.nn.Parameter], offloaded: list[bool], dev: torch.device, steps: int) -> dict:
    """GPU part at 1-f, CPU part at f and the flat copies, each timed alone on the same parameters."""
    on_gpu = [p for p, o in zip(params, offloaded, strict=True) if not o]
    numel = sum(p.numel() for p, o in zip(params, offloaded, strict=True) if o)
    out = {"gpu": 0.0, "cpu": 0.0, "d2h": 0.0, "h2d": 0.0, "numel": numel}
    if on_gpu:
        gpu_opt = torch.optim.AdamW(on_gpu, fused=True, **HYPER)
        out["gpu"] = timed(gpu_opt.step, steps)
    if numel:
        pin = device.has_cuda()
        flat = torch.nn.Parameter(torch.zeros(numel, pin_memory=pin))
        flat.grad = torch.zeros(numel, pin_memory=pin)
        cpu_opt = torch.optim.AdamW([flat], fused=True, **HYPER)
        out["cpu"] = timed(cpu_opt.step, steps)
        on_dev = torch.zeros(numel, device=dev)
        out["d2h"] = timed(lambda: flat.grad.copy_(on_dev, non_blocking=True), steps)
        out["h2d"] = timed(lambda: on_dev.copy_(flat.detach(), non_blocking=True), steps)
    return out


def measure_floor(numels: list[int], dev: torch.device, steps: int) -> list[dict]:
    rows = []
    for f in FRACTIONS:
        params = make_params(numels, dev)
        opt = HybridDeviceOptimizer(params, offload_fraction=f, overlap_cpu_optimizer_d2h_h2d=True, **HYPER)
        step = timed(opt.step, steps)
        opt.reset_transfer_stats()
        opt.step()
        stats = opt.transfer_stats
        offloaded = [opt.is_offloaded(p) for p in params]
        del opt
        parts = floor_parts(params, offloaded, dev, steps)
        floor = parts["gpu"] + parts["cpu"] + parts["d2h"] + parts["h2d"]
        rows.append(
            {"fraction": f, "achieved": parts["numel"] / sum(numels), "step": step, "floor": floor, **parts,
             "ratio": step / floor if floor else float("nan"), "tensors": len(numels),
             "offloaded_tensors": sum(offloaded), "d2h_copies": stats.d2h_copies, "h2d_copies": stats.h2d_copies}
        )  # fmt: skip
    return rows


def overlap_sweep(dev: torch.device, dry: bool, steps: int) -> list[dict]:
    """Forward + backward + step of an MLP, by size, fraction and overlap."""
    sizes = [(64, 2), (128, 2)] if dry else [(1024, 8), (4096, 8), (8192, 8)]
    rows = []
    for width, layers in sizes:
        for f in (0.25, 0.5, 1.0):
            times = {}
            for overlap in (False, True):
                torch.manual_seed(0)
                model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(dev)
                opt = HybridDeviceOptimizer(
                    model.parameters(), offload_fraction=f, overlap_cpu_optimizer_d2h_h2d=overlap, **HYPER
                )
                x = torch.randn(64, width, device=dev)

                def iteration(model=model, opt=opt, x=x) -> None:
                    opt.zero_grad()
                    model(x).pow(2).mean().backward()
                    opt.step()

                times[overlap] = timed(iteration, steps)
                del model, opt
            params = layers * (width * width + width)
            rows.append({"params": params, "fraction": f, "off": times[False], "on": times[True],
                         "gain": times[False] / times[True]})  # fmt: skip
    return rows


def planner_rates(floor_rows: list[dict]) -> dict:
    """This run's CPU AdamW and copy rates beside the planner's preset for this GPU and its default."""
    from mbridge_offload.plan.inputs.hardware import gpu_preset
    from mbridge_offload.plan.time.step import DEFAULT_CPU_ADAM_PARAMS_PER_S_PER_CORE

    big = max(floor_rows, key=lambda r: r["numel"])
    threads = torch.get_num_threads()
    name = torch.cuda.get_device_name() if device.has_cuda() else "cpu"
    preset_name = "h200-141gb" if "H200" in name else "h100-80gb"
    preset = gpu_preset(preset_name)
    return {
        "preset": preset_name,
        "threads": threads,
        "cpu_adam_per_core_measured": big["numel"] / big["cpu"] / threads if big["cpu"] else None,
        "cpu_adam_per_core_preset": preset.cpu_adam_params_per_s_per_core,
        "cpu_adam_per_core_default": DEFAULT_CPU_ADAM_PARAMS_PER_S_PER_CORE,
        "d2h_gbps_measured": 4 * big["numel"] / big["d2h"] / 1e9 if big["d2h"] else None,
        "h2d_gbps_measured": 4 * big["numel"] / big["h2d"] / 1e9 if big["h2d"] else None,
        "d2h_gbps_preset": preset.d2h_effective_gbps,
        "h2d_gbps_preset": preset.h2d_effective_gbps,
    }


def render(result: dict) -> str:
    dry = result["dry_run"]
    label = "**DRY RUN on CPU, tiny shapes: NOT a measurement**" if dry else f"**GPU-measured** on {result['device']}"
    lines = [f"# HDO floor, overlap sweep and planner rates — {result['when']} UTC", "", label + ".", ""]
    lines += ["| parameters | f | achieved | tensors (offloaded) | copies D2H/H2D | step s | floor s | GPU part | "
              "CPU part | D2H | H2D | step / floor |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, rows in result["floor"].items():
        for r in rows:
            lines.append(
                f"| {name} | {r['fraction']:.2f} | {r['achieved']:.3f} | {r['tensors']} ({r['offloaded_tensors']}) | "
                f"{r['d2h_copies']}/{r['h2d_copies']} | {r['step']:.4f} | {r['floor']:.4f} | {r['gpu']:.4f} | "
                f"{r['cpu']:.4f} | {r['d2h']:.4f} | {r['h2d']:.4f} | {r['ratio']:.2f}x |"
            )
    worst = max(r["ratio"] for rows in result["floor"].values() for r in rows)
    lines += ["", f"Worst step / floor {worst:.2f}x (target {TARGET}x).", ""]
    lines += ["| MLP params | f | overlap off s | on s | off / on |", "|---|---|---|---|---|"]
    for r in result["overlap"]:
        lines.append(f"| {r['params'] / 1e6:.1f} M | {r['fraction']:.2f} | {r['off']:.4f} | {r['on']:.4f} | "
                     f"{r['gain']:.2f}x |")  # fmt: skip
    p = result["rates"]
    lines += ["", f"| planner term | measured here ({p['threads']} threads) | planner preset {p['preset']} | default |",
              "|---|---|---|---|"]  # fmt: skip
    fmt = lambda v, unit: "-" if v is None else f"{v:.3g}{unit}"  # noqa: E731
    lines.append(f"| CPU AdamW params/s per core | {fmt(p['cpu_adam_per_core_measured'], '')} | "
                 f"{fmt(p['cpu_adam_per_core_preset'], '')} | {fmt(p['cpu_adam_per_core_default'], '')} |")  # fmt: skip
    lines.append(f"| D2H GB/s | {fmt(p['d2h_gbps_measured'], '')} | {fmt(p['d2h_gbps_preset'], '')} | - |")
    lines.append(f"| H2D GB/s | {fmt(p['h2d_gbps_measured'], '')} | {fmt(p['h2d_gbps_preset'], '')} | - |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU: exercises the script, measures nothing")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per measurement (median)")
    ap.add_argument("--output", default=os.path.join(tempfile.gettempdir(), "gpu-offload-sweep.md"))
    ap.add_argument("--json", default=None, help="also write the raw results here")
    args = ap.parse_args(argv)
    if not device.has_cuda() and not args.dry_run:
        print(json.dumps({"error": "no CUDA device; pass --dry-run for the CPU run of tiny shapes"}))
        return 2
    dev = device.compute_device()
    floor = {name: measure_floor(numels, dev, args.steps) for name, numels in shape_sets(args.dry_run).items()}
    result = {
        "dry_run": args.dry_run,
        "device": torch.cuda.get_device_name() if device.has_cuda() else "cpu",
        "when": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}",
        "floor": floor,
        "overlap": overlap_sweep(dev, args.dry_run, args.steps),
        "rates": planner_rates([r for rows in floor.values() for r in rows]),
    }
    text = render(result)
    with open(args.output, "w") as fh:
        fh.write(text)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
