"""Perturbations of the fields megatron-core checks that are not about offloading, and wrong-type values.

Part of the seeded generator of ``tests/support/config_gen.py`` (registered in its ``PERTURBATIONS``). An independent
tester does not stop at the offload keys: these draw the other checks of ``ModelParallelConfig`` /
``TransformerConfig.__post_init__`` (parallel sizes that do not divide, MoE settings, attention sizes, precision
flags, pipeline stage sizes) and put a value of the wrong type (a string, ``null``, a float, a bool, a list) into a
field megatron-core compares. megatron-core's dataclasses convert nothing: a wrong type either passes (``True`` is
1, ``2.0`` divides like 2) or fails with a ``TypeError`` at upstream's first comparison of it; either way the
oracle decides, and a ``TypeError`` counts as a refusal like any other exception.

Conventions: FP8 is never drawn together with MoE, and ``apply_rope_fusion`` is never set: both branches ask
whether Transformer Engine is installed, so the verdict would depend on the machine (a CPU box has none).
"""

from __future__ import annotations

import random
from typing import Any

Case = dict[str, Any]

# Integer fields megatron-core compares or does arithmetic with in its config checks (model section), with a
# plausible valid value to derive wrong-type variants from.
MODEL_NUMBERS: dict[str, int | float] = {
    "num_layers": 4,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "ffn_hidden_size": 256,
    "kv_channels": 16,
    "tensor_model_parallel_size": 2,
    "pipeline_model_parallel_size": 2,
    "context_parallel_size": 1,
    "expert_model_parallel_size": 1,
    "expert_tensor_parallel_size": 1,
    "num_moe_experts": 4,
    "moe_ffn_hidden_size": 128,
    "moe_router_topk": 2,
    "moe_shared_expert_intermediate_size": 64,
    "moe_expert_capacity_factor": 1.0,
    "virtual_pipeline_model_parallel_size": 2,
    "recompute_num_layers": 1,
    "cpu_offloading_num_layers": 1,
    "num_layers_in_first_pipeline_stage": 1,
    "num_layers_in_last_pipeline_stage": 1,
    "init_method_std": 0.02,
    "hidden_dropout": 0.1,
    "attention_dropout": 0.1,
    "layernorm_epsilon": 1e-5,
}
MODEL_FLAGS = (
    "fp16",
    "bf16",
    "sequence_parallel",
    "gated_linear_unit",
    "add_bias_linear",
    "moe_grouped_gemm",
    "apply_query_key_layer_scaling",
    "bias_activation_fusion",
    "multi_latent_attention",
)
OPTIMIZER_NUMBERS: dict[str, float] = {
    "lr": 1e-3,
    "min_lr": 1e-5,
    "weight_decay": 0.01,
    "adam_beta1": 0.9,
    "adam_beta2": 0.95,
    "adam_eps": 1e-8,
    "clip_grad": 1.0,
    "optimizer_offload_fraction": 0.5,
    "loss_scale": 1.0,
    "initial_loss_scale": 4096.0,
}


def wrong_type(rng: random.Random, value: Any) -> Any:
    """A value of another type than ``value``'s: its text, null, a float, a bool, a one-element list."""
    kind = rng.choice(["str", "str", "null", "float", "bool", "list"])
    if kind == "str":
        return str(value)
    if kind == "null":
        return None
    if kind == "float":
        return float(value) + rng.choice([0.0, 0.5])
    if kind == "bool":
        return rng.choice([True, False])
    return [value]


def p_wrong_type(rng: random.Random, case: Case) -> None:
    """A wrong-type value in one compared field (model numbers and flags, optimizer numbers)."""
    where = rng.choice(["model", "model", "flag", "optimizer"])
    if where == "model":
        key = rng.choice(sorted(MODEL_NUMBERS))
        current = case["model"].get(key, MODEL_NUMBERS[key])
        case["model"][key] = wrong_type(rng, current)
        if key in ("num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size") and rng.random() < 0.5:
            case["model"].setdefault("num_moe_experts", 4)
            case["model"]["add_bias_linear"] = False
    elif where == "flag":
        key = rng.choice(MODEL_FLAGS)
        case["model"][key] = rng.choice(["true", "false", "False", "0", None, 0, 1, 1.0, [True]])
    else:
        key = rng.choice(sorted(OPTIMIZER_NUMBERS))
        case["optimizer"][key] = wrong_type(rng, case["optimizer"].get(key, OPTIMIZER_NUMBERS[key]))


def p_parallel_sizes(rng: random.Random, case: Case) -> None:
    """Parallel sizes that may not divide: PP vs layers, CP, EP without experts, ETP."""
    m = case["model"]
    kind = rng.choice(["pp", "cp", "ep", "etp", "vpp"])
    if kind == "pp":
        m["pipeline_model_parallel_size"] = rng.choice([2, 3, 5])
        m["pipeline_dtype"] = "fp32"
    elif kind == "cp":
        m["context_parallel_size"] = rng.choice([2, 4])
    elif kind == "ep":
        m["expert_model_parallel_size"] = rng.choice([2, 4])
        if rng.random() < 0.5:
            m.update(num_moe_experts=rng.choice([4, 8]), add_bias_linear=False)
    elif kind == "etp":
        m.update(num_moe_experts=4, expert_tensor_parallel_size=rng.choice([1, 2]))
    else:
        m.update(pipeline_model_parallel_size=2, pipeline_dtype="fp32", virtual_pipeline_model_parallel_size=2)
        m["num_layers"] = rng.choice([4, 6, 8])


def p_moe(rng: random.Random, case: Case) -> None:
    """MoE settings checked by TransformerConfig: expert count, shared experts, capacity, dispatcher, router."""
    m = case["model"]
    m["num_moe_experts"] = rng.choice([4, 8, 8, 0, -2])
    m["add_bias_linear"] = rng.random() < 0.2
    for _ in range(rng.randint(1, 2)):
        kind = rng.choice(["shared", "capacity", "pad", "dispatcher", "topk", "bias", "gemm", "freq"])
        if kind == "shared":
            m["moe_shared_expert_intermediate_size"] = rng.choice([64, 0, -8])
            if rng.random() < 0.4:
                m["moe_shared_expert_overlap"] = True
        elif kind == "capacity":
            m["moe_expert_capacity_factor"] = rng.choice([1.0, 1.5, -1.0])
            if rng.random() < 0.4:
                m["moe_router_load_balancing_type"] = rng.choice(["aux_loss", "seq_aux_loss", "none", "sinkhorn"])
        elif kind == "pad":
            m["moe_pad_expert_input_to_capacity"] = True
        elif kind == "dispatcher":
            m["moe_token_dispatcher_type"] = rng.choice(["allgather", "alltoall", "flex"])
        elif kind == "topk":
            m["moe_router_topk"] = rng.choice([1, 2, 3])
            if rng.random() < 0.3:
                m["moe_router_pre_softmax"] = True
        elif kind == "bias":
            m["moe_router_enable_expert_bias"] = True
            m["moe_router_score_function"] = rng.choice(["softmax", "sigmoid"])
        elif kind == "gemm":
            m["moe_grouped_gemm"] = True
        else:
            m["moe_layer_freq"] = rng.choice([1, 2])


def p_attention_sizes(rng: random.Random, case: Case) -> None:
    """Attention and MLP sizes: query groups that do not divide the heads, explicit kv_channels / ffn size."""
    m = case["model"]
    heads = rng.choice([4, 6, 8])
    m.update(num_attention_heads=heads, hidden_size=heads * 16)
    kind = rng.choice(["groups", "groups", "kv", "ffn", "glu"])
    if kind == "groups":
        m["num_query_groups"] = rng.choice([1, 2, 3, 4, 5])
    elif kind == "kv":
        m["kv_channels"] = rng.choice([8, 16, 24])
    elif kind == "ffn":
        m["ffn_hidden_size"] = rng.choice([128, 200])
    else:
        m["gated_linear_unit"] = True
        m["bias_activation_fusion"] = rng.random() < 0.5


def p_low_precision(rng: random.Random, case: Case) -> None:
    """FP8 / FP4 flags and their pairings (never with MoE: see the module docstring)."""
    m = case["model"]
    m.pop("num_moe_experts", None)
    kind = rng.choice(["fp8_param", "fp4_param", "fp4+fp8", "fp8", "qk-scaling"])
    if kind == "fp8_param":
        m["fp8_param"] = True
    elif kind == "fp4_param":
        m["fp4_param"] = True
    elif kind == "fp4+fp8":
        m.update(fp4="nvfp4", fp8="hybrid")
    elif kind == "fp8":
        m.update(fp8=rng.choice(["e4m3", "hybrid"]), fp8_param=rng.random() < 0.5)
    else:
        m["apply_query_key_layer_scaling"] = True
        m[rng.choice(["fp16", "bf16"])] = True


def p_pipeline_stages(rng: random.Random, case: Case) -> None:
    """Uneven pipeline stages: the first / last stage's layer counts."""
    m = case["model"]
    m.update(pipeline_model_parallel_size=rng.choice([2, 4]), pipeline_dtype="fp32", num_layers=rng.choice([6, 8]))
    key = rng.choice(["num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"])
    m[key] = rng.choice([0, -1, 1, 2, 3])
    if rng.random() < 0.3:
        m["virtual_pipeline_model_parallel_size"] = 2


def p_graphed_recompute(rng: random.Random, case: Case) -> None:
    """Selective recompute inside a CUDA graph, with or without dropout (graphed modules replay random numbers)."""
    m = case["model"]
    m.pop("cpu_offloading", None)
    m["recompute_granularity"] = "selective"
    m["recompute_modules"] = rng.choice([["core_attn"], ["mlp"], ["core_attn", "mlp"], ["layernorm"]])
    kind = rng.choice(["enable", "local", "transformer_engine"])
    if kind == "enable":
        m["enable_cuda_graph"] = True
    else:
        m["cuda_graph_impl"] = kind
    for key in ("attention_dropout", "hidden_dropout"):
        if rng.random() < 0.5:
            m[key] = rng.choice([0.0, 0.1])
