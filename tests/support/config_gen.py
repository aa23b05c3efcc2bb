"""A seeded generator of near-valid training configs, each with one or two perturbations.

Used by the differential test (``tests/config/test_differential.py``) and the benchmark
(``benchmarks/validate_differential.py``): each case is judged by real megatron-core (``tests/support/mcore_oracle.py``)
and by ``validate``. A case is a small valid config (a base) plus perturbations drawn from the knobs that decide
offloading verdicts and from the common refusals of megatron-core's ``TransformerConfig`` / ``OptimizerConfig``:
boundaries (``cpu_offloading_num_layers`` at num_layers − 1 / num_layers), type variants (``"2"`` for 2, the string
``'false'``, ``null``), malformed recompute settings, CUDA-graph spellings, parallel sizes that do not divide; and
(``tests/support/config_gen_fields.py``) the checks that are not about offloading (MoE, attention sizes, FP8/FP4,
uneven pipeline stages) and wrong-type values (text, null, float, bool, list) in any field megatron-core compares.

Each case names a source: ``dict`` (the raw dict), ``yaml`` (written as YAML text and read back) or ``overrides``
(Hydra-style ``section.key=value`` on an empty config); :func:`case_to_source` renders it.

Conventions (documented with the results in docs/benchmarks-validate.md):
- ``pipeline_dtype`` is set whenever PP > 1 (Bridge's mixed-precision setup fills it in before MCore sees it).
- The precision-aware optimizer is only drawn with optimizer CPU offload: otherwise megatron-core imports
  Transformer Engine's FusedAdam, which a CPU machine does not have (the verdict would depend on the machine).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

from tests.support import config_gen_fields as fields

Case = dict[str, Any]
FG_MODULES = ["core_attn", "attn_proj", "expert_fc1", "moe_act", "attn_norm", "mlp_norm", "qkv_linear"]


def _base(rng: random.Random) -> Case:
    layers = rng.choice([2, 4, 8, 12])
    heads = rng.choice([4, 8, 16])
    model: dict[str, Any] = {"num_layers": layers, "hidden_size": heads * 16, "num_attention_heads": heads}
    model["tensor_model_parallel_size"] = rng.choice([1, 1, 2, 4])
    if rng.random() < 0.5:
        model["bf16"] = True
    mode = rng.choice(["layer", "layer", "fine", "none"])
    if mode == "layer":
        model.update(cpu_offloading=True, cpu_offloading_num_layers=rng.randint(0, layers - 1))
    elif mode == "fine":
        model.update(fine_grained_activation_offloading=True, offload_modules=rng.sample(FG_MODULES[2:], 2))
    opt: dict[str, Any] = {"optimizer": "adam"}
    if model.get("bf16"):
        opt["bf16"] = True
    if rng.random() < 0.6:
        opt.update(optimizer_cpu_offload=True, optimizer_offload_fraction=rng.choice([0.25, 0.5, 1.0]))
        opt["use_distributed_optimizer"] = True
        if rng.random() < 0.4:
            opt["use_precision_aware_optimizer"] = True
    return {"model": model, "optimizer": opt}


# ---------------------------------------------------------------------------------------------- perturbations


def _p_offload_layers(rng, case):
    m = case["model"]
    m["cpu_offloading"] = rng.choice([True, True, "true", "false", "False", 1, 0])
    n = int(float(m["num_layers"]))
    m["cpu_offloading_num_layers"] = rng.choice([-1, 0, 1, n - 2, n - 1, n, n + 3])


def _p_pipeline(rng, case):
    m = case["model"]
    m["pipeline_model_parallel_size"] = rng.choice([2, 3, 4])
    m["pipeline_dtype"] = rng.choice(["fp32", "bf16"])
    if rng.random() < 0.3:
        m["virtual_pipeline_model_parallel_size"] = rng.choice([2, 3])
    if rng.random() < 0.3:
        m["num_layers"] = rng.choice([6, 8, 12, 16])
    if rng.random() < 0.3:
        pp = m["pipeline_model_parallel_size"]
        m["pipeline_model_parallel_layout"] = _layout(int(float(m["num_layers"])), pp, rng)


def _layout(num_layers: int, pp: int, rng: random.Random) -> str:
    """A valid ``pipeline_model_parallel_layout`` string (Bridge 0.6 recipes set them) with 1 or 2 stages per rank:
    embedding first, loss last, the layers spread over the stages; its VPP may or may not match the case's."""
    stages = pp * rng.choice([1, 2])
    counts = [num_layers // stages + (1 if i < num_layers % stages else 0) for i in range(stages)]
    parts = ["t" * c for c in counts]
    parts[0], parts[-1] = "E" + parts[0], parts[-1] + "L"
    return "|".join(parts)


def _p_recompute(rng, case):
    m = case["model"]
    kind = rng.choice(["full", "full", "selective", "none-str", "null-str", "bad", "full-no-method", "sel-layers"])
    if kind == "full":
        m.update(
            recompute_granularity="full",
            recompute_method=rng.choice(["uniform", "block", "blocks"]),
            recompute_num_layers=rng.choice([1, 2, None]),
        )
    elif kind == "selective":
        m["recompute_granularity"] = "selective"
        if rng.random() < 0.3:
            m["recompute_modules"] = rng.choice([["core_attn"], ["mlp"], ["moe_act"], ["layernorm", "bogus"]])
    elif kind in ("none-str", "null-str"):
        m["recompute_granularity"] = rng.choice(["none", "None", "null"])
    elif kind == "bad":
        m["recompute_granularity"] = "partial"
    elif kind == "full-no-method":
        m.update(recompute_granularity="full", recompute_num_layers=1)
    else:
        m.update(recompute_granularity="selective", recompute_num_layers=1)


def _p_cuda_graph(rng, case):
    m = case["model"]
    kind = rng.choice(["local", "transformer_engine", "full_iteration", "magic", "null", "enable", "external", "both"])
    if kind == "enable":
        m["enable_cuda_graph"] = True
    elif kind == "external":
        m["external_cuda_graph"] = True
    elif kind == "both":
        m[rng.choice(["enable_cuda_graph", "external_cuda_graph"])] = True
        m["cuda_graph_impl"] = rng.choice(["local", "full_iteration", "transformer_engine"])
    else:
        m["cuda_graph_impl"] = None if kind == "null" else kind


def _p_fine_grained(rng, case):
    m = case["model"]
    m["fine_grained_activation_offloading"] = rng.choice([True, True, True, "false"])
    pool = [*FG_MODULES, "fused_group_mlp", "foo"]
    m["offload_modules"] = rng.sample(pool, rng.randint(0, 3))
    if rng.random() < 0.3:
        key = rng.choice(
            ["min_offloaded_tensor_size", "activation_offload_fraction", "delta_offload_bytes_across_pp_ranks"]
        )
        m[key] = rng.choice([-1, 0, 2, 0.5, 1.5])


def _p_paged_stash(rng, case):
    m = case["model"]
    m["moe_paged_stash"] = True
    if rng.random() < 0.3:
        m["num_moe_experts"] = 4


def _p_type_variant(rng, case):
    m = case["model"]
    kind = rng.choice(["num_layers-str", "bool-str", "impl-null", "layers-float", "offload-layers-str-or-null"])
    if kind == "num_layers-str" and isinstance(m["num_layers"], int | float | str):
        # An earlier perturbation may have left a wrong-type value (a list, null): that one then stays.
        m["num_layers"] = str(int(float(m["num_layers"])))
    elif kind == "offload-layers-str-or-null":  # compared with 0 as given once offloading is on
        m["cpu_offloading"] = True
        m["cpu_offloading_num_layers"] = rng.choice(["1", "0", None])
    elif kind == "bool-str":
        m[rng.choice(["cpu_offloading", "bf16", "sequence_parallel"])] = rng.choice(["false", "true", "False"])
    elif kind == "impl-null":
        m["cuda_graph_impl"] = None
    elif isinstance(m["num_layers"], int | float):
        m["num_layers"] = float(m["num_layers"]) if rng.random() < 0.5 else float(m["num_layers"]) + 0.5


def _p_heads(rng, case):
    m = case["model"]
    m["num_attention_heads"] = rng.choice([3, 6, 12])
    m["hidden_size"] = m["num_attention_heads"] * 16
    if rng.random() < 0.4:
        m["num_query_groups"] = rng.choice([1, 2, 3])


def _p_precision(rng, case):
    m = case["model"]
    kind = rng.choice(["fp16+bf16", "sp-no-tp", "sp", "fp16"])
    if kind == "fp16+bf16":
        m.update(fp16=True, bf16=True)
    elif kind == "fp16":
        m["fp16"] = True
        m.pop("bf16", None)
    else:
        m["sequence_parallel"] = True
        if kind == "sp-no-tp":
            m["tensor_model_parallel_size"] = 1


def _p_optimizer(rng, case):
    o = case["optimizer"]
    kind = rng.choice(["dtype", "pao", "pao-sgd", "pao-ddp", "fraction", "wd", "sgd", "skip", "dist"])
    if kind == "dtype":
        o[rng.choice(["main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype"])] = "bf16"
    elif kind in ("pao", "pao-sgd", "pao-ddp"):
        o.update(optimizer_cpu_offload=True, use_precision_aware_optimizer=True)
        if kind == "pao-sgd":
            o["optimizer"] = "sgd"
        if kind == "pao-ddp":
            o.pop("use_distributed_optimizer", None)
            case.setdefault("ddp", {})["use_distributed_optimizer"] = True
    elif kind == "fraction":
        o["optimizer_offload_fraction"] = rng.choice([0.0, 1.5, -0.2, 0.75])
    elif kind == "wd":
        o["decoupled_weight_decay"] = False
    elif kind == "sgd":
        o["optimizer"] = "sgd"
    elif kind == "skip":
        o["skip_megatron_wrapping"] = True
    else:
        o["use_distributed_optimizer"] = rng.choice([False, True])


def _p_offload_flags(rng, case):
    m = case["model"]
    for key in ("cpu_offloading_activations", "cpu_offloading_weights", "cpu_offloading_double_buffering"):
        if rng.random() < 0.4:
            m[key] = key != "cpu_offloading_activations"


PERTURBATIONS: list[tuple[str, Callable[[random.Random, Case], None], int]] = [
    ("offload-layers", _p_offload_layers, 3),
    ("pipeline", _p_pipeline, 2),
    ("recompute", _p_recompute, 3),
    ("cuda-graph", _p_cuda_graph, 3),
    ("fine-grained", _p_fine_grained, 3),
    ("paged-stash", _p_paged_stash, 1),
    ("type-variant", _p_type_variant, 2),
    ("heads", _p_heads, 1),
    ("precision", _p_precision, 2),
    ("optimizer", _p_optimizer, 3),
    ("offload-flags", _p_offload_flags, 1),
    # Checks that are not about offloading, and wrong-type values (tests/support/config_gen_fields.py).
    ("wrong-type", fields.p_wrong_type, 4),
    ("parallel-sizes", fields.p_parallel_sizes, 2),
    ("moe", fields.p_moe, 3),
    ("attention-sizes", fields.p_attention_sizes, 2),
    ("low-precision", fields.p_low_precision, 2),
    ("pipeline-stages", fields.p_pipeline_stages, 1),
    ("graphed-recompute", fields.p_graphed_recompute, 1),
]
_LAST = ("type-variant", "wrong-type")  # they break the numbers other perturbations compute with: applied last


def _drop_pao_without_offload(case: Case) -> None:
    o = case["optimizer"]
    if o.get("use_precision_aware_optimizer") and not o.get("optimizer_cpu_offload"):
        o["use_precision_aware_optimizer"] = False


def _drop_fp8_with_moe(case: Case) -> None:
    # Convention (config_gen_fields.py): FP8 with MoE asks which Transformer Engine is installed; a wrong-type
    # perturbation can turn the experts on after the FP8 one ran.
    m = case["model"]
    if m.get("fp8") and m.get("num_moe_experts"):
        m.pop("fp8")


def generate_case(rng: random.Random, case_id: int) -> Case:
    """One case: ``{"id", "source", "perturbations", "model", "optimizer"[, "ddp"]}``."""
    case = _base(rng)
    names = [name for name, _, weight in PERTURBATIONS for _ in range(weight)]
    chosen = rng.sample(names, rng.choice([1, 1, 2]))
    for name in sorted(chosen, key=lambda n: n in _LAST):
        dict((n, f) for n, f, _ in PERTURBATIONS)[name](rng, case)
    m = case["model"]
    pp = m.get("pipeline_model_parallel_size")
    if isinstance(pp, (int, float)) and not isinstance(pp, bool) and pp > 1:
        m.setdefault("pipeline_dtype", "fp32")
    _drop_pao_without_offload(case)
    _drop_fp8_with_moe(case)
    case.update(id=case_id, perturbations=chosen, source=rng.choice(["dict", "dict", "yaml", "overrides"]))
    return case


def generate(seed: int, n: int) -> list[Case]:
    """``n`` cases from ``seed`` (deterministic)."""
    rng = random.Random(seed)
    return [generate_case(rng, i) for i in range(n)]


def raw_config(case: Case) -> dict[str, Any]:
    """The config sections of a case, as a Bridge YAML would hold them."""
    return {k: dict(case[k]) for k in ("model", "optimizer", "ddp") if k in case}


def _override_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return "'" + value + "'"  # quoted: a string stays a string ('2', 'false')
    if isinstance(value, list):
        return "[" + ",".join(_override_value(v) for v in value) + "]"
    return json.dumps(value)


def case_to_source(case: Case) -> dict[str, Any]:
    """How to hand the case to ``sources.load``: ``{"source": text}`` or ``{"overrides": [...]}``."""
    raw = raw_config(case)
    if case["source"] == "yaml":
        import io

        from ruamel.yaml import YAML

        out = io.StringIO()
        YAML(typ="safe", pure=True).dump(raw, out)
        return {"source": out.getvalue()}
    if case["source"] == "overrides":
        return {"overrides": [f"+{s}.{k}={_override_value(v)}" for s, body in raw.items() for k, v in body.items()]}
    return {"raw": raw}


# ---------------------------------------------------------------------------------------------- planner variants

_BRIDGE_TARGET = "megatron.bridge.models.gpt_provider.GPTModelProvider"


def planner_variant(rng: random.Random, case: Case) -> Case:
    """``case`` made sizeable by the planner and read the ways a Bridge user writes it: a vocabulary; sometimes a
    Bridge ``ConfigContainer`` (``_target_``, so Bridge's ``finalize()`` applies), a MoE with EP > 1 and no ETP, PP
    without ``pipeline_dtype``, a ``mixed_precision`` block, or the distributed optimizer only in ``ddp``. Used by
    the test that every tool prints the same ``effective`` block and memory (tests/tools/test_effective_agreement.py).
    """
    case = json.loads(json.dumps(case))
    m, o = case["model"], case["optimizer"]
    m["vocab_size"] = rng.choice([1000, 32000])
    if rng.random() < 0.6:
        m["_target_"] = _BRIDGE_TARGET
    if rng.random() < 0.4:
        m.update(num_moe_experts=8, moe_ffn_hidden_size=m["hidden_size"], moe_router_topk=2)
        m["expert_model_parallel_size"] = rng.choice([2, 4])
        m.pop("expert_tensor_parallel_size", None)
    if rng.random() < 0.3:
        m["pipeline_model_parallel_size"] = 2
        m.pop("pipeline_dtype", None)
    if rng.random() < 0.3:
        case["mixed_precision"] = {"bf16": True, "params_dtype": "bf16", "grad_reduce_in_fp32": rng.random() < 0.5}
    if rng.random() < 0.3 and "use_distributed_optimizer" in o:
        case["ddp"] = {"use_distributed_optimizer": o.pop("use_distributed_optimizer")}
    if rng.random() < 0.3:
        case.setdefault("ddp", {})["grad_reduce_in_fp32"] = rng.random() < 0.5
    return case


def planner_raw(case: Case) -> dict[str, Any]:
    """:func:`raw_config` with a planner variant's ``mixed_precision`` block."""
    raw = raw_config(case)
    if "mixed_precision" in case:
        raw["mixed_precision"] = dict(case["mixed_precision"])
    return raw
