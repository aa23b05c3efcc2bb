"""What a Bridge run config says beyond its plain keys, for the planner's inputs: the pipeline layout, and the notes on
what the numbers leave out (hybrid layers, MTP, FP8 details, Megatron-FSDP), and the run settings the planner reads
beside its table (manual_gc, the MoE step settings, expandable segments). FP8, the gradient dtype and the
``mixed_precision`` block are read once, by ``mbridge_offload.config.effective``. ``resolve.py`` calls these; never
imports torch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mbridge_offload.config.errors import BoundsError as InputError
from mbridge_offload.config.schema import OffloadConfig
from mbridge_offload.plan.inputs.vocab import tokenizer_vocab
from mbridge_offload.plan.model.run import Setup
from mbridge_offload.upstream_layers import PLANNER_RELEASE

# The layer symbols of a hybrid pattern (megatron-core: HYBRID_SYMBOLS) and what each builds.
LAYER_KINDS = {"M": "Mamba", "G": "gated delta net", "*": "attention", "D": "DSA", "+": "MLA", "-": "MLP", "E": "MoE"}


def raw_section(raw: dict[str, Any] | None, name: str) -> dict[str, Any]:
    node = (raw or {}).get(name)
    return node if isinstance(node, dict) else {}


def model_notes(values: dict[str, Any], s: Setup, raw: dict[str, Any] | None) -> dict[str, str]:
    """What the numbers leave out, next to the input that brings it in."""
    from mbridge_offload.plan.model.layout import mtp_layers

    notes: dict[str, str] = {}
    layout = values.get("pipeline_layout")
    if layout:
        text = f"decides the layers of each stage: {list(s.pipeline_layout or ())} decoder layers per virtual stage"
        if values.get("vpp") not in (None, s.vpp):
            text += (
                f"; it implies VPP {s.vpp} but VPP {values['vpp']} is configured: megatron-core asserts "
                "'virtual_pipeline_model_parallel_size conflicts with pipeline_model_parallel_layout'"
            )
        if mtp_layers(layout):
            text += "; its MTP layers sit on the last stage, as mtp_num_layers puts them"
        notes["pipeline_layout"] = text
    model = raw_section(raw, "model")
    pattern = model.get("hybrid_layer_pattern") or model.get("hybrid_override_pattern")
    if pattern:
        main = str(pattern).split("/")[0]
        counts = ", ".join(f"{main.count(c)} {name}" for c, name in LAYER_KINDS.items() if main.count(c))
        notes["num_layers"] = (
            f"hybrid model (pattern {str(pattern)[:40]}…): {counts}, each a layer of its own; '|' stage marks are "
            f"not followed (stages split evenly); settings act as in megatron-core {PLANNER_RELEASE}'s HybridStack "
            "(references/upstream-layers.md: no layer-level offload; 0.16.1's MambaStack also ignores full "
            "recompute and fine-grained offload)"
        )
    if model.get("vocab_size") is None and (known := tokenizer_vocab(raw_section(raw, "tokenizer"))) is not None:
        name, vocab = known
        notes["vocab_size"] = (
            f"decided by the Hugging Face tokenizer {name} at start-up; taken from the shipped table "
            f"(mbridge_offload/plan/data/hf_vocab.yaml, {vocab.basis} size): {vocab.source}"
        )
    if values.get("fp8_recipe") not in (None, "none"):
        notes["fp8_recipe"] = (
            "GEMM inputs saved in 1 byte (MXFP8: + 1/32 scale bytes), the output projection keeps an FP8 copy of "
            "the attention output; norm inputs, q/k/v, SwiGLU input stay bf16; TE's cached FP8 weights (two bytes "
            "per weight element, none with fp8_param) and dummy weight gradients are held for the step (not counted "
            "under Megatron-FSDP); bf16 first/last layers and FP8 attention not modelled"
        )
    if values.get("use_megatron_fsdp"):
        notes["use_megatron_fsdp"] = (
            "Megatron-FSDP: fp32 main weights (megatron_fsdp_main_params_dtype) and Adam moments sharded over DP·CP "
            "(experts: expert DP); gradients in megatron_fsdp_main_grads_dtype (default the parameter dtype; "
            "grad_reduce_in_fp32 is not read); two layers of unsharded weights and gradients; no optimizer offload"
        )
    return notes


def with_layout(s: Setup, text: str) -> Setup:
    """The layout decides the layers of each stage and VPP (= stages / PP), as megatron-core derives it."""
    from mbridge_offload.plan.model.layout import decoder_counts

    try:
        counts = decoder_counts(text)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    if len(counts) % s.pp:
        raise InputError(
            f"pipeline_model_parallel_layout {text!r} has {len(counts)} stages: it must be divisible by PP {s.pp}"
        )
    vpp = len(counts) // s.pp
    return replace(s, pipeline_layout=counts, vpp=vpp if vpp > 1 else None)


def expandable_segments(raw: dict[str, Any] | None) -> bool:
    """Whether the config's ``env_vars`` set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (Bridge exports
    env_vars at launch): the planner's yardstick then takes the static-shape allocator overhead."""
    env = (raw or {}).get("env_vars")
    conf = env.get("PYTORCH_CUDA_ALLOC_CONF") if isinstance(env, dict) else None
    return isinstance(conf, str) and "expandable_segments:true" in conf.replace(" ", "").lower()


def manual_gc(config: OffloadConfig | None, raw: dict[str, Any] | None) -> bool:
    """``train.manual_gc`` as the run will have it: the config's, else Bridge's recipes' (True, recipes/common.py),
    else Megatron-LM's default (False) for an argv config."""
    given = raw_section(raw, "train").get("manual_gc")
    if given is None:  # Megatron-LM's --manual-gc (its argv keeps the flags no config section reads here)
        given = raw_section(raw, "megatron_lm").get("manual_gc")
    if given is None and config is not None:
        given = config.model_dump(mode="json").get("train", {}).get("manual_gc")
    if isinstance(given, bool):
        return given
    return not (config is not None and config.env.get("frontend") == "megatron-lm")


# model.* keys the MoE step time reads (plan/time/moe.py), with the Setup field each sets and its type.
_MOE_STEP_KEYS = {
    "moe_token_dispatcher_type": str,
    "overlap_moe_expert_parallel_comm": bool,
    "moe_router_force_load_balancing": bool,
    "moe_grouped_gemm": bool,
}


def moe_step_settings(
    config: OffloadConfig | None, raw: dict[str, Any] | None, values: dict[str, Any]
) -> dict[str, Any]:
    """The MoE step-time settings a config writes (else megatron-core's defaults stay)."""
    model = dict(config.model_dump(mode="json").get("model", {})) if config is not None else {}
    model.update(raw_section(raw, "model"))
    out: dict[str, Any] = {}
    for key, kind in _MOE_STEP_KEYS.items():
        if key in raw_section(raw, "model") and isinstance(model.get(key), kind):
            out[key] = model[key]
    return out


def hybrid_optimizer_note(s: Setup) -> str:
    """The assumption every answer carries: which HybridDeviceOptimizer the numbers count, and how to get the other.

    Args:
        s: the settings (``hybrid_optimizer``, ``manual_gc``).

    Returns:
        One sentence for the ``hybrid_optimizer`` assumption.
    """
    if s.hybrid_optimizer == "ours":
        return (
            "optimizer: our HybridDeviceOptimizer (mbridge_offload_runtime.optimizer.install_optimizer_offload() "
            "called before the optimizer is built; it frees its fp32 gradient copies after each step); without that "
            "call Bridge builds megatron-core's: pass hybrid_optimizer=megatron-core to count it"
        )
    gc_words = "" if s.manual_gc else "; no train.manual_gc: its first build's fp32 clones stay too"
    return (
        "optimizer: megatron-core's HybridDeviceOptimizer, what Bridge builds with optimizer_cpu_offload (it keeps "
        f"fp32 gradient copies on the GPU with the precision-aware optimizer{gc_words}); to use ours: call "
        "mbridge_offload_runtime.optimizer.install_optimizer_offload() before the optimizer is built, and pass "
        "hybrid_optimizer=ours"
    )
