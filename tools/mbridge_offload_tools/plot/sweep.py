"""``--sweep KEY=START:STOP:STEP``: which planner inputs may be swept, and the values a range names.

``START:STOP:STEP`` includes the stop; ``KEY=V1,V2,...`` lists the values. Every numeric input of ``PlanInputs`` but
the ``measured`` (one run's figures to anchor on) and ``decision`` groups (they change what recommend picks, never an
estimate), by name, flag or config key; each value within the input's bounds; Decimal arithmetic (0.3, not
0.30000000000000004).
"""

from __future__ import annotations

import typing
from decimal import ROUND_FLOOR, Decimal, InvalidOperation

from mbridge_offload.config.errors import InputError
from mbridge_offload.plan.inputs.fields import FIELDS, PlanInputs, flag_name, group_of
from mbridge_offload.plan.inputs.resolve import CONFIG_KEYS, validate_inputs

MAX_POINTS = 101  # 0:1:0.01; each point is one estimate (milliseconds) and one marker
NOT_SWEPT_GROUPS = ("measured", "decision")
SYNTAX = "KEY=START:STOP:STEP (the stop included) or KEY=V1,V2,..., e.g. optimizer_offload_fraction=0:1:0.25"


def _number_type(field: str) -> type | None:
    """``int`` or ``float`` for a numeric input (``X | None``), else None (bool, text, choices, lists)."""
    args = [a for a in typing.get_args(PlanInputs.model_fields[field].annotation) if a is not type(None)]
    return args[0] if len(args) == 1 and args[0] in (int, float) else None


def sweep_keys() -> dict[str, type]:
    """Every input a sweep may vary → its number type, in the declaration's order."""
    out = {}
    for name in FIELDS:
        kind = _number_type(name)
        if kind is not None and group_of(name) not in NOT_SWEPT_GROUPS:
            out[name] = kind
    return out


def _accepted() -> str:
    return ", ".join(sweep_keys())


def key_of(text: str) -> str:
    """The input a sweep key names (its name, flag or config key)."""
    given = text.strip()
    by_config = {key: name for name, key in CONFIG_KEYS.items()}
    by_flag = {flag_name(name).removeprefix("--"): name for name in FIELDS}
    name = by_config.get(given) or by_flag.get(given.removeprefix("--")) or given.replace("-", "_")
    keys = sweep_keys()
    if name in keys:
        return name
    why = "is not a planner input"
    if name in PlanInputs.model_fields:
        why = (
            f"is not swept ({group_of(name)} input: an estimate does not vary with it)"
            if _number_type(name)
            else "is not a number"
        )
    raise InputError(f"sweep {given!r} {why}", f"sweep one of: {_accepted()}")


def _number(text: str, key: str, kind: type) -> Decimal:
    try:
        value = Decimal(text.strip())
    except InvalidOperation:
        raise InputError(f"sweep {key}: {text.strip()!r} is not a number", f"write {SYNTAX}") from None
    if not value.is_finite():
        raise InputError(f"sweep {key}: {text.strip()!r} is not a finite number", f"write {SYNTAX}")
    if kind is int and value != value.to_integral_value():
        raise InputError(f"sweep {key}: {text.strip()} is not a whole number", f"{key} takes whole numbers")
    return value


def _range(text: str, key: str, kind: type) -> list[Decimal]:
    parts = text.split(":")
    if len(parts) != 3:
        raise InputError(f"sweep {key}={text}: a range has three parts, START:STOP:STEP", f"write {SYNTAX}")
    start, stop, step = (_number(p, key, kind) for p in parts)
    if step <= 0:
        raise InputError(f"sweep {key}={text}: the step must be above 0", f"write {SYNTAX}")
    if stop < start:
        raise InputError(
            f"sweep {key}={text}: the range is empty (START {start} is above STOP {stop})", "write START <= STOP"
        )
    count = ((stop - start) / step).to_integral_value(rounding=ROUND_FLOOR) + 1
    if count > MAX_POINTS:
        raise InputError(f"sweep {key}={text}: {count} points, more than {MAX_POINTS}", "take a larger step")
    return [start + i * step for i in range(int(count))]


def _list(text: str, key: str, kind: type) -> list[Decimal]:
    items = [p for p in text.split(",")]
    if any(not p.strip() for p in items):
        raise InputError(f"sweep {key}={text}: an empty value in the list", f"write {SYNTAX}")
    if len(items) > MAX_POINTS:
        raise InputError(f"sweep {key}: {len(items)} values, more than {MAX_POINTS}", "give fewer values")
    return sorted(set(_number(p, key, kind) for p in items))


def parse(spec: str) -> tuple[str, list[int | float]]:
    """The input and the values of a ``--sweep`` argument, each checked against the input's bounds."""
    key_text, sep, values_text = spec.partition("=")
    if not sep or not key_text.strip() or not values_text.strip():
        raise InputError(f"sweep {spec!r}: expected KEY=VALUES", f"write {SYNTAX}")
    key = key_of(key_text)
    kind = sweep_keys()[key]
    values_text = values_text.strip()
    numbers = _range(values_text, key, kind) if ":" in values_text else _list(values_text, key, kind)
    values: list[int | float] = [int(n) if kind is int else float(n) for n in numbers]
    for value in values:  # the declared bounds, with the input's name and the value in the message
        validate_inputs({key: value}, where={key: "sweep"})
    return key, values
