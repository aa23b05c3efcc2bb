"""Megatron-FSDP (``ddp.use_megatron_fsdp``) in the per-GPU memory model.

What one GPU holds under each ``ddp.data_parallel_sharding_strategy`` (megatron-core 0.19
``distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py``, ``_init_each_parameter_group_buffers``):

============================  ===============  ================  ===================  ===========================
strategy                      compute weights  fp32 main weights  gradients            Adam moments
============================  ===============  ================  ===================  ===========================
``no_shard``                  full             full               full                 full
``optim`` (ZeRO-1)            full             sharded            full                 sharded
``optim_grads`` (ZeRO-2)      full             sharded            sharded + RS buffer  sharded
``optim_grads_params`` (3)    sharded + AG     sharded            sharded + RS buffer  sharded
============================  ===============  ================  ===================  ===========================

- Sharded over the FSDP group: ``DP·CP`` for dense parameters, the expert data-parallel group for experts.
- Compute weights are the model dtype (bf16), or one byte per element for FP8 parameters
  (``fp8_param_gather``: ``float8`` parameter groups; MXFP8 adds a columnwise "transpose" buffer of the same size).
  Norms, embedding and output layer stay in the model dtype.
- Main weights: ``ddp.megatron_fsdp_main_params_dtype`` (default fp32). The optimizer steps these DTensor shards;
  with the precision-aware optimizer FusedAdam's own master weights are switched off (``master_weights=False``).
- Gradients: ``ddp.megatron_fsdp_main_grads_dtype``, default None = the parameter dtype (bf16; bf16 for FP8
  parameters). ``ddp.grad_reduce_in_fp32`` is not read by Megatron-FSDP.
- Unsharded buffers: a layer's weights are all-gathered before its forward and backward and its gradients
  reduce-scattered after its backward. The all-gather pipeline prefetches the next FSDP unit (a transformer
  layer) while the current one runs and ``fsdp_double_buffer`` keeps two persistent slots per kind, so two
  layers' unsharded weights and two layers' unsharded gradients are counted. The embedding and output layer are
  not FSDP units: they are gathered on their own when used; at the activation peak (the start of backward) the
  output layer's unsharded weight and gradient are live. At the end of the backward, before ``finalize_model_grads``
  reduce-scatters them, more unsharded gradients are live (``optim_grads``: all of the stage's, having no FSDP units;
  ``optim_grads_params``: the root module's and two layers'): the optimizer-step phase carries them
  (``FsdpMemory.end_of_backward``) where they exceed its fp32 copies. Traced: ``docs/trace.md`` "Megatron-FSDP".

The transient fp32 copy of a bf16 gradient shard at the optimizer step (``update_main_grads``) is that phase's, after
the activations are freed (``plan/memory/phases.py``). Not modelled: bucket padding, the HSDP/HFSDP outer group
(``num_distributed_optimizer_instances``), a ``grad_comm_dtype`` different from the gradient dtype. Never imports
torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mbridge_offload.plan.model.architecture import ModelSpec
    from mbridge_offload.plan.model.params import Tensor
    from mbridge_offload.plan.model.run import Setup

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
# Tensors that stay in the model dtype when FP8 parameters are on (TE keeps FP8 only for GEMM weights).
_HIGH_PRECISION = ("norm", "bias", "embedding", "output_layer", "router")
# The root module's parameters under ZeRO-3 (megatron-core's FSDP units are the transformer layers only).
_ROOT = ("embedding", "final_layernorm", "output_layer")


@dataclass
class FsdpMemory:
    """One GPU's Megatron-FSDP bytes of one pipeline stage."""

    weights: int  # compute-weight shards (or full copies) + unsharded all-gather buffers
    gradients: int  # gradient shards (or full) + unsharded reduce-scatter buffers
    optimizer: int  # main-weight shards + Adam moments
    shard_numel: int
    buffers: int  # the unsharded part of weights + gradients (also inside them)
    notes: list[str] = field(default_factory=list)
    end_of_backward: int = 0  # unsharded gradients live when the backward ends (not at the activation peak)


def _fp8_weight(t: Tensor, s: Setup) -> bool:
    return s.fp8_param and not any(word in t.name for word in _HIGH_PRECISION)


def _weight_bytes(t: Tensor, s: Setup) -> int:
    if _fp8_weight(t, s):
        return 2 if s.fp8_recipe == "mxfp8" else 1  # MXFP8: rowwise + columnwise copies
    return _BYTES[s.params_dtype]


def _grad_bytes(t: Tensor, s: Setup) -> int:
    if s.fsdp_main_grads_dtype:
        return _BYTES[s.fsdp_main_grads_dtype]
    return 2 if _fp8_weight(t, s) else _BYTES[s.params_dtype]


def _moment_bytes(s: Setup) -> int:
    if s.precision_aware_optimizer:
        return _BYTES[s.exp_avg_dtype] + _BYTES[s.exp_avg_sq_dtype]
    return 8


def _unit_buffers(
    m: ModelSpec, s: Setup, layers: list[int], params_sharded: bool, grads_sharded: bool
) -> tuple[int, int]:
    """Two layers' unsharded weights (all-gather, when params are sharded) and gradients (reduce-scatter)."""
    from mbridge_offload.plan.model.params import layer_params

    w = g = 0
    for index in {(m.layer_kind(i), m.is_moe_layer(i)): i for i in layers}.values():  # one layer of each kind
        unit = layer_params(m, s, index)
        if params_sharded:
            w = max(w, sum(t.numel * _weight_bytes(t, s) for t in unit))
        if grads_sharded:
            g = max(g, sum(t.numel * _grad_bytes(t, s) for t in unit))
    return 2 * w, 2 * g


def fsdp_memory(m: ModelSpec, s: Setup, params: list[Tensor], layers: list[int], last_stage: bool) -> FsdpMemory:
    """Weights, gradients and optimizer bytes of one GPU under Megatron-FSDP.

    Args:
        m, s: the model and setup (``s.fsdp_sharding_strategy`` one of ``STRATEGIES``).
        params: this GPU's parameter tensors (after TP/EP), as ``stage_params`` lists them.
        layers: the stage's transformer-layer indices (the FSDP units).
        last_stage: whether the stage holds the output layer (gathered at the activation peak).
    """
    strategy = s.fsdp_sharding_strategy
    params_sharded = strategy == "optim_grads_params"
    grads_sharded = strategy in ("optim_grads", "optim_grads_params")
    opt_sharded = strategy != "no_shard"
    main = _BYTES[s.fsdp_main_params_dtype] if s.fsdp_main_params_dtype else 0
    weights = grads = optimizer = shard_numel = 0
    for t in params:
        group = s.expert_dp(m) if t.expert else s.dp * s.cp
        shard = math.ceil(t.numel / group)
        weights += (shard if params_sharded else t.numel) * _weight_bytes(t, s)
        grads += (shard if grads_sharded else t.numel) * _grad_bytes(t, s)
        local = shard if opt_sharded else t.numel
        optimizer += local * (main + _moment_bytes(s))
        shard_numel += local
    # ZeRO-3: two layers' unsharded weights (the double buffer's two slots), and the root module's parameters (not
    # FSDP units) gathered at the start of the forward and kept to the end of the backward. Early in the backward,
    # with the activations still nearly all live, two layers' unsharded gradients and the output layer's (the
    # root's first) are. ZeRO-2 (no FSDP units: one unit for the whole module): counted as two layers' there too,
    # but every gradient of the stage is unsharded at the end of the backward, until the reduce-scatter in
    # finalize_model_grads (``end_of_backward``, when the activations are gone).
    w_buf, g_buf = _unit_buffers(m, s, layers, params_sharded, grads_sharded)
    end = 0
    if params_sharded:
        # the output layer only: the trace finds the embedding and final norm gathered too (docs/trace.md
        # "Megatron-FSDP"), which the published-recipe calibration (tests/plan/test_perf_recipes.py) has not taken in
        w_buf += sum(t.numel * _weight_bytes(t, s) for t in params if t.name == "output_layer")
        g_buf += sum(t.numel * _grad_bytes(t, s) for t in params if t.name == "output_layer")
        end = g_buf + sum(t.numel * _grad_bytes(t, s) for t in params if t.name in _ROOT and t.name != "output_layer")
    elif grads_sharded:
        end = sum(t.numel * _grad_bytes(t, s) for t in params)
    notes = [
        f"Megatron-FSDP {strategy}: weights, gradients and optimizer sharded as megatron-core's "
        "param_and_grad_buffer does (dense over DP·CP, experts over expert DP); "
        f"{(w_buf + g_buf) / 1e9:.1f} GB of unsharded all-gather buffers at the activation peak (two layers "
        "double-buffered, plus the embedding and output layer under optim_grads_params); "
        f"{end / 1e9:.1f} GB of unsharded gradients at the end of the backward; bucket padding and HSDP not modelled"
    ]
    return FsdpMemory(weights + w_buf, grads + g_buf, optimizer, shard_numel, w_buf + g_buf, notes, end)
