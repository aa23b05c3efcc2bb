"""``apply --mode fine-grained``: the key edits that switch fine-grained activation offloading on.

Besides the switch and the modules it writes what megatron-core 0.19.2 and Bridge 0.6 check for it: layer-level
offloading off, TE as the transformer implementation, ``env_vars.NVTE_CPU_OFFLOAD_V1=1`` (Bridge >= 0.6 with TE >=
2.10; TE reads it at import, so another launcher must export it: :data:`NVTE_EXPORT_NOTE`) and the TE op fuser
for ``fused_group_mlp``. What cannot be fixed without changing the run's memory or semantics is refused with the
upstream message and the way out.
"""

from __future__ import annotations

import re
from typing import Any

from mbridge_offload.config.validate import fine_grained_errors
from mbridge_offload.upstream_layers import ALLOWED_OFFLOAD_MODULES

MODE = "fine-grained"
NVTE_KEY = "env_vars.NVTE_CPU_OFFLOAD_V1"
# What apply says whenever it writes the variable into env_vars (a note of its answer).
NVTE_EXPORT_NOTE = (
    "env_vars.NVTE_CPU_OFFLOAD_V1=1 is read by Megatron Bridge, which copies env_vars into the process environment "
    "at start-up (os.environ.setdefault) before its check. Transformer Engine reads NVTE_CPU_OFFLOAD_V1 once, when "
    "transformer_engine.pytorch is imported (cpu_offload.py, a module constant), and picks its offload code path "
    "then: with a launcher other than Bridge's (a Megatron-LM script, your own entry point), or wherever TE may be "
    "imported before Bridge applies env_vars, export NVTE_CPU_OFFLOAD_V1=1 in the job's environment before Python "
    "starts (the shell, sbatch/srun --export, the container's env), not only in the config"
)


def _te_at_least_2_10(cfg: Any) -> bool:
    """The run's Transformer Engine (``env.te_version``, else the release Bridge 0.6.2 pins) is 2.10 or newer: the
    release whose default offload path (v2) makes Bridge and Megatron-LM ask for NVTE_CPU_OFFLOAD_V1=1."""
    from mbridge_offload.config.rules.base import TE_VERSION_ASSUMED

    text = str(cfg.env.get("te_version", TE_VERSION_ASSUMED))
    return tuple(int(p) for p in re.findall(r"\d+", text)[:2]) >= (2, 10)


def parse_modules(modules: str | list[str] | tuple[str, ...] | None) -> list[str] | None:
    """``"expert_fc1,attn_proj"`` or a list → the module names (None when not given)."""
    if modules is None:
        return None
    items = modules.split(",") if isinstance(modules, str) else [m for part in modules for m in str(part).split(",")]
    out = [m.strip() for m in items if m.strip()]
    return out or None


def _default_modules(model: Any) -> tuple[list[str], str]:
    if model.offload_modules:
        return list(model.offload_modules), "kept the modules already set"
    if model.num_moe_experts:
        return [
            "expert_fc1"
        ], "expert_fc1 (the routed tokens' fc1 input) as in NVIDIA's MoE perf recipes (pass modules)"
    return ["core_attn", "attn_proj"], "the attention pair, the dense model's offload points (pass modules)"


def fine_grained_edits(cfg: Any, modules: list[str] | None, edits: dict[str, tuple[Any, str]]) -> None:
    """Add the edits of ``mode=fine-grained`` to ``edits`` (ApplyError: a bad module list, or a conflict to resolve)."""
    from mbridge_offload.actions.apply.result import ApplyError  # apply_plan imports this module

    model = cfg.model
    if modules is None:
        modules, why = _default_modules(model)
    else:
        why = "the requested offload points"
    # What megatron-core refuses about these modules beside the run's recompute and CUDA graphs, as the catalogue
    # says it (config.validate.fine_grained_errors); what apply writes itself (layer offload off, TE's op fuser for
    # fused_group_mlp) is not asked.
    asked: dict[str, Any] = {"offload_modules": list(modules), "use_transformer_engine_op_fuser": True}
    for key in ("recompute_granularity", "recompute_modules", "cuda_graph_impl", "cuda_graph_scope"):
        if getattr(model, key) is not None:
            asked[key] = getattr(model, key)
    if model.extras().get("cuda_graph_modules") is not None:
        asked["cuda_graph_modules"] = model.extras()["cuda_graph_modules"]
    errors = fine_grained_errors(asked)
    if errors:
        raise ApplyError(
            f"modules {modules}: "
            + "; ".join(f"{message} ({rule})" for rule, message in errors)
            + f" (megatron-core 0.19.2 accepts {', '.join(ALLOWED_OFFLOAD_MODULES)}; pick other modules, or change "
            "the recompute or CUDA-graph setting it names)"
        )
    edits["model.fine_grained_activation_offloading"] = (True, "master switch for fine-grained activation offloading")
    edits["model.offload_modules"] = (list(modules), why)
    if model.cpu_offloading:
        edits["model.cpu_offloading"] = (
            False,
            "'fine_grained_activation_offloading cannot be enabled with cpu_offloading.'",
        )
    if model.transformer_impl != "transformer_engine":
        edits["model.transformer_impl"] = (
            "transformer_engine",
            "Bridge: 'Fine-grained activation offloading is only supported with transformer_engine implementation.'",
        )
    if "fused_group_mlp" in modules and not model.use_transformer_engine_op_fuser:
        edits["model.use_transformer_engine_op_fuser"] = (
            True,
            "'fused_group_mlp requires use_transformer_engine_op_fuser.'",
        )
    if cfg.env.get("frontend") != "megatron-lm" and _te_at_least_2_10(cfg):  # before 2.10 only v1 exists
        edits[NVTE_KEY] = (
            1,
            "Bridge with TE >= 2.10: 'NVTE_CPU_OFFLOAD_V1 environment variable should be set to 1 to avoid "
            "offloading weights' (Bridge copies env_vars into the environment at start-up; Transformer Engine "
            "reads the variable when it is imported: see the note)",
        )
