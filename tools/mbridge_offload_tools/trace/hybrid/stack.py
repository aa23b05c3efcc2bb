"""megatron-core's hybrid model for the trace: its own stack and layer allocation from the pattern, local modules.

Bridge's hybrid providers (``MambaModelProvider`` / ``HybridModelProvider``, Nemotron-H and Nemotron 3) build
megatron-core's ``mamba_stack_spec`` (0.16.1, ``models/mamba/mamba_layer_specs.py``; 0.19.2's
``hybrid_stack_spec``, ``models/hybrid/hybrid_layer_specs.py``, of which ``mamba_stack_spec`` is an alias), which is
Transformer Engine only: per symbol of the pattern a ``MambaLayer`` (``M``: ``MambaMixer`` with
``TELayerNormColumnParallelLinear`` as ``in_proj`` and ``TERowParallelLinear`` as ``out_proj``), an attention
``TransformerLayer`` without MLP (``*``), an ``MLPLayer`` (``-``) and a ``MoETransformerLayer`` (``E``). Its local
equivalent, built here with the release's own classes, keeps the same tensors as elsewhere in the trace: each fused
norm+linear becomes the norm stand-in then megatron-core's ``ColumnParallelLinear``
(``standins.LayerNormColumnParallelLinearStandIn``; the GPT local spec's separate norm and linear), TE's row
linears megatron-core's ``RowParallelLinear``, core attention the fused-attention stand-in, the MoE layer the GPT
local MoE spec (its experts as the trace builds them, ``patches._grouped_experts``), and the mixer's kernels the
stand-ins of ``hybrid.mamba_kernels``. The model class, the pattern's allocation (``allocate_layers`` /
``select_pipeline_segment``: an even split over the pipeline without ``|`` marks) and the layers' forward are
megatron-core's. No position embedding (``position_embedding_type="none"``, as Bridge's Mamba providers default).
"""

from __future__ import annotations

from typing import Any


def _stack_spec(config: Any) -> Any:
    import standins
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    stack, submodules = _stack_classes()
    dense = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization=config.normalization)
    attention = dense.submodules.self_attention
    standins.use_te_attention(dense, config)
    fields: dict[str, Any] = {
        "mamba_layer": ModuleSpec(
            module=MambaLayer,
            submodules=MambaLayerSubmodules(
                mixer=ModuleSpec(
                    module=MambaMixer,
                    submodules=MambaMixerSubmodules(
                        in_proj=standins.LayerNormColumnParallelLinearStandIn, out_proj=RowParallelLinear
                    ),
                ),
                mamba_bda=get_bias_dropout_add,
            ),
        ),
        "attention_layer": ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=dense.submodules.input_layernorm,
                self_attention=attention,
                self_attn_bda=get_bias_dropout_add,
            ),
        ),
        "mlp_layer": ModuleSpec(
            module=MLPLayer,
            submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=dense.submodules.pre_mlp_layernorm,
                mlp=dense.submodules.mlp,
                mlp_bda=get_bias_dropout_add,
            ),
        ),
    }
    if config.num_moe_experts:
        moe = get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts,
            moe_grouped_gemm=config.moe_grouped_gemm,
            qk_layernorm=config.qk_layernorm,
            normalization=config.normalization,
        )
        fields["moe_layer"] = ModuleSpec(
            module=MoETransformerLayer,
            submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=moe.submodules.pre_mlp_layernorm, mlp=moe.submodules.mlp, mlp_bda=get_bias_dropout_add
            ),
        )
    return ModuleSpec(module=stack, submodules=submodules(**fields))


def _stack_classes() -> tuple[Any, Any]:
    try:  # 0.19.2: HybridStack (megatron.core.models.hybrid)
        from megatron.core.models.hybrid import hybrid_block as block

        stack, submodules = block.HybridStack, block.HybridStackSubmodules
    except ImportError:  # 0.16.1
        from megatron.core.ssm import mamba_block as block

        stack, submodules = block.MambaStack, block.MambaStackSubmodules
    # the stack's final norm is TE's by name in both releases (no spec entry): the norm stand-in, as elsewhere
    block.TENorm = _final_norm
    return stack, submodules


def _final_norm(config: Any, hidden_size: int, **kwargs: Any) -> Any:
    import standins

    return standins.NormStandIn(config, hidden_size)


def chunks(spec: dict[str, Any], config: Any) -> list[Any]:
    """The traced stage's model (one chunk: megatron-core's hybrid stack has no interleaved pipeline without ``|``
    marks), megatron-core's ``HybridModel`` (0.19.2) or ``MambaModel`` (0.16.1) over the pattern."""
    from hybrid import mamba_kernels
    from megatron.core import parallel_state

    mamba_kernels.apply()
    pattern = spec["hybrid"]["pattern"]
    kwargs: dict[str, Any] = {
        "config": config,
        "vocab_size": spec["vocab_size"],
        "max_sequence_length": spec["seq_length"],
        "pre_process": parallel_state.is_pipeline_first_stage(),
        "post_process": parallel_state.is_pipeline_last_stage(),
        "share_embeddings_and_output_weights": spec["tied"],
        "position_embedding_type": "none",
    }
    try:
        from megatron.core.models.hybrid.hybrid_model import HybridModel

        model = HybridModel(hybrid_stack_spec=_stack_spec(config), hybrid_layer_pattern=pattern, **kwargs)
    except ImportError:
        from megatron.core.models.mamba import MambaModel

        model = MambaModel(mamba_stack_spec=_stack_spec(config), hybrid_override_pattern=pattern, **kwargs)
    return [model]
