"""Optimizer-offloading rules (HybridDeviceOptimizer) and config-hygiene rules.

Sources: MCore ``optimizer_config.py``
``OptimizerConfig.__post_init__`` and ``optimizer/__init__.py::_get_megatron_optimizer_based_on_param_groups``
(0.16.1 and 0.19.2, read and run), Megatron-LM ``arguments.py::validate_args``, Bridge ``training/config.py``.
"""

from __future__ import annotations

import operator

from mbridge_offload.config.overrides import format_override
from mbridge_offload.config.rules.base import (
    STAGE_BRIDGE,
    STAGE_FIRST_STEP,
    STAGE_MLM,
    STAGE_OPTIMIZER_CONFIG,
    STAGE_OPTIMIZER_FACTORY,
    Context,
    Match,
    Rule,
    advisory,
)
from mbridge_offload.config.rules.mcore import mcore_rule, upstream_compare
from mbridge_offload.config.schema import unknown_offload_keys

_ON = "optimizer.optimizer_cpu_offload"
_F = "optimizer.optimizer_offload_fraction"
_DO_FIX = ("optimizer.use_distributed_optimizer=true", "ddp.use_distributed_optimizer=true")


# ---------------------------------------------------------------------------------------------- config hygiene


def _unknown_keys(ctx: Context):
    matches = []
    for given, hint in unknown_offload_keys(ctx.raw or {}):
        section, _, key = given.partition(".")
        value = (ctx.raw.get(section) or {}).get(key)
        # Move the value to the key it was meant for (Hydra: delete the typo, add the real key).
        fix = [f"~{given}", format_override(hint, value)]
        matches.append(Match({"given": given, "hint": hint}, fix=fix, keys=[given, hint]))
    return matches


CONFIG_RULES: tuple[Rule, ...] = (
    advisory(
        id="CFG-UNKNOWN-KEY",
        severity="warning",
        summary="An unknown key that looks like a misspelled offload key (did you mean …?).",
        keys=(),
        message="{given} is not a known key; did you mean {hint}?",
        why="Unknown keys are kept and ignored (Bridge configs carry many), so a typo in an offload key silently "
        "leaves the feature at its default.",
        fix=None,
        check=_unknown_keys,
    ),
)


# ---------------------------------------------------------------------------------------------- MCore OptimizerConfig


def _pa_adam(ctx: Context) -> bool:
    return ctx.opt.use_precision_aware_optimizer and ctx.opt.optimizer != "adam"


def _pa_do(ctx: Context) -> bool:
    # Not ctx.distributed_optimizer: Bridge's ConfigContainer finalizes OptimizerConfig (whose __post_init__ asserts
    # this) before it copies ddp.use_distributed_optimizer over, so only optimizer.* counts here.
    return (
        ctx.opt.use_precision_aware_optimizer and ctx.opt.optimizer == "adam" and not ctx.opt.use_distributed_optimizer
    )


# ---------------------------------------------------------------------------------------------- optimizer factory


def _skip_wrapping_pa(ctx: Context) -> bool:
    return ctx.opt.skip_megatron_wrapping and ctx.opt.use_precision_aware_optimizer


def _skip_wrapping(ctx: Context) -> bool:
    return ctx.opt.skip_megatron_wrapping and ctx.opt.optimizer_cpu_offload


def _decoupled_wd(ctx: Context) -> bool:
    return ctx.opt.optimizer_cpu_offload and not ctx.opt.decoupled_weight_decay


def _mfsdp_v2(ctx: Context) -> bool:
    d = ctx.config.ddp
    return (
        ctx.opt.optimizer_cpu_offload
        and d.use_megatron_fsdp
        and str(d.megatron_fsdp_version).lower().lstrip("v") == "2"
    )


def _mfsdp_v2_bridge(ctx: Context) -> bool:
    return ctx.frontend != "megatron-lm" and _mfsdp_v2(ctx)


# ---------------------------------------------------------------------------------------------- Megatron-LM


def _mlm(ctx: Context) -> bool:
    return ctx.frontend == "megatron-lm"


def _mlm_precision_aware(ctx: Context):
    if _mlm(ctx) and ctx.opt.optimizer_cpu_offload and not ctx.opt.use_precision_aware_optimizer:
        fix = ["optimizer.use_precision_aware_optimizer=true"]
        if not ctx.opt.use_distributed_optimizer:
            fix += list(_DO_FIX)
        return Match(fix=fix)
    return None


def _mlm_fp8_param_gather(ctx: Context) -> bool:
    return (
        _mlm(ctx)
        and ctx.opt.optimizer_cpu_offload
        and ctx.config.ddp.fp8_param_gather
        and ctx.opt.fp8_recipe != "delayed"
    )


# ---------------------------------------------------------------------------------------------- advisory


def _fraction_zero(ctx: Context) -> bool:
    return ctx.opt.optimizer_cpu_offload and ctx.opt.optimizer_offload_fraction == 0.0


def _fraction_range(ctx: Context):
    f = ctx.opt.optimizer_offload_fraction
    if 0.0 <= f <= 1.0:
        return None
    return Match(
        {"value": f, "clamped": 1.0 if f > 1 else 0.0, "effect": "1.0 (everything)" if f > 1 else "0.0 (nothing)"}
    )


def _fraction_inert(ctx: Context) -> bool:
    o = ctx.opt
    if o.optimizer_cpu_offload or o.optimizer_offload_fraction == 0.0:
        return False
    # Megatron-LM's CLI default is 1.0 even with offloading off; only an explicit value is worth a note.
    return not (ctx.frontend == "megatron-lm" and o.optimizer_offload_fraction == 1.0)


def _torch_optimizer(ctx: Context) -> bool:
    return ctx.opt.optimizer_cpu_offload and ctx.opt.use_torch_optimizer_for_cpu_offload


def _non_adam(ctx: Context):
    name = ctx.opt.optimizer
    if ctx.opt.optimizer_cpu_offload and name not in {"adam", "sgd"}:
        return Match({"name": name})
    return None


def _offload_without_distributed_optimizer(ctx: Context) -> bool:
    # Only adam/sgd run in the (offloading) distributed optimizer; Muon and the other emerging optimizers have their
    # own layer-wise path (Megatron-LM 0.19 remaps --use-distributed-optimizer for them), so never advise it there.
    if ctx.opt.optimizer not in ("adam", "sgd"):
        return False
    return ctx.opt.optimizer_cpu_offload and not ctx.distributed_optimizer


def _half_precision(ctx: Context) -> bool:
    """16-bit parameters: get_megatron_optimizer wraps the optimizer in Float16OptimizerWithFloat16Params."""
    return bool(ctx.opt.bf16 or ctx.opt.fp16)


def _no_distributed_optimizer(ctx: Context) -> bool:
    return _offload_without_distributed_optimizer(ctx) and not _half_precision(ctx)


def _hdo_float16_wrapper(ctx: Context) -> bool:
    return _offload_without_distributed_optimizer(ctx) and _half_precision(ctx)


# From this fraction on, overlapping D2H/H2D with the CPU step is advised (OPT-OVERLAP) and switched on by `apply`:
# one threshold for both. Published: at 100 % overlap cut the step 4.19 → 3.88 s (Qwen3-30B-A3B card, ≈7 %); at 50 %
# it did not help (NeMo-RL PR #3628, Qwen3-0.6B: 1.187 s without, 1.216 s with;
# mbridge_offload_tools/evidence/data/published.yaml).
OVERLAP_FROM_FRACTION = 0.75


def overlap_advised(fraction: float) -> bool:
    """Whether ``overlap_cpu_optimizer_d2h_h2d`` pays at this ``optimizer_offload_fraction``."""
    return fraction >= OVERLAP_FROM_FRACTION


def _overlap(ctx: Context) -> bool:
    o = ctx.opt
    return (
        o.optimizer_cpu_offload
        and overlap_advised(o.optimizer_offload_fraction)
        and not o.overlap_cpu_optimizer_d2h_h2d
    )


def _fraction_type(ctx: Context):
    # HybridDeviceOptimizer._get_sub_optimizer_param_groups: `threshold = gpu_numel * offload_fraction`, then
    # `offloaded < threshold` (both releases); an int times a str or list repeats it, so the comparison fails.
    if not ctx.opt.optimizer_cpu_offload:
        return None
    threshold, error = upstream_compare(operator.mul, 0, ctx.seen(_F))
    return error or upstream_compare(operator.lt, 0, threshold)[1]


OPTIMIZER_RULES: tuple[Rule, ...] = (
    # ---- MCore OptimizerConfig.__post_init__ (code order)
    mcore_rule(
        id="OPT-PRECISION-AWARE-ADAM",
        stage=STAGE_OPTIMIZER_CONFIG,
        exception="AssertionError",
        summary="The precision-aware optimizer (required by Megatron-LM with offload) only works with adam.",
        keys=("optimizer.use_precision_aware_optimizer", "optimizer.optimizer"),
        message="--use-precision-aware-optimizer only supported with adam",
        why="Megatron-LM requires --use-precision-aware-optimizer with --optimizer-cpu-offload; MCore then "
        "requires adam.",
        fix=("optimizer.optimizer=adam",),
        check=_pa_adam,
    ),
    mcore_rule(
        id="OPT-PRECISION-AWARE-DO",
        stage=STAGE_OPTIMIZER_CONFIG,
        exception="AssertionError",
        summary="The precision-aware optimizer needs the distributed optimizer.",
        keys=("optimizer.use_precision_aware_optimizer", "optimizer.use_distributed_optimizer"),
        message="--use-precision-aware-optimizer only supported with distributed optimizer",
        why="The precision-aware path lives in DistributedOptimizer. (Bridge syncs optimizer.* and ddp.* "
        "use_distributed_optimizer, so either switches it on there.)",
        fix=_DO_FIX,
        check=_pa_do,
    ),
    # ---- MCore get_megatron_optimizer (_get_megatron_optimizer_based_on_param_groups, code order)
    mcore_rule(
        id="OPT-SKIP-WRAPPING-PRECISION-AWARE",
        stage=STAGE_OPTIMIZER_FACTORY,
        exception="ValueError",
        applies_to=">=0.19",
        summary="`skip_megatron_wrapping=True` (layer-wise optimizers) excludes the precision-aware optimizer.",
        keys=("optimizer.skip_megatron_wrapping", "optimizer.use_precision_aware_optimizer"),
        message="skip_megatron_wrapping=True is incompatible with use_precision_aware_optimizer.",
        why="Checked before the offload check below; listed because Megatron-LM's offload needs precision-aware.",
        fix=None,
        check=_skip_wrapping_pa,
    ),
    mcore_rule(
        id="OPT-SKIP-WRAPPING",
        stage=STAGE_OPTIMIZER_FACTORY,
        exception="ValueError",
        applies_to=">=0.19",
        summary="`skip_megatron_wrapping=True` (layer-wise optimizers) excludes optimizer CPU offload.",
        keys=("optimizer.skip_megatron_wrapping", _ON),
        message="skip_megatron_wrapping=True is incompatible with optimizer_cpu_offload.",
        why="The unwrapped optimizer has no place for HybridDeviceOptimizer's fp32 masters (MCore #4113; the "
        "argument does not exist in 0.16).",
        fix=(_ON + "=false",),
        check=_skip_wrapping,
    ),
    mcore_rule(
        id="OPT-DECOUPLED-WD",
        stage=STAGE_OPTIMIZER_FACTORY,
        exception="AssertionError",
        summary="Optimizer CPU offload needs decoupled weight decay (AdamW).",
        keys=(_ON, "optimizer.decoupled_weight_decay"),
        message="CPU offloading only supported with decoupled_weight_decay enabled (AdamW mode).",
        why="The CPU side is always torch AdamW. OptimizerConfig accepts the combination; the assert fires "
        "later, in get_megatron_optimizer, when the job builds its optimizer.",
        fix=("optimizer.decoupled_weight_decay=true",),
        check=_decoupled_wd,
    ),
    mcore_rule(
        id="MC-OPT-FRACTION-TYPE",
        stage=STAGE_OPTIMIZER_FACTORY,
        exception="TypeError",
        summary="`optimizer_offload_fraction` given as text, a list or null with optimizer offload on.",
        keys=(_ON, _F),
        message="'<' not supported between instances of 'int' and 'str'",
        why="OptimizerConfig keeps the value as written; HybridDeviceOptimizer multiplies the GPU parameters' size "
        "by it and compares the running total with the result, which fails for these types. The message is "
        "Python's own for the value given.",
        check=_fraction_type,
    ),
    mcore_rule(
        id="OPT-MFSDP-V2",
        stage="FullyShardedOptimizer (Megatron-FSDP v2)",
        exception="ValueError",
        applies_to=">=0.20",
        summary="Megatron-FSDP v2 does not support optimizer CPU offload (MCore main).",
        keys=(_ON, "ddp.use_megatron_fsdp", "ddp.megatron_fsdp_version"),
        message="MFSDP v2 does not currently support optimizer CPU offload.",
        why="fully_sharded_optimizer.py on MCore main (not in 0.19.2). How a config selects FSDP v2 is read "
        "here from ddp.use_megatron_fsdp + ddp.megatron_fsdp_version=2.",
        fix=(_ON + "=false",),
        check=_mfsdp_v2,
    ),
    Rule(
        id="OPT-BRIDGE-MFSDP-V2",
        severity="error",
        origin="bridge",
        stage=STAGE_BRIDGE,
        applies_to=">=0.20",
        exception="ValueError",
        summary="Bridge's MFSDP v2 config rejects optimizer CPU offload (Bridge HEAD).",
        keys=(_ON, "ddp.use_megatron_fsdp", "ddp.megatron_fsdp_version"),
        message="MFSDP V2 does not support optimizer CPU offload.",
        why="Bridge checks it at config time, before MCore's FullyShardedOptimizer would.",
        fix=(_ON + "=false",),
        check=_mfsdp_v2_bridge,
    ),
    # ---- Megatron-LM validate_args (only for Megatron-LM command lines)
    Rule(
        id="OPT-MLM-PRECISION-AWARE",
        severity="error",
        origin="megatron-lm",
        stage=STAGE_MLM,
        exception="AssertionError",
        summary="Megatron-LM requires --use-precision-aware-optimizer with --optimizer-cpu-offload.",
        keys=(_ON, "optimizer.use_precision_aware_optimizer"),
        message="The optimizer cpu offload must be used in conjunction with `--use-precision-aware-optimizer`, "
        "as the hybrid device optimizer reuses the code path of this flag.",
        why="Only Megatron-LM's argument validation enforces it; Megatron Bridge does not.",
        fix=("optimizer.use_precision_aware_optimizer=true",),
        check=_mlm_precision_aware,
    ),
    Rule(
        id="OPT-MLM-FP8-PARAM-GATHER",
        severity="error",
        origin="megatron-lm",
        stage=STAGE_MLM,
        exception="AssertionError",
        summary="With --fp8-param-gather, Megatron-LM's optimizer offload needs --fp8-recipe delayed.",
        keys=(_ON, "ddp.fp8_param_gather", "optimizer.fp8_recipe"),
        message="When `--fp8-param-gather` is enabled, the optimizer cpu offload must be used in conjunction with "
        "`--fp8-recipe delayed`.",
        why="Megatron-LM validate_args.",
        fix=("optimizer.fp8_recipe=delayed",),
        check=_mlm_fp8_param_gather,
    ),
    # ---- advisory
    advisory(
        id="OPT-FRACTION-ZERO",
        severity="warning",
        summary="Optimizer offload on with `optimizer_offload_fraction: 0.0` offloads nothing.",
        keys=(_ON, _F),
        message="optimizer.optimizer_cpu_offload is on but optimizer.optimizer_offload_fraction is 0.0: "
        "HybridDeviceOptimizer keeps every optimizer state on the GPU, so nothing is offloaded.",
        why="0.0 is the dataclass default (Megatron-LM's CLI default is 1.0), so switching only the master flag in "
        "Bridge does nothing but add overhead. 0.5 is the usual balanced start; 1.0 saves the most.",
        fix=(_F + "=0.5",),
        check=_fraction_zero,
    ),
    advisory(
        id="OPT-FRACTION-RANGE",
        severity="warning",
        summary="`optimizer_offload_fraction` outside [0, 1] (the documented range; not enforced upstream).",
        keys=(_F,),
        message="optimizer.optimizer_offload_fraction is {value}, outside [0.0, 1.0]; upstream accepts it "
        "silently and behaves as {effect}.",
        why="Not enforced by MCore, Bridge or Megatron-LM (the skill documents the range). HybridDeviceOptimizer "
        "offloads params while the offloaded count is below fraction × total, so ≥ 1 offloads everything "
        "and ≤ 0 nothing.",
        fix=(_F + "={clamped}",),
        check=_fraction_range,
    ),
    advisory(
        id="OPT-FRACTION-INERT",
        severity="info",
        summary="`optimizer_offload_fraction` set while `optimizer_cpu_offload` is off has no effect.",
        keys=(_ON, _F),
        message="optimizer.optimizer_offload_fraction is set but optimizer.optimizer_cpu_offload is off: "
        "nothing is offloaded.",
        why="The fraction is only read when the master switch is on. Set optimizer.optimizer_cpu_offload=true to "
        "use it.",
        fix=None,
        check=_fraction_inert,
    ),
    advisory(
        id="OPT-TORCH-OPTIMIZER",
        severity="warning",
        summary="`use_torch_optimizer_for_cpu_offload` has no effect.",
        keys=("optimizer.use_torch_optimizer_for_cpu_offload",),
        message="optimizer.use_torch_optimizer_for_cpu_offload has no effect: the optimizer factory overwrites "
        "the class it selects.",
        why="get_megatron_optimizer sets the GPU class to the CPU class when the flag is on, then the adam/sgd "
        "branch right after overwrites both (true since the feature was added). The CPU side is always "
        "torch AdamW (fused).",
        fix=("optimizer.use_torch_optimizer_for_cpu_offload=false",),
        check=_torch_optimizer,
    ),
    advisory(
        id="OPT-NON-ADAM",
        severity="warning",
        summary="Under optimizer offload, any optimizer name other than adam becomes SGD.",
        keys=(_ON, "optimizer.optimizer"),
        message="optimizer.optimizer is {name!r}, but with optimizer_cpu_offload every optimizer other than adam "
        "silently runs as SGD (momentum = sgd_momentum).",
        why="The offload branch of get_megatron_optimizer picks Adam for 'adam' and SGD for anything else, before "
        "the branches that would build other optimizers.",
        fix=("optimizer.optimizer=adam",),
        check=_non_adam,
    ),
    Rule(
        id="OPT-HDO-FLOAT16-WRAPPER",
        severity="error",
        origin="mcore",
        stage=STAGE_FIRST_STEP,
        exception="KeyError",
        summary="megatron-core's HDO with 16-bit params and no distributed optimizer: KeyError at step 1.",
        keys=(_ON, "optimizer.use_distributed_optimizer", "ddp.use_distributed_optimizer", "optimizer.bf16"),
        message="optimizer_cpu_offload with bf16/fp16 parameters and no distributed optimizer: megatron-core's "
        "HybridDeviceOptimizer fails at its first step (KeyError in _sync_hdo_param_groups_to_sub_optimizers).",
        why="get_megatron_optimizer wraps the HDO in Float16OptimizerWithFloat16Params, which swaps each parameter "
        "of the HDO's groups for its fp32 main copy after the HDO mapped them by identity; the first step looks the "
        "new ones up (0.16.1 and 0.19.2; NVIDIA/Megatron-LM#4042, its fix NVIDIA/Megatron-LM#4046 not merged). The "
        "config checks and the build pass. mbridge_offload_runtime's HDO (install_optimizer_offload) follows the "
        "swap and trains.",
        fix=_DO_FIX,
        check=_hdo_float16_wrapper,
    ),
    advisory(
        id="OPT-DISTRIBUTED-OPTIMIZER",
        severity="warning",
        summary="The skill says optimizer offload requires the distributed optimizer; upstream does not enforce it.",
        keys=(_ON, "optimizer.use_distributed_optimizer", "ddp.use_distributed_optimizer"),
        message="optimizer.optimizer_cpu_offload without the distributed optimizer: documented as required "
        "(skill, Bridge docs), not enforced upstream; every rank then offloads the full, unsharded "
        "optimizer state.",
        why="No MCore or Bridge code requires it (searched HEAD and the Bridge pin), but without it each data-"
        "parallel rank holds and steps the whole optimizer state on its host, multiplying host memory and "
        "CPU time.",
        fix=_DO_FIX,
        check=_no_distributed_optimizer,
    ),
    advisory(
        id="OPT-OVERLAP",
        severity="info",
        summary="At high offload fractions, overlap D2H/H2D with the CPU step.",
        keys=(_F, "optimizer.overlap_cpu_optimizer_d2h_h2d"),
        message="optimizer.optimizer_offload_fraction is high and overlap_cpu_optimizer_d2h_h2d is off; turning "
        "it on overlaps transfers with the CPU optimizer step.",
        why="Measured on Qwen3-30B-A3B at 100 %: 4.2x → 3.9x step time (≈7 %); the card recommends it at high "
        "fractions. Costs one CPU optimizer per parameter.",
        fix=("optimizer.overlap_cpu_optimizer_d2h_h2d=true",),
        check=_overlap,
    ),
)
