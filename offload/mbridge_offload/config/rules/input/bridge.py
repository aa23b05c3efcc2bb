"""Megatron Bridge's own normalisations, reported: what ``finalize()`` changed before megatron-core's checks ran.

The changes themselves are made by :func:`mbridge_offload.config.bridge.finalize` (for Bridge configs only); this
rule makes each one visible in the report, so a reader sees why, say, ``sequence_parallel: true`` at TP=1 is no
error in a Bridge run_config.yaml. Plain Python: no torch, no megatron.
"""

from __future__ import annotations

from mbridge_offload.config.rules.base import STAGE_BRIDGE, Context, Match, Rule

# What the same value meets without Bridge's normalisation (megatron-core alone, or Bridge 0.3.x on 0.16).
_WITHOUT = {
    "model.sequence_parallel": "; megatron-core alone, and Bridge 0.3.x (megatron-core 0.16), refuse it: "
    "'Cannot use sequence parallelism without tensor parallelism'",
    "model.expert_tensor_parallel_size": "; megatron-core alone, and Bridge 0.3.x (megatron-core 0.16), take the "
    "tensor-parallel size instead",
}


def _finalized(ctx: Context) -> list[Match]:
    # The answer names the release whose behaviour it follows: the target's paired Bridge (0.6.x for 0.19.2).
    return [
        Match(
            {"key": key, "old": old, "new": new, "bridge": ctx.target.bridge, "mcore": ctx.target.label,
             "without": _WITHOUT.get(key, "")},
            keys=[key],
        )
        for key, old, new in ctx.normalized
    ]  # fmt: skip


BRIDGE_RULES: tuple[Rule, ...] = (
    Rule(
        id="CFG-BRIDGE-FINALIZE",
        severity="info",
        origin="bridge",
        stage=STAGE_BRIDGE,
        upstream=False,
        summary="Bridge's model finalize() normalises a value before megatron-core's checks (Bridge configs only).",
        keys=("model.pipeline_dtype", "model.sequence_parallel", "model.expert_tensor_parallel_size"),
        message="Megatron Bridge's finalize() ({bridge}, paired with megatron-core {mcore}) sets {key} = {new} "
        "(written: {old}) before megatron-core's checks{without}",
        why="models/transformer_config.py: pipeline_dtype = params_dtype when PP > 1 and unset (every release); "
        "from Bridge 0.6 (megatron-core 0.19) also sequence_parallel = False when TP <= 1 and "
        "expert_tensor_parallel_size = 1 when unset and EP > 1. The checks that follow see these values.",
        fix=None,
        check=_finalized,
    ),
)
