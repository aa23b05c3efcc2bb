"""Failure modes of layer-level activation offloading: the combinations megatron-core refuses, Transformer
Engine's build-time refusals and call shapes, and its double-buffered reload.

Data for :mod:`mbridge_offload.actions.diagnose.diagnose` (the catalogue in ``catalogue.py`` lists every family).
"""

from __future__ import annotations

from mbridge_offload.actions.diagnose import conditions as fc
from mbridge_offload.actions.diagnose.failures.base import SWITCH_TO_OPTIMIZER, FailureMode, fix_layer_range

ACTIVATION: tuple[FailureMode, ...] = (
    # --- the upstream config errors (also matched from the rule catalogue; these carry the confirm step)
    FailureMode(
        "pp_constraint",
        "Activation offloading with pipeline parallelism",
        (r"Currently there is no support for Pipeline parallelism with CPU offloading",),
        "layer-level activation offloading (model.cpu_offloading) is used with pipeline_model_parallel_size > 1; "
        "Megatron Core refuses the combination",
        "check model.pipeline_model_parallel_size in the config (or --pipeline-model-parallel-size)",
        SWITCH_TO_OPTIMIZER,
        (
            "alternatively keep activation offload and set model.pipeline_model_parallel_size=1 if the model fits on "
            "one stage (see `mbridge-offload estimate`)",
        ),
    ),
    FailureMode(
        "recompute_constraint",
        "Activation offloading with recomputation",
        (r"CPU offloading does not work when activation recomputation is enabled",),
        "model.cpu_offloading is combined with activation recomputation (recompute_granularity is not null)",
        "check model.recompute_granularity",
        ("model.recompute_granularity=null",),
        ("or keep recompute and switch activation offload off (model.cpu_offloading=false)",),
    ),
    FailureMode(
        "fine_grained_constraint",
        "Layer-level and fine-grained activation offloading together",
        (r"fine_grained_activation_offloading cannot be enabled with cpu_offloading",),
        "both activation-offload mechanisms are on; their saved-tensor hooks and schedules would corrupt each other",
        "check model.fine_grained_activation_offloading and model.cpu_offloading",
        ("model.fine_grained_activation_offloading=false",),
        ("or keep fine-grained offloading (works with PP>1) and set model.cpu_offloading=false",),
    ),
    FailureMode(
        "cuda_graph_constraint",
        "Activation offloading with CUDA graphs",
        (r"CUDA graphs not supported with CPU offloading", r"Cudagraphs not supported"),
        "CUDA graphs (cuda_graph_impl other than none/full_iteration, or Bridge's local CUDA-graph manager) are on "
        "together with model.cpu_offloading",
        "check model.cuda_graph_impl and model.enable_cuda_graph",
        ("model.cuda_graph_impl=none",),
        ("or keep CUDA graphs and use optimizer offloading instead (unaffected by CUDA graphs)",),
    ),
    FailureMode(
        "layer_range",
        "Too many offloaded layers",
        (r"CPU offloading can be done only for layers less than (?P<n>\d+)",),
        "model.cpu_offloading_num_layers is not below model.num_layers (at least one layer must stay on the GPU)",
        "compare model.cpu_offloading_num_layers with model.num_layers",
        fix_layer_range,
    ),
    FailureMode(
        "te_nothing_to_offload",
        "Activation offload with nothing to offload",
        (r"CPU Offloading is enabled while it is not mentioned what to offload",),
        "model.cpu_offloading is on but cpu_offloading_activations and cpu_offloading_weights are both false; "
        "Transformer Engine raises this during model construction (Megatron-Bridge#2684)",
        "check model.cpu_offloading_activations and model.cpu_offloading_weights",
        ("model.cpu_offloading_activations=true",),
        references=("NVIDIA-NeMo/Megatron-Bridge#2684",),
    ),
    FailureMode(
        "te_missing",
        "Activation offloading without Transformer Engine",
        (
            r"CPU Offloading is enabled when TE is not present",
            r"CPU Offloading cannot be enabled while TE is not present",
        ),
        "layer-level activation offload is implemented by Transformer Engine; it is missing or "
        "model.transformer_impl is not transformer_engine",
        "python -c 'import transformer_engine.pytorch' in the training environment; check model.transformer_impl",
        ("model.transformer_impl=transformer_engine",),
        ("or switch activation offload off: model.cpu_offloading=false",),
    ),
    FailureMode(
        "te_signature",
        "get_cpu_offload_context called with the wrong arguments",
        (
            r"get_cpu_offload_context\(\) takes from \d+ to \d+ positional arguments but \d+ were given",
            r"get_cpu_offload_context\(\) got an unexpected keyword argument",
        ),
        "Megatron Core's version dispatch passes arguments Transformer Engine's version does not take "
        "(TE 1.8/1.9 with older MCore, or a TE version string such as '0.1.0+te2.9.0' that MCore mis-parses)",
        "pip show transformer-engine megatron-core; compare with the pairing in Megatron Bridge's uv.lock",
        (),
        (
            "upgrade megatron-core (dispatch fixed by NVIDIA/Megatron-LM PR #996) or install the transformer-engine "
            "version your megatron-core release was tested with",
        ),
        ("NVIDIA/Megatron-LM#1018", "NVIDIA/Megatron-LM#1041"),
    ),
    FailureMode(
        "double_buffer_size_mismatch",
        "Double-buffered reload: buffers of different sizes",
        (r"Can't copy two buffers of different sizes", r"CPU buffer shape does not match the offloaded tensor shape"),
        "Transformer Engine's double-buffered reload (model.cpu_offloading_double_buffering) reuses one GPU buffer "
        "per tensor slot and assumes every offloaded layer saves the same tensors with the same shapes; layers that "
        "differ (dense and MoE layers, another layer type, a changed sequence length) break it (TE fixed "
        "asymmetric layers in PR #1984)",
        "the traceback ends in transformer_engine/pytorch/cpu_offload.py reload; the run passes with "
        "model.cpu_offloading_double_buffering=false",
        ("model.cpu_offloading_double_buffering=false",),
        ("or upgrade transformer-engine (asymmetric layers fixed in TE PR #1984)",),
        ("NVIDIA-NeMo/Speech#14670",),
        rules_out=fc.rules_out_double_buffering,
    ),
)
