"""What a Bridge run config says beyond its plain keys, for the planner's inputs: the pipeline layout, and the notes on
what the numbers leave out (hybrid layers, MTP, FP8 details, Megatron-FSDP). FP8, the gradient dtype and the
``mixed_precision`` block are read once, by ``mbridge_offload.config.effective``. ``resolve.py`` calls these; never
imports torch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mbridge_offload.config.errors import BoundsError as InputError
from mbridge_offload.plan.inputs.vocab import tokenizer_vocab
from mbridge_offload.plan.model.run import Setup
from mbridge_offload.upstream_layers import PLANNER_RELEASE

_KINDS = (
    ("M", "Mamba"),
    ("G", "gated delta net"),
    ("*", "attention"),
    ("D", "DSA"),
    ("+", "MLA"),
    ("-", "MLP"),
    ("E", "MoE"),
)


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
        counts = ", ".join(f"{main.count(c)} {name}" for c, name in _KINDS if main.count(c))
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
            "the attention output; norm inputs, q/k/v, SwiGLU input stay bf16; bf16 first/last layers and FP8 "
            "attention not modelled"
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
