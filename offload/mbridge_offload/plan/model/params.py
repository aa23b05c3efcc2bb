"""What one GPU holds of the model: the parameter shards of each layer kind and the layers of each pipeline stage
(and of each model chunk under interleaving). Never imports torch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from mbridge_offload.plan.model.architecture import ATTENTION_SYMBOLS, MAMBA, MOE, VOCAB_DIVISIBLE_BY, ModelSpec
from mbridge_offload.plan.model.run import Setup


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
        out.append(Tensor("proj", a * m.mla.v_head_dim * h // tp))  # MultiLatentAttention builds it first
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
        ]
        return out
    q = m.num_attention_heads * m.kv_channels
    kv = m.num_query_groups * m.kv_channels
    # megatron-core's order: Attention.__init__ builds linear_proj, SelfAttention's then adds linear_qkv and the norms
    out.append(Tensor("linear_proj", q * h // tp))
    if bias:
        out.append(Tensor("linear_proj_bias", h, decay=False))
    out.append(Tensor("linear_qkv", h * (q + 2 * kv) // tp))
    if bias:
        out.append(Tensor("linear_qkv_bias", (q + 2 * kv) // tp, decay=False))
    if m.qk_layernorm:
        out += [Tensor("q_layernorm", m.kv_channels, decay=False), Tensor("k_layernorm", m.kv_channels, decay=False)]
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
    return list(_layer_params(m, s.tp, s.ep, s.resolved_etp(m), kind, moe, s.moe_grouped_gemm))


def _moe_params(m: ModelSpec, tp: int, ep: int, etp: int, grouped: bool) -> list[Tensor]:
    out = [Tensor("router", m.hidden_size * m.experts)]
    experts = [_mlp_params(m, m.expert_ffn_hidden_size, etp, True, f"expert{e}.") for e in range(m.experts // ep)]
    if grouped:
        # TEGroupedMLP: one grouped linear_fc1 holding every local expert's weight{i}, then one linear_fc2 (the order
        # HybridDeviceOptimizer's whole-tensor split walks); SequentialMLP: expert by expert
        experts = [[e[k] for e in experts] for k in range(len(experts[0]))] if experts else []
    for tensors in experts:
        out += tensors
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
def _layer_params(
    m: ModelSpec, tp: int, ep: int, etp: int, kind: str, moe: bool, grouped: bool = True
) -> tuple[Tensor, ...]:
    # Every layer of a kind is the same: built once per (model, TP, EP, ETP), the planner's search reuses it.
    if kind == MAMBA or kind == "G":  # GDN layers are counted as Mamba layers of the same shapes
        return tuple(_mamba_params(m, tp))
    out = _attention_params(m, tp) if kind == "T" or kind in ATTENTION_SYMBOLS else []
    if kind in ATTENTION_SYMBOLS:
        return tuple(out)
    out.append(Tensor("pre_mlp_layernorm", m.hidden_size, decay=False))
    if not moe:
        return tuple(out + _mlp_params(m, m.ffn_hidden_size, tp, False, "mlp."))
    return tuple(out + _moe_params(m, tp, ep, etp, grouped))


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
    return [t for chunk in chunk_params(m, s, stage) for t in chunk]


def chunk_params(m: ModelSpec, s: Setup, stage: int) -> list[list[Tensor]]:
    """The parameter shards of each model chunk of pipeline stage ``stage`` (one chunk without VPP), each in its
    ``named_parameters`` order: each chunk is a model of its own with its own DDP buffers."""
    vocab_shard = padded_vocab(m, s.tp) * m.hidden_size // s.tp
    chunks: list[list[Tensor]] = [[] for _ in chunk_layers(m, s, stage)]
    first, last = chunks[0], chunks[-1]
    # megatron-core's GPTModel builds the embedding where it embeds tokens: the first stage, and the stage of the MTP
    # depths (``pre_process or mtp_process``: each depth embeds the shifted tokens), its own copy beside the output
    # layer there when PP > 1, tied or not (language_module.py ties the copies by an all-reduce)
    if stage == 0:
        first.append(Tensor("embedding", vocab_shard))
    if stage == s.pp - 1 and m.mtp_num_layers and not (stage == 0 and len(chunks) == 1):
        last.append(Tensor("embedding", vocab_shard))
    for chunk, layers in zip(chunks, chunk_layers(m, s, stage), strict=True):
        for index in layers:
            chunk += layer_params(m, s, index)
    if stage == s.pp - 1:
        last.append(Tensor("final_layernorm", m.hidden_size, decay=False))
        last += mtp_params(m, s)
        # Untied: a separate output layer. Tied with PP > 1: the last stage keeps its own copy of the embedding.
        if not m.tied_embeddings or s.pp > 1:
            last.append(Tensor("output_layer", vocab_shard))
    return chunks


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
