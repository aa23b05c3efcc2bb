"""What the trace's child builds, from the planner's resolved inputs: one reading of the config for every tool.

``trace`` reads its config, overrides, command line and flags exactly as ``estimate`` does
(:func:`mbridge_offload.plan.service.plan_source`, then :func:`mbridge_offload.plan.inputs.resolve.resolve`,
which applies the one effective config of :mod:`mbridge_offload.config.effective`), so the same file gives the same
``ModelSpec`` and ``Setup``. This module turns those into the megatron-core fields the child passes to
``TransformerConfig``, ``DistributedDataParallelConfig`` and ``OptimizerConfig``, and picks the rank to trace: the
pipeline stage the planner finds worst (its ``worst_stage``). Never imports torch.
"""

from __future__ import annotations

from typing import Any

from mbridge_offload.config.errors import InputError
from mbridge_offload.plan.inputs.resolve import Resolved
from mbridge_offload.plan.model.architecture import ModelSpec
from mbridge_offload.plan.model.params import padded_vocab
from mbridge_offload.plan.model.run import Setup

# What the trace builds with megatron-core's local spec (no Transformer Engine here): the rest is refused, by name.
_NOT_YET = (
    (
        lambda m, s: m.is_moe and s.moe_token_dispatcher_type == "allgather",
        "MoE with the allgather token dispatcher (the trace balances the alltoall dispatcher's routing only)",
    ),
    (
        lambda m, s: m.is_moe and s.moe_token_dispatcher_type not in ("alltoall", "allgather"),
        "MoE with the flex token dispatcher (DeepEP / HybridEP kernels)",
    ),
    (
        lambda m, s: bool(m.layer_pattern and set(m.layer_pattern) - set("M*-E")),
        "hybrid layers other than Mamba, attention, MLP and MoE (gated delta net, DSA, MLA symbols)",
    ),
    (
        lambda m, s: bool(m.layer_pattern and (s.vpp or s.pipeline_layout or m.mtp_num_layers or s.cp > 1)),
        "a hybrid Mamba stack with VPP, a pipeline layout, MTP or CP",
    ),
    (
        lambda m, s: s.use_megatron_fsdp and s.optimizer_offload_fraction > 0,
        "optimizer CPU offload with Megatron-FSDP (the planner does not model it)",
    ),
    (
        lambda m, s: s.use_megatron_fsdp and bool(s.fp8_recipe and s.fp8_recipe != "none"),
        "FP8 recipes under Megatron-FSDP (the planner does not count TE's cached FP8 weights there yet)",
    ),
    (
        lambda m, s: s.use_megatron_fsdp and s.pp > 1,
        "Megatron-FSDP with PP > 1 (megatron-core's FSDP adapter lays its rank mesh over the whole world as "
        "(dp_cp ep tp), _get_dp_tp_mesh: a pipeline does not fit it, 0.16.1 and 0.19.2)",
    ),
    (
        lambda m, s: s.use_megatron_fsdp and (s.fsdp_main_grads_dtype or s.params_dtype) != s.params_dtype,
        "Megatron-FSDP with main gradients in another dtype than the parameters (megatron-core's local linears "
        "write them with torch.matmul(out=...) where TE's GEMM casts)",
    ),
    (
        lambda m, s: s.activation_offload_layers > 0 and s.te_release() < (2, 10),
        "layer-level activation offload before Transformer Engine 2.10 (TE's v1 offload path)",
    ),
    (
        lambda m, s: "fused_group_mlp" in s.offload_modules,
        "fine-grained offload of fused_group_mlp (Transformer Engine's op fuser)",
    ),
)


def unsupported(m: ModelSpec, s: Setup) -> list[str]:
    """What of this run the trace cannot build yet (empty when it can)."""
    return [words for test, words in _NOT_YET if test(m, s)]


def microbatches(s: Setup) -> int:
    """Micro-batches to run: enough for megatron-core's schedule to reach its steady state on every stage (the most
    it keeps in flight), no more (each one costs time, not memory). 1F1B holds at most PP; interleaving reaches
    its steady state within 2·PP."""
    total = s.num_microbatches()
    if s.pp == 1:
        return 1
    need = s.pp if s.vpp is None else 2 * s.pp
    return need if total is None else max(1, min(total, need))


def _transformer(m: ModelSpec, s: Setup) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "num_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "ffn_hidden_size": m.ffn_hidden_size,
        "num_attention_heads": m.num_attention_heads,
        "num_query_groups": m.num_query_groups,
        "kv_channels": m.kv_channels,
        "gated_linear_unit": m.gated_linear_unit,
        "swiglu": m.gated_linear_unit,
        # megatron-core's fused SwiGLU keeps the fc1 output only (Bridge's recipes switch it on)
        "bias_activation_fusion": m.gated_linear_unit,
        "add_bias_linear": m.add_bias_linear,
        "qk_layernorm": m.qk_layernorm,
        "normalization": "RMSNorm",
        "hidden_dropout": m.dropout,
        "attention_dropout": m.dropout,
        "tensor_model_parallel_size": s.tp,
        "pipeline_model_parallel_size": s.pp,
        "virtual_pipeline_model_parallel_size": s.vpp,
        # TE's attention runs the ring over it (trace/te_standins/context_parallel.py); RoPE keeps this rank's chunks
        "context_parallel_size": s.cp,
        "sequence_parallel": s.sp and s.tp > 1,
        "cross_entropy_loss_fusion": s.cross_entropy_loss_fusion,
        "cross_entropy_fusion_impl": s.cross_entropy_fusion_impl,
        # Bridge's GPTModelProvider sets it (megatron-core's default is False): after sending a stage's output,
        # schedules.py's deallocate_output_tensor frees its data, so a non-last stage does not keep one output per
        # in-flight micro-batch
        "deallocate_pipeline_outputs": True,
        # Bridge's GPTModelProvider sets it wherever the fused wgrad kernel is installed (every GPU run): weight
        # gradients go straight into main_grad (the child's patches provide the kernel's in-place no-op)
        "gradient_accumulation_fusion": True,
    }
    if m.is_moe:
        kw.update(_moe(m, s))
    if m.mla is not None:
        kw.update(_mla(m))
    if m.layer_pattern:
        kw.update(_mamba(m))
    if m.mtp_num_layers:  # the last stage builds the MTP depths and their loss (trace/step.py)
        kw["mtp_num_layers"] = m.mtp_num_layers
    if s.pipeline_layout is not None:
        kw["pipeline_model_parallel_layout"] = layout(m, s)
    if s.num_layers_in_first_pipeline_stage is not None:
        kw["num_layers_in_first_pipeline_stage"] = s.num_layers_in_first_pipeline_stage
    if s.num_layers_in_last_pipeline_stage is not None:
        kw["num_layers_in_last_pipeline_stage"] = s.num_layers_in_last_pipeline_stage
    kw.update(_activation_offload(s))
    if s.recompute_granularity in ("full", "selective"):
        kw["recompute_granularity"] = s.recompute_granularity
        if s.recompute_granularity == "full":
            kw["recompute_method"] = s.recompute_method or "uniform"
            kw["recompute_num_layers"] = s.recompute_num_layers or 1
        else:
            kw["recompute_modules"] = list(s.recompute_modules)
    return kw


def _activation_offload(s: Setup) -> dict[str, Any]:
    """Layer-level offload as ``TransformerBlock`` hands it to TE (activations: TE ignores weights from 2.10; the
    child's TE stand-in, ``trace/activation_offload/te_layers.py``) and megatron-core's fine-grained offloading with
    the planner's modules, size floor and fraction (a 0.19 field: passed only where it is not its default)."""
    kw: dict[str, Any] = {}
    if s.activation_offload_layers:
        kw.update(
            cpu_offloading=True,
            cpu_offloading_num_layers=s.activation_offload_layers,
            cpu_offloading_activations=True,
            cpu_offloading_weights=False,
        )
    if s.offload_modules:
        kw.update(
            fine_grained_activation_offloading=True,
            offload_modules=list(s.offload_modules),
            min_offloaded_tensor_size=s.min_offloaded_tensor_size,
        )
        if s.activation_offload_fraction != 1.0:
            kw["activation_offload_fraction"] = s.activation_offload_fraction
    return kw


def layout(m: ModelSpec, s: Setup) -> str:
    """megatron-core's layout string for the planner's decoder layers per virtual stage (``Setup.pipeline_layout``):
    megatron-core asserts the embedding first, the loss last and the MTP layers after all decoder layers
    (``validate_layer_layout``); the planner keeps its MTP depths on the last stage, so they go into the last virtual
    stage, before the loss."""
    stages = ["t" * n for n in s.pipeline_layout or ()]
    stages[0] = "E" + stages[0]
    stages[-1] += "m" * m.mtp_num_layers + "L"
    return "|".join(stages)


def _mla(m: ModelSpec) -> dict[str, Any]:
    """Multi-latent attention (the child builds ``MLATransformerConfig`` and megatron-core's ``MLASelfAttention``):
    the planner's latent ranks and head dimensions. The query and latent norms are on (``qk_layernorm``), as in every
    DeepSeek-style model Bridge builds; TE fuses each into its up projection (``TELayerNormColumnParallelLinear``), the
    local spec runs a norm then a linear, which keep the same tensors (``standins.FACTS["layernorm_linear"]``).
    Plain RoPE: YaRN's scaling changes values, not what is saved."""
    mla = m.mla
    assert mla is not None
    return {
        "multi_latent_attention": True,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_head_dim": mla.qk_head_dim,
        "qk_pos_emb_head_dim": mla.qk_pos_emb_head_dim,
        "v_head_dim": mla.v_head_dim,
        "qk_layernorm": True,
        "rope_type": "rope",
        # megatron-core 0.19.2 resolves MLA's norms and projections from the config's backend (mla_qk_norm_config.py):
        # the local one, whose modules the trace builds (the stand-ins stand for TE's)
        "transformer_impl": "local",
    }


def _mamba(m: ModelSpec) -> dict[str, Any]:
    """The Mamba mixer's shapes (megatron-core's ``mamba_*`` fields; the chunk 128 and ``d_conv`` 4 its defaults) and
    its training path (``use_mamba_mem_eff_path``, the default: mamba_ssm's fused kernel, trace/hybrid/)."""
    mb = m.mamba
    if mb is None:
        return {}
    return {
        "mamba_num_heads": mb.num_heads,
        "mamba_head_dim": mb.head_dim,
        "mamba_state_dim": mb.state_dim,
        "mamba_num_groups": mb.num_groups,
        "use_mamba_mem_eff_path": True,
    }


def _moe(m: ModelSpec, s: Setup) -> dict[str, Any]:
    """The MoE fields: the planner's experts, top-k, shared experts, leading dense layers and dispatcher; the
    router's load-balancing loss as the planner counts it (``aux_loss``: the fp32 softmax over all experts is saved).
    ``moe_grouped_gemm`` as the run sets it (Bridge's MoE recipes: on): the child builds TE's ``TEGroupedMLP`` for
    it with the grouped-linear stand-in (``trace.patches._grouped_experts``), megatron-core's ``SequentialMLP``
    without it."""
    return {
        "num_moe_experts": m.experts,
        "moe_ffn_hidden_size": m.expert_ffn_hidden_size,
        "moe_router_topk": m.moe_router_topk,
        "moe_shared_expert_intermediate_size": m.moe_shared_expert_intermediate_size,
        "moe_layer_freq": [0 if i < m.first_k_dense else 1 for i in range(m.num_layers)],
        "moe_token_dispatcher_type": s.moe_token_dispatcher_type,
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": 1e-3,
        "moe_grouped_gemm": s.moe_grouped_gemm,
        "expert_model_parallel_size": s.ep,
        "expert_tensor_parallel_size": s.resolved_etp(m),
    }


def _fsdp(s: Setup) -> dict[str, Any]:
    """Megatron-FSDP's DDP fields (the child builds megatron-core's ``FullyShardedDataParallel``, trace/fsdp/): always
    over the distributed optimizer, as Bridge forces it; the main dtypes are 0.19's fields (the child drops what its
    release does not have)."""
    if not s.use_megatron_fsdp:
        return {}
    return {
        "use_megatron_fsdp": True,
        "use_distributed_optimizer": True,
        "data_parallel_sharding_strategy": s.fsdp_sharding_strategy,
        "megatron_fsdp_main_params_dtype": s.fsdp_main_params_dtype,
        "megatron_fsdp_main_grads_dtype": s.fsdp_main_grads_dtype,
        # Bridge's FSDP recipes set it with optim_grads_params; megatron-core asserts it off for the EP overlap
        "fsdp_double_buffer": s.fsdp_sharding_strategy == "optim_grads_params",
        # Bridge sets it with the precision-aware optimizer (FusedAdam reads param.decoupled_grad)
        "megatron_fsdp_use_decoupled_grad": s.precision_aware_optimizer,
    }


def build(r: Resolved, stage: int, gpu: int = 0) -> dict[str, Any]:
    """The child's spec for pipeline rank ``stage`` of the resolved run (:func:`build_run`)."""
    return build_run(r.model, r.setup, stage, overlap=bool(r.inputs.overlap), gpu=gpu)


def build_run(m: ModelSpec, s: Setup, stage: int, overlap: bool = False, gpu: int = 0) -> dict[str, Any]:
    """The child's spec for pipeline rank ``stage`` of a run given as the planner's model and settings (``overlap``:
    the HybridDeviceOptimizer's overlapped copies; ``gpu``: which GPU of the stage, in rank order, as the planner's
    ``StageMemory.gpu`` names the one that keeps the most under optimizer offload).

    Raises:
        InputError: what the trace cannot build yet (:func:`unsupported`), or a stage outside the pipeline.
    """
    missing = unsupported(m, s)
    if missing:
        raise InputError(
            "trace cannot build this run yet: " + "; ".join(missing),
            "estimate answers for it with the planner's formulas; trace builds GPT models (local spec), dense or MoE "
            "with the alltoall dispatcher, and hybrid Mamba stacks of Mamba, attention, MLP and MoE layers, with TP, "
            "PP, VPP, pipeline layouts, CP, SP, EP, ETP, recompute, the distributed optimizer or Megatron-FSDP "
            "(PP 1), either HybridDeviceOptimizer, FP8 recipes and the activation offloads (TE's layer-level, "
            "megatron-core's fine-grained)",
        )
    if not 0 <= stage < s.pp:
        raise InputError(f"stage {stage} is outside the pipeline (PP {s.pp}: 0..{s.pp - 1})")
    return {
        "parallel": {
            "tp": s.tp,
            "pp": s.pp,
            "vpp": s.vpp,
            "cp": s.cp,
            "ep": s.ep,
            "etp": s.resolved_etp(m),
            "world": s.num_gpus,
        },
        "stage": stage,
        "gpu": gpu,
        "params_dtype": s.params_dtype,
        "transformer": _transformer(m, s),
        "ddp": {
            "use_distributed_optimizer": s.distributed_optimizer,
            "grad_reduce_in_fp32": s.grad_reduce_in_fp32,
            "overlap_grad_reduce": s.overlap_grad_reduce,
            "overlap_param_gather": s.overlap_param_gather and s.distributed_optimizer,
            **_fsdp(s),
        },
        "optimizer": {
            "optimizer": "adam",
            "lr": 1e-4,
            "bf16": s.params_dtype == "bf16",
            "fp16": s.params_dtype == "fp16",
            "params_dtype": s.params_dtype,
            "use_distributed_optimizer": s.distributed_optimizer or s.use_megatron_fsdp,
            "use_precision_aware_optimizer": s.precision_aware_optimizer,
            "main_params_dtype": s.main_params_dtype,
            "exp_avg_dtype": s.exp_avg_dtype,
            "exp_avg_sq_dtype": s.exp_avg_sq_dtype,
            # megatron-core's HybridDeviceOptimizer (Bridge builds it for optimizer_cpu_offload)
            "optimizer_cpu_offload": s.optimizer_offload_fraction > 0,
            "optimizer_offload_fraction": s.optimizer_offload_fraction,
            "overlap_cpu_optimizer_d2h_h2d": s.optimizer_offload_fraction > 0 and overlap,
            # which HybridDeviceOptimizer runs: megatron-core's, or ours through its install path (the child installs
            # it into megatron-core's factory, as a user's training script does)
            "hybrid_optimizer": s.hybrid_optimizer,
            # The gradient norm is not clipped: its value needs data (trace/patches.py), its memory is a scalar.
            "clip_grad": 0.0,
        },
        "vocab_size": padded_vocab(m, s.tp),  # Bridge builds GPTModel with the padded vocabulary
        "seq_length": s.seq_length or m.seq_length,
        "micro_batch_size": s.micro_batch_size,
        "num_microbatches": microbatches(s),
        "tied": m.tied_embeddings,
        # megatron-core's hybrid model from the pattern (trace/hybrid/stack.py); None for a GPT model
        "hybrid": {"pattern": m.layer_pattern} if m.layer_pattern else None,
        # the TE release the stand-ins follow where TE's allocations changed (trace.standins.TE_VERSION)
        "te_version": ".".join(map(str, s.te_release())),
        # TE's FP8 linears (trace/te_standins/fp8.py): the recipe, None for bf16 compute
        "fp8_recipe": s.fp8_recipe if s.fp8_recipe not in (None, "none") else None,
        "fp8_param": bool(s.fp8_param),
    }
