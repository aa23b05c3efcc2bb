"""``load_state_dict`` of our HybridDeviceOptimizer vs megatron-core's HDO and plain AdamW, measured in one run.

The resume case: each optimizer has stepped once (its state exists, as in Megatron, which initialises the state
before it loads), then loads a checkpoint of independent tensors (what ``torch.load`` gives). All parameters are
offloaded (fraction 1.0). Reported per variant: the best-of-reps CPU time of the call (this thread's time, so
waiting for a core on a shared machine does not count), and its transient host memory, i.e. the peak resident set
during the call minus the larger of the resident set before and after it (the kernel's high-water mark, reset
just before the call through ``/proc/self/clear_refs``), next to the state's own size. Megatron-core's HDO runs
on CPU under the labelled shims of ``tests/support/upstream_shims_hdo.py`` (it is skipped when megatron-core is
not installed). Ratios are against megatron-core's HDO in the same run.

    .venv/bin/python benchmarks/optimizer_load.py                     # ~100 M parameters; prints the table
    .venv/bin/python benchmarks/optimizer_load.py --quick             # ~0.2 M parameters; a smoke test
    .venv/bin/python benchmarks/optimizer_load.py --output docs/benchmarks-optimizer.md   # writes its section

Nothing is written without ``--output``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(1, os.path.join(os.path.dirname(__file__), "..", "offload"))  # this checkout's runtime package
from benchmarks.cpu_optimizer import HYPER, gpt_shapes, make_grads
from benchmarks.doc_fragment import table, write_section
from mbridge_offload_runtime.optimizer.hybrid import HybridDeviceOptimizer

MIB = 2**20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure_call(fn: Callable[[], object]) -> dict[str, float]:
    """CPU seconds of ``fn()`` and its transient resident memory in bytes (peak minus max(before, after)).

    Linux only: the high-water mark is reset by writing 5 to ``/proc/self/clear_refs``.
    """
    gc.collect()
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    t0 = time.thread_time()
    fn()
    seconds = time.thread_time() - t0
    peak, after = _status_kib("VmHWM"), _status_kib("VmRSS")
    return {"seconds": seconds, "transient_bytes": max(0, peak - max(before, after)) * 1024}


def checkpoint_of(opt: torch.optim.Optimizer) -> dict:
    """``opt.state_dict()`` with every tensor an independent copy, like a checkpoint read back from disk."""
    sd = opt.state_dict()
    state = {
        i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()} for i, s in sd["state"].items()
    }
    return {"state": state, "param_groups": sd["param_groups"]}


def state_bytes(sd: dict) -> int:
    return sum(v.nbytes for s in sd["state"].values() for v in s.values() if isinstance(v, torch.Tensor))


def _params(shapes: list[tuple[int, ...]], wrap: type = torch.nn.Parameter) -> list[torch.nn.Parameter]:
    grads = make_grads(shapes)
    params = [wrap(torch.full_like(g, 0.02)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    return params


def _ours(shapes):
    return HybridDeviceOptimizer(_params(shapes), offload_fraction=1.0, **HYPER), None


def _plain(shapes):
    return torch.optim.AdamW(_params(shapes), fused=True, **HYPER), None


def _upstream(shapes):
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer as Upstream

    from tests.support.upstream_shims_hdo import FakeDevParam, upstream_hdo_shims

    shims = upstream_hdo_shims
    with shims():
        opt = Upstream(
            _params(shapes, FakeDevParam),  # SHIM-IS-CUDA
            offload_fraction=1.0,
            cpu_optimizer_cls=torch.optim.AdamW,
            gpu_optimizer_cls=torch.optim.AdamW,
            pin_cpu_grads=False,  # SHIM-PIN
            **HYPER,
        )
    return opt, shims


def measure_variant(make: Callable, shapes: list[tuple[int, ...]], reps: int, scenario: str) -> dict[str, float]:
    """Build, step once, save; then load the checkpoint ``reps`` times: best time, largest transient memory.

    ``copy``: the checkpoint's tensors are independent copies (``torch.load``). ``in_place``: they are the
    optimizer's own state tensors, as with Megatron's dist-checkpointing, whose loader fills a template built from
    the live state (``sharded_state_dict(is_loading=True)``) and then calls ``load_state_dict`` with it.
    """
    opt, shims = make(shapes)
    ctx = shims or contextlib.nullcontext
    with ctx():
        opt.step()
    sd = checkpoint_of(opt) if scenario == "copy" else opt.state_dict()
    runs = []
    for _ in range(reps):
        with ctx():
            runs.append(measure_call(functools.partial(opt.load_state_dict, sd)))
    out = {
        "seconds": min(r["seconds"] for r in runs),
        "transient_bytes": max(r["transient_bytes"] for r in runs),
        "state_bytes": state_bytes(sd),
    }
    del opt, sd
    gc.collect()
    return out


VARIANTS: dict[str, Callable] = {"ours": _ours, "megatron_core_hdo": _upstream, "plain_adamw": _plain}


SCENARIOS = ("copy", "in_place")


def run(shapes: list[tuple[int, ...]], reps: int) -> dict:
    result: dict = {"numel": sum(torch.Size(s).numel() for s in shapes), "scenarios": {}}
    for scenario in SCENARIOS:
        out = result["scenarios"][scenario] = {}
        for name, make in VARIANTS.items():
            try:
                out[name] = measure_variant(make, shapes, reps, scenario)
            except ImportError as exc:  # megatron-core not installed
                out[name] = {"skipped": str(exc)}
    return result


def _rows(variants: dict, scenario: str) -> list[list[object]]:
    ref = variants.get("megatron_core_hdo", {}).get("seconds")
    rows: list[list[object]] = []
    for name, v in variants.items():
        if "skipped" in v:
            rows.append([scenario, name, "skipped", "", "", ""])
            continue
        ratio = f"{v['seconds'] / ref:.2f}" if ref else "n/a"
        share = v["transient_bytes"] / v["state_bytes"]
        mib = v["transient_bytes"] / MIB
        rows.append([scenario, name, f"{v['seconds']:.3f}", ratio, f"{mib:.0f}", f"{share:.2f}"])
    return rows


def render(r: dict, reps: int, command: str) -> str:
    first = next(iter(next(iter(r["scenarios"].values())).values()))
    head = [
        f"`load_state_dict` after one step, fraction 1.0, {r['numel'] / 1e6:.0f} M fp32 parameters, Adam state "
        f"{first.get('state_bytes', 0) / MIB:.0f} MiB; best of {reps}, CPU time of the one compute thread; "
        f"`{command}`. `copy`: the checkpoint holds independent tensors (`torch.load`); `in_place`: it holds the "
        "optimizer's own state tensors (Megatron's dist-checkpointing fills a template built from the live state). "
        "Transient: the peak resident set during the call above the larger of before and after. Megatron-core's "
        "HDO and plain AdamW keep the caller's tensors as their state (no copy); ours copies them into its flat "
        "host buffers (the layout its one-kernel step needs), so with `copy` it does that one copy more.",
        "",
    ]
    cols = ["checkpoint", "optimizer", "seconds", "x megatron-core HDO", "transient MiB", "transient / state"]
    rows = [row for scenario, variants in r["scenarios"].items() for row in _rows(variants, scenario)]
    return "\n".join(head) + table(cols, rows) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="~0.2 M parameters and 2 reps: a smoke test")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--output", help="a docs/benchmarks-*.md fragment to write this script's section into")
    ap.add_argument("--json", action="store_true", help="print the raw numbers as JSON too")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = gpt_shapes(64, 2, 1000) if args.quick else gpt_shapes(768, 12, 32000)
    reps = 2 if args.quick else args.reps
    result = run(shapes, reps)
    command = "benchmarks/optimizer_load.py" + (" --quick" if args.quick else "")
    text = render(result, reps, command)
    if args.output:
        write_section(Path(args.output), "optimizer_load.py", text)
    print(text)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
