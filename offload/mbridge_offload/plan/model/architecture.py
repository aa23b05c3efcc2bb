"""What is trained, as the planner sees it: the architecture (``ModelSpec``: dense, MoE, MLA, Mamba hybrid, MTP)
and the units every memory figure uses. Never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
GiB = 2**30
# Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by × TP.
VOCAB_DIVISIBLE_BY = 128
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


@dataclass(frozen=True)
class MLASpec:
    """Multi-latent attention shapes (DeepSeek-V2/V3); ``q_lora_rank=None`` = no query compression."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class MambaSpec:
    """Mamba-2 mixer shapes (megatron-core ``MambaMixer``: ``mamba_num_heads``, ``mamba_head_dim``,
    ``mamba_state_dim``, ``mamba_num_groups``; ``d_conv`` 4 and the SSD chunk 128 are its defaults)."""

    num_heads: int
    head_dim: int
    state_dim: int
    num_groups: int
    d_conv: int = 4
    chunk_size: int = 128

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: x, B and C."""
        return self.d_inner + 2 * self.num_groups * self.state_dim

    @property
    def in_proj_width(self) -> int:
        """``in_proj`` packs z, x, B, C and dt into one column-parallel GEMM."""
        return 2 * self.d_inner + 2 * self.num_groups * self.state_dim + self.num_heads


# Hybrid layer symbols (megatron-core ``models/hybrid/hybrid_layer_allocation.Symbols``): each is one layer of its
# own. ``T`` is ours: a whole transformer layer (attention + MLP or MoE) of a GPT model.
MAMBA, ATTENTION, MLP, MOE = "M", "*", "-", "E"
ATTENTION_SYMBOLS = frozenset("*D+")  # attention, DeepSeek sparse attention, MLA
HYBRID_SYMBOLS = frozenset("MG*D+-E")


@dataclass(frozen=True)
class ModelSpec:
    """The architecture, in Megatron ``TransformerConfig`` terms."""

    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    seq_length: int = 4096
    gated_linear_unit: bool = True
    tied_embeddings: bool = False
    add_bias_linear: bool = False
    qk_layernorm: bool = False
    dropout: float = 0.0
    num_moe_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_router_topk: int = 2
    moe_shared_expert_intermediate_size: int | None = None
    first_k_dense: int = 0
    mla: MLASpec | None = None
    # Expert-TP the public Bridge recipe uses (MCore's own default is ETP = TP).
    default_etp: int | None = None
    # Hybrid (Mamba) stacks: one symbol per decoder layer (``hybrid_layer_pattern``), the Mamba mixer's shapes.
    layer_pattern: str | None = None
    mamba: MambaSpec | None = None
    # Multi-token prediction: depths on the last stage, each an ``mtp_pattern`` block (hybrid) or one transformer
    # layer (GPT); with ``mtp_repeated`` the depths share one block's parameters.
    mtp_num_layers: int = 0
    mtp_pattern: str | None = None
    mtp_repeated: bool = False

    @property
    def is_moe(self) -> bool:
        return bool(self.num_moe_experts)

    @property
    def experts(self) -> int:
        """Routed experts per MoE layer; 0 for a dense model."""
        return self.num_moe_experts or 0

    @property
    def expert_ffn_hidden_size(self) -> int:
        """The expert MLP width: ``moe_ffn_hidden_size``, else ``ffn_hidden_size``, as megatron-core's
        ``TransformerConfig.__post_init__`` fills it when ``num_moe_experts`` is set and it is not."""
        return self.ffn_hidden_size if self.moe_ffn_hidden_size is None else self.moe_ffn_hidden_size

    def layer_kind(self, index: int) -> str:
        """``T`` (a transformer layer) for a GPT model, else the hybrid pattern's symbol of layer ``index``."""
        return self.layer_pattern[index] if self.layer_pattern else "T"

    def is_moe_layer(self, index: int) -> bool:
        if self.layer_pattern:
            return self.layer_pattern[index] == MOE
        return self.is_moe and index >= self.first_k_dense

    @property
    def attention_layers(self) -> int:
        """Decoder layers with attention (every layer of a GPT model; the attention symbols of a hybrid one)."""
        if not self.layer_pattern:
            return self.num_layers
        return sum(self.layer_pattern.count(c) for c in ATTENTION_SYMBOLS)

    def ssm_flops_per_token(self) -> float:
        """Training FLOPs per token of the Mamba-2 scans (SSD, chunked), outside the GEMMs of in/out_proj:
        per head, forward ``2·Q·(N + P)`` within the chunk plus ``4·N·P`` for the chunk states (Dao & Gu 2024), and
        backward twice the forward."""
        if not self.layer_pattern or self.mamba is None:
            return 0.0
        mb = self.mamba
        forward = 2 * mb.num_heads * (mb.chunk_size * (mb.state_dim + mb.head_dim) + 2 * mb.state_dim * mb.head_dim)
        return 3.0 * forward * (self.layer_pattern.count(MAMBA) + self.layer_pattern.count("G"))

    def mtp_kinds(self) -> str:
        """The layer symbols of one MTP depth: its hybrid pattern, else one transformer layer."""
        return self.mtp_pattern or "T"
