"""The model and the run as the planner sees them: architecture (``ModelSpec``), settings (``Setup``), the checks
megatron-core would make (``check_setup``), the parameter shards one GPU holds and the layers of each pipeline stage.

Shared by the memory model (``plan/memory/``), the step-time model (``plan/time/``), the inputs and the search; each
name is imported from here, the one place it is defined. Never imports torch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from mbridge_offload.plan.memory import fine_grained

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

    def has_attention(self, index: int) -> bool:
        return self.layer_kind(index) in ATTENTION_SYMBOLS or self.layer_kind(index) == "T"

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


@dataclass(frozen=True)
class Setup:
    """Parallelism, batch, precision and offload settings of one run (Bridge recipe defaults)."""

    num_gpus: int = 8
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    sequence_parallel: bool | None = None  # None: on when TP > 1, as Bridge recipes set it
    seq_length: int | None = None
    micro_batch_size: int = 1
    global_batch_size: int | None = None
    params_dtype: str = "bf16"
    grad_reduce_in_fp32: bool = True  # Bridge recipes set ddp.grad_reduce_in_fp32=True
    use_distributed_optimizer: bool = True
    use_precision_aware_optimizer: bool = False
    main_params_dtype: str = "fp32"
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"
    store_param_remainders: bool = True
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    recompute_modules: tuple[str, ...] = ("core_attn",)
    optimizer_offload_fraction: float = 0.0
    activation_offload_layers: int = 0
    # Fine-grained activation offloading (model.offload_modules; on when non-empty): see plan/memory/fine_grained.py.
    offload_modules: tuple[str, ...] = ()
    min_offloaded_tensor_size: int = 1024 * 1024
    activation_offload_fraction: float = 1.0
    # Memory PyTorch's allocator hands out beyond the model's tensors: cuBLAS/TE workspaces, DistOpt's
    # all-gather/reduce-scatter staging, loss temporaries. In "max allocated"; the CUDA context is not.
    overhead_gb: float = 2.0
    # Megatron-FSDP (ddp.use_megatron_fsdp, ddp.data_parallel_sharding_strategy, ddp.megatron_fsdp_*_dtype).
    use_megatron_fsdp: bool = False
    fsdp_sharding_strategy: str = "no_shard"
    fsdp_main_params_dtype: str | None = "fp32"
    fsdp_main_grads_dtype: str | None = None  # None: the parameter dtype
    # FP8 compute (mixed_precision / model.fp8_recipe) and FP8 parameters (fp8_param_gather).
    fp8_recipe: str | None = None
    fp8_param: bool = False
    # Uneven pipeline stages: first/last stage layer counts, or decoder layers per virtual stage (layout order).
    num_layers_in_first_pipeline_stage: int | None = None
    num_layers_in_last_pipeline_stage: int | None = None
    pipeline_layout: tuple[int, ...] | None = None
    cross_entropy_fusion: bool = False  # model.cross_entropy_loss_fusion
    cross_entropy_fusion_impl: str = "native"  # model.cross_entropy_fusion_impl: native | te
    # Communication overlap (step-time model only): ddp.overlap_grad_reduce / ddp.overlap_param_gather, which
    # Bridge recipes switch on, and comm_overlap.tp_comm_overlap (TE userbuffers), which its performance recipes do.
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    tp_comm_overlap: bool = False

    def resolved_etp(self, model: ModelSpec) -> int:
        if self.etp is not None:
            return self.etp
        return model.default_etp if model.default_etp is not None else self.tp

    @property
    def sp(self) -> bool:
        return self.tp > 1 if self.sequence_parallel is None else self.sequence_parallel

    @property
    def dp(self) -> int:
        return self.num_gpus // (self.tp * self.pp * self.cp)

    def expert_dp(self, model: ModelSpec) -> int:
        return self.num_gpus // (self.pp * self.ep * self.resolved_etp(model))

    def num_microbatches(self) -> int | None:
        if self.global_batch_size is None:
            return None
        return max(1, self.global_batch_size // (self.micro_batch_size * self.dp))


def check_setup(model: ModelSpec, setup: Setup) -> None:
    """Reject what Megatron would reject, with the key, the value and the fix.

    Raises:
        ValueError: one line naming the violated constraint.
    """
    s = setup
    for name, value in (
        ("num_gpus", s.num_gpus),
        ("tp", s.tp),
        ("pp", s.pp),
        ("cp", s.cp),
        ("ep", s.ep),
        ("micro_batch_size", s.micro_batch_size),
    ):
        if value < 1:
            raise ValueError(f"{name} is {value}: it must be at least 1")
    etp = s.resolved_etp(model)
    if s.num_gpus % (s.tp * s.pp * s.cp):
        raise ValueError(f"num_gpus {s.num_gpus} is not divisible by TP·PP·CP = {s.tp * s.pp * s.cp}")
    if model.num_attention_heads % s.tp:
        raise ValueError(f"TP {s.tp} does not divide num_attention_heads {model.num_attention_heads}")
    if model.mla is None and model.num_query_groups % s.tp:
        raise ValueError(f"TP {s.tp} does not divide num_query_groups {model.num_query_groups}")
    if model.num_layers < s.pp:
        raise ValueError(f"PP {s.pp} exceeds num_layers {model.num_layers}")
    _check_hybrid(model, s)
    if s.pipeline_layout is not None:
        _check_layout(model, s)
    elif s.vpp is not None and (s.vpp < 1 or s.pp == 1 or model.num_layers % (s.pp * s.vpp)):
        uneven = s.num_layers_in_first_pipeline_stage or s.num_layers_in_last_pipeline_stage
        if s.vpp < 1 or s.pp == 1 or not uneven:
            raise ValueError(
                f"VPP {s.vpp} needs PP > 1 and num_layers {model.num_layers} divisible by PP·VPP "
                "(or an uneven split: pipeline_model_parallel_layout, num_layers_in_first/last_pipeline_stage)"
            )
    seq = s.seq_length or model.seq_length
    if seq % s.cp or (s.cp > 1 and seq % (2 * s.cp)):
        raise ValueError(f"seq_length {seq} must be divisible by 2·CP = {2 * s.cp}")
    if model.is_moe:
        if model.experts % s.ep:
            raise ValueError(f"EP {s.ep} does not divide num_moe_experts {model.num_moe_experts}")
        if s.num_gpus % (s.pp * s.ep * etp):
            raise ValueError(f"num_gpus {s.num_gpus} is not divisible by PP·EP·ETP = {s.pp * s.ep * etp}")
    elif s.ep > 1:
        raise ValueError(f"EP {s.ep} given for dense model {model.name}: expert parallelism needs MoE layers")
    if not 0.0 <= s.optimizer_offload_fraction <= 1.0:
        raise ValueError(f"optimizer_offload_fraction is {s.optimizer_offload_fraction}: it must be in [0.0, 1.0]")
    fine_grained.check(s)
    if s.activation_offload_layers:
        _check_activation_offload(model, s)


def _check_hybrid(model: ModelSpec, s: Setup) -> None:
    """megatron-core's hybrid-model checks: the pattern has one symbol per layer; the Mamba mixer asserts that TP
    divides its heads and groups."""
    if model.layer_pattern is None:
        return
    if len(model.layer_pattern) != model.num_layers:
        raise ValueError(
            f"hybrid_layer_pattern has {len(model.layer_pattern)} layers but num_layers is {model.num_layers}"
        )
    if model.mamba is not None and MAMBA in model.layer_pattern:
        if model.mamba.num_heads % s.tp:
            raise ValueError("nheads must be evenly divisble by tp_size")
        if model.mamba.num_groups % s.tp:
            raise ValueError("ngroups must be evenly divisible by tp_size")


def _check_activation_offload(model: ModelSpec, s: Setup) -> None:
    """The rule catalogue's activation-offload errors (config.rules.activation), raised as ValueError."""
    from mbridge_offload.config.validate import activation_offload_errors

    errors = activation_offload_errors(
        {
            "num_layers": model.num_layers,
            "cpu_offloading_num_layers": s.activation_offload_layers,
            "pipeline_model_parallel_size": s.pp,
            "recompute_granularity": s.recompute_granularity,
        }
    )
    if errors:
        raise ValueError("; ".join(f"{message} ({rule})" for rule, message in errors))


# ------------------------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class Tensor:
    """One tensor on one GPU: ``numel`` elements; ``expert`` = sharded over expert DP; ``decay`` = weight decay."""

    name: str
    numel: int
    expert: bool = False
    decay: bool = True
    nbytes_per: int = 2  # activations only: bytes per element

    @property
    def nbytes(self) -> int:
        return self.numel * self.nbytes_per


def padded_vocab(model: ModelSpec, tp: int) -> int:
    multiple = VOCAB_DIVISIBLE_BY * tp
    return math.ceil(model.vocab_size / multiple) * multiple


def _attention_params(m: ModelSpec, tp: int) -> list[Tensor]:
    h, bias = m.hidden_size, m.add_bias_linear
    out: list[Tensor] = [Tensor("input_layernorm", h, decay=False)]
    if m.mla is not None:
        a = m.num_attention_heads
        qk = m.mla.qk_head_dim + m.mla.qk_pos_emb_head_dim
        if m.mla.q_lora_rank:
            # The down-projections are "duplicated" across TP in MCore; the up-projections are column-parallel.
            out += [
                Tensor("q_down_proj", h * m.mla.q_lora_rank),
                Tensor("q_layernorm", m.mla.q_lora_rank, decay=False),
                Tensor("q_up_proj", m.mla.q_lora_rank * a * qk // tp),
            ]
        else:
            out.append(Tensor("q_proj", h * a * qk // tp))
        out += [
            Tensor("kv_down_proj", h * (m.mla.kv_lora_rank + m.mla.qk_pos_emb_head_dim)),
            Tensor("kv_layernorm", m.mla.kv_lora_rank, decay=False),
            Tensor("kv_up_proj", m.mla.kv_lora_rank * a * (m.mla.qk_head_dim + m.mla.v_head_dim) // tp),
            Tensor("proj", a * m.mla.v_head_dim * h // tp),
        ]
        return out
    q = m.num_attention_heads * m.kv_channels
    kv = m.num_query_groups * m.kv_channels
    out.append(Tensor("linear_qkv", h * (q + 2 * kv) // tp))
    if bias:
        out.append(Tensor("linear_qkv_bias", (q + 2 * kv) // tp, decay=False))
    if m.qk_layernorm:
        out += [Tensor("q_layernorm", m.kv_channels, decay=False), Tensor("k_layernorm", m.kv_channels, decay=False)]
    out.append(Tensor("linear_proj", q * h // tp))
    if bias:
        out.append(Tensor("linear_proj_bias", h, decay=False))
    return out


def _mlp_params(m: ModelSpec, ffn: int, shard: int, expert: bool, prefix: str) -> list[Tensor]:
    h, gate = m.hidden_size, 2 if m.gated_linear_unit else 1
    out = [Tensor(f"{prefix}fc1", h * gate * ffn // shard, expert), Tensor(f"{prefix}fc2", ffn * h // shard, expert)]
    if m.add_bias_linear:
        out += [
            Tensor(f"{prefix}fc1_bias", gate * ffn // shard, expert, decay=False),
            Tensor(f"{prefix}fc2_bias", h, expert, decay=False),
        ]
    return out


def layer_params(m: ModelSpec, s: Setup, index: int) -> list[Tensor]:
    """The parameter shards of decoder layer ``index`` held by one GPU."""
    return kind_params(m, s, m.layer_kind(index), m.is_moe_layer(index))


def kind_params(m: ModelSpec, s: Setup, kind: str, moe: bool) -> list[Tensor]:
    """The parameter shards of one layer of ``kind`` (``T`` or a hybrid symbol) held by one GPU."""
    return list(_layer_params(m, s.tp, s.ep, s.resolved_etp(m), kind, moe))


def _moe_params(m: ModelSpec, tp: int, ep: int, etp: int) -> list[Tensor]:
    out = [Tensor("router", m.hidden_size * m.experts)]
    for e in range(m.experts // ep):
        out += _mlp_params(m, m.expert_ffn_hidden_size, etp, True, f"expert{e}.")
    if m.moe_shared_expert_intermediate_size:
        out += _mlp_params(m, m.moe_shared_expert_intermediate_size, tp, False, "shared_expert.")
    return out


def _mamba_params(m: ModelSpec, tp: int) -> list[Tensor]:
    """megatron-core ``MambaMixer``: TP shards d_inner, the heads and the groups; A_log, D and dt_bias are fp32
    parameters in the module but counted like the others here (a few thousand elements)."""
    if m.mamba is None:
        raise ValueError(
            f"{m.name}: the hybrid pattern has Mamba layers but the Mamba shapes are missing "
            "(mamba_num_heads, mamba_head_dim, mamba_state_dim, mamba_num_groups)"
        )
    mb, h = m.mamba, m.hidden_size
    return [
        Tensor("mamba_norm", h, decay=False),
        Tensor("in_proj", h * mb.in_proj_width // tp),
        Tensor("conv1d_weight", mb.conv_dim * mb.d_conv // tp, decay=False),
        Tensor("conv1d_bias", mb.conv_dim // tp, decay=False),
        Tensor("dt_bias", mb.num_heads // tp, decay=False),
        Tensor("A_log", mb.num_heads // tp, decay=False),
        Tensor("D", mb.num_heads // tp, decay=False),
        Tensor("mixer_norm", mb.d_inner // tp, decay=False),
        Tensor("out_proj", mb.d_inner * h // tp),
    ]


@functools.lru_cache(maxsize=256)
def _layer_params(m: ModelSpec, tp: int, ep: int, etp: int, kind: str, moe: bool) -> tuple[Tensor, ...]:
    # Every layer of a kind is the same: built once per (model, TP, EP, ETP), the planner's search reuses it.
    if kind == MAMBA or kind == "G":  # GDN layers are counted as Mamba layers of the same shapes
        return tuple(_mamba_params(m, tp))
    out = _attention_params(m, tp) if kind == "T" or kind in ATTENTION_SYMBOLS else []
    if kind in ATTENTION_SYMBOLS:
        return tuple(out)
    out.append(Tensor("pre_mlp_layernorm", m.hidden_size, decay=False))
    if not moe:
        return tuple(out + _mlp_params(m, m.ffn_hidden_size, tp, False, "mlp."))
    return tuple(out + _moe_params(m, tp, ep, etp))


def mtp_params(m: ModelSpec, s: Setup) -> list[Tensor]:
    """The MTP block(s) on the last stage: one per depth, or one for all when the depths repeat one block
    (``mtp_use_repeated_layer``)."""
    return mtp_depth_params(m, s) * (1 if m.mtp_repeated else m.mtp_num_layers)


def mtp_depth_params(m: ModelSpec, s: Setup) -> list[Tensor]:
    """One MTP depth: the embedding and hidden norms, ``eh_proj`` (2h → h), the depth's layers, its final norm."""
    if not m.mtp_num_layers:
        return []
    h = m.hidden_size
    out = [
        Tensor("mtp.enorm", h, decay=False),
        Tensor("mtp.hnorm", h, decay=False),
        Tensor("mtp.eh_proj", 2 * h * h // s.tp),
    ]
    for kind in m.mtp_kinds():
        out += kind_params(m, s, kind, kind == MOE or (kind == "T" and m.is_moe))
    return [*out, Tensor("mtp.final_layernorm", h, decay=False)]


def _check_layout(m: ModelSpec, s: Setup) -> None:
    layout = s.pipeline_layout or ()
    if len(layout) % s.pp:
        raise ValueError(f"pipeline_model_parallel_layout has {len(layout)} stages: it must be divisible by PP {s.pp}")
    if sum(layout) != m.num_layers:
        raise ValueError(
            f"pipeline_model_parallel_layout places {sum(layout)} decoder layers but num_layers is {m.num_layers}"
        )


def _stage_counts(m: ModelSpec, s: Setup) -> list[int]:
    """Decoder layers per virtual stage, in layer order (virtual stage ``v`` runs on rank ``v mod PP``)."""
    if s.pipeline_layout is not None:
        return list(s.pipeline_layout)
    first, last = s.num_layers_in_first_pipeline_stage, s.num_layers_in_last_pipeline_stage
    if s.pp > 1 and (first is not None or last is not None):
        middle_ranks = s.pp - (first is not None) - (last is not None)
        rest = m.num_layers - (first or 0) - (last or 0)
        base, extra = divmod(rest, middle_ranks) if middle_ranks else (0, 0)
        mids = [base + (1 if i < extra else 0) for i in range(middle_ranks)]
        return ([first] if first is not None else []) + mids + ([last] if last is not None else [])
    stages = s.pp * (s.vpp or 1)
    base, extra = divmod(m.num_layers, stages)
    return [base + (1 if v < extra else 0) for v in range(stages)]


def stage_layers(m: ModelSpec, s: Setup) -> list[list[int]]:
    """Layer indices each pipeline rank holds (all its virtual stages); an even split gives the first
    ``L mod PP`` ranks one more."""
    ranks: list[list[int]] = [[] for _ in range(s.pp)]
    start = 0
    for v, n in enumerate(_stage_counts(m, s)):
        ranks[v % s.pp].extend(range(start, start + n))
        start += n
    return ranks


def chunk_layers(m: ModelSpec, s: Setup, stage: int) -> list[list[int]]:
    """The layers of each model chunk of pipeline rank ``stage`` (virtual stage ``v`` is chunk ``v // PP`` of rank
    ``v mod PP``); one chunk without VPP. When the split gives a rank fewer virtual stages than VPP (first/last stage
    counts with VPP), its layers are spread evenly over the chunks."""
    chunks = s.vpp or 1
    counts = _stage_counts(m, s)
    if len(counts) == s.pp * chunks:
        starts = [sum(counts[:v]) for v in range(len(counts))]
        return [list(range(starts[v], starts[v] + counts[v])) for v in range(stage, len(counts), s.pp)]
    layers = stage_layers(m, s)[stage]
    base, extra = divmod(len(layers), chunks)
    out, start = [], 0
    for c in range(chunks):
        n = base + (1 if c < extra else 0)
        out.append(layers[start : start + n])
        start += n
    return out


def stage_params(m: ModelSpec, s: Setup, stage: int) -> list[Tensor]:
    """All parameter shards of one GPU of pipeline stage ``stage``, in model (``named_parameters``) order."""
    vocab_shard = padded_vocab(m, s.tp) * m.hidden_size // s.tp
    out: list[Tensor] = []
    if stage == 0:
        out.append(Tensor("embedding", vocab_shard))
    for index in stage_layers(m, s)[stage]:
        out += layer_params(m, s, index)
    if stage == s.pp - 1:
        out.append(Tensor("final_layernorm", m.hidden_size, decay=False))
        out += mtp_params(m, s)
        # Untied: a separate output layer. Tied with PP > 1: the last stage keeps its own copy of the embedding.
        if not m.tied_embeddings or s.pp > 1:
            out.append(Tensor("output_layer", vocab_shard))
    return out


def total_params(m: ModelSpec) -> int:
    """Unsharded parameter count (no vocab padding), for reports."""
    one = Setup(num_gpus=1)
    n = m.vocab_size * m.hidden_size * (1 if m.tied_embeddings else 2) + m.hidden_size
    flat = replace(one, ep=1, etp=1)
    for index in range(m.num_layers):
        n += sum(t.numel for t in layer_params(m, flat, index))
    return n + sum(t.numel for t in mtp_params(m, flat))


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
