"""How a megatron-core refusal is written as a rule, and how a group of rules says where upstream checks it.

The rules in ``parallelism``, ``recompute``, ``offload_extras``, ``model_init``, ``cuda_graphs`` (all
``TransformerConfig.__post_init__``; ``ModelParallelConfig.__post_init__`` for the first) and ``optimizer_config``
(``OptimizerConfig.__post_init__``) are megatron-core 0.16.1's and 0.19.2's own refusals, read and run
(``tests/config/test_differential.py``). Messages are upstream's, verbatim, with the values printed as
megatron-core prints them (as the user wrote them: ``'false'`` stays a string). Each group names the upstream check
it comes right after (:func:`following`); the catalogue merges the groups into upstream's order from that alone,
because upstream stops at its first failing check.
"""

from __future__ import annotations

from dataclasses import replace

from mbridge_offload.config.rules.base import STAGE_TRANSFORMER_CONFIG, Rule

TC = STAGE_TRANSFORMER_CONFIG
MOE_INSIDE = ("expert_fc1", "fused_group_mlp", "moe_act")


def set_repr(items) -> str:
    """A set as Python prints it, sorted (upstream's messages print sets)."""
    return "{" + ", ".join(repr(x) for x in sorted(items)) + "}"


def mcore_rule(id: str, exception: str, message: str, check, summary: str, keys: tuple[str, ...], **kw) -> Rule:
    """An MCore TransformerConfig error rule (most fields are the same for every rule here)."""
    return Rule(
        id=id,
        severity=kw.pop("severity", "error"),
        origin="mcore",
        stage=kw.pop("stage", TC),
        exception=exception,
        summary=summary,
        keys=keys,
        message=message,
        why=kw.pop("why", "megatron-core refuses the config before any training starts."),
        check=check,
        **kw,
    )


def following(anchor: str, *rules: Rule) -> tuple[Rule, ...]:
    """``rules`` in upstream order, the first declared to come right after upstream's check ``anchor``."""
    return (replace(rules[0], follows=anchor), *rules[1:])
