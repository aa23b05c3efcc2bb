"""What a caller gave the planner, checked against the declaration (``fields.PlanInputs``): bounds with the input
named as given (flag or config key), the measured run's settings, and which inputs two runs share."""

from __future__ import annotations

import math
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from mbridge_offload.config.errors import BoundsError as InputError
from mbridge_offload.plan.inputs.fields import PlanInputs, flag_name, group_of

# Inputs that describe the job, the machine and the evidence, not the run's settings: the same in the run a user's
# evidence measured and the run asked about (``plan/evidence/runs.py``).
_SHARED_GROUPS = {"model", "hardware", "time", "decision", "measured"}
# In those groups but settings of the run (config keys the caller may change).
_RUN_SETTINGS_THERE = {"overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap"}


def shared(name: str) -> bool:
    """``name`` describes the job and the machine (both runs), not a setting the caller may change. The GPU count is
    the job's: a flag gives it to both runs (``measured_settings`` or a log's world size may say otherwise)."""
    return name == "num_gpus" or (group_of(name) in _SHARED_GROUPS and name not in _RUN_SETTINGS_THERE)


def measured_settings(items: list[str] | None) -> dict[str, Any]:
    """``measured_settings`` (``NAME=VALUE`` items) as planner input values, checked like the inputs themselves.

    Raises:
        InputError: an item without ``=``, a name that is no planner input or not a setting of the run, a value the
            input refuses.
    """
    out: dict[str, Any] = {}
    for item in items or []:
        name, sep, text = (part.strip() for part in item.partition("="))
        if not sep or name not in PlanInputs.model_fields:
            raise InputError(
                f"measured_settings {item!r}: expected NAME=VALUE with NAME a planner input, e.g. micro_batch_size=1 "
                "or seq_length=4096 (CLI: --measured-settings micro_batch_size=1)"
            )
        if shared(name) and name != "num_gpus":
            raise InputError(
                f"measured_settings {item!r}: {name} is the same in the measured and the asked run (the model, the "
                f"hardware, the evidence); pass it as {flag_name(name)}"
            )
        value: Any = [v for v in text.split(",") if v] if name in ("recompute_modules", "offload_modules") else text
        out[name] = getattr(validate_inputs({name: value}, {name: "measured_settings"}), name)
    return out


def _message(err: ErrorDetails, where: dict[str, str], keys: dict[str, str]) -> str:
    name = str(err["loc"][0]) if err["loc"] else "input"
    value = err.get("input")
    source = where.get(name, "flag")
    shown = flag_name(name) if name in PlanInputs.model_fields and source == "flag" else name
    if source in ("config", "argv") and name in keys:
        shown = keys[name]  # the config's own key: model.tensor_model_parallel_size, not tp
    text = err["msg"]
    if isinstance(value, float) and not math.isfinite(value):
        text = "must be a finite number"
    return f"{shown} = {value!r} ({source}): {text[0].lower() + text[1:]}"


def validate_inputs(
    values: dict[str, Any], where: dict[str, str] | None = None, keys: dict[str, str] | None = None
) -> PlanInputs:
    """``PlanInputs`` from a dict of values; one readable line per violated bound.

    Args:
        values: input name → value (unknown names are refused).
        where: input name → source (``flag``, ``config``, ``preset``...), named in the message.
        keys: input name → the dotted config key, named instead of the input where the config gave the value.

    Raises:
        InputError: the first three problems, each with the input, its value and the bound.
    """
    try:
        return PlanInputs.model_validate(values)
    except ValidationError as exc:
        errors = exc.errors()
        lines = [_message(e, where or {}, keys or {}) for e in errors[:3]]
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        raise InputError("; ".join(lines) + more) from None
