"""Parallel sizes of 0 or below: refused as bad input by every tool, with the key and the value.

megatron-core's dataclasses pass most of them (they compare with 1) and the run fails later (a size divides the
world size; a negative one yields negative group sizes). ``validate`` keeps the catalogue's finding where the
dataclass itself refuses (MC-HEADS-TP, MC-PP-POSITIVE) and refuses the input otherwise; the planning and writing
tools always refuse it, since no memory or step time exists for such a run. A boolean or string is a wrong type,
not a size (megatron-core's TypeError answers it). No torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mbridge_offload.config.errors import InputError

# The sizes megatron-core builds its process groups (or virtual stages) from; each must be at least 1.
PARALLEL_SIZE_KEYS: tuple[str, ...] = (
    "model.tensor_model_parallel_size",
    "model.pipeline_model_parallel_size",
    "model.virtual_pipeline_model_parallel_size",
    "model.context_parallel_size",
    "model.expert_model_parallel_size",
    "model.expert_tensor_parallel_size",
)


class ParallelSizeError(InputError):
    """A parallel size of 0 or below in a config (bad input: exit 2, MCP ToolError)."""


def _lookup(raw: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    section, _, key = dotted.partition(".")
    body = raw.get(section)
    if isinstance(body, dict) and key in body:
        return True, body[key]
    return False, None


def not_positive(raw: dict[str, Any] | None) -> list[tuple[str, int | float]]:
    """``(dotted key, value)`` of every parallel size the config writes as a number of 0 or below, in key order.

    ``None`` (unset: VPP off, ETP = TP) is not a size; a bool or a string is a wrong type, left to the catalogue.
    """
    out: list[tuple[str, int | float]] = []
    for dotted in PARALLEL_SIZE_KEYS:
        has, value = _lookup(raw or {}, dotted)
        if has and isinstance(value, int | float) and not isinstance(value, bool) and value <= 0:
            out.append((dotted, value))
    return out


def error(found: list[tuple[str, int | float]], where: str = "config") -> ParallelSizeError:
    """The one error for the sizes found: each key (a Megatron-LM command line: its flag) with its value, and what
    is accepted."""
    if where == "argv":
        from mbridge_offload.config.megatron_lm.argv import flags_by_key

        flags = flags_by_key()
        listed = "; ".join(f"{flags.get(key, key)} {value!r} (argv)" for key, value in found)
    else:
        listed = "; ".join(f"{key} = {value!r} ({where})" for key, value in found)
    return ParallelSizeError(
        f"{listed}: a parallel size must be an integer >= 1 (megatron-core builds its process groups from it; "
        "1 = that parallelism off; virtual_pipeline_model_parallel_size and expert_tensor_parallel_size may be null "
        "= unset)",
        "set it to 1 or more",
    )


def check(raw: dict[str, Any] | None, where: str = "config", covered: Iterable[str] = ()) -> None:
    """Refuse (ParallelSizeError) a parallel size of 0 or below in ``raw``, unless ``covered``.

    ``covered``: keys an error finding already names (the dataclass refuses the value itself, so the finding, not an
    input error, is the answer); ``where`` names the input in the message.
    """
    skip = set(covered)
    found = [(key, value) for key, value in not_positive(raw) if key not in skip]
    if found:
        raise error(found, where)
