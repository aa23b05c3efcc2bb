"""``recommend``'s side of fine-grained activation offloading: when it is the tool, which modules, which overrides.

It is proposed where layer-level offload is refused (PP > 1, activation recompute, CUDA graphs other than
``full_iteration``): fine-grained offloading works with all three in megatron-core 0.19.2, within its own checks,
which the rule catalogue runs here (``blockers``). Module sets grow one ``fine_grained.SELECTION_STEPS`` step at a
time and the first that fits wins. The overrides carry what Bridge 0.6 checks besides the switch: the TE implementation,
and ``NVTE_CPU_OFFLOAD_V1=1`` (TE >= 2.10 would otherwise take its v2 offload path, "to avoid offloading
weights", Bridge ``training/config.py``). Never imports torch.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

from mbridge_offload.config.overrides import format_override
from mbridge_offload.plan.inputs.resolve import catalogue_keys
from mbridge_offload.plan.memory import activations, fine_grained
from mbridge_offload.plan.model.architecture import ModelSpec
from mbridge_offload.plan.model.run import Setup

MODE = "fine-grained"
MODE_WITH_OPTIMIZER = "fine-grained+optimizer"


def overrides(s: Setup) -> list[str]:
    """The Hydra-style overrides that switch on the fine-grained settings of ``s`` (empty when it has none)."""
    if not s.offload_modules:
        return []
    out = [
        format_override("model.fine_grained_activation_offloading", True),
        format_override("model.offload_modules", list(s.offload_modules)),
        format_override("model.cpu_offloading", False),  # mutually exclusive with layer-level offloading
        format_override("model.transformer_impl", "transformer_engine"),
        format_override("env_vars.NVTE_CPU_OFFLOAD_V1", 1),
    ]
    if s.activation_offload_fraction != 1.0:
        out.append(format_override("model.activation_offload_fraction", f"{s.activation_offload_fraction:g}"))
    if "fused_group_mlp" in s.offload_modules:
        out.append(format_override("model.use_transformer_engine_op_fuser", True))
    return out


def blockers(s: Setup, modules: tuple[str, ...], model_config: dict[str, Any]) -> list[str]:
    """Errors the rule catalogue raises for fine-grained offloading of ``modules`` on this setup.

    Args:
        s: the setup (PP, recompute).
        modules: the candidate ``offload_modules``.
        model_config: other ``model.*`` facts that decide (``cuda_graph_impl``, ``moe_paged_stash``, ...).
    """
    section = {**catalogue_keys(s, 8), "recompute_modules": tuple(s.recompute_modules), **model_config}
    return list(_blockers(tuple(section.items()), tuple(modules)))


@functools.lru_cache(maxsize=512)
def _blockers(section: tuple[tuple[str, Any], ...], modules: tuple[str, ...]) -> tuple[str, ...]:
    from mbridge_offload.config.schema import OffloadConfig
    from mbridge_offload.config.validate import validate

    model = dict(section)
    pp = model["pipeline_model_parallel_size"]
    model.update(
        recompute_modules=list(model["recompute_modules"]),
        fine_grained_activation_offloading=True,
        offload_modules=list(modules),
        transformer_impl="transformer_engine",
    )
    if "fused_group_mlp" in modules:
        model["use_transformer_engine_op_fuser"] = True
    if pp > 1:
        model["pipeline_dtype"] = "bf16"  # Bridge fills it in; not what decides here
    # What the switch adds: the errors of this config that the same config without fine-grained offloading lacks.
    without = {**model, "fine_grained_activation_offloading": False, "offload_modules": []}
    found = {}
    for m in (model, without):
        # The overrides set env_vars.NVTE_CPU_OFFLOAD_V1=1 with the switch (Bridge >= 0.6, TE >= 2.10): probe so.
        raw = {"model": m, "env_vars": {"NVTE_CPU_OFFLOAD_V1": 1}}
        found[id(m)] = {(f.rule, f.message) for f in validate(OffloadConfig.model_validate(raw), raw).errors}
    added = found[id(model)] - found[id(without)]
    return tuple(f"fine-grained offloading: {message} ({rule})" for rule, message in sorted(added))


def useful_sets(m: ModelSpec, s: Setup, model_config: dict[str, Any]) -> list[tuple[str, ...]]:
    """Growing module sets, one ``fine_grained.SELECTION_STEPS`` step at a time; a step is skipped when the rule
    catalogue refuses it here or it frees nothing more (``expert_fc1`` on a dense model, a fused norm)."""
    if s.recompute_granularity == "full":
        return []  # 0.19.2's points sit inside the checkpointed layer: nothing is saved there to move
    out: list[tuple[str, ...]] = []
    acc: tuple[str, ...] = ()
    last = 0
    for step in fine_grained.SELECTION_STEPS:
        trial = (*acc, *step)
        if blockers(s, trial, model_config):
            continue
        saving = max(
            activations.stage_groups(m, replace(s, offload_modules=trial), st).gpu_saving_bytes for st in range(s.pp)
        )
        if saving > last:
            acc, last = trial, saving
            out.append(acc)
    return out
