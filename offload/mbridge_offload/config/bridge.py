"""Megatron Bridge as a validation layer: what its model ``finalize()`` changes before megatron-core's checks.

Every release sets ``pipeline_dtype = params_dtype`` under pipeline parallelism; 0.6.x also sets
``sequence_parallel = False`` at TP <= 1 and ``expert_tensor_parallel_size = 1`` when unset under EP > 1. A
validator that skips these reports errors Bridge never raises. They apply to Bridge configs only (a
``ConfigContainer`` YAML or a recipe). The ``comm_overlap`` section is copied onto the model and DDP configs at
start-up too (:func:`comm_overlap`). No torch, no megatron.
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
    if "mixed_precision" in raw or isinstance(raw.get("comm_overlap"), dict):
        return True  # only a ConfigContainer has these sections (mixed_precision: a recipe name or a mapping)
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
    """``(config, raw, changes)`` as megatron-core's checks see them after Bridge's ``finalize()`` for ``target``."""
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


# Bridge 0.6.2's MixedPrecisionConfig (training/mixed_precision.py): its fields and defaults (0.3.1 has the same but
# fp4_param and fp4_param_gather, which a 0.3.1 target's megatron-core then drops as unknown fields).
_BF16 = {"_target_": "torch.bfloat16", "_call_": False}
_FP16 = {"_target_": "torch.float16", "_call_": False}
MIXED_PRECISION_DEFAULTS: dict[str, Any] = {
    "fp32": False, "fp16": False, "bf16": False, "params_dtype": None, "pipeline_dtype": None,
    "autocast_dtype": None, "autocast_enabled": False, "grad_reduce_in_fp32": True, "fp8": None,
    "fp8_recipe": "tensorwise", "first_last_layers_bf16": False, "fp8_margin": 0, "fp8_amax_history_len": 1,
    "fp8_amax_compute_algo": "most_recent", "fp8_wgrad": True, "fp8_dot_product_attention": False,
    "fp8_multi_head_attention": False, "fp8_param": None, "fp8_param_gather": False, "fp4": None,
    "fp4_recipe": "nvfp4", "fp4_param": None, "fp4_param_gather": False, "loss_scale": None,
    "initial_loss_scale": 4294967296, "min_loss_scale": 1.0, "loss_scale_window": 1000, "hysteresis": 2,
    "num_layers_at_start_in_bf16": 0, "num_layers_at_end_in_bf16": 0, "reuse_grad_buf_for_mxfp8_param_ag": False,
}  # fmt: skip
_BF16_MIXED = {"bf16": True, "params_dtype": _BF16, "pipeline_dtype": _BF16, "grad_reduce_in_fp32": True}
_FP16_MIXED = {"fp16": True, "params_dtype": _FP16, "pipeline_dtype": _FP16, "grad_reduce_in_fp32": False}
_DELAYED = {"fp8": "hybrid", "fp8_recipe": "delayed", "fp8_amax_history_len": 1024, "fp8_amax_compute_algo": "max"}
_MX = {"fp8": "e4m3", "fp8_recipe": "mxfp8", "fp8_param_gather": True, "reuse_grad_buf_for_mxfp8_param_ag": True}
_CURRENT = {"fp8": "hybrid", "fp8_recipe": "tensorwise", "first_last_layers_bf16": True, "fp8_param_gather": True}
_NVFP4 = {"fp4": "e2m1", "fp4_recipe": "nvfp4", "fp4_param_gather": True}
# The named recipes a ConfigContainer's ``mixed_precision: <name>`` resolves to (``get_mixed_precision_config``; a
# hyphenated name is the same recipe): each the fields it sets over the defaults above.
MIXED_PRECISION_RECIPES: dict[str, dict[str, Any]] = {
    "bf16_mixed": _BF16_MIXED,
    "fp16_mixed": _FP16_MIXED,
    "bf16_with_fp8_delayed_scaling_mixed": {**_BF16_MIXED, **_DELAYED, "fp8_param_gather": True},
    "fp16_with_fp8_delayed_scaling_mixed": {**_FP16_MIXED, **_DELAYED, "fp8_param_gather": True},
    "bf16_with_mxfp8_mixed": {**_BF16_MIXED, **_MX},
    "fp16_with_mxfp8_mixed": {**_FP16_MIXED, **_MX},
    "bf16_with_fp8_current_scaling_mixed": {**_BF16_MIXED, **_CURRENT, "num_layers_at_start_in_bf16": 1,
                                            "num_layers_at_end_in_bf16": 1},
    "nemotron_h_bf16_with_fp8_current_scaling_mixed": {**_BF16_MIXED, **_CURRENT, "num_layers_at_start_in_bf16": 2,
                                                       "num_layers_at_end_in_bf16": 2},
    "nanov2_bf16_with_fp8_current_scaling_mixed": {**_BF16_MIXED, **_CURRENT, "fp8_recipe": "blockwise",
                                                   "num_layers_at_start_in_bf16": 2, "num_layers_at_end_in_bf16": 2},
    "fp16_with_fp8_current_scaling_mixed": {**_FP16_MIXED, **_CURRENT, "num_layers_at_start_in_bf16": 1,
                                            "num_layers_at_end_in_bf16": 1},
    "bf16_with_fp8_subchannel_scaling_mixed": {**_BF16_MIXED, "fp8": "hybrid", "fp8_recipe": "blockwise"},
    "fp16_with_fp8_subchannel_scaling_mixed": {**_FP16_MIXED, "fp8": "hybrid", "fp8_recipe": "blockwise"},
    "bf16_with_nvfp4_mixed": {**_BF16_MIXED, **_NVFP4},
    "nemotron_3_super_bf16_with_nvfp4_mixed": {**_BF16_MIXED, **_NVFP4, "first_last_layers_bf16": True,
                                               "num_layers_at_end_in_bf16": 14},
    "nemotron_3_ultra_bf16_with_nvfp4_mixed": {**_BF16_MIXED, **_NVFP4, "first_last_layers_bf16": True,
                                               "num_layers_at_end_in_bf16": 16},
}  # fmt: skip


def mixed_precision_section(raw: dict[str, Any]) -> dict[str, Any] | None:
    """The ``mixed_precision`` section of a ConfigContainer as Bridge instantiates it: every field of
    ``MixedPrecisionConfig`` (the defaults where the section is silent; a recipe name resolved), after its
    ``finalize()`` (``fp8_param`` / ``fp4_param`` unset take ``fp8_param_gather`` / ``fp4_param_gather``). None
    without one, or for a name that is no recipe (Bridge raises there; the catalogue reports the config).
    """
    section = raw.get("mixed_precision")
    if isinstance(section, str):
        section = MIXED_PRECISION_RECIPES.get(section.replace("-", "_"))
    if not isinstance(section, dict):
        return None
    values = {**MIXED_PRECISION_DEFAULTS, **{k: v for k, v in section.items() if not k.startswith("_")}}
    for name in ("fp8", "fp4"):
        if values.get(f"{name}_param") is None:
            values[f"{name}_param"] = values.get(f"{name}_param_gather")
    return values


def mixed_precision(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` (a copy) with its ``mixed_precision`` section applied as Bridge 0.6.2's ``runtime_config_update`` does.

    Bridge copies every field onto each config that has a field of that name, before ``finalize()``; here each field
    goes into each section, and exact mode's child passes on only the installed dataclasses' fields (Bridge's
    ``hasattr`` test).
    """
    values = mixed_precision_section(raw)
    if values is None:
        return raw
    raw = copy.deepcopy(raw)
    for part in ("model", "optimizer", "ddp"):
        body = raw.setdefault(part, {})
        if isinstance(body, dict):
            body.update(copy.deepcopy(values))
    return raw


# ---------------------------------------------------------------------------------------------- comm_overlap

_SETUP = "comm_overlap (Bridge 0.6.2 CommOverlapConfig.setup)"


def comm_overlap(raw: dict[str, Any], config: OffloadConfig) -> list[tuple[str, Any, str]]:
    """What Bridge 0.6.2's ``comm_overlap`` section decides on the model and DDP configs, as ``(key, value, source)``.

    It overwrites whatever the model section says: ``model.tp_comm_overlap`` only at TP >= 2 with sequence
    parallelism (else false, with a warning in Bridge's log); with the distributed optimizer, the DDP overlaps take the
    section's value, else on above DP 1 (the world size is not in a config, so that case is named in the source).
    """
    section = raw.get("comm_overlap")
    if not isinstance(section, dict):
        return []
    m = config.model
    asked = section.get("tp_comm_overlap")
    out: list[tuple[str, Any, str]] = []
    if asked is True:
        tp = m.tensor_model_parallel_size
        if not isinstance(tp, int) or tp < 2:
            out.append(("model.tp_comm_overlap", False, f"{_SETUP}: asked for, switched off at TP {tp} < 2"))
        elif not m.sequence_parallel:
            out.append(("model.tp_comm_overlap", False, f"{_SETUP}: asked for, switched off (sequence_parallel off)"))
        else:
            out.append(("model.tp_comm_overlap", True, f"{_SETUP}: comm_overlap.tp_comm_overlap (TE assumed)"))
    else:
        out.append(("model.tp_comm_overlap", False, f"{_SETUP}: off unless comm_overlap.tp_comm_overlap is true"))
    if config.ddp.use_distributed_optimizer:
        for key in ("overlap_grad_reduce", "overlap_param_gather"):
            value = section.get(key)
            if value is not None:
                out.append((f"ddp.{key}", value, f"{_SETUP}: comm_overlap.{key}"))
            else:
                out.append((f"ddp.{key}", True, f"{_SETUP}: on for data-parallel size > 1 (off at DP 1)"))
    return out
