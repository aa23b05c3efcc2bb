"""What a run's config says about each failure mode: ``rules_out_*`` gives the reason (key and value) the config
excludes the mode, or None; ``explain_*`` tells the cause with the config's values. No torch.
"""

from __future__ import annotations

from typing import Any

from mbridge_offload.config.schema import OffloadConfig


def section(cfg: OffloadConfig, name: str) -> dict[str, Any]:
    """An untyped section of the config (``checkpoint`` ...), as a dict (empty when absent)."""
    value = (cfg.model_extra or {}).get(name)
    return value if isinstance(value, dict) else {}


def fraction(cfg: OffloadConfig) -> float | None:
    """The offload fraction that takes effect (None: optimizer offload is off)."""
    return cfg.optimizer.optimizer_offload_fraction if cfg.optimizer.optimizer_cpu_offload else None


def distributed_optimizer(cfg: OffloadConfig) -> bool:
    return bool(cfg.optimizer.use_distributed_optimizer or cfg.ddp.use_distributed_optimizer)


def half_precision(cfg: OffloadConfig) -> bool:
    return bool(cfg.model.bf16 or cfg.model.fp16 or cfg.optimizer.bf16 or cfg.optimizer.fp16)


def _offload_off(cfg: OffloadConfig) -> str | None:
    if cfg.optimizer.optimizer_cpu_offload:
        return None
    return "optimizer.optimizer_cpu_offload is false in this config: no HybridDeviceOptimizer is built"


# ---------------------------------------------------------------------------------------------- OOM readings


def rules_out_oom_activation(cfg: OffloadConfig) -> str | None:
    return None if cfg.model.cpu_offloading else "model.cpu_offloading is false: activation offloading is off"


def rules_out_oom_partial(cfg: OffloadConfig) -> str | None:
    if cfg.model.cpu_offloading:
        return "model.cpu_offloading is true: the activation-offload reading applies"
    if not cfg.optimizer.optimizer_cpu_offload:
        return "optimizer.optimizer_cpu_offload is false: optimizer offloading is off"
    if cfg.optimizer.optimizer_offload_fraction >= 1.0:
        return "optimizer.optimizer_offload_fraction is 1.0: every optimizer state is already on the host"
    return None


def rules_out_oom_full(cfg: OffloadConfig) -> str | None:
    f = fraction(cfg)
    if cfg.model.cpu_offloading or f is None or f < 1.0:
        return f"the config does not offload every optimizer state (effective fraction {f or 0.0})"
    return None


def rules_out_oom_none(cfg: OffloadConfig) -> str | None:
    if cfg.model.cpu_offloading or cfg.optimizer.optimizer_cpu_offload:
        return "the config already offloads (model.cpu_offloading or optimizer.optimizer_cpu_offload is true)"
    return None


# ---------------------------------------------------------------------------------------------- no saving, slowdown


def rules_out_no_saving(cfg: OffloadConfig) -> str | None:
    f = fraction(cfg)
    if f is None or f <= 0.0:
        return None
    return (
        f"optimizer.optimizer_offload_fraction is {f} in this config (not 0.0): about {f:.0%} of the parameters' "
        "optimizer states are on the host. Compare torch.cuda.max_memory_allocated() (not nvidia-smi, which shows "
        "the allocator's cache) and `mbridge-offload estimate` for the expected saving (with the distributed "
        "optimizer it is divided by the data-parallel size)"
    )


def explain_no_saving(cfg: OffloadConfig) -> str:
    if not cfg.optimizer.optimizer_cpu_offload:
        return (
            "optimizer.optimizer_cpu_offload is false in this config, so no HybridDeviceOptimizer is built and "
            "every optimizer state stays on the GPU"
        )
    return (
        "optimizer.optimizer_cpu_offload is true but optimizer.optimizer_offload_fraction is 0.0 in this config "
        "(Bridge's default), so the HybridDeviceOptimizer keeps every state on the GPU"
    )


def fix_no_saving(cfg: OffloadConfig | None) -> list[str]:
    fix = ["optimizer.optimizer_offload_fraction=0.5"]
    if cfg is not None and not cfg.optimizer.optimizer_cpu_offload:
        fix.insert(0, "optimizer.optimizer_cpu_offload=true")
    return fix


def rules_out_slowdown(cfg: OffloadConfig) -> str | None:
    if cfg.model.cpu_offloading or cfg.optimizer.optimizer_cpu_offload:
        return None
    return (
        "nothing is offloaded in this config (model.cpu_offloading and optimizer.optimizer_cpu_offload are both "
        "false): the slowdown has another cause"
    )


def explain_slowdown(cfg: OffloadConfig) -> str:
    f = fraction(cfg)
    parts = []
    if f is not None:
        parts.append(
            f"this config updates {f:.0%} of the parameters on the CPU (optimizer_offload_fraction={f}); the CPU "
            "Adam step dominates and the penalty grows roughly linearly with the fraction (1.9x at 25 %, 4.2x at "
            "100 % on Qwen3-30B-A3B); D2H/H2D overlap "
            + ("is on" if cfg.optimizer.overlap_cpu_optimizer_d2h_h2d else "is off (overlap_cpu_optimizer_d2h_h2d)")
        )
    if cfg.model.cpu_offloading:
        parts.append(
            f"model.cpu_offloading moves the activations of {cfg.model.cpu_offloading_num_layers} layers to the "
            "host and back each step; the copies stall compute when they outrun the host link"
        )
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------- checkpoints


def _load_optim(cfg: OffloadConfig) -> Any:
    return section(cfg, "checkpoint").get("load_optim")


def rules_out_resume_jump(cfg: OffloadConfig) -> str | None:
    if reason := _offload_off(cfg):
        return reason
    if _load_optim(cfg) is False:
        return (
            "checkpoint.load_optim is false in this config: no optimizer state is restored, so a wrong restore of "
            "the HybridDeviceOptimizer's state cannot be the cause (a fine-tune start is finetune_stale_masters)"
        )
    return None


def explain_stale_masters(cfg: OffloadConfig) -> str:
    ckpt = section(cfg, "checkpoint")
    seen = [
        "optimizer_cpu_offload=true",
        f"distributed optimizer {'on' if distributed_optimizer(cfg) else 'off'}",
        f"bf16/fp16 {'on' if half_precision(cfg) else 'off'}",
        f"checkpoint.pretrained_checkpoint={ckpt.get('pretrained_checkpoint')!r}",
    ]
    return (
        "the HybridDeviceOptimizer's CPU copies (gpu_params_map_cpu_copy) and fp32 working copies "
        "(param_to_fp32_param) are made when the optimizer is built, before the pretrained weights are loaded; "
        "reload_model_params() refreshes only the distributed optimizer's own fp32 shards, so the first step runs "
        "Adam on the random-init copies and writes them back into the model: step 1's loss (computed from the "
        "loaded weights) is right, step 2's is that of a random model. This config: " + ", ".join(seen)
    )


def rules_out_save_assert(cfg: OffloadConfig) -> str | None:
    return _offload_off(cfg)


def rules_out_fsdp(cfg: OffloadConfig) -> str | None:
    if cfg.ddp.use_megatron_fsdp or cfg.ddp.use_custom_fsdp:
        return _offload_off(cfg)
    return "ddp.use_megatron_fsdp is false in this config: the failure is Megatron-FSDP's"


def fix_pinned(cfg: OffloadConfig | None) -> list[str]:
    keys = ("pin_cpu_grads", "pin_cpu_params")
    if cfg is None:
        return [f"optimizer.{k}=false" for k in keys]
    return [f"optimizer.{k}=false" for k in keys if getattr(cfg.optimizer, k)]


# ---------------------------------------------------------------------------------------------- the 2025-2026 reports


def rules_out_double_buffering(cfg: OffloadConfig) -> str | None:
    if not cfg.model.cpu_offloading:
        return "model.cpu_offloading is false in this config: Transformer Engine's offload reload does not run"
    if not cfg.model.cpu_offloading_double_buffering:
        return (
            "model.cpu_offloading_double_buffering is false in this config: the assertion is in the double-buffered "
            "reload"
        )
    return None


def rules_out_precision_dtypes(cfg: OffloadConfig) -> str | None:
    if reason := _offload_off(cfg):
        return reason
    low = {k: getattr(cfg.optimizer, k) for k in ("main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")}
    if all(v in (None, "fp32") for v in low.values()):
        return "main_params_dtype, exp_avg_dtype and exp_avg_sq_dtype are all fp32 in this config: nothing to ignore"
    return None


def explain_precision_dtypes(cfg: OffloadConfig) -> str:
    o = cfg.optimizer
    return (
        f"this config asks for main_params_dtype={o.main_params_dtype}, exp_avg_dtype={o.exp_avg_dtype}, "
        f"exp_avg_sq_dtype={o.exp_avg_sq_dtype}; with optimizer_cpu_offload megatron-core's factory builds the "
        "HybridDeviceOptimizer with param_update_in_fp32=True and never passes these dtypes, and torch AdamW "
        "creates its moments with zeros_like(the fp32 master): all three states are fp32 (4 bytes each per "
        "parameter), on the host for the offloaded fraction"
    )


def explain_stale_grad(cfg: OffloadConfig) -> str:
    experts = cfg.model.num_moe_experts
    where = (
        f"this config has {experts} MoE experts (model.num_moe_experts): an expert that receives no tokens in a "
        "step has no gradient"
        if experts
        else "any parameter without a gradient in a step (an unused branch, a frozen or conditional module)"
    )
    return (
        "megatron-core's HybridDeviceOptimizer keeps each inner parameter's .grad from the last step; when the "
        "model parameter has no gradient it only sets requires_grad=False, and torch's Adam skips a parameter only "
        f"when .grad is None, so the previous step's gradient is applied again; {where}"
    )
