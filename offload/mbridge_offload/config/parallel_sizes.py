"""Parallel sizes of 0 or below: refused as bad input by every tool, with the key and the value.

What upstream does with them (megatron-core 0.16.1 / 0.19.2, Bridge 0.6.2):

- ``ModelParallelConfig`` and ``TransformerConfig`` keep the numbers as written and compare them with 1 (``pp > 1``,
  ``cp > 1``, ``ep > 1``), so most of them pass the dataclass. Two do not: ``tensor_model_parallel_size`` 0 divides
  by zero in ``num_attention_heads % tensor_model_parallel_size`` (rule MC-HEADS-TP), and a pipeline size below 1
  trips the assert of MC-PP-POSITIVE.
- The rest fail later, before any training step: Bridge's ``ConfigContainer.get_data_parallel_size`` divides the
  world size by TP × PP × CP, megatron-core's ``initialize_model_parallel`` by TP × PP × CP and ETP × EP × PP, and
  the pipeline schedule splits the layers by VPP. A negative size divides without an error and leads to negative
  group sizes.

So ``validate`` keeps the catalogue's finding where the dataclass itself refuses the value, and refuses the input
otherwise (:func:`check`, ``covered`` = the error findings); the planning and writing tools (estimate, recommend,
apply, diagnose) always refuse it, since no memory or step time exists for such a run. A boolean or a string is a
wrong type, not a size: megatron-core's own run in validate refuses it with its TypeError, and the planner's
bounds refuse it. Config side: no torch.
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
    """Refuse a config with a parallel size of 0 or below.

    Args:
        raw: the config as read (sections → keys), e.g. ``LoadedConfig.raw`` or ``Effective.raw``.
        where: the input's kind for the message (``config``, ``argv``, ``before``...).
        covered: keys an error finding of the rule catalogue already names (``validate``: the dataclass refuses
            the value in ``__post_init__``, so the finding, not an input error, is the answer).

    Raises:
        ParallelSizeError: a size of 0 or below that no finding covers.

    Example:
        >>> check({"model": {"context_parallel_size": 0}})
        Traceback (most recent call last):
        ...
        mbridge_offload.config.parallel_sizes.ParallelSizeError: model.context_parallel_size = 0 (config): ...
    """
    skip = set(covered)
    found = [(key, value) for key, value in not_positive(raw) if key not in skip]
    if found:
        raise error(found, where)
