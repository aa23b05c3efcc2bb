"""Model presets from public model configs, and the model section of a Bridge YAML as a ``ModelSpec``.

Numbers are the published ``config.json`` values (Hugging Face model cards) that Megatron Bridge's providers map
onto ``TransformerConfig``. DeepSeek-V3 is approximated: multi-latent attention is modelled by its projection
shapes (see ``MLASpec``), the multi-token-prediction module is left out (Bridge leaves it off by default), and the
first three dense layers are kept. Never imports torch.
"""

from __future__ import annotations

from typing import Any

from mbridge_offload.config.schema import OffloadConfig
from mbridge_offload.plan.memory import MLASpec, ModelSpec

MODEL_PRESETS: dict[str, ModelSpec] = {
    "llama3-8b": ModelSpec(
        name="llama3-8b",
        num_layers=32,
        hidden_size=4096,
        ffn_hidden_size=14336,
        num_attention_heads=32,
        num_query_groups=8,
        kv_channels=128,
        vocab_size=128256,
        seq_length=8192,
    ),
    "llama3-70b": ModelSpec(
        name="llama3-70b",
        num_layers=80,
        hidden_size=8192,
        ffn_hidden_size=28672,
        num_attention_heads=64,
        num_query_groups=8,
        kv_channels=128,
        vocab_size=128256,
        seq_length=8192,
    ),
    "qwen3-0.6b": ModelSpec(
        name="qwen3-0.6b",
        num_layers=28,
        hidden_size=1024,
        ffn_hidden_size=3072,
        num_attention_heads=16,
        num_query_groups=8,
        kv_channels=128,
        vocab_size=151936,
        seq_length=4096,
        tied_embeddings=True,
        qk_layernorm=True,
    ),
    "qwen3-8b": ModelSpec(
        name="qwen3-8b",
        num_layers=36,
        hidden_size=4096,
        ffn_hidden_size=12288,
        num_attention_heads=32,
        num_query_groups=8,
        kv_channels=128,
        vocab_size=151936,
        seq_length=4096,
        qk_layernorm=True,
    ),
    "qwen3-30b-a3b": ModelSpec(
        name="qwen3-30b-a3b",
        num_layers=48,
        hidden_size=2048,
        ffn_hidden_size=6144,
        num_attention_heads=32,
        num_query_groups=4,
        kv_channels=128,
        vocab_size=151936,
        seq_length=4096,
        qk_layernorm=True,
        num_moe_experts=128,
        moe_ffn_hidden_size=768,
        moe_router_topk=8,
        default_etp=1,
    ),
    "deepseek-v3": ModelSpec(
        name="deepseek-v3",
        num_layers=61,
        hidden_size=7168,
        ffn_hidden_size=18432,
        num_attention_heads=128,
        num_query_groups=128,
        kv_channels=128,
        vocab_size=129280,
        seq_length=4096,
        num_moe_experts=256,
        moe_ffn_hidden_size=2048,
        moe_router_topk=8,
        moe_shared_expert_intermediate_size=2048,
        first_k_dense=3,
        default_etp=1,
        mla=MLASpec(q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128),
    ),
    "gpt-oss-20b": ModelSpec(
        name="gpt-oss-20b",
        num_layers=24,
        hidden_size=2880,
        ffn_hidden_size=2880,
        num_attention_heads=64,
        num_query_groups=8,
        kv_channels=64,
        vocab_size=201088,
        seq_length=4096,
        add_bias_linear=True,
        num_moe_experts=32,
        moe_ffn_hidden_size=2880,
        moe_router_topk=4,
        default_etp=1,
    ),
}


def model_preset(name: str) -> ModelSpec:
    """Look up a model preset by its lowercase name.

    Raises:
        KeyError: with the known names, for an unknown preset.
    """
    key = name.strip().lower()
    if key not in MODEL_PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(sorted(MODEL_PRESETS))}")
    return MODEL_PRESETS[key]


def _first_k_dense(freq: Any, num_layers: int) -> int:
    """Leading dense layers from ``moe_layer_freq`` (int 1 = every layer MoE, or a 0/1 list)."""
    if isinstance(freq, list):
        dense = 0
        for flag in freq:
            if flag:
                break
            dense += 1
        return min(dense, num_layers)
    return 0


def model_from_config(config: OffloadConfig, name: str = "config") -> ModelSpec:
    """Read the architecture from the ``model`` section of a Bridge config.

    Raises:
        ValueError: naming the missing key when an architecture size is absent.
    """
    m = config.model
    required = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size")
    missing = [f"model.{key}" for key in required if getattr(m, key) is None]
    if missing:
        raise ValueError(f"{', '.join(missing)} not set: the memory model needs the architecture sizes")
    hidden = int(m.hidden_size)
    heads = int(m.num_attention_heads)
    mla = None
    if m.multi_latent_attention:
        extra = m.extras()
        mla = MLASpec(
            q_lora_rank=extra.get("q_lora_rank"),
            kv_lora_rank=int(extra.get("kv_lora_rank", 512)),
            qk_head_dim=int(extra.get("qk_head_dim", 128)),
            qk_pos_emb_head_dim=int(extra.get("qk_pos_emb_head_dim", 64)),
            v_head_dim=int(extra.get("v_head_dim", 128)),
        )
    extras = m.extras()
    return ModelSpec(
        name=name,
        num_layers=int(m.num_layers),
        hidden_size=hidden,
        ffn_hidden_size=int(m.ffn_hidden_size or 4 * hidden),
        num_attention_heads=heads,
        num_query_groups=int(m.num_query_groups or heads),
        kv_channels=int(m.kv_channels or hidden // heads),
        vocab_size=int(m.vocab_size),
        seq_length=int(config.seq_length or 4096),
        gated_linear_unit=bool(m.gated_linear_unit),
        # Bridge/MCore default: tied unless the provider says otherwise (GPTModelProvider default True).
        tied_embeddings=True
        if m.share_embeddings_and_output_weights is None
        else bool(m.share_embeddings_and_output_weights),
        add_bias_linear=bool(m.add_bias_linear),
        qk_layernorm=bool(extras.get("qk_layernorm", False)),
        dropout=float(extras.get("hidden_dropout", 0.0) or 0.0),
        num_moe_experts=m.num_moe_experts,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        moe_router_topk=int(m.moe_router_topk),
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        first_k_dense=_first_k_dense(m.moe_layer_freq, int(m.num_layers)) if m.num_moe_experts else 0,
        mla=mla,
    )
