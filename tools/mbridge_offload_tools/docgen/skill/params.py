"""The parameter reference: every ``model.*``, ``optimizer.*`` and ``ddp.*`` field with its default and meaning.

The defaults are read from ``mbridge_offload.config.schema``; this module adds only the words and the grouping.
"""

from __future__ import annotations

import json
from typing import Any

from mbridge_offload.config.schema import OFFLOAD_KEYS, RELATED_KEYS, SECTIONS, field_default

# What each field means, in the user's words; upstream's docstring where it has one.
MEANINGS: dict[str, str] = {
    # --- layer-level activation offloading (MCore model_parallel_config.py, "CPU Offloading")
    "model.cpu_offloading": "Master switch of layer-level activation offloading (Transformer Engine's offload context "
    "around each transformer layer). Needs PP = 1, no recompute, no CUDA graphs except `full_iteration`.",
    "model.cpu_offloading_num_layers": "How many transformer layers (counted from the first) have their activations "
    "offloaded. Valid range 0 … num_layers − 1 inclusive in Megatron Core; Transformer Engine ≥ 2.10 warns at "
    "num_layers − 1 (no compute/transfer overlap left). On the Megatron-LM CLI a value > 0 also switches "
    "`cpu_offloading` on; Bridge does not derive it.",
    "model.cpu_offloading_activations": "Offload the layer's saved activations. Setting it and "
    "`cpu_offloading_weights` both false makes Transformer Engine raise deep in model construction.",
    "model.cpu_offloading_weights": "Offload weights too. Deprecated in Transformer Engine since April 2025: it has "
    "no effect.",
    "model.cpu_offloading_double_buffering": "Double-buffer the reload across layers. Ignored by the default "
    "Transformer Engine path since TE 2.10 (only the legacy `NVTE_CPU_OFFLOAD_V1=1` path reads it).",
    "model.cpu_offloading_retain_pinned_cpu_buffers": "Keep the pinned host buffers and reuse them next iteration "
    "(needed for CUDA-graph capture before PyTorch 2.11); shapes must then stay the same.",
    # --- fine-grained activation offloading (MCore transformer_config.py)
    "model.fine_grained_activation_offloading": "Module-level activation offloading (the newer MCore feature; works "
    "with PP > 1). Mutually exclusive with `cpu_offloading`; with TE ≥ 2.10 needs `NVTE_CPU_OFFLOAD_V1=1`.",
    "model.offload_modules": "Which submodules' inputs fine-grained offloading moves (attn_norm, qkv_linear, "
    "core_attn, attn_proj, mlp_norm, expert_fc1, moe_act, …).",
    "model.min_offloaded_tensor_size": "Fine-grained offloading skips tensors with fewer elements than this.",
    "model.activation_offload_fraction": "Fraction of eligible fine-grained groups (in execution order, not bytes) "
    "that are offloaded.",
    "model.delay_offload_until_cuda_graph": "Fine-grained: defer the D2H launch of delayed-commit groups until after "
    "the CUDA-graph replay.",
    "model.delta_offload_bytes_across_pp_ranks": "Fine-grained: offload this many fewer bytes on each higher "
    "pipeline rank.",
    "model.fine_grained_offloading_max_inflight_offloads": "Fine-grained: cap on un-joined D2H copies per group "
    "name (0 = wait after each).",
    # --- optimizer offloading (MCore optimizer_config.py, "Optimizer Offload")
    "optimizer.optimizer_cpu_offload": "Master switch of optimizer offloading: Megatron Core builds a "
    "`HybridDeviceOptimizer` that runs part of the Adam step on the CPU.",
    "optimizer.optimizer_offload_fraction": "Fraction of the parameters (by element count, greedy in parameter "
    "order) whose optimizer states and step live on the CPU. The dataclass default 0.0 offloads nothing: set it "
    "explicitly in Bridge. The Megatron-LM CLI default is 1.0.",
    "optimizer.use_torch_optimizer_for_cpu_offload": "Meant to use torch.optim for the GPU part too; the factory "
    "overwrites the choice, so it has no effect.",
    "optimizer.overlap_cpu_optimizer_d2h_h2d": "Pipeline gradient D2H, the CPU step and the parameter H2D per "
    "parameter on side streams (upstream measured ≈ 7 % faster at fraction 1.0).",
    "optimizer.pin_cpu_grads": "Pin the CPU gradient buffers (faster, asynchronous D2H).",
    "optimizer.pin_cpu_params": "Pin the CPU parameter copies and fp32 masters (faster, asynchronous H2D).",
    "optimizer.skip_megatron_wrapping": "An argument of `get_megatron_optimizer`; True is refused together with "
    "`optimizer_cpu_offload`.",
    # --- optimizer fields the offload rules and the planner read
    "optimizer.optimizer": "Optimizer name. Under CPU offload anything but `adam` silently becomes SGD.",
    "optimizer.lr": "Learning rate.",
    "optimizer.min_lr": "Minimum learning rate of the schedule.",
    "optimizer.weight_decay": "Weight decay.",
    "optimizer.adam_beta1": "Adam β1.",
    "optimizer.adam_beta2": "Adam β2.",
    "optimizer.adam_eps": "Adam ε.",
    "optimizer.sgd_momentum": "SGD momentum (used when the optimizer is not Adam).",
    "optimizer.clip_grad": "Gradient-norm clipping threshold.",
    "optimizer.bf16": "bf16 training (the optimizer keeps fp32 main params).",
    "optimizer.fp16": "fp16 training.",
    "optimizer.params_dtype": "Parameter dtype.",
    "optimizer.fp8_recipe": "FP8 recipe; with `fp8_param_gather` and CPU offload Megatron-LM requires `delayed`.",
    "optimizer.use_distributed_optimizer": "Shard optimizer states over data-parallel ranks. The upstream skill "
    "calls it a requirement of optimizer offload; no upstream code enforces it (advisory).",
    "optimizer.use_precision_aware_optimizer": "TE FusedAdam with reduced-precision states/masters. Megatron-LM's "
    "`validate_args` requires it with `--optimizer-cpu-offload`; Bridge does not. With offload, the hybrid "
    "optimizer owns the fp32 masters, so they move to the CPU too.",
    "optimizer.decoupled_weight_decay": "AdamW-style decoupled weight decay; optimizer offload asserts it.",
    "optimizer.store_param_remainders": "Precision-aware: store the bf16 remainders instead of full fp32 masters.",
    "optimizer.main_grads_dtype": "Dtype of the main gradients.",
    "optimizer.main_params_dtype": "Dtype of the main (master) parameters.",
    "optimizer.exp_avg_dtype": "Dtype of Adam's first moment (precision-aware optimizer only).",
    "optimizer.exp_avg_sq_dtype": "Dtype of Adam's second moment (precision-aware optimizer only).",
    "optimizer.overlap_param_gather": "Overlap the parameter all-gather with the forward pass.",
    # --- model fields the rules and the planner read
    "model.num_layers": "Number of transformer layers (bounds `cpu_offloading_num_layers`). Not given = unknown; "
    "upstream's placeholder is 0.",
    "model.hidden_size": "Hidden size (memory model).",
    "model.ffn_hidden_size": "MLP hidden size (memory model).",
    "model.num_attention_heads": "Attention heads (memory model).",
    "model.num_query_groups": "Key/value groups for GQA (memory model).",
    "model.kv_channels": "Per-head channels (memory model).",
    "model.seq_length": "Sequence length (activation memory).",
    "model.vocab_size": "Vocabulary size (embedding and output layer memory).",
    "model.gated_linear_unit": "SwiGLU-style gated MLP (memory model).",
    "model.add_bias_linear": "Biases in linear layers (memory model).",
    "model.share_embeddings_and_output_weights": "Tied input/output embeddings (memory model).",
    "model.multi_latent_attention": "Multi-latent attention (DeepSeek-style; memory model).",
    "model.num_moe_experts": "Number of MoE experts (None = dense).",
    "model.moe_ffn_hidden_size": "Expert MLP hidden size.",
    "model.moe_router_topk": "Experts per token.",
    "model.moe_shared_expert_intermediate_size": "Shared-expert hidden size.",
    "model.moe_layer_freq": "Which layers are MoE layers.",
    "model.moe_paged_stash": "MoE paged stash; cannot be combined with `cpu_offloading`.",
    "model.tensor_model_parallel_size": "Tensor parallel size (TP).",
    "model.pipeline_model_parallel_size": "Pipeline parallel size (PP); layer-level activation offloading needs 1.",
    "model.virtual_pipeline_model_parallel_size": "Virtual pipeline stages per rank (interleaved schedule).",
    "model.context_parallel_size": "Context parallel size (CP).",
    "model.expert_model_parallel_size": "Expert parallel size (EP).",
    "model.expert_tensor_parallel_size": "Expert tensor parallel size (ETP).",
    "model.sequence_parallel": "Sequence parallelism (divides activations by TP).",
    "model.pipeline_dtype": "Dtype of pipeline communication.",
    "model.bf16": "bf16 model.",
    "model.fp16": "fp16 model.",
    "model.params_dtype": "Parameter dtype.",
    "model.fp8": "FP8 format (None = off).",
    "model.recompute_granularity": "Activation recomputation (`full`, `selective` or null); layer-level activation "
    "offloading needs null.",
    "model.recompute_method": "Full-recompute method (`uniform` or `block`).",
    "model.recompute_num_layers": "Layers recomputed under full recompute.",
    "model.recompute_modules": "Modules recomputed under selective recompute.",
    "model.cuda_graph_impl": "CUDA-graph implementation (`none`, `local`, `transformer_engine`, `full_iteration`); "
    "activation offloading allows only `none` and `full_iteration`.",
    "model.cuda_graph_scope": "What the CUDA graphs capture (the default differs by release).",
    "model.enable_cuda_graph": "Legacy CUDA-graph switch.",
    "model.external_cuda_graph": "Legacy spelling of cuda_graph_impl=transformer_engine.",
    "model.cuda_graph_warmup_steps": "Warm-up steps before CUDA-graph capture (> 0 with fine-grained offloading).",
    "model.use_transformer_engine_op_fuser": "TE op fuser (needed to offload fused_group_mlp).",
    "model.moe_expert_rank_capacity_factor": "Per-rank MoE capacity factor (needed by moe_paged_stash).",
    "model.moe_grouped_gemm": "Grouped GEMM for MoE experts (needed to recompute moe_act).",
    "model.distribute_saved_activations": "Distribute recomputed checkpoints across TP ranks (not with SP).",
    "model.transformer_impl": "`transformer_engine` or `local`; fine-grained offloading needs `transformer_engine`.",
    # --- ddp
    "ddp.use_distributed_optimizer": "Distributed optimizer, as the DDP config sees it (Bridge keeps it in step "
    "with `optimizer.use_distributed_optimizer`).",
    "ddp.use_megatron_fsdp": "Megatron-FSDP; version 2 rejects optimizer CPU offload.",
    "ddp.use_custom_fsdp": "Older name of Megatron-FSDP.",
    "ddp.data_parallel_sharding_strategy": "FSDP sharding strategy (`no_shard`, `optim`, `optim_grads`, "
    "`optim_grads_params`).",
    "ddp.grad_reduce_in_fp32": "Reduce gradients in fp32 (gradient buffer memory).",
    "ddp.overlap_grad_reduce": "Overlap the gradient reduce-scatter with backward.",
    "ddp.overlap_param_gather": "Overlap the parameter all-gather with forward.",
    "ddp.fp8_param_gather": "Gather parameters in FP8; with CPU offload Megatron-LM requires the `delayed` recipe.",
    "ddp.megatron_fsdp_version": "Megatron-FSDP version (2 rejects optimizer CPU offload).",
}

# The groups of docs/parameters.md, in order. A field not named here lands in the "other" group of its section.
GROUPS: list[tuple[str, list[str]]] = [
    ("Layer-level activation offloading", [k for k in OFFLOAD_KEYS if k.startswith("model.cpu_offloading")]),
    (
        "Fine-grained activation offloading",
        [
            "model.fine_grained_activation_offloading",
            "model.offload_modules",
            "model.min_offloaded_tensor_size",
            "model.activation_offload_fraction",
            "model.delay_offload_until_cuda_graph",
            "model.delta_offload_bytes_across_pp_ranks",
            "model.fine_grained_offloading_max_inflight_offloads",
        ],
    ),
    (
        "Optimizer offloading",
        [k for k in OFFLOAD_KEYS if k.startswith("optimizer.")] + ["optimizer.skip_megatron_wrapping"],
    ),
    ("Keys the offload rules read", [k for k in RELATED_KEYS if k not in OFFLOAD_KEYS]),
]

# The short table in SKILL.md: the keys a user sets to switch offloading on, plus the switches that decide the rules.
SKILL_KEYS: tuple[str, ...] = (
    *(k for k in OFFLOAD_KEYS if k.startswith("model.cpu_offloading")),
    *(k for k in OFFLOAD_KEYS if k.startswith("optimizer.")),
)


def all_keys() -> list[str]:
    """Every dotted field of the sections this reference covers (model, optimizer, ddp)."""
    return [f"{name}.{field}" for name in ("model", "optimizer", "ddp") for field in SECTIONS[name].model_fields]


def format_default(value: Any) -> str:
    """A default as a user writes it in YAML (``null``, ``true``, ``0.0``, ``[]``), in backticks."""
    return f"`{json.dumps(value)}`"


def megatron_lm_flags() -> dict[str, str]:
    """dotted key → the Megatron-LM flag that sets it (Megatron-LM's full parser, ``config.megatron_lm``)."""
    from mbridge_offload.config.megatron_lm.argv import flags_by_key

    return flags_by_key()


def _row(key: str, flags: dict[str, str]) -> str:
    from mbridge_offload.config.megatron_lm.argv import MLM_CLI_DEFAULTS

    default = format_default(field_default(key))
    flag = f"`{flags[key]}`" if key in flags else ""
    if key in MLM_CLI_DEFAULTS:
        flag += f" (CLI default {format_default(MLM_CLI_DEFAULTS[key])})"
    return f"| `{key}` | {default} | {flag} | {MEANINGS.get(key, '')} |"


_HEADER = "| key | default | Megatron-LM flag | meaning |\n|---|---|---|---|"


def render_skill_parameters() -> str:
    """The parameter table of SKILL.md (the offload switches only)."""
    flags = megatron_lm_flags()
    return "\n".join([_HEADER, *(_row(k, flags) for k in SKILL_KEYS)])


def render_parameters_doc() -> str:
    """The generated body of docs/parameters.md: every model/optimizer/ddp field, grouped."""
    flags = megatron_lm_flags()
    seen: set[str] = set()
    parts: list[str] = []
    for title, keys in GROUPS:
        parts += [f"### {title}", "", _HEADER, *(_row(k, flags) for k in keys), ""]
        seen.update(keys)
    for section in ("model", "optimizer", "ddp"):
        rest = [k for k in all_keys() if k.startswith(section + ".") and k not in seen]
        if rest:
            parts += [f"### Other `{section}.*` fields", "", _HEADER, *(_row(k, flags) for k in rest), ""]
    return "\n".join(parts).rstrip("\n")
