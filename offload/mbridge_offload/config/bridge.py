"""Megatron Bridge as a validation layer: what its model ``finalize()`` changes before megatron-core's checks.

Bridge's model providers defer megatron-core's ``TransformerConfig.__post_init__`` to ``finalize()``, which first
normalises a few values (``models/transformer_config.py``):

- every release: ``pipeline_dtype = params_dtype`` when pipeline parallel size > 1 and it is unset;
- 0.6.x (megatron-core 0.19) and later, also: ``sequence_parallel = False`` when tensor parallel size <= 1, and
  ``expert_tensor_parallel_size = 1`` when it is unset and expert parallel size > 1 (megatron-core's own default
  would be the tensor parallel size).

A validator that skips these reports errors Bridge never raises (``Cannot use sequence parallelism without tensor
parallelism`` on a TP=1 run_config.yaml). They apply to Bridge configs only: a ``ConfigContainer`` YAML (a
``_target_`` naming ``megatron.bridge``) or a recipe; a plain megatron-core config is judged as megatron-core
judges it. Plain Python: no torch, no megatron.
"""

from __future__ import annotations

import copy
from typing import Any

from mbridge_offload.config.rules.base import Target
from mbridge_offload.config.schema import OffloadConfig

Change = tuple[str, Any, Any]


def is_container(raw: dict[str, Any], source: str | None = None) -> bool:
    """Whether ``raw`` is a Megatron Bridge ``ConfigContainer``: its YAML names Bridge classes, or a recipe built it."""
    if source is not None and source.startswith("recipe:"):
        return True
    for node in (raw, raw.get("model")):
        target = node.get("_target_") if isinstance(node, dict) else None
        if isinstance(target, str) and target.startswith("megatron.bridge."):
            return True
    return False


def _changes(config: OffloadConfig, target: Target) -> list[Change]:
    m = config.model
    out: list[Change] = []
    if m.pipeline_model_parallel_size > 1 and m.pipeline_dtype is None and m.params_dtype is not None:
        out.append(("model.pipeline_dtype", None, m.params_dtype))
    if target.version >= (0, 19, 0):
        if m.sequence_parallel and m.tensor_model_parallel_size <= 1:
            out.append(("model.sequence_parallel", m.sequence_parallel, False))
        if m.expert_tensor_parallel_size is None and m.expert_model_parallel_size > 1:
            out.append(("model.expert_tensor_parallel_size", None, 1))
    return out


def finalize(
    config: OffloadConfig, raw: dict[str, Any], target: Target
) -> tuple[OffloadConfig, dict[str, Any], list[Change]]:
    """The config as megatron-core's checks see it after Bridge's ``finalize()`` for ``target``'s Bridge release.

    Returns:
        ``(config, raw, changes)``: copies with the normalised values, and each change as ``(key, old, new)``.
    """
    changes = _changes(config, target)
    if not changes:
        return config, raw, []
    config = config.model_copy(deep=True)
    raw = copy.deepcopy(raw)
    model_raw = raw.get("model") if isinstance(raw.get("model"), dict) else None
    for dotted, _old, new in changes:
        key = dotted.split(".", 1)[1]
        setattr(config.model, key, new)
        if model_raw is not None and key in model_raw:
            model_raw[key] = new
    return config, raw, changes
