"""Time model: what CPU offloading adds to a training step.

Optimizer offload (HybridDeviceOptimizer, per step, for the ``N`` offloaded fp32 shard elements of a GPU):

- D2H of the gradients and H2D of the updated params, ``4·N`` bytes each way over the GPU↔host link; the two
  directions run on separate copy engines, so they overlap each other (full duplex).
- the CPU AdamW step: ``max(N·36 B / host bandwidth, N / (threads × params/s per core))``. 36 B = read param,
  grad, m, v (16) + write param, m, v (12) + the DMA traffic of the two copies (8). The per-core rate is the
  measured one (``mbridge-offload calibrate``) or ``DEFAULT_CPU_ADAM_PARAMS_PER_S_PER_CORE``; ``threads`` defaults
  to 1 because ``torchrun`` sets ``OMP_NUM_THREADS=1`` for every rank when it starts more than one per node.
- without ``overlap_cpu_optimizer_d2h_h2d`` the three run one after another; with it (one CPU optimizer per
  param, D2H queued up front, each H2D launched after its update) the step costs their maximum.

Fine-grained activation offload (``plan/fine_grained.py``): each layer's groups go D2H behind that layer's forward
and come back behind its backward; the slowest stage's exposed remainder counts.

Activation offload: each offloaded layer's eligible bytes go D2H during the next layers' forward and come back
during backward; only what the link cannot hide behind one layer's compute is exposed.

The baseline step (to turn seconds into a factor) comes from model FLOPs at an assumed MFU, or from the user's
measured step time (``baseline_step_s``), which is what the docs compare against. Never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from mbridge_offload.plan import calibration as calibrate
from mbridge_offload.plan.hardware import GpuPreset
from mbridge_offload.plan.memory import MemoryEstimate, ModelSpec, Setup, layer_params, padded_vocab, stage_layers

# torch 2.13 fused CPU AdamW, fp32, one thread, four 8 M-element tensors, measured on the development host
# (Intel Xeon, `mbridge-offload calibrate --threads 1`): median of five runs 0.82 · 10⁹ params/s (0.57-0.83).
DEFAULT_CPU_ADAM_PARAMS_PER_S_PER_CORE = 0.82e9
CPU_ADAM_BYTES_PER_PARAM = 36
# Model-FLOPs utilisation (recomputation counted as work) of the baseline step when none is measured.
# MoE: implied by the one published MoE baseline whose settings are all published — the Qwen3-30B-A3B card's job
# 10119286 (0.996 s; TP2 PP2 EP4, full recompute, global batch 8 on 2 x 8 H100; plan/data/published.yaml;
# published.fit_mfu_moe refits it, a test checks they agree). Tuned large-batch MoE runs reach about twice that
# (Bridge moe-hardware-configs skill: Qwen3 30B on H100 "low-200s TFLOPS/GPU"), so for large global batches this
# baseline is long and the predicted factors low: pass --baseline-step-s when you have a measured step.
DEFAULT_MFU_MOE = 0.096
MFU_MOE_SOURCE = "published: implied by the Qwen3-30B-A3B card's measured baseline (job 10119286, 0.996 s)"
# Dense: assumed; no dense baseline with all its settings is published in plan/data/published.yaml.
DEFAULT_MFU_DENSE = 0.35
MFU_DENSE_SOURCE = "assumed (no published dense baseline with its settings)"


@dataclass
class TimeEstimate:
    baseline_s: float
    d2h_s: float = 0.0
    cpu_adam_s: float = 0.0
    h2d_s: float = 0.0
    optimizer_extra_s: float = 0.0
    activation_extra_s: float = 0.0
    cpu_params_per_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def step_s(self) -> float:
        return self.baseline_s + self.optimizer_extra_s + self.activation_extra_s

    @property
    def step_time_factor(self) -> float:
        return self.step_s / self.baseline_s if self.baseline_s > 0 else 1.0


def no_lever_setup(s: Setup) -> Setup:
    """``s`` with none of the levers ``recommend`` pulls inside the layout: recompute off, every offload off.

    The yardstick of an option's ``step_time_factor`` (design.md: "relative to the same run with none of the levers
    the planner may change"); the parallel layout and the micro-batch size stay as given.
    """
    return replace(
        s,
        recompute_granularity=None,
        recompute_method=None,
        recompute_num_layers=None,
        optimizer_offload_fraction=0.0,
        activation_offload_layers=0,
        offload_modules=(),
    )


def _flops_per_token(m: ModelSpec, s: Setup) -> float:
    """Training FLOPs per token (6 × active matmul params + causal attention), whole model."""
    one = Setup(num_gpus=1)
    active: float = padded_vocab(m, 1) * m.hidden_size  # output layer
    for index in range(m.num_layers):
        for t in layer_params(m, one, index):
            if "norm" in t.name or "bias" in t.name:
                continue
            if t.expert:
                active += t.numel * m.moe_router_topk / m.experts
            else:
                active += t.numel
    seq = s.seq_length or m.seq_length
    attn_dim = m.num_attention_heads * (m.mla.qk_head_dim + m.mla.qk_pos_emb_head_dim if m.mla else m.kv_channels)
    attention = 6 * m.num_layers * seq * attn_dim  # 12·s·d per layer, halved by the causal mask
    factor = 8 / 6 if s.recompute_granularity == "full" else 1.0
    return (6 * active + attention) * factor


def default_microbatches(s: Setup) -> int:
    """Micro-batches per step per DP rank: from the global batch, else 4·PP (a filled 1F1B pipeline)."""
    return s.num_microbatches() or 4 * s.pp


def default_mfu(m: ModelSpec) -> tuple[float, str]:
    """The MFU a derived baseline uses for this model without a measured step, and where it comes from."""
    return (DEFAULT_MFU_MOE, MFU_MOE_SOURCE) if m.is_moe else (DEFAULT_MFU_DENSE, MFU_DENSE_SOURCE)


def baseline_step_s(m: ModelSpec, s: Setup, gpu: GpuPreset, mfu: float | None = None) -> float:
    """Step time without offload from FLOPs at ``mfu`` of peak, plus the 1F1B bubble ``(PP−1)/(m·VPP)``."""
    mfu = mfu or default_mfu(m)[0]
    mb = default_microbatches(s)
    seq = s.seq_length or m.seq_length
    tokens = mb * s.micro_batch_size * seq * s.dp
    compute = tokens * _flops_per_token(m, s) / s.num_gpus / (gpu.peak_tflops * 1e12 * mfu)
    bubble = (s.pp - 1) / (mb * (s.vpp or 1))
    return compute * (1 + bubble)


def cpu_adam_rate(
    threads: int, per_core: float | None = None, calibration: str | None = None, preset: float | None = None
) -> float:
    """Params/s of one rank's CPU AdamW: ``threads × per-core rate``.

    The per-core rate is, in order: the argument, the calibration file, the GPU preset's host figure
    (``preset``), the measured default.
    """
    return threads * cpu_adam_rate_source(per_core, calibration, preset)[0]


def cpu_adam_rate_source(
    per_core: float | None = None, calibration: str | None = None, preset: float | None = None
) -> tuple[float, str]:
    """The per-core CPU AdamW rate in force and where it comes from (flag, calibration, preset, default)."""
    if per_core is not None:
        return per_core, "flag"
    stored = calibrate.load(calibration)
    if stored:
        return float(stored["cpu_adam_params_per_s_per_core"]), "calibration"
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
    calibration: str | None = None,
) -> TimeEstimate:
    """Extra step time of the offload settings in ``est.setup`` on ``gpu``.

    Args:
        est: the memory estimate (gives offloaded elements and activation bytes).
        gpu: link and host figures.
        overlap: ``optimizer.overlap_cpu_optimizer_d2h_h2d``.
        cpu_threads: CPU threads each rank's optimizer gets (``OMP_NUM_THREADS``), capped at ``gpu.cpu_cores``.
        cpu_params_per_s_per_core: override of the measured/default CPU AdamW rate.
        baseline_s: the measured step time without offload; else derived from FLOPs at ``mfu``.
        mfu: assumed model-FLOPs utilisation for the derived baseline.
        calibration: path of the calibration file (default: see ``mbridge_offload.plan.calibration``).
    """
    m, s = est.model, est.setup
    base = baseline_s if baseline_s is not None else baseline_step_s(m, s, gpu, mfu)
    out = TimeEstimate(baseline_s=base)
    threads = max(1, min(cpu_threads, gpu.cpu_cores))
    rate = cpu_adam_rate(threads, cpu_params_per_s_per_core, calibration, gpu.cpu_adam_params_per_s_per_core)
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
        from mbridge_offload.plan.activations import step_extra_s

        # One figure per link for both copy directions: the slower (D2H on Grace, measured), so never optimistic.
        out.activation_extra_s, note = step_extra_s(m, s, min(d2h, h2d), base, default_microbatches(s))
        out.notes += [note] if note else []
    if s.use_megatron_fsdp:
        out.notes.append(
            "Megatron-FSDP's all-gather and reduce-scatter time is not modelled (the baseline is FLOPs at the MFU); "
            "activation copies share the host link with nothing else here"
        )
    k = s.activation_offload_layers
    if k:
        from mbridge_offload.plan.activations import stage_activations

        eligible = stage_activations(m, s, 0).offloadable_bytes
        mb = default_microbatches(s)
        layers = len(stage_layers(m, s)[0])
        per_layer_fwd = base / (1 + (s.pp - 1) / mb) / mb / layers / 3  # forward ≈ 1/3 of a layer's fwd+bwd
        copy = eligible / d2h  # offload during the forward, reload (H2D) during the backward
        exposed = max(0.0, copy - per_layer_fwd) + max(0.0, eligible / h2d - 2 * per_layer_fwd)
        out.activation_extra_s = k * exposed * mb
        if exposed > 0:
            out.notes.append(
                f"activation copies ({copy * 1e3:.1f} ms per layer) exceed a layer's forward "
                f"({per_layer_fwd * 1e3:.1f} ms): not fully hidden"
            )
    return out
