"""CPU benchmark of HybridDeviceOptimizer against its floor at every fraction; writes docs/benchmarks-optimizer.md.

On a CPU-only machine the offloaded path still copies every offloaded gradient into the flat host buffers and every
updated weight back into the model (the code a GPU machine runs, minus the PCIe), and the rest is updated in place.
So the work it cannot avoid at fraction f is

    floor(f) = f x (copy + fused-AdamW offload floor) + (1 - f) x (in-place fused AdamW)

with both terms measured over all parameters in the same run: the offload floor is one ``_foreach_copy_`` of all
gradients into views of one flat buffer, one fused AdamW over it and one copy back; in place is one fused AdamW over
the parameters. The parameters are a GPT-like mix of ~100 M fp32 elements; one intra-op thread (the ratio is the
point, and one thread keeps it steady on a shared machine). It also measures ``state_dict()``: the time and the bytes
it copies (references cost none). Run (about 2-3 minutes here):

    .venv/bin/python benchmarks/cpu_optimizer.py                 # writes docs/benchmarks-optimizer.md
    .venv/bin/python benchmarks/cpu_optimizer.py --quick --output /tmp/b.md   # seconds; a smoke test
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(1, os.path.join(os.path.dirname(__file__), "..", "offload"))  # this checkout's runtime package
from benchmarks import optimizer_peers as peers
from benchmarks.doc_fragment import with_sections_of
from mbridge_offload_runtime.optimizer.hybrid import HybridDeviceOptimizer

ROOT = Path(__file__).resolve().parents[1]
HYPER = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
TARGET = 1.2


def gpt_shapes(hidden: int, layers: int, vocab: int) -> list[tuple[int, ...]]:
    """Parameter shapes of a GPT (embedding, per layer: 2 norms, QKV, proj, 2 MLP matrices, biases; final norm)."""
    shapes: list[tuple[int, ...]] = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden,), (hidden,), (3 * hidden, hidden), (3 * hidden,), (hidden, hidden), (hidden,)]
        shapes += [(hidden,), (hidden,), (4 * hidden, hidden), (4 * hidden,), (hidden, 4 * hidden), (hidden,)]
    return [*shapes, (hidden,), (hidden,)]


def make_grads(shapes: list[tuple[int, ...]], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) * 1e-3 for s in shapes]


def params_like(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    """Own weights per variant (another variant's writes would look like a model load), shared read-only grads."""
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.full_like(g, 0.02))
        p.grad = g
        params.append(p)
    return params


class InPlace:
    """One fused AdamW over all parameters, in place: the (1 - f) term of the floor."""

    def __init__(self, params):
        self.opt = torch.optim.AdamW(params, fused=True, **HYPER)

    def step(self):
        self.opt.step()


class OffloadFloor:
    """Flat grad copy + one fused AdamW over the flat buffer + copy back: the f term of the floor."""

    def __init__(self, params):
        self.params = params
        self.flat = torch.cat([p.detach().reshape(-1) for p in params])
        self.flat.grad = torch.empty_like(self.flat)
        offsets = torch.tensor([0] + [p.numel() for p in params]).cumsum(0).tolist()
        spans = list(zip(offsets[:-1], offsets[1:], params, strict=True))
        self.param_views = [self.flat[a:b].view(p.shape) for a, b, p in spans]
        self.grad_views = [self.flat.grad[a:b].view(p.shape) for a, b, p in spans]
        self.opt = torch.optim.AdamW([self.flat], fused=True, **HYPER)

    @torch.no_grad()
    def step(self):
        torch._foreach_copy_(self.grad_views, [p.grad for p in self.params])
        self.opt.step()
        torch._foreach_copy_(self.params, self.param_views)


class PerParamScheme:
    """Upstream's overlap scheme, for context: one fused CPU AdamW per parameter, per-parameter copies."""

    def __init__(self, params):
        self.params = params
        self.host = [p.detach().clone() for p in params]
        for h in self.host:
            h.grad = torch.empty_like(h)
        self.opts = [torch.optim.AdamW([h], fused=True, **HYPER) for h in self.host]

    @torch.no_grad()
    def step(self):
        for p, h in zip(self.params, self.host, strict=True):
            h.grad.copy_(p.grad)
        for p, h, opt in zip(self.params, self.host, self.opts, strict=True):
            opt.step()
            p.copy_(h)


class MegatronHDO:
    """megatron-core's own HDO built as ``get_megatron_optimizer`` builds it (``optimizer_peers.megatron_hdo``),
    run on CPU under the three labelled shims of ``tests/support/upstream_shims_hdo.py`` (no-op streams, identity
    pinning, parameters that report ``is_cuda``): its CPU part is what runs, fused CPU AdamW per parameter."""

    def __init__(self, params, fraction: float):
        from tests.support.upstream_shims_hdo import FakeDevParam, upstream_hdo_shims

        self.shims = upstream_hdo_shims
        self.params = []
        for p in params:
            fake = FakeDevParam(p.detach(), requires_grad=True)
            fake.grad = p.grad
            self.params.append(fake)
        with self.shims():
            self.opt = peers.megatron_hdo(self.params, fraction, overlap=True, pin=False)

    def step(self):
        with self.shims():
            self.opt.step()


class DeepSpeedFloor(OffloadFloor):
    """The offload floor with DeepSpeed's CPU Adam (AdamW mode) in place of torch's fused AdamW on the flat buffer."""

    def __init__(self, params, make):
        super().__init__(params)
        self.opt = make([self.flat])


def hdo_maker(fraction: float):
    def make(params):
        return HybridDeviceOptimizer(params, offload_fraction=fraction, overlap_cpu_optimizer_d2h_h2d=True, **HYPER)

    return make


def best_times(makers: dict, grads: list[torch.Tensor], reps: int) -> tuple[dict[str, float], dict]:
    """Best-of-``reps`` seconds per step of each variant, timed in rotation (noise from other jobs hits all alike
    and only ever adds time), after one warm-up step each that materializes the state. Returns the runners too."""
    runners = {name: make(params_like(grads)) for name, make in makers.items()}
    for runner in runners.values():
        runner.step()
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(reps):
        for name, runner in runners.items():
            # CPU time of this (the only compute) thread: on a machine shared with other jobs the wall clock also
            # counts the time the thread waits for a core, which says nothing about the optimizer.
            t0 = time.thread_time()
            runner.step()
            times[name].append(time.thread_time() - t0)
    return {name: min(ts) for name, ts in times.items()}, runners


def live_storages(opt: HybridDeviceOptimizer) -> set[int]:
    ptrs = {b.flat_param.untyped_storage().data_ptr() for b in opt._buckets}
    for sub in opt.sub_optimizers:
        for st in sub.state.values():
            ptrs |= {v.untyped_storage().data_ptr() for v in st.values() if isinstance(v, torch.Tensor)}
    return ptrs


def measure_state_dict(opt: HybridDeviceOptimizer, reps: int) -> dict[str, float]:
    """Time of ``state_dict()`` (best of reps) and the bytes it copied vs the bytes of state it returns."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sd = opt.state_dict()
        times.append(time.perf_counter() - t0)
    live = live_storages(opt)
    tensors = [v for st in sd["state"].values() for v in st.values() if isinstance(v, torch.Tensor)]
    total = sum(v.nbytes for v in tensors)
    copied = sum(v.nbytes for v in tensors if v.untyped_storage().data_ptr() not in live)
    return {"seconds": min(times), "state_bytes": total, "copied_bytes": copied}


def run(hidden: int, layers: int, vocab: int, reps: int) -> dict:
    grads = make_grads(gpt_shapes(hidden, layers, vocab))
    result: dict = {"numel": sum(g.numel() for g in grads), "tensors": len(grads), "fractions": {}}
    upstream = peers.megatron_hdo_classes() is not None
    ds = peers.deepspeed_cpu_adam_cls()
    for f in FRACTIONS:
        makers = {"in_place": InPlace, "offload_floor": OffloadFloor, "hdo": hdo_maker(f)}
        if upstream:
            makers["megatron_hdo"] = lambda ps, f=f: MegatronHDO(ps, f)
        if f == 1.0:
            makers["per_param"] = PerParamScheme
            if ds is not None:
                makers["deepspeed_floor"] = lambda ps: DeepSpeedFloor(ps, ds)
        t, runners = best_times(makers, grads, reps)
        # The split is whole tensors (Megatron's greedy prefix), so the floor uses the fraction actually offloaded.
        achieved = runners["hdo"].offloaded_fraction
        floor = achieved * t["offload_floor"] + (1 - achieved) * t["in_place"]
        result["fractions"][f] = {**t, "achieved": achieved, "floor": floor, "ratio": t["hdo"] / floor}
        if upstream:
            result["fractions"][f]["megatron_achieved"] = peers.megatron_hdo_fraction(runners["megatron_hdo"].opt)
        if f in (0.5, 1.0):
            result[f"state_dict_{f}"] = measure_state_dict(runners["hdo"], reps)
        if f == 1.0:
            result["context"] = t
            result["peers"] = {**peers.peer_status(), "megatron_note": peers.megatron_hdo_note()}
        del runners
        gc.collect()
    return result


def render(r: dict, reps: int, elapsed: float, command: str) -> str:
    """The Markdown fragment (docs/benchmarks-optimizer.md): every figure comes from ``r``, nothing typed in."""
    now = datetime.datetime.now(datetime.timezone.utc)
    threads = torch.get_num_threads()
    lines = [
        "# Optimizer offload benchmark (CPU)",
        "",
        f"**Measured on CPU, {threads} thread{'s' if threads > 1 else ''}, this machine** (no GPU): "
        f"{now:%Y-%m-%d %H:%M} UTC, by `benchmarks/cpu_optimizer.py` in one run of {elapsed:.0f} s. Machine: "
        f"`{platform.processor() or platform.machine()}`, {os.cpu_count()} cores (shared with other jobs), "
        f"torch {torch.__version__}, Python {platform.python_version()}. Each variant is timed in rotation with the "
        f"others and the best of {reps} steps is kept (after one warm-up step); times are the CPU time of the one "
        "compute thread (`time.thread_time`), so waiting for a core on the shared machine is not counted. Ratios are "
        "the point; absolute times depend on the machine. Nothing here is measured on a GPU (see "
        "`benchmarks/gpu_optimizer.py`).",
        "",
        "Reproduce:",
        "",
        "```bash",
        f"{command}",
        "```",
        "",
        "## What is measured",
        "",
        f"A GPT-like set of {r['tensors']} fp32 parameters, {r['numel'] / 1e6:.1f} M elements (embedding, per layer "
        "QKV/proj/MLP matrices, biases and norms), gradients already present; AdamW with lr 1e-3, betas (0.9, 0.95), "
        "weight decay 0.1. One `step()` of `HybridDeviceOptimizer(offload_fraction=f, overlap on)` is compared with "
        "its floor, the work it cannot avoid at that fraction:",
        "",
        "    floor(f) = f x (copy + fused-AdamW offload floor) + (1 - f) x (in-place fused AdamW)",
        "",
        "with f the fraction actually offloaded (the split is whole tensors, Megatron's greedy prefix, so it can",
        "land above the requested one),",
        "where the offload floor is one `_foreach_copy_` of all gradients into views of one flat buffer, one fused "
        "AdamW over it and one copy back, and in place is one fused AdamW over the parameters, both over all "
        "parameters and timed in the same rotation. On CPU the offloaded part still does every copy a GPU machine "
        "does, minus the PCIe transfer.",
        "",
        "## Every fraction against its floor",
        "",
        "| fraction | achieved | HDO s/step | floor s/step | in place s/step | offload floor s/step | HDO / floor |"
        " megatron-core HDO s/step (achieved) | megatron-core / ours |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for f, t in r["fractions"].items():
        cells = [
            f"{t['achieved']:.3f}",
            f"{t['hdo']:.4f}",
            f"{t['floor']:.4f}",
            f"{t['in_place']:.4f}",
            f"{t['offload_floor']:.4f}",
            f"{t['ratio']:.2f}x",
        ]
        if "megatron_hdo" in t:
            cells += [f"{t['megatron_hdo']:.4f} ({t['megatron_achieved']:.3f})", f"{t['megatron_hdo'] / t['hdo']:.2f}x"]
        else:
            cells += ["not installed", "-"]
        lines.append(f"| f = {f:.2f} | " + " | ".join(cells) + " |")
    worst = max(t["ratio"] for t in r["fractions"].values())
    verdict = "within" if worst <= TARGET else "NOT within"
    lines += ["", f"Worst ratio {worst:.2f}x: every fraction {verdict} the {TARGET}x target.", ""]
    lines += [
        "megatron-core's HDO is built as `get_megatron_optimizer` builds it (`benchmarks/optimizer_peers.py`: "
        "fused CPU AdamW, `param_update_in_fp32`, the factory's pinning defaults; "
        f"{r['peers'].get('megatron_note', '')}), and runs here under the three labelled shims of "
        "`tests/support/upstream_shims_hdo.py` (no-op streams, no pinning, parameters that report `is_cuda`): "
        "what is timed is its CPU part, one fused CPU AdamW per parameter with overlap on; its achieved fraction is "
        "read from its own state. Peers: "
        + ", ".join(f"{k}: {v}" for k, v in r["peers"].items() if k != "megatron_note")
        + " (installed with `pip install --target .peers --no-deps`, never into the shared environment).",
        "",
    ]
    lines += _context_and_state_dict(r)
    return "\n".join(lines) + "\n"


def _context_and_state_dict(r: dict) -> list[str]:
    c = r["context"]
    rows = [
        ("(a) fused AdamW in place (no offload)", c["in_place"]),
        ("(b) HybridDeviceOptimizer, fraction 1.0, overlap", c["hdo"]),
        ("(c) per-parameter optimizers (upstream scheme)", c["per_param"]),
        ("(d) floor: flat copy + one fused AdamW + copy back", c["offload_floor"]),
    ]
    if "deepspeed_floor" in c:
        rows.append(("(e) floor with DeepSpeed's DeepSpeedCPUAdam in place of fused AdamW", c["deepspeed_floor"]))
    if "megatron_hdo" in c:
        rows.append(("(f) megatron-core's HDO as its factory builds it, fraction 1.0", c["megatron_hdo"]))
    lines = [
        "## Fraction 1.0 in context",
        "",
        "(c) is the scheme upstream builds with overlap on: one fused CPU AdamW per parameter, per-parameter copies.",
        "",
        "| variant | s/step | vs (d) |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {t:.4f} | {t / c['offload_floor']:.2f}x |" for name, t in rows]
    lines += [
        "",
        "## `state_dict()`: references, not copies",
        "",
        "Bytes of optimizer state the returned dict holds, the bytes `state_dict()` copied to build it (only the",
        "4-byte per-parameter `step` counters; the rest are the live tensors or views into the flat buckets), and",
        "its time (best of the same number of calls).",
        "",
        "| fraction | state MiB | copied MiB | copied % | state_dict() s |",
        "|---|---|---|---|---|",
    ]
    for f in (0.5, 1.0):
        s = r[f"state_dict_{f}"]
        pct = 100 * s["copied_bytes"] / s["state_bytes"]
        mib = s["state_bytes"] / 2**20, s["copied_bytes"] / 2**20
        lines.append(f"| fraction {f} | {mib[0]:.1f} | {mib[1]:.4f} | {pct:.4f} % | {s['seconds']:.4f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a ~2 M-parameter model and 2 reps: a smoke test")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--output", default=str(ROOT / "docs" / "benchmarks-optimizer.md"), help="Markdown to write")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    size = (64, 2, 1000) if args.quick else (768, 12, 32000)  # ~2 M / ~110 M parameters
    reps = 2 if args.quick else args.reps
    t0 = time.perf_counter()
    result = run(*size, reps)
    command = ".venv/bin/python benchmarks/cpu_optimizer.py" + (" --quick" if args.quick else "")
    text = render(result, reps, time.perf_counter() - t0, command)
    Path(args.output).write_text(with_sections_of(Path(args.output), text))
    print(text)


if __name__ == "__main__":
    main()
