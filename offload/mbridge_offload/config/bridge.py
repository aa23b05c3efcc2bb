"""Megatron Bridge as a validation layer: what its model ``finalize()`` changes before megatron-core's checks.

Bridge's model providers defer megatron-core's ``TransformerConfig.__post_init__`` to ``finalize()``, which first
normalises a few values (``models/transformer_config.py``):

- every release: ``pipeline_dtype = params_dtype`` (fp32, the dataclass default, when unset) when pipeline
  parallel size > 1 and it is unset;
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
    if m.pipeline_model_parallel_size > 1 and m.pipeline_dtype is None:
        # params_dtype unset is the dataclass default, torch.float32, which Bridge copies as it is.
        out.append(("model.pipeline_dtype", None, m.params_dtype or "fp32"))
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


def mixed_precision(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with its ``mixed_precision`` section applied as Bridge's ``runtime_config_update`` applies it.

    Bridge (0.6.2 ``training/mixed_precision.py``) first finalizes the section (``fp8_param`` and ``fp4_param``
    unset take ``fp8_param_gather`` / ``fp4_param_gather``), then copies each of its fields onto the model, optimizer
    and DDP configs that have that field, before ``finalize()`` and megatron-core's checks. A field counts as present
    when the section writes it (a run_config.yaml writes every field). A copy; ``raw`` without a ``mixed_precision``
    mapping is returned as it is. ``config.effective`` applies it (the catalogue, the planner and ``validate --exact``
    all read that one resolution).
    """
    section = raw.get("mixed_precision")
    if not isinstance(section, dict):
        return raw
    values = {k: v for k, v in section.items() if not k.startswith("_")}
    for name in ("fp8", "fp4"):
        if values.get(f"{name}_param") is None and f"{name}_param_gather" in values:
            values[f"{name}_param"] = values[f"{name}_param_gather"]
    raw = copy.deepcopy(raw)
    for part in ("model", "optimizer", "ddp"):
        body = raw.get(part)
        if isinstance(body, dict):
            body.update({k: copy.deepcopy(v) for k, v in values.items() if k in body})
    return raw
