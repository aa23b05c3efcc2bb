"""Rules on the input itself, before any upstream check: an empty config (valid, but "no finding" would read as
"your offload settings are fine"), what Bridge's ``finalize()`` normalised (made visible, so ``sequence_parallel: true``
at TP=1 is seen to be no error in a Bridge run), unknown Megatron-LM arguments, flags and integers given as text."""

from __future__ import annotations

from mbridge_offload.config.overrides import format_override
from mbridge_offload.config.rules.base import STAGE_BRIDGE, Context, Match, Rule, advisory
from mbridge_offload.config.schema import SECTIONS


def _empty(ctx: Context) -> bool:
    return not any(isinstance(ctx.raw.get(name), dict) and ctx.raw[name] for name in SECTIONS)


INPUT_RULES: tuple[Rule, ...] = (
    advisory(
        id="CFG-EMPTY",
        severity="warning",
        summary="The config sets no model/optimizer/ddp/train/dataset key: nothing offload-related was checked.",
        keys=tuple(SECTIONS),
        message="the config is empty (no model, optimizer, ddp, train or dataset keys): nothing was checked; "
        "Bridge would run "
        "its recipe defaults with CPU offloading off",
        why="An empty file, a comment-only file, or only unknown sections. Upstream accepts it (every default "
        "applies), so this is a warning, not an error; pass the config you train with (ConfigContainer.to_yaml()).",
        check=_empty,
    ),
)


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
