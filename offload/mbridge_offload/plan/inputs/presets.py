"""Model presets from public model configs, and the model section of a Bridge YAML as a ``ModelSpec``.

Numbers are the published ``config.json`` values (Hugging Face model cards) that Megatron Bridge's providers map
onto ``TransformerConfig``. DeepSeek-V3 is approximated: multi-latent attention is modelled by its projection
shapes (see ``MLASpec``), the multi-token-prediction module is left out (Bridge leaves it off by default), and the
first three dense layers are kept. Never imports torch.
"""

from __future__ import annotations

from typing import Any

from mbridge_offload.config.schema import OffloadConfig
from mbridge_offload.plan.model.architecture import MLASpec, ModelSpec

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
    "llama3.1-405b": ModelSpec(
        name="llama3.1-405b",
        num_layers=126,
        hidden_size=16384,
        ffn_hidden_size=53248,
        num_attention_heads=128,
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


# The settings of the public recipe (or published run) behind each preset, as PlanInputs values. A preset without
# an entry contributes only its architecture and sequence length; everything else takes the documented defaults.
RECIPES: dict[str, dict[str, Any]] = {
    # Megatron Bridge qwen3_30b_a3b_pretrain_config as run for the upstream CPU-offloading card (skills
    # nemo-mbridge-perf-cpu-offloading card.yaml, 2 x 8 H100 80 GB): TP2 PP2 EP4 ETP1, full recompute (uniform,
    # 1 layer), seq 4096, bf16 with fp32 gradient reduction, distributed optimizer; the skill's minimal command
    # (train.global_batch_size=8, micro_batch_size=1); the fraction sweep without D2H/H2D overlap.
    "qwen3-30b-a3b": {
        "num_gpus": 16,
        "tp": 2,
        "pp": 2,
        "ep": 4,
        "etp": 1,
        "sequence_parallel": True,
        "seq_length": 4096,
        "micro_batch_size": 1,
        "global_batch_size": 8,
        "params_dtype": "bf16",
        "grad_reduce_in_fp32": True,
        "distributed_optimizer": True,
        "precision_aware_optimizer": False,
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
        "overlap": False,
    },
    # Bridge's DeepSeek-V3 and GPT-OSS recipes set expert_tensor_parallel_size=1 (megatron-core's default is TP).
    "deepseek-v3": {"etp": 1},
    "gpt-oss-20b": {"etp": 1},
}


def recipe_values(name: str) -> dict[str, Any]:
    """The preset's architecture sizes, sequence length and recipe settings, as ``PlanInputs`` values.

    Raises:
        KeyError: unknown preset (with the known names).
    """
    from mbridge_offload.plan.inputs.fields import ARCHITECTURE

    m = model_preset(name)
    sizes = [k for k in (*ARCHITECTURE, "seq_length") if m.is_moe or not k.startswith(("num_moe", "moe_"))]
    out: dict[str, Any] = {k: getattr(m, k) for k in sizes}
    out["share_embeddings_and_output_weights"] = m.tied_embeddings
    out.update(RECIPES.get(m.name, {}))
    return out


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


def _mla(config: OffloadConfig) -> MLASpec | None:
    if not config.model.multi_latent_attention:
        return None
    extra = config.model.extras()
    return MLASpec(
        q_lora_rank=extra.get("q_lora_rank"),
        kv_lora_rank=int(extra.get("kv_lora_rank", 512)),
        qk_head_dim=int(extra.get("qk_head_dim", 128)),
        qk_pos_emb_head_dim=int(extra.get("qk_pos_emb_head_dim", 64)),
        v_head_dim=int(extra.get("v_head_dim", 128)),
    )


def model_extras(config: OffloadConfig, raw: dict[str, Any], base: ModelSpec | None) -> dict[str, Any]:
    """``ModelSpec`` fields that are not planner inputs (norms, bias, MLA, dense layers), from a config.

    With a preset (``base``) only the keys the config states override it; without one, absent keys take the
    Bridge/MCore defaults. Tied embeddings are a planner input (``share_embeddings_and_output_weights``): the
    config's, the preset's, the model family's or the frontend's default (``plan/inputs/family.py``).
    """
    m = config.model
    section = raw.get("model")
    given: dict[str, Any] = section if isinstance(section, dict) else {}
    extras = m.extras()
    out: dict[str, Any] = {}
    if base is None or "gated_linear_unit" in given:
        out["gated_linear_unit"] = bool(m.gated_linear_unit)
    if base is None or "add_bias_linear" in given:
        out["add_bias_linear"] = bool(m.add_bias_linear)
    if base is None or "qk_layernorm" in given:
        out["qk_layernorm"] = bool(extras.get("qk_layernorm", False))
    if base is None or "hidden_dropout" in given:
        out["dropout"] = float(extras.get("hidden_dropout", 0.0) or 0.0)
    if base is None or "moe_shared_expert_intermediate_size" in given:
        out["moe_shared_expert_intermediate_size"] = m.moe_shared_expert_intermediate_size
    if base is None or "moe_layer_freq" in given:
        out["first_k_dense"] = _first_k_dense(m.moe_layer_freq, int(m.num_layers or 0)) if m.num_moe_experts else 0
    if base is None or "multi_latent_attention" in given:
        out["mla"] = _mla(config)
    out.update(hybrid_extras(extras, m.hidden_size))
    return out


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def hybrid_extras(extras: dict[str, Any], hidden: int | None) -> dict[str, Any]:
    """The hybrid layer pattern, the Mamba mixer's shapes and the MTP depths a config states.

    megatron-core's unified pattern (0.19: ``hybrid_layer_pattern``; older: ``hybrid_override_pattern``) is
    ``<decoder>/<mtp depth>/<mtp depth>…``, with ``|`` marking pipeline stages (not modelled: stages split evenly).
    Raises:
        InputError: a pattern symbol megatron-core does not know.
    """
    from mbridge_offload.config.errors import BoundsError as InputError
    from mbridge_offload.plan.inputs.config_facts import LAYER_KINDS
    from mbridge_offload.plan.model.architecture import HYBRID_SYMBOLS, MambaSpec

    out: dict[str, Any] = {}
    pattern = extras.get("hybrid_layer_pattern") or extras.get("hybrid_override_pattern")
    mtp_pattern = extras.get("mtp_hybrid_override_pattern")
    mtp = _int(extras.get("mtp_num_layers")) or 0
    if isinstance(pattern, str) and pattern:
        main, *depths = pattern.split("/")
        main = main.replace("|", "")
        bad = sorted(set(main + "".join(depths)) - HYBRID_SYMBOLS)
        if bad:
            raise InputError(
                f"hybrid_layer_pattern {pattern[:60]!r}: unknown layer symbol(s) {''.join(bad)} "
                f"({', '.join(f'{c} {kind}' for c, kind in LAYER_KINDS.items())}, | stage, / MTP)"
            )
        out["layer_pattern"] = main
        if depths:
            mtp, mtp_pattern = len(depths), depths[0]
        heads, head_dim = _int(extras.get("mamba_num_heads")), _int(extras.get("mamba_head_dim")) or 64
        state, groups = _int(extras.get("mamba_state_dim")) or 128, _int(extras.get("mamba_num_groups")) or 8
        if heads is None and hidden:  # megatron-core: nheads = d_inner / headdim, d_inner = expand (2) × hidden
            heads = 2 * hidden // head_dim
        if heads:
            out["mamba"] = MambaSpec(num_heads=heads, head_dim=head_dim, state_dim=state, num_groups=groups)
    if mtp:
        out["mtp_num_layers"] = mtp
        out["mtp_pattern"] = mtp_pattern if isinstance(mtp_pattern, str) and mtp_pattern else None
        out["mtp_repeated"] = bool(extras.get("mtp_use_repeated_layer", False))
    return out
