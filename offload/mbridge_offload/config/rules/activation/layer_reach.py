"""Settings megatron-core accepts and then ignores in some model classes: the hybrid Mamba stack and the MTP block.

Each rule reads its verdict and its reason from the table of what each setting reaches per model class
(:mod:`mbridge_offload.upstream_layers`, tested against megatron-core's source), for the config's release: the
message names the upstream class and file, so a 0.16.1 config hears about ``MambaStack`` and a 0.19.2 one about
``HybridStack``. A hybrid model is one with a layer pattern (``hybrid_layer_pattern``, or the older
``hybrid_override_pattern``), Megatron-LM's ``--is-hybrid-model``, or a Bridge Mamba / hybrid / Nemotron-H provider.
"""

from __future__ import annotations

from typing import Any

from mbridge_offload.config.overrides import format_override
from mbridge_offload.config.rules.activation.recompute import granularity, recompute_modules
from mbridge_offload.config.rules.base import Context, Match, Rule, advisory
from mbridge_offload.config.rules.mcore import given, mcore_rule
from mbridge_offload.upstream_layers import SETTINGS, because, cell, release_of

SETTING_KEYS = frozenset(s.key for s in SETTINGS)

STAGE_MODEL_FORWARD = "MultiTokenPredictionLayer.forward (first training step)"
_HYBRID_PROVIDERS = (".mamba.", ".hybrid.", "nemotronh", "nemotron_h")


def _stated(ctx: Context, key: str) -> Any:
    """``model.<key>``, else the Megatron-LM flag of that name (kept under ``megatron_lm`` when no rule reads it)."""
    value = given(ctx, key, None)
    mlm = ctx.raw.get("megatron_lm") if isinstance(ctx.raw, dict) else None
    return value if value is not None or not isinstance(mlm, dict) else mlm.get(key)


def hybrid_stack(ctx: Context) -> bool:
    """Whether megatron-core builds this model's decoder as a hybrid stack (MambaStack / HybridStack)."""
    pattern = _stated(ctx, "hybrid_layer_pattern") or _stated(ctx, "hybrid_override_pattern")
    if isinstance(pattern, str) and pattern.strip():
        return True
    if _stated(ctx, "is_hybrid_model") is True:
        return True
    body = ctx.raw.get("model") if isinstance(ctx.raw, dict) else None
    target = str(body.get("_target_", "")).lower() if isinstance(body, dict) else ""
    return any(p in target for p in _HYBRID_PROVIDERS)


def _release(ctx: Context) -> str:
    return release_of(ctx.target.version)


def _layer_offload(ctx: Context):
    if not (ctx.model.cpu_offloading and hybrid_stack(ctx)):
        return None
    release = _release(ctx)
    alternative = (
        "fine-grained offloading (model.fine_grained_activation_offloading with model.offload_modules) reaches the "
        "stack's attention, MLP and MoE layers, never the Mamba mixers"
        if release != "0.16.1"
        else "on 0.16.1 fine-grained offloading does not reach a hybrid stack either (MambaModel opens no chunk)"
    )
    return Match({"because": because("cpu_offloading", "hybrid", release), "alternative": alternative})


def _fine_grained(ctx: Context):
    m = ctx.model
    if not (m.fine_grained_activation_offloading and m.offload_modules and hybrid_stack(ctx)):
        return None
    return Match({"because": because("offload_modules:core_attn", "hybrid", _release(ctx))})


def _full_recompute(ctx: Context):
    method = ctx.model.recompute_method or "uniform"
    if granularity(ctx) != "full" or method not in ("uniform", "block") or not hybrid_stack(ctx):
        return None
    return Match({"because": because(f"recompute:full-{method}", "hybrid", _release(ctx))})


def _mtp_depths(ctx: Context) -> int:
    depths = _stated(ctx, "mtp_num_layers")
    if isinstance(depths, int) and not isinstance(depths, bool) and depths > 0:
        return depths
    pattern: Any = _stated(ctx, "hybrid_layer_pattern")  # 0.19: '<decoder>/<depth>/<depth>…'
    return pattern.count("/") if isinstance(pattern, str) else 0


def _mtp_uniform_layers(ctx: Context):
    m = ctx.model
    if not _mtp_depths(ctx) or granularity(ctx) != "full" or m.recompute_method != "uniform":
        return None
    if m.recompute_num_layers in (None, 1):
        return None
    return Match({"n": m.recompute_num_layers})


def _mtp_block(ctx: Context) -> bool:
    return bool(_mtp_depths(ctx)) and granularity(ctx) == "full" and ctx.model.recompute_method == "block"


def _layer_kinds(ctx: Context) -> tuple[bool, bool]:
    """``(dense layers, MoE layers)`` of a GPT decoder: ``moe_layer_freq`` N makes every N-th layer MoE (from the
    first), a list marks each layer (1 = MoE); without experts every layer is dense."""
    experts = given(ctx, "num_moe_experts", None)
    if not experts:
        return True, False
    freq = given(ctx, "moe_layer_freq", 1)
    if isinstance(freq, list):
        return 0 in freq, 1 in freq
    if isinstance(freq, int) and not isinstance(freq, bool) and freq >= 1:
        return freq > 1, True
    return True, True  # a form megatron-core parses later (a pattern string): both kinds, no claim


def _columns(ctx: Context, module: str) -> list[str]:
    """The table's columns (upstream_layers.LAYERS) where ``module`` would act in this model, attention side first."""
    dense, moe = _layer_kinds(ctx)
    attention = "mla" if ctx.model.multi_latent_attention else "dense"
    mlp_side = [c for c, present in (("dense", dense), ("moe", moe)) if present]
    if module in ("core_attn", "mla_up_proj"):
        return [attention]
    if module == "layernorm":
        return [attention, *mlp_side]
    return mlp_side


def _recompute_no_effect(ctx: Context):
    if granularity(ctx) != "selective" or hybrid_stack(ctx):
        return None  # a hybrid stack's layers come from its pattern: the hybrid column of the table says
    release = _release(ctx)
    for module in dict.fromkeys(recompute_modules(ctx)):
        setting = f"recompute_modules:{module}"
        refused = module == "mla_up_proj" or (module == "moe_act" and not ctx.model.moe_grouped_gemm)
        if refused or setting not in SETTING_KEYS:
            continue  # refused outright where they cannot act (by megatron-core / MC-RECOMPUTE-MOE-ACT), or unknown
        if module == "layernorm" and ctx.model.transformer_impl != "transformer_engine":
            continue  # the local spec keeps its norms as modules: they are recomputed
        columns = _columns(ctx, module)
        if any(cell(setting, c, release).verdict == "applies" for c in columns):
            if module != "shared_experts" or given(ctx, "moe_shared_expert_intermediate_size", None):
                continue
            yield Match(
                {
                    "module": module,
                    "because": "the MoE layers build no shared experts (moe_shared_expert_intermediate_size is unset)",
                },
                fix=_without(ctx, module),
            )
            continue
        yield Match({"module": module, "because": because(setting, columns[0], release)}, fix=_without(ctx, module))


def _without(ctx: Context, module: str) -> list[str]:
    kept = [m for m in recompute_modules(ctx) if m != module]
    return [format_override("model.recompute_modules", kept) if kept else "model.recompute_granularity=null"]


_OFFLOAD, _FG, _MODULES = "model.cpu_offloading", "model.fine_grained_activation_offloading", "model.offload_modules"
_GRANULARITY, _METHOD, _N = "model.recompute_granularity", "model.recompute_method", "model.recompute_num_layers"
_PATTERN = "model.hybrid_layer_pattern"
_TABLE = " The table of what each setting reaches per model class: references/upstream-layers.md."

RULES: tuple[Rule, ...] = (
    advisory(
        id="ACT-RECOMPUTE-MODULE-NO-EFFECT",
        severity="warning",
        summary="A selective `recompute_modules` entry that no layer of this model reads (e.g. `mlp` on an all-MoE "
        "model, `moe` on a dense one).",
        keys=("model.recompute_modules", "model.num_moe_experts", "model.moe_layer_freq"),
        message="model.recompute_modules includes {module}, which recomputes nothing in this model: {because}.",
        why="megatron-core accepts every name of its set on every model and each layer reads only its own modules "
        "(TransformerLayer: core_attn, layernorm, mlp; MoELayer: moe, moe_act, shared_experts; MLA: mla_up_proj), "
        "so the memory it was meant to save is not saved. The same in 0.16.1 and 0.19.2; layernorm acts only "
        "where the layer spec keeps the norm as a module (not the TE spec's fused dense norms)." + _TABLE,
        fix=None,
        check=_recompute_no_effect,
    ),
    advisory(
        id="ACT-HYBRID-LAYER-OFFLOAD",
        severity="warning",
        summary="Layer-level activation offloading does nothing on a hybrid (Mamba) stack.",
        keys=(_OFFLOAD, _PATTERN),
        message="model.cpu_offloading=true has no effect on a hybrid stack: {because}. Remove it; {alternative}.",
        why="megatron-core opens the layer-level CPU-offload context only in TransformerBlock; MambaStack (0.16) and "
        "HybridStack (0.19) never build or enter it, and accept the setting in silence: the run fits no better "
        "than without it." + _TABLE,
        fix=("model.cpu_offloading=false",),
        check=_layer_offload,
    ),
    advisory(
        id="ACT-HYBRID-FINE-GRAINED",
        severity="warning",
        applies_to="<0.19",
        summary="Fine-grained activation offloading does nothing in a 0.16 hybrid (Mamba) model.",
        keys=(_FG, _MODULES, _PATTERN),
        message="model.fine_grained_activation_offloading=true has no effect on a hybrid model: {because}.",
        why="Every offload group needs the chunk GPTModel opens per micro-batch; 0.16.1's MambaModel never opens "
        "one, so each group is a no-op. 0.19's HybridModel does (then the attention, MLP and MoE layers offload, "
        "the Mamba mixers never)." + _TABLE,
        fix=(f"{_FG}=false",),
        check=_fine_grained,
    ),
    advisory(
        id="ACT-HYBRID-FULL-RECOMPUTE",
        severity="warning",
        applies_to="<0.19",
        summary="Full activation recompute does nothing in a 0.16 hybrid (Mamba) stack.",
        keys=(_GRANULARITY, _METHOD, _PATTERN),
        message="model.recompute_granularity=full has no effect on a hybrid stack: {because}.",
        why="0.16.1's MambaStack runs its layers without a checkpointed forward, so every activation stays; the "
        "TransformerLayers' selective recompute_modules still apply. 0.19's HybridStack checkpoints its layers "
        "(Mamba layers included)." + _TABLE,
        fix=None,
        check=_full_recompute,
    ),
    mcore_rule(
        id="MC-MTP-RECOMPUTE-LAYERS",
        stage=STAGE_MODEL_FORWARD,
        exception="AssertionError",
        summary="Full uniform recompute with MTP needs `recompute_num_layers: 1`.",
        keys=(_GRANULARITY, _METHOD, _N, "model.mtp_num_layers"),
        message="recompute_num_layers must be 1 for MTP recompute",
        why="MultiTokenPredictionLayer._checkpointed_forward asserts it at the first training step (both releases); "
        "the decoder accepts any count, so the config checks pass and the run dies after start-up." + _TABLE,
        fix=(f"{_N}=1",),
        check=_mtp_uniform_layers,
    ),
    Rule(
        id="ACT-MTP-RECOMPUTE-BLOCK",
        severity="warning",
        origin="mcore",
        stage=STAGE_MODEL_FORWARD,
        summary="Full block recompute skips the MTP depths (megatron-core warns and keeps their activations).",
        keys=(_GRANULARITY, _METHOD, "model.mtp_num_layers"),
        message="recompute_method == 'block' is not supported for MTP yet. Skipping recompute.",
        why="MultiTokenPredictionLayer._checkpointed_forward warns and runs the depth without a checkpoint (both "
        "releases): the MTP depths keep all their activations; recompute_method=uniform with "
        "recompute_num_layers=1 recomputes them too." + _TABLE,
        fix=None,
        check=_mtp_block,
    ),
)
