"""Physics before trust: a figure that no run of these settings on this GPU can produce is set aside, with why.

- a measured peak (a point) above what the GPU holds (its capacity as CUDA reports it);
- a measured peak below the resident state the model computes for that run and stage (weights, gradients and
  optimizer state are counted from the parameters: a peak below them is another run, or a report taken before the
  optimizer state existed);
- an out-of-memory message whose allocated memory alone is above the GPU's capacity;
- a step time faster than the model's FLOPs allow at the GPU's peak: model FLOPs per step / (step time x GPUs x
  peak FLOP/s) is the efficiency (MFU) it implies, and an MFU above 1 is impossible;
- a log whose own throughput line (Megatron-LM's "throughput per GPU (TFLOP/s/GPU)") is above the GPU's peak: its
  step times come from another GPU.

The model FLOPs are the training FLOPs of the model (3 x forward: forward and backward, no recompute), per token
(``time/terms.forward_flops``), over the global batch (as given, or the micro-batches the time model assumes); the
peak is the GPU preset's dense bf16 figure, its FP8 one when the run trains in FP8 (the larger, so never too strict).
Never imports torch.
"""

from __future__ import annotations

from mbridge_offload.plan.evidence.figures import Figure
from mbridge_offload.plan.inputs.resolve import Resolved
from mbridge_offload.plan.memory.stage import MemoryEstimate, StageMemory
from mbridge_offload.plan.model.architecture import GiB
from mbridge_offload.plan.time.step import samples_per_step
from mbridge_offload.plan.time.terms import forward_flops

# A figure's own rounding (Megatron prints MB with two decimals, Bridge five significant GB digits): a little slack
# before a figure is called impossible.
SLACK = 0.005


def resident(st: StageMemory) -> float:
    """Bytes held for the whole step on one GPU of stage ``st``: weights, gradients and optimizer state."""
    return float(st.weights + st.gradients + st.optimizer)


def point_problem(f: Figure, r: Resolved, est: MemoryEstimate) -> str | None:
    """Why a measured peak cannot come from this run on this GPU, or None."""
    value = float(f.value_gib or 0.0)
    capacity = r.gpu.capacity_bytes / GiB
    where = f"line {f.line_number}" if f.line_number else "measured_peak_gib"
    if value > capacity * (1 + SLACK):
        return (
            f"{where}: a peak of {value:.2f} GiB allocated is above the {capacity:.2f} GiB the {r.gpu.name} holds: "
            "another GPU, or a unit misread (pass gpu / gpu_memory_gb to match the run, or measured_peak_gib)"
        )
    stages = {st.stage: st for st in est.stages}
    st = stages.get(f.stage if f.stage is not None else est.worst.stage, est.worst)
    floor = resident(st) / GiB
    if value < floor * (1 - SLACK):
        return (
            f"{where}: a peak of {value:.2f} GiB allocated is below the {floor:.2f} GiB of weights, gradients and "
            f"optimizer state the model counts from the parameters on stage {st.stage} of the measured run "
            f"({st.weights / GiB:.2f} + {st.gradients / GiB:.2f} + {st.optimizer / GiB:.2f} GiB): it is not this "
            "run's peak (another layout or model, a report before the first optimizer step, a figure in GB read as "
            "GiB, or an assumption listed that differs from the run: grad_reduce_in_fp32, the distributed optimizer, "
            "the precision)"
        )
    return None


def bound_problem(f: Figure, r: Resolved) -> str | None:
    """Why an out-of-memory message cannot come from this GPU, or None."""
    capacity = r.gpu.capacity_bytes / GiB
    allocated = f.allocated_gib
    if allocated is not None and allocated > capacity * (1 + SLACK):
        return (
            f"line {f.line_number}: {allocated:.2f} GiB allocated at the failure is above the {capacity:.2f} GiB the "
            f"{r.gpu.name} holds: the log is from another GPU (pass gpu / gpu_memory_gb to match the run)"
        )
    return None


def min_step_s(r: Resolved) -> float:
    """The fastest step the model's FLOPs allow on the run's GPUs at their peak (MFU 1)."""
    m, s, g = r.model, r.setup, r.gpu
    seq = s.seq_length or m.seq_length
    flops = 3 * forward_flops(m, seq).total * samples_per_step(s) * seq
    peak = max(g.peak_tflops, g.fp8_tflops if s.fp8_recipe else 0.0) * 1e12
    return flops / (s.num_gpus * peak)


def step_problem(step_s: float, r: Resolved, where: str) -> str | None:
    """Why a measured step time cannot come from this run on these GPUs, or None."""
    fastest = min_step_s(r)
    if step_s <= 0 or fastest / step_s <= 1 + SLACK:
        return None
    g = r.gpu
    return (
        f"{where}: a step of {step_s:.3f} s implies an efficiency (MFU) of {fastest / step_s:.2f}, above the GPU's "
        f"peak: the model's training FLOPs of the global batch ({samples_per_step(r.setup)} samples of "
        f"{r.setup.seq_length or r.model.seq_length} tokens) need at least {fastest:.3f} s on {r.setup.num_gpus} x "
        f"{g.name} at {max(g.peak_tflops, g.fp8_tflops if r.setup.fp8_recipe else 0.0):g} TFLOP/s; a step faster "
        "than the FLOPs allow is another run (a smaller batch or model, more GPUs) or a time per micro-batch"
    )


def throughput_problem(steps: list[Figure], r: Resolved) -> str | None:
    """Why a log's step times cannot come from this GPU: the throughput it prints itself is above the GPU's peak."""
    g = r.gpu
    peak = max(g.peak_tflops, g.fp8_tflops if r.setup.fp8_recipe else 0.0)
    over = [f for f in steps if f.tflops_per_gpu is not None and f.tflops_per_gpu > peak * (1 + SLACK)]
    if not over:
        return None
    f = max(over, key=lambda x: x.tflops_per_gpu or 0.0)
    return (
        f"line {f.line_number}: the log's own throughput, {f.tflops_per_gpu:g} TFLOP/s per GPU, is an efficiency of "
        f"{(f.tflops_per_gpu or 0.0) / peak:.2f}, above the {g.name}'s peak ({peak:g} TFLOP/s): its step times come "
        "from another GPU (pass gpu to match the run)"
    )
