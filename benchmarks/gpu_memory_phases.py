"""GPU measurement: the memory of each phase of a training step in real megatron-core, to check the planner's phases.

A real megatron-core ``GPTModel`` (local layer spec: torch layers, no Transformer Engine), bf16 weights in
``Float16Module``, Megatron's ``DistributedDataParallel`` with the distributed optimizer (world size 1) and the
optimizer from ``get_megatron_optimizer``, trained for a few steps. For each set-up it reads, at the last step,
``torch.cuda`` allocated memory before the step and the peak allocated memory of each phase, the counter reset
between phases:

    forward          the forward pass and the loss (the logits peak sits here)
    backward         backward and the gradient sync (``finish_grad_sync``)
    optimizer_step   ``optimizer.step()`` after the activations are freed: the distributed optimizer's transients
                     (the fp32 copy of bf16 gradients), the HybridDeviceOptimizer's copies

Set-ups: fp32 vs bf16 gradient buffers (``ddp.grad_reduce_in_fp32``), and optimizer offload at fractions 0.5 and
1.0, ours (:func:`install_optimizer_offload`) and megatron-core's own HybridDeviceOptimizer. Also the parameter count
and the bytes of what is resident (weights, gradient buffers, optimizer states on the GPU), so that a CPU test can
hold the planner's phases against these figures. The local spec's attention is unfused (it saves the softmax
probabilities, batch x heads x seq^2 in bf16 per layer); the JSON gives that term so a comparison can account for it.

    python3 benchmarks/gpu_memory_phases.py --json benchmarks/results/gpu_memory_phases.json   # on a GPU machine
    python3 benchmarks/gpu_memory_phases.py --quick --json /tmp/phases.json                   # CPU smoke run

Without CUDA it runs tiny sizes on the CPU (gloo) and says so: its memory figures are zeros there, a smoke test only.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(1, os.path.join(os.path.dirname(__file__), "..", "offload"))  # this checkout's runtime package
from mbridge_offload_runtime import device

MiB = 2**20


@dataclass(frozen=True)
class Shape:
    layers: int = 16
    hidden: int = 2048
    heads: int = 16
    ffn: int = 8192
    vocab: int = 32000
    seq: int = 2048
    batch: int = 1


TINY = Shape(layers=2, hidden=64, heads=4, ffn=256, vocab=128, seq=32, batch=2)


@dataclass
class Setup:
    name: str
    grad_reduce_in_fp32: bool
    offload: str = "none"  # none | ours | megatron-core
    fraction: float = 0.0


SETUPS = (
    Setup("fp32 grads", True),
    Setup("bf16 grads", False),
    Setup("bf16 grads, ours 0.5", False, "ours", 0.5),
    Setup("bf16 grads, ours 1.0", False, "ours", 1.0),
    Setup("bf16 grads, megatron-core HDO 0.5", False, "megatron-core", 0.5),
)


@dataclass
class Result:
    setup: str
    grad_reduce_in_fp32: bool
    offload: str
    fraction: float
    params: int = 0
    weights_bytes: int = 0
    grad_buffer_bytes: int = 0
    optimizer_state_gpu_bytes: int = 0
    allocated_before_step_bytes: int = 0
    peak_bytes: dict[str, int] = field(default_factory=dict)
    step_s: float = 0.0
    error: str | None = None


def _tensor_bytes(tensors: Any) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def _optimizer_state_tensors(opt: Any):
    """Every tensor held by the torch optimizers inside Megatron's wrappers (states and fp32 masters)."""
    for wrapper in getattr(opt, "chained_optimizers", [opt]):
        inner = wrapper.optimizer
        for state in inner.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))
        for group in getattr(wrapper, "shard_fp32_from_float16_groups", []) or []:
            yield from group
        sub = getattr(inner, "sub_optimizers", None) or []
        for o in sub:
            for state in o.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def _build(shape: Shape, setup: Setup):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from mbridge_offload_runtime.megatron import build_tiny_gpt

    model = build_tiny_gpt(
        shape.layers,
        shape.hidden,
        shape.heads,
        shape.vocab,
        shape.seq,
        ffn_hidden_size=shape.ffn,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    model = Float16Module(model.config, model).to(device.compute_device())
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=setup.grad_reduce_in_fp32)
    model = DistributedDataParallel(model.config, ddp, model)
    offload = setup.offload != "none"
    config = OptimizerConfig(
        optimizer="adam",
        lr=1e-4,
        weight_decay=0.01,
        bf16=True,
        use_distributed_optimizer=True,
        optimizer_cpu_offload=offload,
        optimizer_offload_fraction=setup.fraction,
        overlap_cpu_optimizer_d2h_h2d=offload and setup.fraction >= 0.75,
        use_precision_aware_optimizer=offload,
    )
    return model, get_megatron_optimizer(config, [model])


def measure(shape: Shape, setup: Setup, steps: int) -> Result:
    from mbridge_offload_runtime.megatron import tiny_batch
    from mbridge_offload_runtime.optimizer.megatron import install_optimizer_offload

    result = Result(setup.name, setup.grad_reduce_in_fp32, setup.offload, setup.fraction)
    dev = device.compute_device()
    installed = install_optimizer_offload() if setup.offload == "ours" else None
    try:
        model, opt = _build(shape, setup)
        batch = {k: v.to(dev) for k, v in tiny_batch(shape.batch, shape.seq, shape.vocab).items()}
        result.params = sum(p.numel() for p in model.parameters())
        result.weights_bytes = _tensor_bytes(model.parameters())
        result.grad_buffer_bytes = sum(
            b.grad_data.numel() * b.grad_data.element_size() for b in model.buffers if b.grad_data.is_cuda
        )
        for _ in range(steps):
            device.synchronize()
            t0 = time.perf_counter()
            model.zero_grad_buffer()
            opt.zero_grad()
            device.synchronize()
            result.allocated_before_step_bytes = device.memory_counters(dev).allocated
            device.reset_peak(dev)
            loss = model(**batch).float().mean()
            device.synchronize()
            result.peak_bytes["forward"] = device.memory_counters(dev).max_allocated
            device.reset_peak(dev)
            loss.backward()
            model.finish_grad_sync()
            del loss
            device.synchronize()
            result.peak_bytes["backward"] = device.memory_counters(dev).max_allocated
            device.reset_peak(dev)
            ok, _, _ = opt.step()
            device.synchronize()
            result.peak_bytes["optimizer_step"] = device.memory_counters(dev).max_allocated
            result.step_s = time.perf_counter() - t0
            assert ok, "the optimizer step was skipped"
        result.optimizer_state_gpu_bytes = _tensor_bytes(_optimizer_state_tensors(opt))
        del model, opt, batch
    except Exception as exc:  # one set-up failing (an upstream refusal, say) must not lose the others
        tb = traceback.format_exc(limit=4).strip().splitlines()
        result.error = f"{type(exc).__name__}: {exc} | {' / '.join(tb[-3:])}"
    finally:
        if installed is not None:
            installed.remove()
        gc.collect()
        if device.has_cuda():
            torch.cuda.empty_cache()
    return result


@contextlib.contextmanager
def _cpu_stand_ins() -> Iterator[None]:
    """The CPU smoke run only: the labelled stand-ins of the CPU optimizer tests (megatron-core's optimizer wrappers
    assume CUDA tensors). Never entered on a GPU, where every figure is real."""
    from mbridge_offload_runtime.megatron import cpu_compat_shims
    from tests.support.megatron_optimizer_worker import CudaOnCpu, _DoneStream

    saved = torch.cuda.synchronize, torch.cuda.current_stream
    torch.cuda.synchronize = lambda *args, **kwargs: None  # SHIM-CUDA-SYNC
    torch.cuda.current_stream = lambda *args, **kwargs: _DoneStream()  # SHIM-CUDA-STREAM
    try:
        with cpu_compat_shims(), CudaOnCpu():
            yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_stream = saved


def render(shape: Shape, results: list[Result], header: str) -> str:
    lines = [
        header,
        "",
        f"Model: megatron-core GPTModel, local spec, {shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads,"
        f" FFN {shape.ffn}, vocab {shape.vocab}, seq {shape.seq}, micro-batch {shape.batch}; bf16 weights,"
        " distributed optimizer, world size 1. Peaks are torch.cuda.max_memory_allocated per phase (the counter reset"
        " between phases), GiB; 'before' is allocated at the start of the step.",
        "",
        "| set-up | params | before | forward peak | backward peak | optimizer_step peak | step s | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        p = r.peak_bytes
        if r.error:
            lines.append(f"| {r.setup} | - | - | - | - | - | - | {r.error[:160]} |")
            continue
        lines.append(
            f"| {r.setup} | {r.params / 1e6:.1f} M | {r.allocated_before_step_bytes / 2**30:.2f} | "
            f"{p['forward'] / 2**30:.2f} | {p['backward'] / 2**30:.2f} | {p['optimizer_step'] / 2**30:.2f} | "
            f"{r.step_s:.3f} | |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (what runs without a GPU)")
    ap.add_argument("--steps", type=int, default=3, help="training steps per set-up (the last one is read)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--output", help="write the Markdown table here")
    args = ap.parse_args(argv)
    cuda = device.has_cuda()
    shape = TINY if (args.quick or not cuda) else Shape()
    from mbridge_offload_runtime.megatron import ensure_model_parallel

    ensure_model_parallel()
    import megatron.core

    where = (
        f"**GPU-measured** on {torch.cuda.get_device_name()}"
        if cuda
        else "**No CUDA device: CPU smoke run, tiny sizes, memory counters are zero (NOT a measurement)**"
    )
    header = (
        f"# GPU memory by phase — {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n\n{where}; "
        f"torch {torch.__version__}, megatron-core {megatron.core.__version__}, host {platform.machine()}, "
        f"{os.cpu_count()} cores. Written by `benchmarks/gpu_memory_phases.py`."
    )
    with contextlib.ExitStack() as stack:
        if not cuda:
            stack.enter_context(_cpu_stand_ins())
        results = [measure(shape, s, args.steps) for s in SETUPS]
    text = render(shape, results, header)
    print(text)
    payload = {
        "cuda": cuda,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "megatron_core": megatron.core.__version__,
        "shape": asdict(shape),
        "attention": "unfused (local spec): saves softmax probabilities, batch*heads*seq^2 bf16 per layer",
        "results": [asdict(r) for r in results],
    }
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=2)
    if args.output:
        with open(args.output, "w") as fh:
            fh.write(text)
    return 0 if all(r.error is None for r in results) or not cuda else 1


if __name__ == "__main__":
    raise SystemExit(main())
