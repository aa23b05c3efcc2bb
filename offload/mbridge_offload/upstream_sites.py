"""Where megatron-core decides what each offload and recompute setting reaches: one line per release.

The evidence behind :mod:`mbridge_offload.upstream_layers`: a file, a symbol, the text on a line and, where a "no
effect" rests on what a class never does, the texts its source never contains. ``tests/test_upstream_layers.py``
re-reads every site in both installed releases, so an upstream change fails the table instead of leaving it stale.
No imports from the project.
"""

from __future__ import annotations

from dataclasses import dataclass

RELEASES: tuple[str, ...] = ("0.16.1", "0.19.2")


@dataclass(frozen=True)
class Site:
    """One line of megatron-core in one release; ``absent``: texts the symbol's source never contains."""

    release: str
    path: str
    symbol: str
    line: int
    needle: str
    absent: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass(frozen=True)
class Evidence:
    """What decides: one or more sites per release (the first of a release is the one cited)."""

    key: str
    what: str
    sites: tuple[Site, ...]

    def at(self, release: str) -> Site:
        """The cited site of ``release`` (KeyError: none in that release)."""
        for site in self.sites:
            if site.release == release:
                return site
        raise KeyError(f"{self.key} has no site in megatron-core {release}")

    def releases(self) -> set[str]:
        return {s.release for s in self.sites}


_C = "megatron/core/"
BLOCK = _C + "transformer/transformer_block.py"
LAYER = _C + "transformer/transformer_layer.py"
ATTN = _C + "transformer/attention.py"
MLA = _C + "transformer/multi_latent_attention.py"
MTP = _C + "transformer/multi_token_prediction.py"
EXPERTS = _C + "transformer/moe/experts.py"
MOE_LAYER = _C + "transformer/moe/moe_layer.py"
CONFIG = _C + "transformer/transformer_config.py"
GPT_MODEL = _C + "models/gpt/gpt_model.py"
GPT_SPECS = _C + "models/gpt/gpt_layer_specs.py"
MAMBA_STACK = _C + "ssm/mamba_block.py"  # 0.16.1
HYBRID_STACK = _C + "models/hybrid/hybrid_block.py"  # 0.19.2
MAMBA_MODEL = _C + "models/mamba/mamba_model.py"  # 0.16.1
HYBRID_MODEL = _C + "models/hybrid/hybrid_model.py"  # 0.19.2
MAMBA_SPECS = _C + "models/mamba/mamba_layer_specs.py"  # 0.16.1
HYBRID_SPECS = _C + "models/hybrid/hybrid_layer_specs.py"  # 0.19.2
RECOMPUTE = _C + "recompute.py"  # 0.19.2
OPTIMIZER = _C + "optimizer/__init__.py"

# The hybrid stack's class and file per release (the name the rules and the planner print).
STACK_CLASS = {"0.16.1": ("MambaStack", MAMBA_STACK), "0.19.2": ("HybridStack", HYBRID_STACK)}


def _both(key: str, what: str, path: str, symbol: str, lines: tuple[int, int], needle: str) -> Evidence:
    """The same text in the same symbol of both releases, at ``lines`` (0.16.1, 0.19.2)."""
    return Evidence(key, what, tuple(Site(r, path, symbol, n, needle) for r, n in zip(RELEASES, lines, strict=True)))


def _each(key: str, what: str, *sites: Site) -> Evidence:
    return Evidence(key, what, sites)


def join(key: str, what: str, *parts: Evidence) -> Evidence:
    """Several pieces of evidence as one (the first site of each release is the cited one)."""
    return Evidence(key, what or parts[0].what, tuple(s for part in parts for s in part.sites))


_NO_CONTEXT = ("offload_context", "cpu_offloading")
_NO_FULL = ("recompute_granularity", "checkpoint(")
_NO_MODULES = ("off_interface", "offload_modules", "recompute_modules", "checkpoint_core_attention")

# ------------------------------------------------------------------------------------ layer-level offload
BLOCK_CONTEXT = _both(
    "block-context",
    "TransformerBlock builds the layer-level CPU-offload context from model.cpu_offloading",
    BLOCK, "TransformerBlock.__init__", (305, 300), "get_cpu_offload_context(",
)  # fmt: skip
BLOCK_ENTER = _both(
    "block-enter",
    "TransformerBlock runs each of its layers inside that context",
    BLOCK, "TransformerBlock.forward", (764, 663), "with self.offload_context, inner_quantization_context:",
)  # fmt: skip
BLOCK_WEIGHTS = _both(
    "block-weights",
    "TransformerBlock hands cpu_offloading_weights to Transformer Engine's context",
    BLOCK, "TransformerBlock.__init__", (310, 305), "self.config.cpu_offloading_weights,",
)  # fmt: skip
STACK_NO_CONTEXT = _each(
    "stack-no-context",
    "the hybrid stack never builds or enters a CPU-offload context",
    Site("0.16.1", MAMBA_STACK, "MambaStack", 47, "class MambaStack(MegatronModule):", _NO_CONTEXT),
    Site("0.19.2", HYBRID_STACK, "HybridStack", 55, "class HybridStack(MegatronModule):", _NO_CONTEXT),
)
MTP_NULL_CONTEXT = _both(
    "mtp-null-context",
    "an MTP layer's offload context is a nullcontext it never enters; MTP depths run after the decoder block",
    MTP, "MultiTokenPredictionLayer", (679, 1054), "self.offload_context = nullcontext()",
)  # fmt: skip

# ------------------------------------------------------------------------------------ optimizer offload
OPTIMIZER_HDO = _both(
    "optimizer-hdo",
    "HybridDeviceOptimizer is built over every parameter group, whatever layer the parameters belong to",
    OPTIMIZER, "_get_megatron_optimizer_based_on_param_groups", (336, 532), "HybridDeviceOptimizer(",
)  # fmt: skip

# ------------------------------------------------------------------------------------ full recompute
BLOCK_FULL = _both(
    "block-full",
    "TransformerBlock checkpoints its layers when recompute_granularity is full",
    BLOCK, "TransformerBlock.forward", (735, 624), "if self.config.recompute_granularity == 'full' and self.training:",
)  # fmt: skip
STACK_FULL = _each(
    "stack-full",
    "0.16.1's MambaStack never checkpoints; 0.19.2's HybridStack runs the shared checkpointed_forward",
    Site("0.16.1", MAMBA_STACK, "MambaStack", 47, "class MambaStack(MegatronModule):", _NO_FULL),
    Site(
        "0.19.2", HYBRID_STACK, "HybridStack.forward", 348,
        "if self.config.recompute_granularity == 'full' and self.training:",
    ),
)  # fmt: skip
MAMBA_FULL = _each(
    "mamba-full",
    "0.19.2's checkpointed_forward runs Mamba layers inside the checkpoint too (0.16.1's stack never checkpoints)",
    Site("0.16.1", MAMBA_STACK, "MambaStack", 47, "class MambaStack(MegatronModule):", _NO_FULL),
    Site("0.19.2", RECOMPUTE, "checkpointed_forward", 112, "else:  # MambaLayer (HybridStack `M` slot)"),
)
MTP_FULL_UNIFORM = _both(
    "mtp-full-uniform",
    "an MTP layer checkpoints itself under the uniform method, and asserts recompute_num_layers == 1",
    MTP, "MultiTokenPredictionLayer._checkpointed_forward", (848, 1421),
    '), "recompute_num_layers must be 1 for MTP recompute"',
)  # fmt: skip
MTP_FULL_BLOCK = _both(
    "mtp-full-block",
    "an MTP layer warns and skips recompute under the block method",
    MTP, "MultiTokenPredictionLayer._checkpointed_forward", (853, 1427), "is not supported for MTP yet.",
)  # fmt: skip
MTP_LAYER_BUILD = _each(
    "mtp-layer-build",
    "an MTP depth builds its layer from the decoder's layer spec, so module-level settings reach it as they reach "
    "the decoder's layers",
    Site("0.16.1", MTP, "MultiTokenPredictionLayer.__init__", 666, "self.transformer_layer = build_module("),
    Site("0.19.2", MTP, "MultiTokenPredictionLayer.__init__", 1039, "self.mtp_model_layer = build_module("),
)

# ------------------------------------------------------------------------------------ fine-grained offload
GPT_CHUNK = _both(
    "gpt-chunk",
    "GPTModel opens a fine-grained offload chunk for each micro-batch",
    GPT_MODEL, "GPTModel.preprocess_for_fine_grained_offloading", (454, 493), "off_interface.init_chunk_handler(",
)  # fmt: skip
HYBRID_CHUNK = _each(
    "hybrid-chunk",
    "0.16.1's MambaModel never opens a fine-grained chunk (every offload group is then a no-op); 0.19.2's "
    "HybridModel does",
    Site(
        "0.16.1", MAMBA_MODEL, "MambaModel", 27, "class MambaModel(LanguageModule):",
        ("init_chunk_handler", "fine_grained_activation_offloading"),
    ),
    Site(
        "0.19.2", HYBRID_MODEL, "HybridModel.preprocess_for_fine_grained_offloading", 353,
        "off_interface.init_chunk_handler(",
    ),
)  # fmt: skip
MAMBA_NONE = _each(
    "mamba-none",
    "the Mamba layer and mixer open no offload group and set no selective-recompute flag",
    Site("0.16.1", _C + "ssm/mamba_mixer.py", "MambaMixer", 113, "class MambaMixer(MegatronModule):", _NO_MODULES),
    Site("0.16.1", _C + "ssm/mamba_layer.py", "MambaLayer", 51, "class MambaLayer(", _NO_MODULES),
    Site("0.19.2", _C + "ssm/mamba_mixer.py", "MambaMixer", 141, "class MambaMixer(MegatronModule):", _NO_MODULES),
    Site("0.19.2", _C + "ssm/mamba_layer.py", "MambaLayer", 54, "class MambaLayer(", _NO_MODULES),
)
SPEC_DENSE_FUSED = _each(
    "spec-dense-fused",
    "the TE layer spec fuses the input norm into linear_qkv (input_layernorm stays IdentityOp) and, without "
    "experts, the pre-MLP norm into linear_fc1",
    Site(
        "0.16.1", GPT_SPECS, "get_gpt_layer_with_transformer_engine_spec", 279,
        "linear_qkv=backend.column_parallel_layer_norm_linear(),",
    ),
    Site(
        "0.19.2", GPT_SPECS, "get_gpt_layer_with_transformer_engine_submodules", 324,
        "linear_qkv=backend.column_parallel_layer_norm_linear(),",
    ),
)  # fmt: skip
SPEC_MLA_NORM = _each(
    "spec-mla-norm",
    "the TE layer spec gives MLA a separate input norm (0.19.2's mla_down_proj_fusion fuses it)",
    Site(
        "0.16.1", GPT_SPECS, "get_gpt_layer_with_transformer_engine_spec", 248, "input_layernorm=backend.layer_norm(),"
    ),
    Site(
        "0.19.2", GPT_SPECS, "get_gpt_layer_with_transformer_engine_submodules", 296,
        "input_layernorm=backend.layer_norm(has_residual=True),",
    ),
)  # fmt: skip
SPEC_MOE_NORM = _each(
    "spec-moe-norm",
    "a MoE layer keeps a separate pre-MLP norm: it feeds the router",
    Site(
        "0.16.1", GPT_SPECS, "get_gpt_layer_with_transformer_engine_spec", 291,
        "pre_mlp_layernorm=backend.layer_norm() if num_experts else IdentityOp,",
    ),
    Site(
        "0.19.2", GPT_SPECS, "get_gpt_layer_with_transformer_engine_submodules", 336,
        "pre_mlp_layernorm=backend.layer_norm(has_residual=True) if num_experts else IdentityOp,",
    ),
)  # fmt: skip
_HYBRID_MOE_NORM = "pre_mlp_layernorm=TENorm, mlp=moe, mlp_bda=get_bias_dropout_add"
SPEC_HYBRID = _each(
    "spec-hybrid",
    "the hybrid stack spec: attention (*) and MLP (-) layers fuse their norms, MoE (E) layers keep a TENorm",
    Site("0.16.1", MAMBA_SPECS, "mamba_stack_spec", 61, "linear_qkv=TELayerNormColumnParallelLinear,"),
    Site("0.16.1", MAMBA_SPECS, "mamba_stack_spec", 87, _HYBRID_MOE_NORM),
    Site("0.19.2", HYBRID_SPECS, "hybrid_stack_spec", 129, "linear_qkv=TELayerNormColumnParallelLinear,"),
    Site("0.19.2", HYBRID_SPECS, "hybrid_stack_spec", 212, _HYBRID_MOE_NORM),
)  # fmt: skip
FG_ATTN_NORM = _each(
    "fg-attn-norm",
    "attn_norm is offloaded only where input_layernorm is a module of its own (not IdentityOp)",
    Site("0.16.1", LAYER, "TransformerLayer.__init__", 450, 'and "attn_norm" in self.config.offload_modules'),
    Site(
        "0.19.2", LAYER, "TransformerLayer._set_offload_modules", 1442,
        'self.offload_attn_norm = "attn_norm" in self.config.offload_modules and not isinstance(',
    ),
)  # fmt: skip
FG_MLP_NORM = _each(
    "fg-mlp-norm",
    "mlp_norm is offloaded only where pre_mlp_layernorm is a module of its own (not IdentityOp)",
    Site("0.16.1", LAYER, "TransformerLayer.__init__", 455, 'and "mlp_norm" in self.config.offload_modules'),
    Site(
        "0.19.2", LAYER, "TransformerLayer._set_offload_modules", 1448,
        'self.offload_mlp_norm = "mlp_norm" in self.config.offload_modules and not isinstance(',
    ),
)  # fmt: skip
FG_QKV = _both(
    "fg-qkv", "Attention reads qkv_linear", ATTN, "Attention.__init__", (335, 399),
    'and "qkv_linear" in self.config.offload_modules',
)  # fmt: skip
FG_CORE = _both(
    "fg-core", "Attention reads core_attn", ATTN, "Attention.__init__", (340, 404),
    'and "core_attn" in self.config.offload_modules',
)  # fmt: skip
FG_PROJ = _both(
    "fg-proj", "Attention reads attn_proj", ATTN, "Attention.__init__", (345, 409),
    'and "attn_proj" in self.config.offload_modules',
)  # fmt: skip
MLA_FG_QKV = _both(
    "mla-fg-qkv", "MultiLatentAttention offloads around its down/up projections", MLA,
    "MultiLatentAttention.forward", (246, 343), 'off_interface(self.offload_qkv_linear, hidden_states, "qkv_linear")',
)  # fmt: skip
MLA_FG_CORE = _each(
    "mla-fg-core",
    "MultiLatentAttention offloads around its core attention",
    Site("0.16.1", MLA, "MultiLatentAttention.forward", 291, "with off_interface("),
    Site("0.19.2", MLA, "MultiLatentAttention.forward", 380, "core_attn_manager = off_interface("),
)
MLA_FG_PROJ = _both(
    "mla-fg-proj", "MultiLatentAttention offloads around linear_proj", MLA, "MultiLatentAttention.forward",
    (352, 462), 'off_interface(self.offload_attn_proj, core_attn_out, "attn_proj")',
)  # fmt: skip
FG_EXPERT_FC1 = _both(
    "fg-expert-fc1",
    "only TEGroupedMLP (moe_grouped_gemm with TE) reads expert_fc1; SequentialMLP never does",
    EXPERTS, "TEGroupedMLP.__init__", (580, 255), 'and "expert_fc1" in self.config.offload_modules',
)  # fmt: skip
FG_MOE_ACT = _both(
    "fg-moe-act",
    "only TEGroupedMLP (moe_grouped_gemm with TE) reads moe_act; SequentialMLP never does",
    EXPERTS, "TEGroupedMLP.__init__", (585, 260), 'and "moe_act" in self.config.offload_modules',
)  # fmt: skip
FG_FUSED = _each(
    "fg-fused",
    "0.16.1 refuses fused_group_mlp (not an allowed offload module); in 0.19.2 only TEGroupedMLP reads it",
    Site("0.16.1", CONFIG, "TransformerConfig.__post_init__", 1284, "Invalid choices for offload_modules"),
    Site("0.19.2", EXPERTS, "TEGroupedMLP.__init__", 265, 'and "fused_group_mlp" in self.config.offload_modules'),
)

# ------------------------------------------------------------------------------------ selective recompute
REC_CORE = _both(
    "rec-core", "Attention sets checkpoint_core_attention from recompute_modules", ATTN, "Attention.__init__",
    (330, 394), 'and "core_attn" in self.config.recompute_modules',
)  # fmt: skip
MLA_REC_CORE = _both(
    "mla-rec-core", "MultiLatentAttention checkpoints its core attention", MLA, "MultiLatentAttention.forward",
    (279, 384), "if self.checkpoint_core_attention and self.training:",
)  # fmt: skip
REC_INPUT_NORM = _both(
    "rec-input-norm", "layernorm recompute needs an input_layernorm of its own (not IdentityOp)", LAYER,
    "TransformerLayer.__init__", (384, 453), "if not isinstance(self.input_layernorm, IdentityOp):",
)  # fmt: skip
REC_PRE_MLP_NORM = _both(
    "rec-pre-mlp-norm", "layernorm recompute of the pre-MLP norm needs one of its own (not IdentityOp)", LAYER,
    "TransformerLayer.__init__", (432, 501), "not isinstance(self.pre_mlp_layernorm, IdentityOp)",
)  # fmt: skip
REC_MLP = _both(
    "rec-mlp", "mlp recompute is set only on layers that are not MoE layers", LAYER, "TransformerLayer.__init__",
    (446, 515), "if not self.is_moe_layer:",
)  # fmt: skip
REC_MOE = _both(
    "rec-moe", "MoELayer checkpoints its whole forward for 'moe'", MOE_LAYER, "MoELayer.__init__", (155, 248),
    'and "moe" in config.recompute_modules',
)  # fmt: skip
REC_SHARED = _both(
    "rec-shared", "MoELayer checkpoints its shared experts for 'shared_experts'", MOE_LAYER, "MoELayer.__init__",
    (160, 253), 'and "shared_experts" in config.recompute_modules',
)  # fmt: skip
REC_MOE_ACT = _both(
    "rec-moe-act", "TEGroupedMLP recomputes its activation for 'moe_act'", EXPERTS, "TEGroupedMLP.__init__",
    (590, 270), 'and "moe_act" in self.config.recompute_modules',
)  # fmt: skip
REC_MOE_ACT_REFUSED = _both(
    "rec-moe-act-refused", "moe_act recompute is refused without moe_grouped_gemm", CONFIG,
    "TransformerConfig.__post_init__", (1215, 1786),
    "moe_act in recompute_modules is only supported with moe_grouped_gemm.",
)  # fmt: skip
REC_MLA_UP = _both(
    "rec-mla-up", "MultiLatentAttention recomputes its up-projections for 'mla_up_proj'", MLA,
    "MultiLatentAttention.__init__", (121, 173), 'and "mla_up_proj" in self.config.recompute_modules',
)  # fmt: skip
REC_MLA_UP_REFUSED = _both(
    "rec-mla-up-refused", "mla_up_proj recompute is refused without multi_latent_attention", CONFIG,
    "TransformerConfig.__post_init__", (1220, 1791), "mla_up_proj in recompute_modules is only supported with ",
)  # fmt: skip
