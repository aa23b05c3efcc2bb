"""The traced step, inside the child: build, warm up, run megatron-core's schedule, step; the tracker's answer.

Imported by ``trace/child.py`` only (torch and megatron-core). See ``child.py`` for the order of things.
"""

from __future__ import annotations

import contextlib
import gc
import re
from typing import Any

from tracker import CATEGORIES, Tracker

_LAYER = re.compile(r"\.(\d+)(?=\.|$)")


def _config(torch: Any, spec: dict[str, Any]) -> Any:
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    dtype = (
        torch.bfloat16
        if spec["params_dtype"] == "bf16"
        else torch.float16
        if spec["params_dtype"] == "fp16"
        else torch.float32
    )
    kw = dict(spec["transformer"])
    if kw.pop("swiglu", False):
        kw["activation_func"] = torch.nn.functional.silu
    cls = MLATransformerConfig if kw.get("multi_latent_attention") else TransformerConfig
    return cls(
        **kw,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=False,  # parameters made on the GPU (the device mode makes them fake CPU tensors)
        perform_initialization=False,  # values are not needed: a fake tensor has none
    )


def _chunks(torch: Any, spec: dict[str, Any], config: Any) -> list[Any]:
    import standins
    from activation_offload import fine_grained
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    if spec.get("hybrid"):  # megatron-core's hybrid Mamba model (trace/hybrid/stack.py)
        from hybrid import stack

        return list(stack.chunks(spec, config))
    vpp = spec["parallel"].get("vpp")
    chunks = []
    for vp in range(vpp or 1):
        vp_stage = vp if vpp else None
        layer_spec: Any
        if config.num_moe_experts:
            # MoE: megatron-core's block spec, local backend, which reads moe_layer_freq (dense and MoE layers mixed);
            # a single layer spec would make every layer MoE.
            layer_spec = get_gpt_decoder_block_spec(
                config, use_transformer_engine=False, normalization=config.normalization, vp_stage=vp_stage
            )
            layers = list(layer_spec.layer_specs)
        else:
            layer_spec = get_gpt_layer_local_spec(
                qk_layernorm=config.qk_layernorm,
                multi_latent_attention=config.multi_latent_attention,
                normalization=config.normalization,
            )
            layers = [layer_spec]
        if spec.get("attention", "fused") == "fused":
            for one in layers:
                standins.use_te_attention(one, config)
        fine_grained.te_layout(layers, config)
        mtp = None
        if config.mtp_num_layers:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

            # as Bridge's GPTModelProvider builds it: the depth's layer is the block's last (with its stand-ins);
            # None on a chunk without MTP depths
            mtp = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False, vp_stage=vp_stage)
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        kwargs: dict[str, Any] = {"vp_stage": vp_stage} if vpp else {}
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=layer_spec,
                vocab_size=spec["vocab_size"],
                max_sequence_length=spec["seq_length"],
                pre_process=first,
                post_process=last,
                share_embeddings_and_output_weights=spec["tied"],
                position_embedding_type="rope",
                mtp_block_spec=mtp,
                **kwargs,
            )
        )
    return chunks


def _module_hooks(tracker: Tracker, chunks: list[Any]) -> None:
    """Name each activation after the module whose forward made it (layer numbers as ``*``)."""
    stack: list[str] = []

    def pre(name: str) -> Any:
        def hook(module: Any, args: Any) -> None:
            stack.append(name)
            tracker.module = name
            if (
                name.endswith("output_layer")
                and tracker.phase == "forward_backward"
                and tracker.category == "activations"
            ):
                tracker.mark_phase("loss")

        return hook

    def post(module: Any, args: Any, out: Any) -> None:
        if stack:
            stack.pop()
        tracker.module = stack[-1] if stack else ""

    for chunk in chunks:
        for name, module in chunk.named_modules():
            if name.count(".") > 4:
                continue
            short = _LAYER.sub(".*", name) or "gpt_model (outside its submodules: the loss, the output's glue)"
            module.register_forward_pre_hook(pre(short))
            module.register_forward_hook(post)


def trace(torch: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """Trace one rank's step (module docstring); the answer's JSON."""
    import patches
    import standins
    from activation_offload import fine_grained

    tracker = Tracker(fast=spec.get("fast", True))
    patches.MODE_TRACKER[:] = [tracker]
    standins.reset()
    standins.TE_VERSION = tuple(int(part) for part in spec.get("te_version", "2.18").split(".")[:2])
    fine_grained.reset(spec)
    from te_standins import fp8

    # TE's FP8 linears (te_standins/fp8.py); inert without a recipe
    fp8.reset(spec.get("fp8_recipe"), bool(spec.get("fp8_param")))
    fp8.install()
    with tracker, patches.CpuForCuda(tracker):
        built = _build(torch, spec, tracker)
        _warm_up(torch, tracker, built)
        fine_grained.warm_iteration(spec, tracker, lambda: _run(torch, spec, tracker, built), built)
        _run(torch, spec, tracker, built)
    return _answer(spec, tracker, built)


def _build(torch: Any, spec: dict[str, Any], tracker: Tracker) -> dict[str, Any]:
    import patches
    from activation_offload import te_layers
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    tracker.category = "weights"
    config = _config(torch, spec)
    chunks = _chunks(torch, spec, config)
    te_layers.after_build(config)
    params = sum(p.numel() for c in chunks for p in c.parameters())
    param_bytes = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    tracker.category = "other"
    from te_standins import fp8

    fp8.mark(chunks)  # the FP8 linears and TE's dummy weight gradients (kept for the run: "other")
    if spec["ddp"].get("use_megatron_fsdp"):
        from fsdp import wrap

        model = wrap.wrap(torch, config, spec["ddp"], chunks, tracker)
    else:
        ddp_config = DistributedDataParallelConfig(**spec["ddp"])
        model = [
            DistributedDataParallel(config=config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
            for i, c in enumerate(chunks)
        ]
    for m in model if not spec["ddp"].get("use_megatron_fsdp") else ():
        for buffer in [*m.buffers, *m.expert_parallel_buffers]:
            tracker.retag(buffer.param_data, "weights") if buffer.param_data is not None else None
            tracker.retag(buffer.grad_data, "gradients")
        for p in m.module.parameters():
            tracker.retag(p, "weights")
    tracker.category = "optimizer"
    opt_kw = dict(spec["optimizer"])
    ours = opt_kw.pop("hybrid_optimizer", "megatron-core") == "ours" and opt_kw["optimizer_cpu_offload"]
    with patches.te_fused_adam_importable():
        opt_config = OptimizerConfig(**_dtypes(torch, opt_kw))
    with _hybrid_optimizer(ours):
        optimizer = get_megatron_optimizer(opt_config, model, use_gloo_process_groups=False)
    # megatron-core 0.16 builds a HybridDeviceOptimizer over the model's parameters, then the distributed optimizer
    # builds its own over its shards; the first, with its fp32 copies, is cyclic garbage that Python's collector
    # frees at its next pass (long before the first step on a real run): collect it now.
    gc.collect()
    _module_hooks(tracker, chunks)
    return {"config": config, "model": model, "optimizer": optimizer, "params": params, "param_bytes": param_bytes}


def _hybrid_optimizer(ours: bool) -> Any:
    """Our HybridDeviceOptimizer in megatron-core's factory for the optimizer's build (the install path a user's
    training script takes: ``mbridge_offload_runtime.optimizer.install_optimizer_offload``), or nothing."""
    if not ours:
        return contextlib.nullcontext()
    from mbridge_offload_runtime.optimizer.megatron import install_optimizer_offload

    return install_optimizer_offload()


def _dtypes(torch: Any, kw: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in kw.items():
        out[k] = (
            getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(v, v))
            if k.endswith("_dtype") and isinstance(v, str)
            else v
        )
    return out


def _warm_up(torch: Any, tracker: Tracker, built: dict[str, Any]) -> None:
    """One optimizer step before the traced one: Adam makes its moments at its first step, and what an optimizer
    keeps from one step to the next (megatron-core's HybridDeviceOptimizer's fp32 gradient copies) is resident."""
    tracker.category = "step"
    if built["config"].finalize_model_grads_func is not None:  # Megatron-FSDP: gradients reach the optimizer here
        built["config"].finalize_model_grads_func(built["model"])
    built["optimizer"].step()
    for entry in tracker.live.values():
        if entry[1] == "step":
            tracker.by_category["step"] -= entry[0]
            tracker.by_category["optimizer"] += entry[0]
            entry[1] = "optimizer"
    for m in built["model"]:
        m.zero_grad_buffer()
    built["optimizer"].zero_grad()


def _run(torch: Any, spec: dict[str, Any], tracker: Tracker, built: dict[str, Any]) -> None:
    from megatron.core.pipeline_parallel import schedules

    b, s, v = spec["micro_batch_size"], spec["seq_length"] // spec["parallel"]["cp"], spec["vocab_size"]

    def forward_step(data_iterator: Any, model: Any) -> Any:
        tracker.category = "activations"
        tokens = torch.randint(0, v, (b, s))
        positions = torch.arange(s).unsqueeze(0).expand(b, s)
        labels = torch.randint(0, v, (b, s))
        output = model(tokens, positions, None, labels=labels)

        def loss_func(output_tensor: Any) -> Any:
            loss = output_tensor.float().sum()
            return loss, {"lm loss": loss}

        return output, loss_func

    original_backward = schedules.backward_step

    def backward_step(*args: Any, **kwargs: Any) -> Any:
        tracker.mark_phase("forward_backward")
        tracker.category = "other"
        tracker.module = ""
        try:
            return original_backward(*args, **kwargs)
        finally:
            tracker.category = "activations"

    schedules.backward_step = backward_step
    model = built["model"]
    tracker.mark_phase("forward_backward")
    tracker.category = "activations"
    schedules.get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[iter(())] * len(model),
        model=model if len(model) > 1 else model[0],
        num_microbatches=spec["num_microbatches"],
        seq_length=spec["seq_length"],  # the whole sequence: the schedule divides it by CP
        micro_batch_size=b,
        forward_only=False,
    )
    tracker.mark_phase("optimizer_step")
    tracker.category = "other"
    built["optimizer"].step()


def _answer(spec: dict[str, Any], tracker: Tracker, built: dict[str, Any]) -> dict[str, Any]:
    phases = {
        name: {
            "total": peak["total"],
            "by_category": {c: max(0, peak["by_category"].get(c, 0)) for c in CATEGORIES},
            "by_module": {k: v for k, v in sorted(peak["by_module"].items(), key=lambda kv: -kv[1]) if v > 0},
        }
        for name, peak in tracker.peaks.items()
        if name in ("forward_backward", "loss", "optimizer_step")
    }
    return {
        "phases": phases,
        "host_bytes": tracker.host_bytes,
        "host_peak_bytes": tracker.host_peak,
        "params": built["params"],
        "param_bytes": built["param_bytes"],
        "allocations": tracker.allocations,
        "ops": tracker.ops,
        "slow_ops": tracker.slow_ops,
    }
