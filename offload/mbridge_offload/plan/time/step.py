"""Time model: what CPU offloading adds to a training step.

Optimizer offload (HybridDeviceOptimizer, per step, for the ``N`` offloaded fp32 shard elements of a GPU):

- D2H of the gradients and H2D of the updated params, ``4·N`` bytes each way over the GPU↔host link; the two
  directions run on separate copy engines, so they overlap each other (full duplex).
- the CPU AdamW step: ``max(N·36 B / host bandwidth, N / (threads × params/s per core))``. 36 B = read param,
  grad, m, v (16) + write param, m, v (12) + the DMA traffic of the two copies (8). The per-core rate is the
  caller's (a flag, or a host profile ``mbridge-offload calibrate`` measured, when named), the GPU preset's host
  figure, or ``DEFAULT_CPU_ADAM_PARAMS_PER_S_PER_CORE``; ``threads`` defaults
  to 1 because ``torchrun`` sets ``OMP_NUM_THREADS=1`` for every rank when it starts more than one per node.
- without ``overlap_cpu_optimizer_d2h_h2d`` the three run one after another; with it (one CPU optimizer per
  param, D2H queued up front, each H2D launched after its update) the step costs their maximum.

Fine-grained activation offload (``plan/memory/fine_grained.py``): each layer's groups go D2H behind that layer's
forward
and come back behind its backward; the slowest stage's exposed remainder counts.

Activation offload: each offloaded layer's eligible bytes go D2H during the next layers' forward and come back
during backward; only what the link cannot hide behind one layer's compute is exposed.

The run's own step (compute, recompute, TP/CP/EP/DP communication, pipeline bubble) comes from
``plan/time/terms.py`` at a compute efficiency fitted on Megatron Bridge's performance summary; a measured step time
(``baseline_s``: the configured run without offload) calibrates that efficiency instead, so a changed setting still
changes the prediction. ``step_time_factor`` divides by the step of the same run with its offload off (recompute as
configured): the factor a measured offload sweep compares, the card's ×2.5 at 50 % on Qwen3-30B-A3B.
``step_time_factor_vs_no_levers`` divides by the step of ``no_lever_setup`` (recompute off too), so recomputation
shows its cost there. Never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from mbridge_offload.plan.inputs.hardware import GpuPreset
from mbridge_offload.plan.memory.stage import MemoryEstimate
from mbridge_offload.plan.model.architecture import ModelSpec
from mbridge_offload.plan.model.params import stage_layers
from mbridge_offload.plan.model.run import Setup
from mbridge_offload.plan.time import terms as step_time

# torch 2.13 fused CPU AdamW, fp32, one thread, four 8 M-element tensors, measured on the development host
# (Intel Xeon, `mbridge-offload calibrate --threads 1`): median of five runs 0.82 · 10⁹ params/s (0.57-0.83).
DEFAULT_CPU_ADAM_PARAMS_PER_S_PER_CORE = 0.82e9
CPU_ADAM_BYTES_PER_PARAM = 36


@dataclass
class TimeEstimate:
    """Seconds per step. ``baseline_s``: the run with no lever (``no_lever_setup``); ``run_s``: the configured run
    without its offload cost, by term (``compute_s`` ... ``bubble_s``); ``step_s`` adds the offload cost."""

    baseline_s: float
    run_s: float | None = None  # None: the same as baseline_s (a caller that builds one by hand)
    compute_s: float = 0.0
    recompute_s: float = 0.0
    tp_comm_s: float = 0.0
    cp_comm_s: float = 0.0
    ep_comm_s: float = 0.0
    moe_overhead_s: float = 0.0
    dp_comm_s: float = 0.0
    bubble_s: float = 0.0
    efficiency: float = 0.0
    efficiency_source: str = ""
    d2h_s: float = 0.0
    cpu_adam_s: float = 0.0
    h2d_s: float = 0.0
    optimizer_extra_s: float = 0.0
    activation_extra_s: float = 0.0
    cpu_params_per_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)  # what the seconds rest on: efficiency source, links

    @property
    def without_offload_s(self) -> float:
        """The configured run's step without its offload cost (recomputation included)."""
        return self.baseline_s if self.run_s is None else self.run_s

    @property
    def offload_s(self) -> float:
        return self.optimizer_extra_s + self.activation_extra_s

    @property
    def step_s(self) -> float:
        return self.without_offload_s + self.offload_s

    @property
    def step_time_factor(self) -> float:
        """Step time over the same run without its offload, recompute as configured (what a measured offload
        sweep compares: the card's 2484 ms / 996 ms at 50 %)."""
        return self.step_s / self.without_offload_s if self.without_offload_s > 0 else 1.0

    @property
    def step_time_factor_vs_no_levers(self) -> float:
        """Step time over the same run with no lever at all (recompute and every offload off)."""
        return self.step_s / self.baseline_s if self.baseline_s > 0 else 1.0


def default_microbatches(s: Setup) -> int:
    """Micro-batches per step per DP rank: from the global batch, else 4·PP (a filled 1F1B pipeline)."""
    return s.num_microbatches() or 4 * s.pp


def samples_per_step(s: Setup) -> int:
    """The global batch: as given, else what the micro-batches the time model assumes add up to over DP."""
    return s.global_batch_size or default_microbatches(s) * s.micro_batch_size * s.dp


def no_lever_setup(s: Setup) -> Setup:
    """The same run with recomputation off and every offload off: what ``step_time_factor_vs_no_levers`` divides
    by."""
    return replace(offload_off(s), recompute_granularity=None, recompute_method=None, recompute_num_layers=None)


def offload_off(s: Setup) -> Setup:
    """The same run with every offload off (recomputation as configured): what a measured baseline step is, and
    what ``step_time_factor`` divides by."""
    return replace(s, optimizer_offload_fraction=0.0, activation_offload_layers=0, offload_modules=())


def compute_efficiency(
    m: ModelSpec,
    s: Setup,
    gpu: GpuPreset,
    *,
    mfu: float | None = None,
    baseline_s: float | None = None,
    mfu_source: str | None = None,
) -> tuple[float, str]:
    """The efficiency on the compute terms and where it comes from: ``mfu`` as given (``mfu_source`` says why),
    else the one at which the run without offload takes the measured ``baseline_s``, else the fitted one."""
    if mfu is not None:
        return mfu, mfu_source or "flag (--mfu: fraction of peak on the compute terms)"
    fitted, source = step_time.efficiency(m, s, gpu)
    if baseline_s is not None:
        measured = step_time.step_terms(m, offload_off(s), gpu).efficiency_for(baseline_s)
        if measured is not None:
            return measured, f"calibrated: the run without offload takes the measured {baseline_s:.3f} s"
        return fitted, f"{source}; the measured {baseline_s:.3f} s is out of reach of any efficiency, not used"
    return fitted, source


def baseline_step_s(m: ModelSpec, s: Setup, gpu: GpuPreset, mfu: float | None = None) -> float:
    """Seconds per step of the run without offload (recomputation as configured) at ``mfu`` or the fitted
    efficiency."""
    eff, _ = compute_efficiency(m, s, gpu, mfu=mfu)
    return step_time.step_terms(m, offload_off(s), gpu).step(eff)


def cpu_adam_rate(threads: int, per_core: float | None = None, preset: float | None = None) -> float:
    """Params/s of one rank's CPU AdamW: ``threads × per-core rate``.

    The per-core rate is, in order: the argument (a flag, or a named host profile's), the GPU preset's host
    figure (``preset``), the measured default. No file is consulted here: a host profile counts only when the
    caller names it (``plan/time/host_profile.py``).
    """
    return threads * cpu_adam_rate_source(per_core, preset)[0]


def cpu_adam_rate_source(per_core: float | None = None, preset: float | None = None) -> tuple[float, str]:
    """The per-core CPU AdamW rate in force and where it comes from (flag, preset, default)."""
    if per_core is not None:
        return per_core, "flag"
    if preset is not None:
        return preset, "preset"
    return DEFAULT_CPU_ADAM_PARAMS_PER_S_PER_CORE, "default"


def estimate_time(
    est: MemoryEstimate,
    gpu: GpuPreset,
    *,
    overlap: bool = True,
    cpu_threads: int = 1,
    cpu_params_per_s_per_core: float | None = None,
    baseline_s: float | None = None,
    mfu: float | None = None,
    mfu_source: str | None = None,
) -> TimeEstimate:
    """Step time of ``est.setup`` on ``gpu`` by term, what its offload adds, and the step without any lever.

    Args:
        est: the memory estimate (gives offloaded elements and activation bytes).
        gpu: link and host figures.
        overlap: ``optimizer.overlap_cpu_optimizer_d2h_h2d``.
        cpu_threads: CPU threads each rank's optimizer gets (``OMP_NUM_THREADS``), capped at ``gpu.cpu_cores``.
        cpu_params_per_s_per_core: the caller's CPU AdamW rate per core (a flag or a named host profile); else
            the preset's, else the default.
        baseline_s: the measured step time of the configured run without offload: calibrates the compute
            efficiency (``compute_efficiency``), which then applies to every setting.
        mfu: the compute efficiency (fraction of peak on the compute terms) to use instead of the fitted one.
        mfu_source: where ``mfu`` comes from (e.g. a measured step of another setting), for the assumptions.
    """
    m, s = est.model, est.setup
    eff, source = compute_efficiency(m, s, gpu, mfu=mfu, baseline_s=baseline_s, mfu_source=mfu_source)
    terms = step_time.step_terms(m, offload_off(s), gpu)
    secs = terms.seconds(eff)
    out = TimeEstimate(
        baseline_s=step_time.step_terms(m, no_lever_setup(s), gpu).step(eff),
        run_s=sum(secs.values()),
        compute_s=secs["compute"],
        recompute_s=secs["recompute"],
        tp_comm_s=secs["tp_comm"],
        cp_comm_s=secs["cp_comm"],
        ep_comm_s=secs["ep_comm"],
        moe_overhead_s=secs["moe_overhead"],
        dp_comm_s=secs["dp_comm"],
        bubble_s=secs["bubble"],
        efficiency=eff,
        efficiency_source=source,
        assumptions=[f"compute efficiency {eff:.3f}: {source}", *terms.notes],
    )
    base = out.without_offload_s
    threads = max(1, min(cpu_threads, gpu.cpu_cores))
    rate = cpu_adam_rate(threads, cpu_params_per_s_per_core, gpu.cpu_adam_params_per_s_per_core)
    out.cpu_params_per_s = rate
    d2h, h2d = gpu.d2h_effective_gbps * 1e9, gpu.h2d_effective_gbps * 1e9
    offloaded = max(st.offloaded_numel for st in est.stages)  # every rank waits for the slowest stage
    if offloaded:
        out.d2h_s = 4 * offloaded / d2h
        out.h2d_s = 4 * offloaded / h2d
        by_bandwidth = CPU_ADAM_BYTES_PER_PARAM * offloaded / (gpu.host_bw_effective_gbps * 1e9)
        out.cpu_adam_s = max(by_bandwidth, offloaded / rate)
        if overlap:
            out.optimizer_extra_s = max(out.d2h_s, out.cpu_adam_s, out.h2d_s)
        else:
            out.optimizer_extra_s = out.d2h_s + out.cpu_adam_s + out.h2d_s
        if out.cpu_adam_s > out.d2h_s + out.h2d_s:
            out.notes.append("the CPU AdamW step dominates the offload cost; overlap hides only the copies")
    if s.offload_modules:
        from mbridge_offload.plan.memory.activations import step_extra_s

        # One figure per link for both copy directions: the slower (D2H on Grace, measured), so never optimistic.
        out.activation_extra_s, note = step_extra_s(m, s, min(d2h, h2d), base, default_microbatches(s))
        out.notes += [note] if note else []
    if s.use_megatron_fsdp:
        out.notes.append(
            "activation copies share the host link with nothing else here (Megatron-FSDP's own traffic "
            "runs over NVLink and the network)"
        )
    if s.activation_offload_layers:
        from mbridge_offload.plan.memory.activations import layer_offload_reaches

        if layer_offload_reaches(m):  # a hybrid stack copies nothing
            _layer_offload(out, est, d2h, h2d)
    return out


def _layer_offload(out: TimeEstimate, est: MemoryEstimate, d2h: float, h2d: float) -> None:
    """Layer-level activation offload: each offloaded layer's eligible bytes go D2H during the next layer's forward
    and come back during the backward; only what the link cannot hide is added."""
    from mbridge_offload.plan.memory.activations import stage_activations

    m, s = est.model, est.setup
    eligible = stage_activations(m, s, 0).offloadable_bytes
    mb = default_microbatches(s)
    layers = len(stage_layers(m, s)[0])
    per_layer_fwd = out.compute_s / mb / layers / 3  # forward ≈ 1/3 of a layer's fwd+bwd compute
    copy = eligible / d2h  # offload during the forward, reload (H2D) during the backward
    exposed = max(0.0, copy - per_layer_fwd) + max(0.0, eligible / h2d - 2 * per_layer_fwd)
    out.activation_extra_s = s.activation_offload_layers * exposed * mb
    if exposed > 0:
        out.notes.append(
            f"activation copies ({copy * 1e3:.1f} ms per layer) exceed a layer's forward "
            f"({per_layer_fwd * 1e3:.1f} ms): not fully hidden"
        )
