"""How a megatron-core refusal is written as a rule, and how a group of rules says where upstream checks it.

Messages are upstream's verbatim, with values printed as megatron-core prints them (as written: ``'false'`` stays a
string). Each group names the upstream check it follows (:func:`following`), because upstream stops at its first
failing check and the catalogue must keep that order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from mbridge_offload.config.rules.base import STAGE_TRANSFORMER_CONFIG, Context, Match, Rule

TC = STAGE_TRANSFORMER_CONFIG
MOE_INSIDE = ("expert_fc1", "fused_group_mlp", "moe_act")


def set_repr(items) -> str:
    """A set as Python prints it, sorted (upstream's messages print sets)."""
    return "{" + ", ".join(repr(x) for x in sorted(items)) + "}"


def mcore_rule(id: str, exception: str | None, message: str, check, summary: str, keys: tuple[str, ...], **kw) -> Rule:
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


_MISSING = object()


def written(ctx: Context, key: str) -> bool:
    """Whether the config writes ``model.<key>`` (even as null)."""
    body = ctx.raw.get("model") if isinstance(ctx.raw, dict) else None
    return isinstance(body, dict) and key in body


def given(ctx: Context, key: str, default: Any) -> Any:
    """``model.<key>`` as written (a string stays a string), else upstream's dataclass default."""
    body = ctx.raw.get("model") if isinstance(ctx.raw, dict) else None
    if isinstance(body, dict) and key in body:
        return body[key]
    value = getattr(ctx.model, key, _MISSING)
    return default if value is _MISSING or value is None else value


def upstream_compare(op: Callable[[Any, Any], Any], left: Any, right: Any) -> tuple[Any, Match | None]:
    """``op(left, right)`` as megatron-core evaluates it: ``(result, None)``, or ``(None, Match)`` carrying the
    exception Python raises for these operands (a ``TypeError`` for the wrong types, a ``ZeroDivisionError`` for
    a zero given as ``False``): megatron-core raises that very exception, text included."""
    try:
        return op(left, right), None
    except (TypeError, ZeroDivisionError) as exc:
        return None, Match(message=str(exc), exception=type(exc).__name__)
