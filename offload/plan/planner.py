"""The planner: the skill's decision table made executable, then a search for the smallest offload that fits.

Decision table (NVIDIA skill ``nemo-mbridge-perf-cpu-offloading``, "Quick Decision"):

- the run already fits → no offload (offloading always adds step time);
- activation offload is possible only with PP = 1, no activation recompute, CUDA graphs off (or
  ``full_iteration``) and no fine-grained activation offloading — the upstream checks; otherwise optimizer offload;
- activations dominate and activation offload is possible → activation offload, smallest layer count that fits;
- otherwise → optimizer offload, the smallest fraction (on a 0.05 grid, realised by HybridDeviceOptimizer's greedy
  whole-tensor split) that brings the worst pipeline stage under the budget; both when neither alone suffices;
- nothing fits → say what would: more PP, full recompute, more GPUs, each with its predicted memory.

Never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from mbridge_offload.config.schema import OffloadConfig
from mbridge_offload.plan.hardware import GpuPreset, gpu_preset, with_overrides
from mbridge_offload.plan.memory import GB, MemoryEstimate, ModelSpec, Setup, check_setup, estimate_memory
from mbridge_offload.plan.timing import TimeEstimate, estimate_time

FRACTION_STEP = 0.05
DEFAULT_MARGIN = 0.05  # dense: keep 5 % of HBM free for fragmentation and peaks the model does not see
# MoE: the model assumes balanced routing, but Megatron's default dropless routing sends a varying, often
# several-fold, share of tokens to the busiest local expert, and the variable-shape expert buffers fragment the
# caching allocator; keep 30 % free (upstream's own runs of Qwen3-30B-A3B at a predicted ~60 GB of 80 GB were
# made with optimizer offload, and Bridge lowered offload settings "to lower chance of oom", PR #1028).
MOE_MARGIN = 0.30


def default_margin(m: ModelSpec) -> float:
    """The fraction of HBM the planner keeps free by default: ``MOE_MARGIN`` for MoE, else ``DEFAULT_MARGIN``."""
    return MOE_MARGIN if m.is_moe else DEFAULT_MARGIN


@dataclass(frozen=True)
class Constraints:
    """Config facts outside ``Setup`` that the offload rules read."""

    cuda_graph_impl: str = "none"
    fine_grained_activation_offloading: bool = False
    moe_paged_stash: bool = False

    def activation_blockers(self, s: Setup) -> list[str]:
        """Why layer-level activation offload is not allowed (upstream errors), empty when it is."""
        out = []
        if s.pp > 1:
            out.append(
                f"activation offloading needs PP=1 (PP is {s.pp}): MCore raises 'Currently there is no "
                "support for Pipeline parallelism with CPU offloading'"
            )
        if s.recompute_granularity is not None:
            out.append(f"activation offloading cannot run with recompute_granularity={s.recompute_granularity}")
        if self.cuda_graph_impl not in ("none", "full_iteration"):
            out.append(f"activation offloading is incompatible with cuda_graph_impl={self.cuda_graph_impl}")
        if self.fine_grained_activation_offloading:
            out.append("activation offloading cannot be combined with fine_grained_activation_offloading")
        if self.moe_paged_stash:
            out.append("activation offloading cannot be combined with moe_paged_stash")
        return out


@dataclass
class Recommendation:
    mode: str
    overrides: list[str]
    before: MemoryEstimate
    after: MemoryEstimate
    fits: bool
    time: TimeEstimate
    budget_gb: float
    rationale: list[str] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)

    @property
    def step_time_factor(self) -> float:
        return self.time.step_time_factor

    def to_dict(self) -> dict:
        return self.to_json()

    def to_json(self) -> dict:
        s = self.after.setup
        return {
            "mode": self.mode,
            "overrides": self.overrides,
            "memory_gb": {"before": self.before.breakdown_gb(), "after": self.after.breakdown_gb()},
            "fits": self.fits,
            "step_time_factor": round(self.step_time_factor, 3),
            "rationale": self.rationale,
            "budget_gb": round(self.budget_gb, 3),
            "optimizer_offload_fraction": s.optimizer_offload_fraction,
            "offloaded_fraction": round(self.after.offloaded_fraction, 4),
            "activation_offload_layers": s.activation_offload_layers,
            "host_gb": round(self.after.host_gb, 3),
            "host_peak_gb": round(self.after.host_peak_gb, 3),
            "suggestions": self.suggestions,
            "warnings": self.after.warnings,
        }


def budget_gb(gpu: GpuPreset, margin: float = DEFAULT_MARGIN) -> float:
    return gpu.hbm_gb * (1.0 - margin)


def _fits(est: MemoryEstimate, budget: float) -> bool:
    return est.worst.total <= budget * GB


def overrides_for(s: Setup) -> list[str]:
    """The Hydra-style overrides that switch on the offload settings of ``s``."""
    out = []
    if s.optimizer_offload_fraction > 0:
        out += [
            "optimizer.optimizer_cpu_offload=True",
            f"optimizer.optimizer_offload_fraction={round(s.optimizer_offload_fraction, 4)}",
            "optimizer.overlap_cpu_optimizer_d2h_h2d=True",
        ]
    if s.activation_offload_layers > 0:
        out += [
            "model.cpu_offloading=True",
            f"model.cpu_offloading_num_layers={s.activation_offload_layers}",
            "model.cpu_offloading_activations=True",
            "model.cpu_offloading_weights=False",
        ]
    return out


def _smallest_fraction(m: ModelSpec, s: Setup, budget: float, host_ram: float | None) -> MemoryEstimate | None:
    steps = round(1 / FRACTION_STEP)
    for i in range(1, steps + 1):
        est = estimate_memory(m, replace(s, optimizer_offload_fraction=round(i * FRACTION_STEP, 2)), host_ram)
        if _fits(est, budget):
            return est
    return None


def _smallest_layers(m: ModelSpec, s: Setup, budget: float, host_ram: float | None) -> MemoryEstimate | None:
    for k in range(1, m.num_layers):
        est = estimate_memory(m, replace(s, activation_offload_layers=k), host_ram)
        if _fits(est, budget):
            return est
    return None


def _suggest(m: ModelSpec, s: Setup, budget: float, full_offload: Setup) -> list[str]:
    """What would make the run fit, each with its predicted worst-stage memory."""
    out = []
    # More pipeline stages on the same GPUs.
    pp = s.pp * 2
    while pp <= m.num_layers and s.num_gpus % (s.tp * pp * s.cp) == 0:
        try:
            est = estimate_memory(m, replace(full_offload, pp=pp, vpp=None, activation_offload_layers=0))
        except ValueError:
            break
        total = est.worst.total / GB
        if total <= budget:
            out.append(f"PP={pp} with optimizer offload fraction 1.0: {total:.1f} GB per GPU (budget {budget:.1f})")
            break
        pp *= 2
    # Full activation recompute (then activation offload is not allowed, optimizer offload is).
    est = estimate_memory(
        m,
        replace(
            full_offload,
            recompute_granularity="full",
            recompute_method="uniform",
            recompute_num_layers=1,
            activation_offload_layers=0,
        ),
    )
    verdict = "fits" if est.worst.total <= budget * GB else "still does not fit"
    out.append(
        f"model.recompute_granularity=full (uniform, 1 layer) with optimizer offload fraction 1.0: "
        f"{est.worst.total / GB:.1f} GB per GPU, {verdict}"
    )
    # More GPUs: data parallelism shrinks the distributed-optimizer shards.
    for mult in (2, 4, 8, 16):
        try:
            est = estimate_memory(
                m, replace(s, num_gpus=s.num_gpus * mult, optimizer_offload_fraction=0.0, activation_offload_layers=0)
            )
        except ValueError:
            continue
        if est.worst.total <= budget * GB:
            out.append(f"{s.num_gpus * mult} GPUs (DP ×{mult}) without offload: {est.worst.total / GB:.1f} GB per GPU")
            break
    else:
        out.append("more GPUs alone do not help: weights, gradients and activations are not sharded by DP")
    return out


def recommend(
    m: ModelSpec,
    s: Setup,
    gpu: GpuPreset,
    constraints: Constraints | None = None,
    *,
    margin: float | None = None,
    time_kwargs: dict | None = None,
) -> Recommendation:
    """Pick the smallest offload that brings the worst pipeline stage under ``gpu.hbm_gb × (1 − margin)``.

    Args:
        m: the architecture.
        s: the run; its offload settings are ignored (the search starts from no offload).
        gpu: HBM size, link and host figures.
        constraints: CUDA graphs, fine-grained offloading, paged stash (block activation offload).
        margin: the fraction of HBM kept free; ``None`` = ``default_margin(m)`` (5 % dense, 30 % MoE).
        time_kwargs: passed to ``estimate_time`` (``baseline_s``, ``cpu_threads``, ...).

    Raises:
        ValueError: for a setup Megatron would reject.

    Example:
        >>> from mbridge_offload.plan.presets import model_preset
        >>> from mbridge_offload.plan.hardware import gpu_preset
        >>> rec = recommend(model_preset("qwen3-0.6b"), Setup(num_gpus=1), gpu_preset("h100-80gb"))
        >>> rec.mode
        'none'
    """
    constraints = constraints or Constraints()
    time_kwargs = time_kwargs or {}
    base = replace(s, optimizer_offload_fraction=0.0, activation_offload_layers=0)
    check_setup(m, base)
    margin = default_margin(m) if margin is None else margin
    budget = budget_gb(gpu, margin)
    host_ram = gpu.host_ram_gb
    before = estimate_memory(m, base, host_ram)
    w = before.worst
    rationale = [
        f"without offload the worst stage (stage {w.stage}) needs {w.total / GB:.1f} GB of "
        f"{gpu.hbm_gb:g} GB; budget {budget:.1f} GB ({margin:.0%} kept free)"
    ]

    def done(mode: str, after: MemoryEstimate, fits: bool, suggestions: list[str] | None = None) -> Recommendation:
        t = estimate_time(after, gpu, overlap=True, **time_kwargs)
        if after.setup.optimizer_offload_fraction:
            rationale.append(
                f"optimizer offload fraction {after.setup.optimizer_offload_fraction:g} puts "
                f"{after.offloaded_fraction:.1%} of the optimizer shards on the CPU (HDO splits whole "
                f"tensors): saves {(w.optimizer - after.worst.optimizer) / GB:.1f} GB; CPU AdamW "
                f"{t.cpu_adam_s:.2f} s, copies {t.d2h_s:.2f} s each way per step"
            )
        if after.setup.activation_offload_layers:
            rationale.append(
                f"offloading {after.setup.activation_offload_layers} of {m.num_layers} layers' "
                f"activations saves {(w.activations - after.worst.activations) / GB:.1f} GB"
            )
        if mode != "none":
            rationale.append(f"predicted step time ×{t.step_time_factor:.2f} (baseline {t.baseline_s:.2f} s)")
            rationale.extend(t.notes)
        rationale.extend(after.warnings)
        return Recommendation(
            mode, overrides_for(after.setup), before, after, fits, t, budget, rationale, suggestions or []
        )

    if _fits(before, budget):
        rationale.append("it fits: offloading only adds step time, so none is recommended")
        return done("none", before, True)

    blockers = constraints.activation_blockers(base)
    rationale.extend(blockers)
    activation_ok = not blockers
    activations_dominate = w.activations > w.optimizer
    if activation_ok and activations_dominate:
        rationale.append(
            f"activations ({w.activations / GB:.1f} GB) dominate the optimizer state "
            f"({w.optimizer / GB:.1f} GB) and PP=1: activation offloading first"
        )
        order = ("activation", "optimizer")
    else:
        if activation_ok:
            rationale.append(
                f"optimizer state ({w.optimizer / GB:.1f} GB) dominates activations "
                f"({w.activations / GB:.1f} GB): optimizer offloading first"
            )
        order = ("optimizer", "activation") if activation_ok else ("optimizer",)
    for mode in order:
        found = (_smallest_layers if mode == "activation" else _smallest_fraction)(m, base, budget, host_ram)
        if found is not None:
            return done(mode, found, True)
    if activation_ok:
        # Both: the most activation offload allowed, then the smallest fraction, then back off the layers.
        most = replace(base, activation_offload_layers=m.num_layers - 1)
        found = _smallest_fraction(m, most, budget, host_ram)
        if found is not None:
            with_fraction = replace(base, optimizer_offload_fraction=found.setup.optimizer_offload_fraction)
            fewer = _smallest_layers(m, with_fraction, budget, host_ram)
            return done("both", fewer or found, True)
    full = replace(
        base, optimizer_offload_fraction=1.0, activation_offload_layers=m.num_layers - 1 if activation_ok else 0
    )
    after = estimate_memory(m, full, host_ram)
    rationale.append(f"even the most offload allowed leaves {after.worst.total / GB:.1f} GB: nothing fits")
    mode = "both" if activation_ok else "optimizer"
    return done(mode, after, False, _suggest(m, base, budget, replace(full, activation_offload_layers=0)))


# ------------------------------------------------------------------------------------------- inputs


@dataclass
class Inputs:
    """Everything the estimator and planner need, resolved from a config and/or flags."""

    model: ModelSpec
    setup: Setup
    gpu: GpuPreset
    constraints: Constraints
    overlap: bool = True


def _default_gpus(s: Setup, m: ModelSpec) -> int:
    """Smallest multiple of both TP·PP·CP and PP·EP·ETP that is at least 8 (one node)."""
    import math

    unit = math.lcm(s.tp * s.pp * s.cp, s.pp * s.ep * s.resolved_etp(m))
    return unit * max(1, math.ceil(8 / unit))


def resolve_inputs(
    config: OffloadConfig | None = None,
    raw: dict[str, Any] | None = None,
    *,
    model: str | None = None,
    gpu: str | None = None,
    gpu_memory_gb: float | None = None,
    num_gpus: int | None = None,
    tp: int | None = None,
    pp: int | None = None,
    ep: int | None = None,
    etp: int | None = None,
    cp: int | None = None,
    vpp: int | None = None,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    global_batch_size: int | None = None,
    optimizer_offload_fraction: float | None = None,
    activation_offload_layers: int | None = None,
    distributed_optimizer: bool | None = None,
    precision_aware_optimizer: bool | None = None,
    recompute_granularity: str | None = None,
    overlap: bool | None = None,
    host_ram_gb: float | None = None,
    link_gbps: float | None = None,
    host_bw_gbps: float | None = None,
    cpu_cores: int | None = None,
) -> Inputs:
    """Model from a preset name or the config's model section; parallelism, batch, precision and offload from the
    config, each overridden by the flag of the same meaning when given.

    Raises:
        KeyError: unknown model or GPU preset.
        ValueError: no model given, or a setup Megatron rejects (checked by the estimator).
    """
    from mbridge_offload.plan.presets import model_from_config, model_preset

    if model is not None:
        spec = model_preset(model)
    elif config is not None:
        spec = model_from_config(config)
    else:
        raise ValueError("no model: pass --model NAME (a preset) or --model-config FILE (a Bridge YAML)")
    values: dict[str, Any] = {}
    c = config
    if c is not None:
        mc, oc = c.model, c.optimizer
        values.update(
            tp=mc.tensor_model_parallel_size,
            pp=mc.pipeline_model_parallel_size,
            vpp=mc.virtual_pipeline_model_parallel_size,
            cp=mc.context_parallel_size,
            ep=mc.expert_model_parallel_size,
            etp=mc.expert_tensor_parallel_size,
            sequence_parallel=mc.sequence_parallel,
            recompute_granularity=mc.recompute_granularity,
            recompute_method=mc.recompute_method,
            recompute_num_layers=mc.recompute_num_layers,
            use_precision_aware_optimizer=oc.use_precision_aware_optimizer,
            use_distributed_optimizer=oc.use_distributed_optimizer or c.ddp.use_distributed_optimizer,
            main_params_dtype=oc.main_params_dtype or "fp32",
            exp_avg_dtype=oc.exp_avg_dtype or "fp32",
            exp_avg_sq_dtype=oc.exp_avg_sq_dtype or "fp32",
            store_param_remainders=oc.store_param_remainders,
        )
        if mc.recompute_modules:
            values["recompute_modules"] = tuple(mc.recompute_modules)
        if c.seq_length:
            values["seq_length"] = c.seq_length
        if c.train.micro_batch_size:
            values["micro_batch_size"] = c.train.micro_batch_size
        if c.train.global_batch_size:
            values["global_batch_size"] = c.train.global_batch_size
        if oc.optimizer_cpu_offload:
            values["optimizer_offload_fraction"] = oc.optimizer_offload_fraction
        if mc.cpu_offloading:
            values["activation_offload_layers"] = mc.cpu_offloading_num_layers
        ddp_raw = (raw or {}).get("ddp") or {}
        opt_raw = (raw or {}).get("optimizer") or {}
        if raw is not None and "use_distributed_optimizer" not in {*ddp_raw, *opt_raw}:
            values.pop("use_distributed_optimizer")  # not given: the Bridge-recipe default (on)
        if isinstance(ddp_raw, dict) and "grad_reduce_in_fp32" in ddp_raw:
            values["grad_reduce_in_fp32"] = bool(c.ddp.grad_reduce_in_fp32)  # else the Bridge-recipe default
        if mc.sequence_parallel is False and (values.get("tp") or 1) > 1:
            values["sequence_parallel"] = False
    flags = dict(
        tp=tp,
        pp=pp,
        ep=ep,
        etp=etp,
        cp=cp,
        vpp=vpp,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size,
        optimizer_offload_fraction=optimizer_offload_fraction,
        activation_offload_layers=activation_offload_layers,
        recompute_granularity=recompute_granularity,
        use_distributed_optimizer=distributed_optimizer,
        use_precision_aware_optimizer=precision_aware_optimizer,
    )
    values.update({k: v for k, v in flags.items() if v is not None})
    if values.get("sequence_parallel") is None or (values.get("tp") or 1) == 1:
        values.pop("sequence_parallel", None)
    setup = Setup(**{k: v for k, v in values.items() if v is not None or k in ("vpp", "etp")})
    setup = replace(setup, num_gpus=num_gpus if num_gpus is not None else _default_gpus(setup, spec))
    preset = gpu_preset(gpu or "h100-80gb")
    if gpu_memory_gb is not None and gpu_memory_gb <= 0:
        raise ValueError(f"--gpu-memory-gb is {gpu_memory_gb}: it must be positive")
    preset = with_overrides(
        preset,
        hbm_gb=gpu_memory_gb,
        host_ram_gb=host_ram_gb,
        link_gbps=link_gbps,
        host_bw_gbps=host_bw_gbps,
        cpu_cores=cpu_cores,
    )
    constraints = Constraints()
    if c is not None:
        constraints = Constraints(
            cuda_graph_impl=c.model.cuda_graph_impl,
            fine_grained_activation_offloading=c.model.fine_grained_activation_offloading,
            moe_paged_stash=c.model.moe_paged_stash,
        )
    if overlap is None:
        overlap = (
            c.optimizer.overlap_cpu_optimizer_d2h_h2d if c is not None and c.optimizer.optimizer_cpu_offload else True
        )
    # Offload settings already in the config are checked by the estimator; the planner starts without them.
    check_setup(spec, replace(setup, optimizer_offload_fraction=0.0, activation_offload_layers=0))
    return Inputs(spec, setup, preset, constraints, overlap)


def revalidate(rec: Recommendation, config: OffloadConfig | None, raw: dict[str, Any] | None) -> None:
    """Run the rule catalogue (when present) on the config with the recommended overrides; note any error."""
    if config is None or not rec.overrides:
        return
    try:
        from mbridge_offload.config import sources
        from mbridge_offload.config.validate import validate
    except ImportError:  # the catalogue is optional for the planner
        return
    import copy

    edited = copy.deepcopy(raw if raw is not None else config.model_dump())
    try:
        sources.apply_overrides(edited, rec.overrides)
        report = validate(sources.build_config(edited, "<recommended>"), edited)
    except Exception as exc:  # never let the lint step hide the plan itself
        rec.rationale.append(f"could not re-validate the recommended overrides: {exc}")
        return
    errors = [f for f in report.findings if f.severity == "error"]
    if errors:
        rec.rationale.append(
            "the rule catalogue rejects the result: " + "; ".join(f"{f.rule}: {f.message}" for f in errors)
        )
    else:
        rec.rationale.append("the recommended overrides pass the rule catalogue (mbridge_offload.config.validate)")


def recommend_for_inputs(
    config: OffloadConfig | None = None,
    raw: dict[str, Any] | None = None,
    *,
    margin: float | None = None,
    time_kwargs: dict | None = None,
    **flags: Any,
) -> Recommendation:
    """``recommend`` from a loaded config and/or flags (``model``, ``gpu``, ``tp``, ...), re-validated."""
    inputs = resolve_inputs(config, raw, **flags)
    rec = recommend(inputs.model, inputs.setup, inputs.gpu, inputs.constraints, margin=margin, time_kwargs=time_kwargs)
    revalidate(rec, config, raw)
    return rec


def recommend_for_config(config: OffloadConfig, raw: dict[str, Any] | None = None, **flags: Any) -> Recommendation:
    """``recommend`` for a loaded config (``apply --mode recommended``)."""
    return recommend_for_inputs(config, raw, **flags)
