"""A training step as phases, per pipeline stage: what one GPU holds at the highest point of each.

Phases never coexist, so a stage's peak is the largest of them, not the sum of every term:

- ``forward_backward``: weights, gradients and optimizer states resident, plus the activations the schedule keeps
  in flight (``plan/memory/schedule.py``), what full recompute rebuilds at once, and backward's transient gradient
  buffers of the largest layer (with the MoE dispatch buffers of the running layer).
- ``loss`` (last stage): the in-flight activations at the moment the cross entropy runs, the output layer's inputs,
  the logits it keeps and their second copy while it casts them (``activations.loss_transient_bytes``). The logits are
  freed before that micro-batch's layers run backward, so they never meet the recompute or the backward buffers.
- ``optimizer_step``: after the last backward, activations are gone; the step's transients are the fp32 copies of
  bf16 gradients that megatron-core's optimizers make (``_copy_model_grads_to_main_grads``:
  ``main_param.grad = shard_grad.float()``, every shard, offloaded ones included; Megatron-FSDP's
  ``update_main_grads``: ``optimizer_grad.to(param.dtype)``). Our HybridDeviceOptimizer adds, on the GPU, only the
  fp32 copy of the gradients of the parameters it steps there when it owns bf16 parameters (precision-aware path:
  ``fp32_param.grad = grad.to(fp32)``); its offloaded gradients go straight to pinned host buffers and the updated
  parameters are copied back in place. Every copy is freed by the end of the step (measured on an H200 phase by
  phase: ``tests/plan/test_gpu_measured.py``). megatron-core's own HybridDeviceOptimizer never frees those copies:
  they are resident (``plan/memory/stage.py``), and its step adds only the new copy of one tensor.
  fp32 gradients (``grad_reduce_in_fp32``) are used as they are: no copy. The precision-aware optimizer reads the
  bf16 gradients in place (``decoupled_grad``), but TE's FusedAdam step makes an fp32 copy of every state that is not
  fp32 (``get_unscaled_state``: fp16 or fp8 moments, an fp16 or bf16 master) and holds them for the whole parameter
  group until its kernels have run; two bf16 moments are unscaled inside the kernel instead (``fuse_unscale``, TE
  2.13 on: ``Setup.te_version``), and int16 remainders are used as they are.

Every phase carries the ``other`` workspaces the allocator hands out throughout (``Setup.overhead_gb``). Never
imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from mbridge_offload.plan.memory.activations import ActivationMemory, in_flight
from mbridge_offload.plan.model.architecture import DTYPE_BYTES
from mbridge_offload.plan.model.run import Setup

__all__ = ["PHASES", "PhaseMemory", "keeps_param_remainders", "optimizer_step_transient", "stage_phases"]

PHASES = ("forward_backward", "loss", "optimizer_step")


@dataclass(frozen=True)
class PhaseMemory:
    """Bytes one GPU of a stage holds at the highest point of one phase, by kind."""

    name: str
    weights: int
    gradients: int
    optimizer: int
    activations: int
    other: int
    what: str = ""

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.other


def keeps_param_remainders(s: Setup) -> bool:
    """Whether TE's FusedAdam keeps only the 16 low bits of an fp32 master a bf16 parameter lacks (int16,
    ``store_param_remainders``) rather than the master itself."""
    return s.main_params_dtype == "fp32" and s.store_param_remainders and DTYPE_BYTES[s.params_dtype] == 2


def te_unscaled_states(s: Setup) -> list[str]:
    """The optimizer states TE FusedAdam copies to fp32 in each step (module docstring), by name."""
    fused = s.exp_avg_dtype == s.exp_avg_sq_dtype == "bf16" and s.te_at_least(2, 13)
    states = {"exp_avg": s.exp_avg_dtype, "exp_avg_sq": s.exp_avg_sq_dtype}
    if not keeps_param_remainders(s):
        states["master_param"] = s.main_params_dtype
    return [name for name, dtype in states.items() if dtype != "fp32" and not (dtype == "bf16" and fused)]


def optimizer_step_transient(
    s: Setup, shard_numel: int, offloaded_numel: int, largest_gpu_numel: int = 0, largest_group_numel: int = 0
) -> tuple[int, str]:
    """GPU bytes the optimizer step allocates beyond the resident state, and what they are (module docstring).

    ``largest_gpu_numel``: megatron-core's HDO keeps its fp32 gradient copies resident (``plan/memory/stage.py``
    ``_megatron_core_kept``), so its step only ever adds the new copy of one tensor before the old one is dropped:
    the largest it steps on the GPU. ``largest_group_numel``: the largest parameter group's shard, over which TE's
    FusedAdam holds its fp32 copies (precision-aware path)."""
    if s.use_megatron_fsdp:
        grads = s.fsdp_main_grads_dtype or s.params_dtype
        if s.precision_aware_optimizer or s.fsdp_main_params_dtype != "fp32" or grads == "fp32":
            return 0, ""
        return 4 * shard_numel, f"fp32 copies of the {grads} gradient shards (Megatron-FSDP update_main_grads)"
    if s.precision_aware_optimizer and s.distributed_optimizer and s.optimizer_offload_fraction <= 0:
        unscaled = te_unscaled_states(s)
        if unscaled and largest_group_numel:
            return (
                4 * len(unscaled) * largest_group_numel,
                f"TE FusedAdam's fp32 copies of {', '.join(unscaled)} for its largest parameter group "
                "(get_unscaled_state)",
            )
        return 0, ""
    if s.grad_reduce_in_fp32 or DTYPE_BYTES[s.params_dtype] == 4:
        return 0, ""
    if not s.precision_aware_optimizer:
        return 4 * shard_numel, "fp32 copies of the bf16 gradient shards (main_param.grad = shard_grad.float())"
    if s.optimizer_offload_fraction > 0 and s.hybrid_optimizer == "megatron-core":
        return (
            4 * largest_gpu_numel,
            "the new fp32 copy of one gradient megatron-core's HDO steps on the GPU (the others stay resident)",
        )
    if s.optimizer_offload_fraction > 0:
        return (
            4 * (shard_numel - offloaded_numel),
            "fp32 copies of the bf16 gradients HybridDeviceOptimizer steps on the GPU (fp32_param.grad)",
        )
    return 0, ""


def _schedule_words(s: Setup, stage: int) -> str:
    n = in_flight(s, stage)
    if s.pp == 1:
        return "one micro-batch's saved activations"
    kind = f"interleaved, {s.vpp} chunks" if s.vpp else "1F1B"
    return f"{n:g} micro-batches' saved activations ({kind})"


def stage_phases(
    s: Setup,
    stage: int,
    resident: tuple[int, int, int],
    overhead: int,
    act: ActivationMemory,
    step: tuple[int, str],
    kept: str = "",
) -> list[PhaseMemory]:
    """The phases of one pipeline stage.

    Args:
        s: the settings.
        stage: the pipeline rank.
        resident: weights, gradients and optimizer-state bytes on the GPU throughout.
        overhead: the workspaces every phase carries (``other``).
        act: the stage's activations by moment (``activations.stage_activations``).
        step: the optimizer step's transient bytes and what they are (``optimizer_step_transient``).
        kept: what the resident optimizer bytes hold beyond the states (megatron-core's HDO), named in every phase.
    """
    w, g, o = resident
    extras = [
        words
        for bytes_, words in (
            (act.rebuilt, "recompute's rebuilt layers"),
            (act.workspace, "backward's gradient buffers of the largest layer"),
            (len(kept), kept),
        )
        if bytes_
    ]
    out = [
        PhaseMemory(
            "forward_backward",
            w,
            g,
            o,
            act.saved + act.rebuilt,
            overhead + act.workspace,
            "; ".join([_schedule_words(s, stage), *extras]),
        )
    ]
    if stage == s.pp - 1:
        copy = "" if not act.loss_transient else " and their second copy while the cross entropy casts them"
        out.append(
            PhaseMemory(
                "loss",
                w,
                g,
                o,
                act.loss_saved,
                overhead + act.loss_transient,
                f"in-flight activations, the output layer's inputs, the logits kept for backward{copy}",
            )
        )
    transient, words = step
    out.append(
        PhaseMemory(
            "optimizer_step",
            w,
            g,
            o,
            act.held,  # TE's FP8 weight caches and dummy weight gradients outlive the backward
            overhead + transient,
            (words or "no activations; no transient beyond the resident state (fp32 gradients used as they are)")
            + ("; TE's cached FP8 weights and dummy weight gradients" if act.held else ""),
        )
    )
    return out


def peak(phases: list[PhaseMemory]) -> PhaseMemory:
    """The phase that sets the stage's peak (the first of equals, in step order)."""
    return max(phases, key=lambda p: (p.total, -PHASES.index(p.name)))
