"""Megatron-LM 0.19.2's own MoE asserts (``validate_args``), which a command line meets before megatron-core's.

Their text is the one its user sees (``num_experts must be non None ...`` rather than megatron-core's
``num_moe_experts ...``). Megatron-LM command lines only; 0.19.2's for every target.
"""

from __future__ import annotations

from mbridge_offload.config.rules.base import STAGE_MLM, Context, Match, Rule
from mbridge_offload.config.rules.mcore import given

_EP, _EXPERTS, _LATENT = "model.expert_model_parallel_size", "model.num_moe_experts", "model.moe_latent_size"


def _mlm(ctx: Context) -> bool:
    return ctx.frontend == "megatron-lm"


def _ep(ctx: Context) -> int:
    ep = ctx.model.expert_model_parallel_size
    return ep if isinstance(ep, int) else 1


def _ep_without_experts(ctx: Context) -> bool:
    return _mlm(ctx) and _ep(ctx) > 1 and ctx.model.num_moe_experts is None


def _experts_not_divisible(ctx: Context):
    experts = ctx.model.num_moe_experts
    if not _mlm(ctx) or _ep(ctx) <= 1 or not isinstance(experts, int) or experts % _ep(ctx) == 0:
        return None
    return Match({"experts": experts, "ep": _ep(ctx)})


def _latent_size(ctx: Context):
    size = given(ctx, "moe_latent_size", None)
    if not _mlm(ctx) or size is None:
        return None
    if size <= 0:
        return Match(message="MoE latent projection dimension has to be greater than zero.")
    if ctx.model.num_moe_experts is None:
        return Match(message="MoE latent projections are applicable only for MoE models.")
    return None


def _rule(id: str, message: str, check, summary: str, keys: tuple[str, ...], **kw) -> Rule:
    return Rule(
        id=id,
        severity="error",
        origin="megatron-lm",
        stage=STAGE_MLM,
        exception="AssertionError",
        summary=summary,
        keys=keys,
        message=message,
        why=kw.pop("why", "Megatron-LM's validate_args asserts it at start-up, before megatron-core's own check."),
        check=check,
        **kw,
    )


RULES: tuple[Rule, ...] = (
    _rule(
        "CFG-MLM-EP-WITHOUT-EXPERTS",
        "num_experts must be non None to use expert model parallelism",
        _ep_without_experts,
        "`--expert-model-parallel-size` above 1 needs `--num-experts` (Megatron-LM).",
        (_EP, _EXPERTS),
        fix=(f"{_EP}=1",),
    ),
    _rule(
        "CFG-MLM-EP-EXPERTS-DIVISIBLE",
        "Number of experts should be a multiple of expert model parallel_size.",
        _experts_not_divisible,
        "`--num-experts` must be a multiple of `--expert-model-parallel-size` (Megatron-LM).",
        (_EP, _EXPERTS),
        why="Megatron-LM's validate_args asserts it before megatron-core's own check (each expert-parallel rank holds "
        "the same number of experts).",
    ),
    _rule(
        "CFG-MLM-MOE-LATENT-SIZE",
        "MoE latent projection dimension has to be greater than zero.",
        _latent_size,
        "`--moe-latent-size` must be above 0 and needs `--num-experts` (Megatron-LM).",
        (_LATENT, _EXPERTS),
    ),
)
