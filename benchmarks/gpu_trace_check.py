"""GPU check of the trace: megatron-core's real step on CUDA, by phase, against ``trace`` and ``estimate``.

For six settings of one small GPT (no lever, full recompute, selective recompute, layer offload of k layers with
our activation runtime, megatron-core's fine-grained activation offloading, megatron-core's HybridDeviceOptimizer at
fraction 0.5) it builds the model the trace builds (``trace.step._build``: megatron-core's ``GPTModel`` with the
local layer spec and the trace's Transformer Engine stand-ins for attention, norms and FusedAdam, megatron-core's
DDP and ``get_megatron_optimizer``), on **real CUDA tensors** with an NCCL group of one, runs megatron-core's own
schedule and one optimizer step (after a warm-up step), and reads ``torch.cuda.max_memory_allocated`` by phase, the
counter reset between phases:

    forward          from the start of the step to the first backward (activations, the logits and the loss)
    backward         the backward passes and the gradient sync
    optimizer_step   ``optimizer.step()``

It compares the GPU's forward/backward peak (the higher of the two) with the trace's (``forward_backward`` and
``loss``), and the optimizer step with the trace's, target within 3 %; and with ``estimate``'s phases (its fitted
workspace constant ``Setup.overhead_gb`` taken out, as the differential test does: the allocator counter does not
see it), target within 5 %. Where the trace refuses a setting the row says so. The trace runs layer-level offload
through its stand-in for Transformer Engine's offload context (``trace/activation_offload/te_layers.py``, TE's v2
path), which the GPU row's runtime follows too.

    .venv/bin/python benchmarks/gpu_trace_check.py                       # on a GPU: writes the doc and the JSON
    .venv/bin/python benchmarks/gpu_trace_check.py --dry-run             # CPU: same code path, tiny shapes

``--dry-run`` (or no CUDA) runs the same build, schedule and comparison on the CPU with tiny shapes under the
trace's CPU patches (``trace.patches``), gloo as the group; the CUDA memory counters do not exist there, so the GPU
columns are empty and nothing tracked is written (it exits 0 when every setting ran).
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
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRACE_DIR = ROOT / "tools" / "mbridge_offload_tools" / "trace"
for extra in (ROOT / "offload", ROOT / "tools", TRACE_DIR):  # this checkout's packages, the trace child's modules
    sys.path.insert(0, str(extra))
DOC = ROOT / "docs" / "benchmarks-trace-gpu.md"
RESULTS = ROOT / "benchmarks" / "results" / "gpu_trace_check.json"
GIB = 2**30
TRACE_TOLERANCE, ESTIMATE_TOLERANCE = 0.03, 0.05

MODEL = {  # a small dense GQA model on one GPU: the activations are a real share of the peak
    "num_layers": 8,
    "hidden_size": 2048,
    "ffn_hidden_size": 5632,
    "num_attention_heads": 16,
    "num_query_groups": 4,
    "kv_channels": 128,
    "vocab_size": 32000,
    "seq_length": 4096,
    "micro_batch_size": 1,
    "global_batch_size": 1,
    "num_gpus": 1,
    "distributed_optimizer": True,
    "grad_reduce_in_fp32": True,
    "params_dtype": "bf16",
}
TINY = {**MODEL, "num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4}
TINY.update(num_query_groups=2, kv_channels=16, vocab_size=128, seq_length=32)
LAYERS_OFFLOADED = 2
SETTINGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("no lever", {}),
    ("full recompute", {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}),
    ("selective recompute", {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}),
    (f"layer offload k={LAYERS_OFFLOADED} (ours)", {"activation_offload_layers": LAYERS_OFFLOADED}),
    (
        "fine-grained modules (megatron-core)",
        {"fine_grained_activation_offloading": True, "offload_modules": ["core_attn", "attn_proj"]},
    ),
    ("HDO 0.5 (megatron-core)", {"optimizer_offload_fraction": 0.5}),
)
NOT_ON_LOCAL_SPEC = "TE CPU offload is not available"  # megatron-core's words where TE is not installed
_ACTIVATION_LEVERS = ("activation_offload_layers", "fine_grained_activation_offloading", "offload_modules")


class _NoTracker:
    """What ``trace.step._build`` reports to, for a real run: nothing is tracked (the allocator counts)."""

    category = module = phase = ""

    def retag(self, *args: Any) -> None:
        return None

    def mark_phase(self, name: str) -> None:
        self.phase = name


def _planner_inputs(model: dict[str, Any], lever: dict[str, Any]) -> dict[str, Any]:
    return {"config": None, "overrides": [], "megatron_args": None, **model, **lever}


def child_spec(model: dict[str, Any], lever: dict[str, Any]) -> dict[str, Any]:
    """The trace's spec for ``model`` with ``lever``; activation offload (which the trace refuses) is added to the
    spec of the run without it, as the GPU run applies it."""
    from mbridge_offload.plan.inputs.resolve import resolve
    from mbridge_offload_tools.trace import spec as specs

    base = {k: v for k, v in lever.items() if k not in _ACTIVATION_LEVERS}
    spec = specs.build(resolve({**model, **base}), 0)
    if lever.get("fine_grained_activation_offloading"):
        spec["transformer"].update(fine_grained_activation_offloading=True, offload_modules=lever["offload_modules"])
    spec["layer_offload"] = int(lever.get("activation_offload_layers") or 0)
    if spec["layer_offload"]:
        # Under any saved-tensor hook (ours, TE's) autograd hands backward a new tensor object for a saved weight,
        # so the local spec's linear loses the weight's `grad_added_to_main_grad` flag, returns no dummy gradient
        # with gradient_accumulation_fusion, and DDP's overlap_grad_reduce hook asserts. Reducing after backward
        # instead changes when the (same, contiguous) gradient buffer is reduced, not what is allocated.
        spec["ddp"]["overlap_grad_reduce"] = False
    return spec


def _init_group(cuda: bool) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        store = dist.FileStore(tempfile.mktemp(prefix="gpu_trace_check_"), 1)
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    from megatron.core.tensor_parallel import random

    if cuda:
        random.model_parallel_cuda_manual_seed(1234)
    else:  # the CPU patches stand in for the CUDA RNG (trace.patches)
        random.model_parallel_cuda_manual_seed = lambda *a, **k: None


def _counters(torch: Any, cuda: bool) -> tuple[Any, Any]:
    """(read the phase's peak, reset it): the CUDA allocator's, or None on the CPU (no such counter there)."""
    if not cuda:
        return (lambda: None), (lambda: None)

    def read() -> int:
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())

    def reset() -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    return read, reset


def measure(torch: Any, spec: dict[str, Any], cuda: bool) -> dict[str, Any]:
    """One real step of the trace's model: the allocator's peak by phase (None on the CPU)."""
    import step as trace_step
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import layers

    # The trace builds with gradient_accumulation_fusion (Bridge turns it on wherever apex/TE's fused wgrad kernel is
    # installed); megatron-core refuses it without the kernel, so a GPU host without apex/TE runs without it, and
    # then holds one weight-sized gradient temporary per linear in backward that the trace does not count.
    if not getattr(layers, "_grad_accum_fusion_available", False):
        spec["transformer"]["gradient_accumulation_fusion"] = False
    built = trace_step._build(torch, spec, _NoTracker())  # type: ignore[arg-type]
    model, optimizer = built["model"], built["optimizer"]
    handle = None
    if spec["layer_offload"]:
        from mbridge_offload_runtime.activation.layers import offload_layers

        handle = offload_layers(model[0].module.decoder.layers, spec["layer_offload"], pin_memory=cuda)
    b, s, v = spec["micro_batch_size"], spec["seq_length"], spec["vocab_size"]
    read, reset = _counters(torch, cuda)
    peaks: dict[str, Any] = {}
    dev = "cuda" if cuda else "cpu"

    def forward_step(data_iterator: Any, chunk: Any) -> Any:
        tokens = torch.randint(0, v, (b, s), device=dev)
        positions = torch.arange(s, device=dev).unsqueeze(0).expand(b, s)
        output = chunk(tokens, positions, None, labels=torch.randint(0, v, (b, s), device=dev))
        return output, lambda out: (out.float().sum(), {"lm loss": out.float().sum()})

    original = schedules.backward_step

    def backward_step(*args: Any, **kwargs: Any) -> Any:
        peaks.setdefault("forward", read())
        reset()
        return original(*args, **kwargs)

    schedules.backward_step = backward_step
    try:
        for _ in range(2):  # the first step makes Adam's moments; the second is read
            for m in model:
                m.zero_grad_buffer()
            optimizer.zero_grad()
            gc.collect()
            peaks.clear()
            resident = torch.cuda.memory_allocated() if cuda else None
            reset()
            schedules.get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=[iter(())] * len(model),
                model=model[0],
                num_microbatches=spec["num_microbatches"],
                seq_length=s,
                micro_batch_size=b,
                forward_only=False,
            )
            peaks["backward"] = read()
            reset()
            optimizer.step()
            peaks["optimizer_step"] = read()
        peaks["resident_before_step"] = resident
    finally:
        schedules.backward_step = original
        if handle is not None:
            handle.remove()
    del model, optimizer, built
    gc.collect()
    return peaks


def _trace(model: dict[str, Any], lever: dict[str, Any], release: str) -> dict[str, Any]:
    from mbridge_offload.config.errors import InputError
    from mbridge_offload_tools.trace.run import trace_answer

    try:
        d = trace_answer({**_planner_inputs(model, lever), "megatron_core": release, "stage": 0})
    except InputError as exc:
        return {"refused": str(exc)}
    by = {p["name"]: p["memory_gib"] for p in d["phases"]}
    return {"forward_backward": max(by.get("forward_backward", 0.0), by.get("loss", 0.0)), **by}


def _estimate(model: dict[str, Any], lever: dict[str, Any]) -> dict[str, Any]:
    from mbridge_offload.plan.inputs.resolve import resolve
    from mbridge_offload.plan.service import plan_answer

    d = plan_answer("estimate", _planner_inputs(model, lever)).model_dump(mode="json")
    overhead = resolve({**model, **lever}).setup.overhead_gb * 1e9 / GIB
    by = {p["name"]: max(0.0, p["memory_gib"] - overhead) for p in d["phases"][0]["phases"]}
    return {"forward_backward": max(by.get("forward_backward", 0.0), by.get("loss", 0.0)), **by}


def _gap(got: float | None, truth: float | None) -> float | None:
    return None if got is None or not truth else round((got - truth) / truth, 4)


def run(model: dict[str, Any], cuda: bool, release: str) -> list[dict[str, Any]]:
    """Every setting: the GPU's peaks, the trace's and the estimate's, and their gaps."""
    import torch

    rows = []
    for name, lever in SETTINGS:
        row: dict[str, Any] = {"setting": name, "lever": lever}
        try:
            spec = child_spec(model, lever)
            with _device_patches(cuda):
                _init_group(cuda)
                try:
                    got = measure(torch, spec, cuda)
                finally:
                    from megatron.core import parallel_state

                    parallel_state.destroy_model_parallel()
            gpu = {
                "forward_backward": None if got["forward"] is None else max(got["forward"], got["backward"]) / GIB,
                "optimizer_step": None if got["optimizer_step"] is None else got["optimizer_step"] / GIB,
                "raw_bytes": got,
            }
            row.update(gpu_gib=gpu, trace_gib=_trace(model, lever, release), estimate_gib=_estimate(model, lever))
            for phase in ("forward_backward", "optimizer_step"):
                row[f"trace_gap_{phase}"] = _gap(row["trace_gib"].get(phase), gpu[phase])
                row[f"estimate_gap_{phase}"] = _gap(row["estimate_gib"].get(phase), gpu[phase])
        except RuntimeError as exc:
            if NOT_ON_LOCAL_SPEC not in str(exc):
                row["error"] = f"{type(exc).__name__}: {exc}"[:600]
            else:  # megatron-core's own refusal: its fine-grained offloading runs through TE only
                row["unsupported"] = f"megatron-core: {exc} (its fine-grained offloading needs Transformer Engine)"
        except Exception as exc:  # one setting failing must not lose the others
            tb = traceback.format_exc(limit=4).strip().splitlines()
            row["error"] = f"{type(exc).__name__}: {exc} | {' / '.join(tb[-3:])}"[:600]
        rows.append(row)
    return rows


@contextlib.contextmanager
def _device_patches(cuda: bool) -> Any:
    """On a GPU only the TE stand-ins; on the CPU (dry run) every trace patch and its device mode (trace.patches)."""
    import patches

    if cuda:
        if not getattr(_device_patches, "done", False):
            patches.apply_standins()
            _device_patches.done = True  # type: ignore[attr-defined]
        yield
        return
    if not getattr(_device_patches, "done", False):
        patches.apply()
        _device_patches.done = True  # type: ignore[attr-defined]
    with patches.CpuForCuda():
        yield


def _fmt(x: float | None, pct: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x * 100:+.1f} %" if pct else f"{x:.3f}"


def render(rows: list[dict[str, Any]], header: str, model: dict[str, Any]) -> str:
    lines = [
        header,
        "",
        f"Model (planner inputs): {json.dumps(model)}. The GPU run builds what the trace builds (megatron-core's "
        "GPTModel, local spec, the trace's TE stand-ins for attention, norms and FusedAdam; DDP; "
        "get_megatron_optimizer) on CUDA tensors. GiB = 2^30 bytes. fwd/bwd = the higher of the forward and "
        "backward peaks (torch.cuda.max_memory_allocated, reset between phases); estimate has its fitted workspace "
        f"constant (Setup.overhead_gb) taken out. Targets: trace within {TRACE_TOLERANCE:.0%}, estimate within "
        f"{ESTIMATE_TOLERANCE:.0%}.",
        "",
        "| setting | GPU fwd/bwd | trace fwd/bwd | gap | estimate fwd/bwd | gap | GPU optimizer step | trace | gap "
        "| estimate | gap | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['setting']} | - | - | - | - | - | - | - | - | - | - | {r['error'][:200]} |")
            continue
        if "unsupported" in r:
            lines.append(f"| {r['setting']} | - | - | - | - | - | - | - | - | - | - | {r['unsupported'][:200]} |")
            continue
        g, t, e = r["gpu_gib"], r["trace_gib"], r["estimate_gib"]
        note = ("trace refused: " + t["refused"][:120]) if "refused" in t else ""
        cells = [
            _fmt(g["forward_backward"]),
            _fmt(t.get("forward_backward")),
            _fmt(r["trace_gap_forward_backward"], True),
            _fmt(e["forward_backward"]),
            _fmt(r["estimate_gap_forward_backward"], True),
            _fmt(g["optimizer_step"]),
            _fmt(t.get("optimizer_step")),
            _fmt(r["trace_gap_optimizer_step"], True),
            _fmt(e.get("optimizer_step")),
            _fmt(r["estimate_gap_optimizer_step"], True),
        ]
        lines.append(f"| {r['setting']} | " + " | ".join(cells) + f" | {note} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, no memory counters, writes nothing")
    ap.add_argument("--megatron-core", default="0.16.1", help="the trace's release (the GPU runs the venv's)")
    ap.add_argument("--output", type=Path, default=DOC, help="the Markdown doc (GPU runs only)")
    ap.add_argument("--json", type=Path, default=RESULTS, help="the JSON results (GPU runs only)")
    args = ap.parse_args(argv)
    import megatron.core
    import torch

    cuda = torch.cuda.is_available() and not args.dry_run
    model = MODEL if cuda else TINY
    started = time.perf_counter()
    rows = run(model, cuda, args.megatron_core)
    where = (
        f"**GPU-measured** on {torch.cuda.get_device_name()}"
        if cuda
        else "**Dry run on the CPU: tiny shapes, the CUDA memory counters skipped (NOT a measurement)**"
    )
    header = (
        f"# The trace on a GPU — {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n\n{where}; "
        f"torch {torch.__version__}, megatron-core {megatron.core.__version__} (trace: {args.megatron_core}), host "
        f"{platform.machine()}, {os.cpu_count()} cores, {time.perf_counter() - started:.0f} s. Written by "
        "`benchmarks/gpu_trace_check.py`."
    )
    text = render(rows, header, model)
    print(text)
    if cuda:  # a dry run writes nothing tracked
        args.output.write_text(text)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=2))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
