"""``mbridge-offload trace`` / MCP ``trace_memory``: megatron-core's own step for the worst rank, on fake tensors.

The parent side (torch-free, like the CLI and the server): read the config and planner inputs as ``estimate`` does
(``plan.service.plan_source`` and ``plan.inputs.resolve``), ask the planner which pipeline stage is worst, build
the child's spec (``trace.spec``), run ``trace/child.py`` under the chosen megatron-core release (the releases and
their paths are exact mode's: ``exact.run.installs``), with a deadline, and answer like ``estimate``: ``memory_gib``
by category with ``total`` = the peak, ``phases`` and ``peak_phase``, ``assumptions``, plus ``by_module`` and
``under_test``. How the child runs on a CPU-only host: ``docs/trace.md``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from mbridge_offload.config.errors import InputError
from mbridge_offload_tools.exact.run import Install, installs

CHILD = Path(__file__).with_name("child.py")
DEFAULT_RELEASE = "0.19.2"
DEFAULT_DEADLINE_S = 300.0
GIB = 2**30
CATEGORIES = ("weights", "gradients", "optimizer", "activations", "other")
PHASES = ("forward_backward", "loss", "optimizer_step")


def choose_release(label: str) -> Install:
    """The megatron-core release ``label`` (0.16.1 or 0.19.2) as installed here.

    Raises:
        InputError: that release is not installed.
    """
    found = installs()
    for install in found:
        if install.version == label:
            return install
    have = ", ".join(i.version for i in found) or "none"
    raise InputError(
        f"megatron_core {label!r} is not installed here (installed: {have})",
        "pass --megatron-core with an installed release; scripts/setup installs 0.19.2 into .mcore/0.19.2",
    )


def spawn(install: Install, spec: dict[str, Any], deadline_s: float) -> dict[str, Any]:
    """The child's answer for ``spec`` under ``install``.

    Raises:
        InputError: the child passed its deadline or failed (its last line said).
    """
    env = dict(os.environ)
    if install.pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (install.pythonpath, env.get("PYTHONPATH")) if p)
    try:
        proc = subprocess.run(
            [sys.executable, str(CHILD)],
            input=json.dumps(spec),
            capture_output=True,
            text=True,
            timeout=deadline_s,
            env=env,
        )
    except subprocess.TimeoutExpired:
        raise InputError(
            f"trace: megatron-core {install.version} did not finish within {deadline_s:g} s",
            "raise --deadline, or trace fewer layers (estimate answers at once)",
        ) from None
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()] or ["no output"]
        raise InputError(f"trace: megatron-core {install.version} failed: {lines[-1].strip()[:400]}")
    answer: dict[str, Any] = json.loads(proc.stdout)
    return answer


def spawn_batch(release: str, specs: list[dict[str, Any]], deadline_s: float = 1800.0) -> list[dict[str, Any]]:
    """The child's answer for each of ``specs`` (``trace.spec.build``) from one import of megatron-core: what the
    differential test compares the planner with. A spec the child could not trace answers ``{"error": ...}``.

    Raises:
        InputError: as :func:`spawn`.
    """
    got: list[dict[str, Any]] = spawn(choose_release(release), {"batch": specs}, deadline_s)["batch"]
    return got


def _gib(n: float) -> float:
    return round(max(0.0, n) / GIB, 4)


def _optimizer_words(s: Any) -> str:
    base = "DistributedOptimizer" if s.distributed_optimizer else "Float16OptimizerWithFloat16Params"
    adam = "TE FusedAdam (stand-in: its state, and the fp32 copies its step makes of low-precision states)"
    if s.optimizer_offload_fraction > 0 and s.hybrid_optimizer == "ours":
        return (
            f"{base} over mbridge_offload_runtime's HybridDeviceOptimizer (offload fraction "
            f"{s.optimizer_offload_fraction:g}, installed into megatron-core's factory by install_optimizer_offload: "
            "torch's fused AdamW on the GPU side and in its host buckets); megatron-core's own is hybrid_optimizer="
            "megatron-core (what Bridge builds)"
        )
    if s.optimizer_offload_fraction > 0:
        return (
            f"{base} over megatron-core's HybridDeviceOptimizer (offload fraction {s.optimizer_offload_fraction:g}: "
            f"{adam} on the GPU side, torch's fused CPU AdamW on the host side); the project's own is "
            "hybrid_optimizer=ours (apply's install path)"
        )
    return f"{base} over {adam}"


def _experts_words(spec: dict[str, Any]) -> str:
    moe = spec["transformer"]
    if not moe.get("num_moe_experts"):
        return ""
    if moe.get("moe_grouped_gemm"):
        return "; experts: megatron-core's TEGroupedMLP over TE GroupedLinear stand-ins (moe_grouped_gemm)"
    return "; experts: megatron-core's SequentialMLP (moe_grouped_gemm off)"


def _hybrid_words(spec: dict[str, Any]) -> str:
    if not spec.get("hybrid"):
        return ""
    return (
        f"; hybrid: megatron-core's MambaModel / HybridModel over the pattern {spec['hybrid']['pattern']!r} (the local "
        "equivalent of its Mamba stack spec), mamba_ssm's kernels stood in (trace/hybrid/mamba_kernels.py: what "
        "they save, per mamba_ssm's source)"
    )


def _offload_words(spec: dict[str, Any]) -> str:
    layer = spec["transformer"]
    words = ""
    if layer.get("cpu_offloading"):
        words += (
            f"; layer-level activation offload of {layer['cpu_offloading_num_layers']} layer(s) through a stand-in "
            f"for Transformer Engine's get_cpu_offload_context (its v2 path at TE {spec['te_version']})"
        )
    if layer.get("fine_grained_activation_offloading"):
        words += (
            f"; megatron-core's own fine-grained offload manager ({', '.join(layer['offload_modules'])}) in its "
            "steady state (one untraced iteration first), the norms fused into the next linear as TE builds them"
        )
    return words


def _rank_words(spec: dict[str, Any], s: Any, stage: int) -> str:
    where = f"traced pipeline stage {stage} of {s.pp} (the stage the planner finds worst)"
    gpu = spec.get("gpu", 0)
    if not gpu:
        return where + ", the first rank of it"
    return (
        f"{where}, its GPU {gpu} in rank order (data-parallel rank {gpu // (s.tp * s.cp)}): under the distributed "
        "optimizer each rank owns other tensors of the buffers, and HybridDeviceOptimizer's split of whole tensors "
        "leaves the most on this one"
    )


def answer(child: dict[str, Any], spec: dict[str, Any], r: Any, install: Install, stage: int) -> dict[str, Any]:
    """The JSON answer (module docstring) from the child's bytes."""
    phases: list[dict[str, Any]] = []
    for name in PHASES:
        got = child["phases"].get(name)
        if got is None:
            continue
        cats = {c: _gib(got["by_category"][c]) for c in CATEGORIES}
        phases.append({"name": name, "memory_gib": _gib(got["total"]), "breakdown_gib": cats})
    top = max(phases, key=lambda p: p["memory_gib"])
    memory = {**top["breakdown_gib"], "total": top["memory_gib"]}
    peak = child["phases"][top["name"]]
    assumptions = [a.model_dump(mode="json") for a in r.assumptions]
    notes = [
        _rank_words(spec, r.setup, stage),
        f"{spec['num_microbatches']} micro-batch(es) through megatron-core's own schedule: enough for it to keep "
        "its most in flight on this stage",
        "megatron-core's local layer spec with Transformer Engine stand-ins (TE cannot run on this host)",
        "one optimizer step before the traced step (Adam's moments exist from the first step on)",
        "the gradient norm is not clipped (clip_grad 0): its value needs data; its memory is a scalar per tensor",
        "simulated on CPU with fake tensors: no allocator fragmentation, CUDA context, NCCL or cuBLAS workspaces",
    ]
    if r.setup.cp > 1:
        notes.append(
            f"context parallelism {r.setup.cp}: TE's p2p ring attention (stand-in, the last CP rank's steps, the "
            "largest transient); the a2a and allgather communication types are not traced"
        )
    return {
        "unit": "GiB (2^30 bytes), allocated by tensors (simulated on CPU, fake tensors)",
        "memory_gib": memory,
        "phases": phases,
        "peak_phase": top["name"],
        "stage": stage,
        "by_module": {k: _gib(v) for k, v in list(peak["by_module"].items())[:40]},
        "host_gib": _gib(child["host_bytes"]),
        "host_peak_gib": _gib(child["host_peak_bytes"]),
        "params": child["params"],
        "param_bytes": child["param_bytes"],
        "allocations": child["allocations"],
        "seconds": child["seconds"],
        "under_test": {
            "megatron_core": child["megatron_core"],
            "megatron_core_from": install.where,
            "spec": "megatron-core's local spec (get_gpt_layer_local_spec) with Transformer Engine stand-ins for "
            "attention, norms and FusedAdam (trace/standins.py: what TE saves, per TE's source)"
            + _experts_words(spec)
            + _hybrid_words(spec)
            + _offload_words(spec),
            "schedule": "interleaved 1F1B" if r.setup.vpp else ("1F1B" if r.setup.pp > 1 else "no pipelining"),
            "optimizer": _optimizer_words(r.setup),
            "transformer_engine": None,
        },
        "model": r.model.name,
        "parallel": {
            "tp": r.setup.tp,
            "pp": r.setup.pp,
            "vpp": r.setup.vpp,
            "cp": r.setup.cp,
            "dp": r.setup.dp,
            "num_gpus": r.setup.num_gpus,
        },
        "notes": notes,
        "assumptions": assumptions,
    }


def trace_answer(v: dict[str, Any]) -> dict[str, Any]:
    """``trace`` / ``trace_memory``: read the inputs as ``estimate`` does, trace the worst stage, answer.

    Raises:
        InputError: a bad input, a run the trace cannot build yet, a release not installed, a child that failed or
            passed its deadline.
    """
    from mbridge_offload.plan.inputs.resolve import resolve
    from mbridge_offload.plan.memory.stage import estimate_memory
    from mbridge_offload.plan.search.planner import estimate
    from mbridge_offload.plan.service import plan_source
    from mbridge_offload_tools.trace import spec as specs

    args = dict(v)
    release = args.pop("megatron_core", None) or DEFAULT_RELEASE
    deadline = float(args.pop("deadline", None) or DEFAULT_DEADLINE_S)
    stage = args.pop("stage", None)
    cfg, raw, source = plan_source(args)
    try:
        r = resolve(args, cfg, raw, source)
        worst = estimate(r).worst_stage if stage is None else int(stage)
    except InputError:
        raise
    except (ValueError, KeyError) as exc:
        raise InputError(str(exc).strip("'\"")) from None
    from mbridge_offload_tools.trace.result import TraceAnswer

    stages = estimate_memory(r.model, r.setup).stages
    spec = specs.build(r, worst, stages[worst].gpu if 0 <= worst < len(stages) else 0)  # build refuses the rest
    install = choose_release(release)
    child = spawn(install, spec, deadline)
    return TraceAnswer.model_validate(answer(child, spec, r, install, worst)).model_dump(mode="json")
