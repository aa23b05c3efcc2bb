"""Fine-grained activation offloading (megatron-core 0.19.2): what each ``offload_modules`` entry moves, and when.

Read from ``megatron/core/pipeline_parallel/fine_grained_activation_offload.py`` and its call sites
(``transformer_layer.py``, ``attention.py``, ``multi_latent_attention.py``, ``moe/experts.py``). Each module opens an
offload *group* around one sub-module call: every tensor autograd saves inside that scope is captured by a
saved-tensor hook and, at the group's commit, copied on a dedicated D2H stream to a pinned host pool; tensors with
fewer than ``min_offloaded_tensor_size`` elements stay. In backward the next layer's group of the same name is
reloaded on an H2D stream while the current layer's gradients run ("layer-staggered reload").

What stays on the GPU (``PipelineOffloadManager.post_warmup_callback`` and ``ChunkOffloadHandler``):

- the offload margin: one group per module name (the last layer of the chunk that runs backward first) is never
  offloaded, so the first reload does not stall the compute stream;
- ``activation_offload_fraction`` f: in every chunk the *last* ``int(n·(1−f))`` of its n eligible groups stay (in the
  chunk holding the margin group, of its n − 1 others);
- ``delta_offload_bytes_across_pp_ranks`` d: pipeline rank r keeps its first ``r·d`` bytes of groups (default 0);
- during backward one reloaded group per module name is resident again (prefetched one layer ahead).

The GPU saving at the activation peak is therefore ``(in-flight groups − 1) × bytes per group`` per module, where
in-flight groups = layers of the stage × micro-batches the 1F1B / interleaved schedule keeps alive
(``activations.in_flight``): the margin group and the prefetched group are the same single group per name that
megatron-core's docs describe as "only one activation per module type resides on GPU at a time". Host memory is
the pinned pool, which reuses tensors by (shape, dtype) and never shrinks: the in-flight offloaded tensors, each
rounded to a power of two by PyTorch's pinned caching allocator. Step time: the copies run on their own streams;
only what one layer's forward (D2H) or backward (H2D) cannot hide is exposed (``exposed_copy_s``).

Plain Python: takes the saved-tensor lists of ``plan.memory.activations.layer_activations`` (name, numel, nbytes); never
imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

DEFAULT_MIN_OFFLOADED_TENSOR_SIZE = 1024 * 1024  # elements (TransformerConfig.min_offloaded_tensor_size)


@dataclass(frozen=True)
class OffloadPoint:
    """One ``offload_modules`` entry: the sub-module call it wraps in 0.19.2 and the saved tensors that scope holds.

    ``tensors`` are names of ``plan.memory.activations.layer_activations``; ``transfer_only`` are saved inside the
    scope and
    copied, but another module still holds the same storage, so the GPU keeps it (``core_attn``'s output is the
    input ``linear_proj`` saves; only ``attn_proj`` releases it, which is why upstream refuses ``attn_proj`` alone).
    """

    name: str
    scope: str
    tensors: tuple[str, ...]
    transfer_only: tuple[str, ...] = ()
    note: str = ""
    # The layer kinds where the point exists: it needs a separate norm module (MLA's input norm, the MoE layer's
    # pre-MLP norm); in TE's fused LayerNormLinear the norm is an IdentityOp and upstream switches the point off.
    only_with: str | None = None
    # Tensors outside the scope in layers that have this one (MLA: the input norm is its own module).
    not_with: tuple[str, tuple[str, ...]] | None = None

    def moved(self, names: set[str]) -> tuple[set[str], set[str]]:
        """``(freed, copied-only)`` tensor names of this point in a layer whose saved tensors are ``names``."""
        if self.only_with is not None and self.only_with not in names:
            return set(), set()
        freed = set(self.tensors)
        if self.not_with is not None and self.not_with[0] in names:
            freed -= set(self.not_with[1])
        return freed & names, set(self.transfer_only) & names


POINTS: dict[str, OffloadPoint] = {
    p.name: p
    for p in (
        OffloadPoint(
            "attn_norm",
            "TransformerLayer._forward_attention: input_layernorm(hidden_states); residual force-released after "
            "self_attn_bda",
            ("input_norm_in",),
            note="a no-op where the norm is fused into linear_qkv (TE spec, standard attention: IdentityOp); "
            "effective for MLA, whose input norm is a separate TENorm",
            only_with="kv_down_out",
        ),
        OffloadPoint(
            "qkv_linear",
            "Attention.get_query_key_value_tensors (TE LayerNormLinear incl. the fused norm, QK-norm) / "
            "MLA down- and up-projections with their norms",
            ("input_norm_in", "qkv_in", "q_norm_in", "k_norm_in", "q_down_out", "q_up_in", "kv_down_out", "kv_up_in"),
            note="with MLA the input norm is outside the scope (attn_norm covers it)",
            not_with=("kv_down_out", ("input_norm_in",)),
        ),
        OffloadPoint(
            "core_attn",
            "core_attention(query, key, value); query/key/value force-released; training only, and not with "
            "recompute of core_attn (checkpointed path)",
            ("q", "k", "v", "softmax_lse"),
            transfer_only=("attn_out",),
        ),
        OffloadPoint("attn_proj", "linear_proj(core_attn_out); core_attn_out force-released", ("attn_out",)),
        OffloadPoint(
            "mlp_norm",
            "TransformerLayer._forward_pre_mlp_layernorm; residual force-released after mlp_bda",
            ("mlp_norm_in",),
            note="a no-op in dense TE layers (the norm is fused into linear_fc1: IdentityOp); effective in MoE "
            "layers, whose pre-MLP norm feeds the router",
            only_with="router_in",
        ),
        OffloadPoint(
            "expert_fc1",
            "experts linear_fc1(permuted_local_hidden_states): the routed tokens (top-k copies per token); input "
            "force-released",
            ("expert_fc1_in",),
        ),
        OffloadPoint(
            "moe_act",
            "experts activation (SwiGLU) on fc1_output; fc1_output force-released",
            ("expert_fc1_out",),
        ),
        OffloadPoint(
            "fused_group_mlp",
            "the whole TE op-fuser grouped MLP (fc1, activation, fc2) on the routed tokens",
            ("expert_fc1_in", "expert_fc1_out", "expert_act_out"),
        ),
    )
}
# The order ``recommend`` adds modules in. Every module copies about one byte per byte it frees, so the order follows
# upstream's guidance and recipes: expert_fc1 first (every published fine-grained recipe), then the attention pair
# (core_attn alone would copy its output without freeing it, so it comes with attn_proj), the QKV projection, and
# last the cheap-to-recompute ones (norms, moe_act: "use recomputation" for low-overhead modules, upstream docs).
SELECTION_STEPS: tuple[tuple[str, ...], ...] = (
    ("expert_fc1",),
    ("core_attn", "attn_proj"),
    ("qkv_linear",),
    ("moe_act",),
    ("mlp_norm",),
    ("attn_norm",),
)


class SavedTensor(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def numel(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


def check(setup) -> None:
    """Refuse what megatron-core refuses about a ``memory.Setup``'s fine-grained settings (the rule catalogue's
    fine-grained errors, ``config.validate.fine_grained_errors``).

    Raises:
        ValueError: naming the rules and upstream's messages.
    """
    from mbridge_offload.config.validate import fine_grained_errors

    modules = list(setup.offload_modules)
    if not modules:
        return
    model: dict[str, object] = {
        "offload_modules": modules,
        "activation_offload_fraction": setup.activation_offload_fraction,
        "min_offloaded_tensor_size": setup.min_offloaded_tensor_size,
    }
    if "fused_group_mlp" in modules:
        model["use_transformer_engine_op_fuser"] = True  # the planner models the fused MLP as TE's op fuser runs it
    if setup.activation_offload_layers:
        model.update(cpu_offloading=True, cpu_offloading_num_layers=setup.activation_offload_layers)
    errors = fine_grained_errors(model)
    if errors:
        raise ValueError(f"model.offload_modules={modules}: " + "; ".join(f"{m} ({rule})" for rule, m in errors))


def _eligible(t: SavedTensor, min_size: int) -> bool:
    return t.numel >= min_size


def _released(acts: Sequence[SavedTensor], modules: Sequence[str], min_size: int) -> dict[str, tuple[int, int]]:
    """Per module of one layer: bytes freed and copied, counting a tensor two modules share only once for the GPU
    (``attn_out`` under core_attn + attn_proj is freed by attn_proj, copied by both)."""
    out: dict[str, tuple[int, int]] = {}
    names = {t.name for t in acts}
    eligible = [t for t in acts if _eligible(t, min_size)]
    freed_names: set[str] = set()
    for module in modules:
        frees, copies_only = POINTS[module].moved(names)
        freed = sum(t.nbytes for t in eligible if t.name in frees and t.name not in freed_names)
        copied = sum(t.nbytes for t in eligible if t.name in frees | copies_only)
        freed_names |= frees
        if copied:
            out[module] = (freed, copied)
    return out


@dataclass
class FineGrainedMemory:
    gpu_saving_bytes: int = 0  # at the stage's activation peak
    host_bytes: int = 0  # pinned pool, power-of-two rounded
    copied_bytes_per_microbatch: int = 0  # D2H (and the same H2D) of one micro-batch on this stage
    max_group_bytes: int = 0  # the largest single layer's copy (for the overlap check)
    by_module: dict[str, int] | None = None  # GPU saving per module


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def stage_saving(
    per_layer: Sequence[Sequence[SavedTensor]],
    modules: Sequence[str],
    in_flight: float,
    *,
    min_size: int = DEFAULT_MIN_OFFLOADED_TENSOR_SIZE,
    fraction: float = 1.0,
    keep_bytes: int = 0,
) -> FineGrainedMemory:
    """What fine-grained offloading of ``modules`` frees on one pipeline stage.

    Args:
        per_layer: the saved tensors of each layer of the stage, one micro-batch (after selective recompute).
        modules: ``model.offload_modules``.
        in_flight: micro-batches whose activations the stage holds at its peak (``activations.in_flight``).
        min_size: ``model.min_offloaded_tensor_size`` (elements).
        fraction: ``model.activation_offload_fraction`` (of each chunk's eligible groups, earliest kept offloaded).
        keep_bytes: ``pp_rank × delta_offload_bytes_across_pp_ranks`` kept on the GPU.
    """
    out = FineGrainedMemory(by_module={})
    if not modules or not per_layer:
        return out
    groups: dict[str, list[tuple[int, int]]] = {}
    for acts in per_layer:
        for module, fc in _released(acts, modules, min_size).items():
            groups.setdefault(module, []).append(fc)
    host = 0
    for module, layers in groups.items():
        n = len(layers)
        offloaded = layers[: n - int(n * (1 - fraction))]  # upstream disables the latest groups of each chunk
        if not offloaded:
            continue
        freed = sum(f for f, _ in offloaded) / len(offloaded)
        copied = sum(c for _, c in offloaded)
        # One group per module name stays (margin) / is back on the GPU (prefetch) at any time. Upstream takes the
        # margin group out first (post_warmup_callback), then the fraction of each chunk's groups still eligible: the
        # micro-batch holding the margin keeps the fraction of n - 1 groups offloaded, the others of n.
        first = (n - 1) - int((n - 1) * (1 - fraction))
        resident_groups = max(0.0, first + (in_flight - 1) * len(offloaded))
        saving = int(resident_groups * freed)
        out.by_module[module] = saving  # type: ignore[index]
        out.gpu_saving_bytes += saving
        out.copied_bytes_per_microbatch += copied
        out.max_group_bytes = max(out.max_group_bytes, max(c for _, c in offloaded))
        per_group_pinned = sum(_next_pow2(c) for _, c in offloaded) / len(offloaded)
        host += int(per_group_pinned * math.ceil(resident_groups))
    if keep_bytes:
        kept = min(keep_bytes, out.gpu_saving_bytes)
        out.gpu_saving_bytes -= kept
    out.host_bytes = host
    return out


def exposed_copy_s(group_bytes_: int, link_bytes_per_s: float, layer_forward_s: float) -> float:
    """Exposed time of one layer's group: D2H behind the layer's forward, H2D behind its backward (≈ 2× forward)."""
    copy = group_bytes_ / link_bytes_per_s
    return max(0.0, copy - layer_forward_s) + max(0.0, copy - 2 * layer_forward_s)
