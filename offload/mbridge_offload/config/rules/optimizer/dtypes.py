"""``OptimizerConfig.__post_init__``'s dtype checks, right after its precision-aware-optimizer checks."""

from __future__ import annotations

from mbridge_offload.config.rules.base import STAGE_OPTIMIZER_CONFIG, Context, Rule
from mbridge_offload.config.rules.mcore import following, mcore_rule


def _dtype_not_fp32(key: str):
    def check(ctx: Context) -> bool:
        return not ctx.opt.use_precision_aware_optimizer and getattr(ctx.opt, key) not in (None, "fp32")

    return check


OPTIMIZER_DTYPE_RULES: tuple[Rule, ...] = tuple(
    mcore_rule(
        f"MC-OPT-{key.upper().replace('_', '-')}",
        "AssertionError",
        f"{key} can only be fp32 when not using precision-aware optimizer",
        _dtype_not_fp32(key),
        f"`{key}` other than fp32 needs the precision-aware optimizer.",
        (f"optimizer.{key}", "optimizer.use_precision_aware_optimizer"),
        stage=STAGE_OPTIMIZER_CONFIG,
        fix=(f"optimizer.{key}=fp32",),
    )
    for key in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
)


RULES = following("OPT-PRECISION-AWARE-DO", *OPTIMIZER_DTYPE_RULES)
