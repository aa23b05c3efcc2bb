"""``mbridge-offload estimate | recommend | calibrate`` — the memory/time planner on the command line.

``estimate`` and ``recommend`` never import torch; ``calibrate`` does (it times torch's fused CPU AdamW).
"""

from __future__ import annotations

import argparse
from typing import Any

from mbridge_offload_tools.common import EXIT_OK, UsageError, emit


def _add_common(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="NAME", help="model preset (qwen3-30b-a3b, llama3-8b, ...)")
    src.add_argument("--model-config", metavar="FILE", help="a Bridge YAML/JSON: its model section (and parallelism)")
    hw = p.add_mutually_exclusive_group()
    hw.add_argument("--gpu", metavar="PRESET", help="GPU preset (h100-80gb, h200-141gb, gh200, a100-80gb, b200)")
    hw.add_argument("--gpu-memory-gb", type=float, metavar="G", help="GPU memory instead of a preset (H100 links)")
    p.add_argument("--num-gpus", type=int, metavar="N")
    for flag in ("tp", "pp", "ep", "etp", "cp", "vpp"):
        p.add_argument(f"--{flag}", type=int, metavar="N")
    p.add_argument("--seq-length", type=int, metavar="S")
    p.add_argument("--micro-batch-size", type=int, metavar="B")
    p.add_argument("--global-batch-size", type=int, metavar="B")
    p.add_argument("--optimizer-offload-fraction", type=float, metavar="F")
    p.add_argument("--activation-offload-layers", type=int, metavar="K")
    p.add_argument("--no-distributed-optimizer", action="store_true")
    p.add_argument("--precision-aware-optimizer", action="store_true")
    p.add_argument("--recompute", choices=["full", "selective"], help="model.recompute_granularity")
    p.add_argument("--no-overlap", action="store_true", help="overlap_cpu_optimizer_d2h_h2d=False")
    p.add_argument("--cpu-threads", type=int, default=1, help="CPU threads per rank (OMP_NUM_THREADS; torchrun: 1)")
    p.add_argument("--cpu-adam-params-per-s", type=float, help="CPU AdamW params/s per core (else calibration)")
    p.add_argument("--baseline-step-s", type=float, help="measured step time without offload, seconds")
    p.add_argument("--mfu", type=float, help="assumed MFU for the derived baseline step time")
    p.add_argument("--host-ram-gb", type=float, help="host RAM per GPU (warning threshold)")
    p.add_argument("--link-gbps", type=float, help="GPU<->host GB/s per direction (theoretical)")
    p.add_argument("--host-bw-gbps", type=float, help="host memory GB/s per GPU (theoretical)")
    p.add_argument("--calibration", metavar="PATH", help="calibration file (default ~/.cache/mbridge-offload/...)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")


def add_parsers(sub: Any) -> None:
    est = sub.add_parser("estimate", help="per-GPU memory (worst pipeline stage), host memory and step-time factor")
    _add_common(est)
    est.set_defaults(handler=run_estimate)
    rec = sub.add_parser("recommend", help="the smallest offload that fits: none, optimizer, activation or both")
    _add_common(rec)
    rec.add_argument("config", nargs="?", metavar="CONFIG", help="Bridge YAML/JSON (same as --model-config)")
    rec.add_argument(
        "--margin", type=float, default=None, help="fraction of GPU memory kept free (default 0.05 dense, 0.30 MoE)"
    )
    rec.set_defaults(handler=run_recommend)
    cal = sub.add_parser("calibrate", help="time torch's fused CPU AdamW here and store params/s")
    cal.add_argument(
        "--output",
        metavar="PATH",
        help="where to store it (else $MBRIDGE_OFFLOAD_CALIBRATION or ~/.cache/mbridge-offload/calibration.json)",
    )
    cal.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    cal.add_argument("--numel", type=int, default=32 * 1024 * 1024, help="elements updated per step")
    cal.add_argument("--steps", type=int, default=5)
    cal.add_argument("--json", action="store_true")
    cal.set_defaults(handler=run_calibrate)


# ---------------------------------------------------------------------------------------------- inputs


def _inputs(args: argparse.Namespace):
    from mbridge_offload.config import sources
    from mbridge_offload.plan import planner as plan

    path = args.model_config or getattr(args, "config", None)
    if args.model_config and getattr(args, "config", None):
        raise UsageError("give the config once: either --model-config FILE or CONFIG")
    loaded = None
    if path:
        try:
            loaded = sources.load(path)
        except sources.ConfigError as exc:
            raise UsageError(str(exc)) from None
    if args.model is None and loaded is None:
        raise UsageError("no model: pass --model NAME (a preset) or --model-config FILE (a Bridge YAML)")
    for name in ("num_gpus", "tp", "pp", "ep", "etp", "cp", "vpp", "seq_length", "micro_batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} is {value}: it must be at least 1")
    fraction = args.optimizer_offload_fraction
    if fraction is not None and not 0.0 <= fraction <= 1.0:
        raise UsageError(f"--optimizer-offload-fraction is {fraction}: it must be in [0.0, 1.0]")
    if args.activation_offload_layers is not None and args.activation_offload_layers < 0:
        raise UsageError(f"--activation-offload-layers is {args.activation_offload_layers}: it must be at least 0")
    flags = dict(
        model=args.model,
        gpu=args.gpu,
        gpu_memory_gb=args.gpu_memory_gb,
        num_gpus=args.num_gpus,
        tp=args.tp,
        pp=args.pp,
        ep=args.ep,
        etp=args.etp,
        cp=args.cp,
        vpp=args.vpp,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        optimizer_offload_fraction=args.optimizer_offload_fraction,
        activation_offload_layers=args.activation_offload_layers,
        distributed_optimizer=False if args.no_distributed_optimizer else None,
        precision_aware_optimizer=True if args.precision_aware_optimizer else None,
        recompute_granularity=args.recompute,
        overlap=False if args.no_overlap else None,
        host_ram_gb=args.host_ram_gb,
        link_gbps=args.link_gbps,
        host_bw_gbps=args.host_bw_gbps,
    )
    time_kwargs = dict(
        cpu_threads=args.cpu_threads,
        cpu_params_per_s_per_core=args.cpu_adam_params_per_s,
        baseline_s=args.baseline_step_s,
        mfu=args.mfu,
        calibration=args.calibration,
    )
    if args.cpu_threads < 1:
        raise UsageError(f"--cpu-threads is {args.cpu_threads}: it must be at least 1")
    try:
        inputs = plan.resolve_inputs(loaded.config if loaded else None, loaded.raw if loaded else None, **flags)
    except (KeyError, ValueError) as exc:
        raise UsageError(str(exc).strip("'\"")) from None
    return inputs, loaded, time_kwargs


# ---------------------------------------------------------------------------------------------- estimate


def estimate_payload(inputs: Any, time_kwargs: dict[str, Any], margin: float | None = None) -> dict[str, Any]:
    """The ``estimate`` JSON object (contract keys first, then details)."""
    from mbridge_offload.plan.memory import GB, estimate_memory
    from mbridge_offload.plan.planner import budget_gb, default_margin
    from mbridge_offload.plan.timing import estimate_time

    m, s, gpu = inputs.model, inputs.setup, inputs.gpu
    est = estimate_memory(m, s, gpu.host_ram_gb)
    t = estimate_time(est, gpu, overlap=inputs.overlap, **time_kwargs)
    # "fits" means under the planner's budget, so that estimate and recommend never disagree.
    budget = budget_gb(gpu, default_margin(m) if margin is None else margin)
    return {
        "memory_gb": est.breakdown_gb(),
        "host_gb": round(est.host_gb, 3),
        "offloaded_fraction": round(est.offloaded_fraction, 4),
        "step_time_factor": round(t.step_time_factor, 3),
        "fits": est.worst.total <= budget * GB,
        "budget_gb": round(budget, 3),
        "gpu_memory_gb": gpu.hbm_gb,
        "worst_stage": est.worst.stage,
        "stages": [{"stage": st.stage, "total_gb": round(st.total / GB, 3), "params": st.params} for st in est.stages],
        "host_peak_gb": round(est.host_peak_gb, 3),
        "time_s": {
            "baseline": round(t.baseline_s, 4),
            "d2h": round(t.d2h_s, 4),
            "cpu_adam": round(t.cpu_adam_s, 4),
            "h2d": round(t.h2d_s, 4),
            "optimizer_extra": round(t.optimizer_extra_s, 4),
            "activation_extra": round(t.activation_extra_s, 4),
        },
        "model": m.name,
        "parallel": {
            "num_gpus": s.num_gpus,
            "tp": s.tp,
            "pp": s.pp,
            "vpp": s.vpp,
            "cp": s.cp,
            "ep": s.ep,
            "etp": s.resolved_etp(m),
            "dp": s.dp,
            "expert_dp": s.expert_dp(m) if m.is_moe else None,
            "sequence_parallel": s.sp,
            "distributed_optimizer": s.use_distributed_optimizer,
            "precision_aware_optimizer": s.use_precision_aware_optimizer,
        },
        "optimizer_offload_fraction": s.optimizer_offload_fraction,
        "activation_offload_layers": s.activation_offload_layers,
        "warnings": est.warnings + t.notes,
    }


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _memory_rows(mem: dict[str, float], other: dict[str, float] | None = None) -> list[tuple[str, str]]:
    rows = []
    for key in ("weights", "gradients", "optimizer", "activations", "other", "total"):
        value = f"{mem[key]:8.2f} GB"
        if other is not None:
            value = f"{other[key]:8.2f} GB  ->{mem[key]:8.2f} GB"
        rows.append((key, value))
    return rows


def _human_estimate(d: dict[str, Any]) -> str:
    p = d["parallel"]
    head = (
        f"{d['model']} on {p['num_gpus']} GPUs (TP{p['tp']} PP{p['pp']} CP{p['cp']} EP{p['ep']} ETP{p['etp']}, "
        f"DP{p['dp']}), worst stage {d['worst_stage']}, per GPU:"
    )
    rows = _memory_rows(d["memory_gb"])
    rows += [
        (
            "budget",
            f"{d['budget_gb']:8.2f} GB of {d['gpu_memory_gb']:g} GB -> {'fits' if d['fits'] else 'DOES NOT FIT'}",
        ),
        ("host", f"{d['host_gb']:8.2f} GB (peak {d['host_peak_gb']:.2f} GB)"),
        (
            "offloaded",
            f"{d['offloaded_fraction']:.1%} of optimizer shards, {d['activation_offload_layers']} activation layers",
        ),
        ("step time", f"x{d['step_time_factor']:.2f} (baseline {d['time_s']['baseline']:.3f} s)"),
    ]
    return "\n".join([head, _table(rows)] + [f"warning: {w}" for w in d["warnings"]])


def run_estimate(args: argparse.Namespace) -> int:
    inputs, _, time_kwargs = _inputs(args)
    try:
        payload = estimate_payload(inputs, time_kwargs)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    emit(payload, args.json, _human_estimate)
    return EXIT_OK


# ---------------------------------------------------------------------------------------------- recommend


def _human_recommend(d: dict[str, Any]) -> str:
    lines = [
        f"mode: {d['mode']}    fits: {'yes' if d['fits'] else 'NO'}    step time: x{d['step_time_factor']:.2f}",
        "memory per GPU (worst stage), before -> after:",
    ]
    lines.append(_table(_memory_rows(d["memory_gb"]["after"], d["memory_gb"]["before"])))
    if d["overrides"]:
        lines.append("overrides:")
        lines += [f"  {o}" for o in d["overrides"]]
    lines.append("why:")
    lines += [f"  - {r}" for r in d["rationale"]]
    if d.get("suggestions"):
        lines.append("what would fit:")
        lines += [f"  - {r}" for r in d["suggestions"]]
    return "\n".join(lines)


def run_recommend(args: argparse.Namespace) -> int:
    from mbridge_offload.plan import planner as plan

    if args.margin is not None and not 0.0 <= args.margin < 1.0:
        raise UsageError(f"--margin is {args.margin}: it must be in [0, 1)")
    inputs, loaded, time_kwargs = _inputs(args)
    try:
        rec = plan.recommend(
            inputs.model, inputs.setup, inputs.gpu, inputs.constraints, margin=args.margin, time_kwargs=time_kwargs
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    plan.revalidate(rec, loaded.config if loaded else None, loaded.raw if loaded else None)
    emit(rec.to_json(), args.json, _human_recommend)
    return EXIT_OK


# ---------------------------------------------------------------------------------------------- calibrate


def run_calibrate(args: argparse.Namespace) -> int:
    from mbridge_offload.plan import calibration as calibrate

    if args.numel < 1024 or args.steps < 1 or (args.threads is not None and args.threads < 1):
        raise UsageError("--numel must be at least 1024, --steps and --threads at least 1")
    try:
        from mbridge_offload.runtime.adam_throughput import measure

        result = measure(numel=args.numel, steps=args.steps, threads=args.threads)
    except ImportError as exc:
        raise UsageError(f"calibrate needs torch ({exc}); install mbridge-offload[runtime]") from None
    result["path"] = str(calibrate.save(result, args.output))
    emit(
        result,
        args.json,
        lambda d: (
            f"fused CPU AdamW: {d['cpu_adam_params_per_s'] / 1e9:.2f}e9 params/s on {d['threads']} threads "
            f"({d['cpu_adam_params_per_s_per_core'] / 1e9:.2f}e9 per core); stored in {d['path']}"
        ),
    )
    return EXIT_OK
