"""Value hygiene, before any upstream check: Megatron-LM arguments we do not know, flags and integers given as text."""

from __future__ import annotations

from mbridge_offload.config.overrides import format_override
from mbridge_offload.config.rules.base import Context, Match, Rule, advisory
from mbridge_offload.config.schema import SECTIONS

_INTEGER_KEYS = (
    "model.num_layers",
    "model.cpu_offloading_num_layers",
    "model.min_offloaded_tensor_size",
    "model.delta_offload_bytes_across_pp_ranks",
)


def _string_flags(ctx: Context):
    for section, cls in SECTIONS.items():
        body = ctx.raw.get(section) if isinstance(ctx.raw, dict) else None
        for key, value in (body or {}).items() if isinstance(body, dict) else ():
            info = cls.model_fields.get(key)
            if isinstance(value, str) and info is not None and info.annotation is bool:
                dotted = f"{section}.{key}"
                fix = format_override(dotted, bool(value))
                truth = fix.partition("=")[2]
                yield Match({"key": dotted, "value": value, "truth": truth}, fix=[fix], keys=[dotted])


def _not_integer(ctx: Context):
    for dotted in _INTEGER_KEYS:
        value = ctx.seen(dotted)
        if isinstance(value, float) and not value.is_integer():
            yield Match({"key": dotted, "value": value}, keys=[dotted])


def _unknown_arguments(ctx: Context):
    raw = ctx.raw if isinstance(ctx.raw, dict) else {}
    for flag in raw.get("unknown_arguments") or ():
        yield Match({"flag": flag, "version": raw.get("megatron_lm_version", "?")}, keys=[])


VALUE_RULES: tuple[Rule, ...] = (
    Rule(
        id="CFG-UNKNOWN-ARGUMENT",
        severity="warning",
        origin="megatron-lm",
        upstream=False,
        summary="A Megatron-LM command-line flag that Megatron-LM's parser does not know.",
        keys=(),
        message="{flag} is not an argument of Megatron-LM {version}; it was not read",
        why="Read with Megatron-LM's full argument set; an unknown flag is a typo or belongs to another release "
        "(Megatron-LM itself exits on it unless the script passes ignore_unknown_args).",
        check=_unknown_arguments,
    ),
    advisory(
        id="CFG-STRING-FLAG",
        severity="warning",
        summary="A flag given as a string (`'false'`): megatron-core reads it by truthiness.",
        keys=(),
        message="{key} is the string {value!r}, which megatron-core reads as {truth}",
        why="megatron-core's dataclasses do not convert types, so any non-empty string switches a flag on; "
        "validate reads it the same way. Write true/false without quotes.",
        check=_string_flags,
    ),
    advisory(
        id="CFG-NOT-INTEGER",
        severity="warning",
        summary="An integer setting given a fractional number.",
        keys=(),
        message="{key} = {value} is not a whole number; megatron-core's config accepts it, building the model fails",
        why="megatron-core does not convert or check the type when the config is constructed.",
        check=_not_integer,
    ),
)


RULES = VALUE_RULES
