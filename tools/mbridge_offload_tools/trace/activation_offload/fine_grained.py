"""megatron-core's fine-grained activation offloading (``offload_modules``), run as it is inside the trace's child.

megatron-core's own manager (``pipeline_parallel/fine_grained_activation_offload.py``: ``PipelineOffloadManager``,
``ChunkOffloadHandler``) runs unchanged, with its saved-tensor hooks, groups, pinned host pool, warm-up iteration and
steady state. Its D2H copies make host tensors (``pin_memory``: the tracker counts them as host memory); a group's
GPU tensors are freed when the group keeps only their host copies (their storages die) or when megatron-core
releases them (``untyped_storage().resize_(0)``, which the tracker follows); a reload allocates new GPU tensors.
What it needs from a GPU machine, given in :func:`apply` (each for its reason):

- ``megatron.core.extensions.transformer_engine.cpu_offload``: the manager refuses to enter its hooks without TE's
  offload module and only sets its ``CPUOffloadEnabled`` flag, read by TE's v1 path, not by the v2 path TE runs from
  2.10 (nor by the stand-ins): a namespace with the flag;
- the saved-tensor check: 0.16.1 asserts a saved tensor is no ``FakeTensor`` (a stray one from ``torch.compile``'s
  tracing) and 0.19.2 passes fake and non-CUDA tensors through unmanaged; every tensor of the trace is a fake CPU
  tensor, so the GPU/host split is the tracker's instead (0.16.1: its ``tensor_push`` without the assert);
- ``torch.cuda.nvtx`` markers (0.16.1 calls them directly): no-ops, there is no profiler (a CPU build raises);
- ``print_offload_summary_table``: prints on rank 0 after the warm-up iteration; the child's stdout is its answer;
- reloads run in backward, outside the device mode: they run inside it, counted as activations.

Streams and events are the trace's null ones (``trace/patches.py``): one host thread is already in order.

The layout TE builds (:func:`te_layout`): TE fuses the input norm into ``linear_qkv`` and a dense layer's pre-MLP norm
into ``linear_fc1`` (``TELayerNormColumnParallelLinear``, the norm module an ``IdentityOp``), so upstream switches
``attn_norm`` / ``mlp_norm`` off there and the fused norm's saved tensors fall in the ``qkv_linear`` scope; the
local spec keeps the norms apart. With fine-grained offloading on, the trace builds TE's layout (the norm stand-in
inside the linear: the same saved tensors).

Steady state (:func:`warm_iteration`): megatron-core offloads every group in its first iteration (warm-up) and from
the second on keeps the last group of each name on the GPU (its offload margin) and applies
``activation_offload_fraction``; the trace runs one untraced iteration first.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

RELOADED = "fine-grained offload: reloaded"  # the by_module name of the tensors a reload makes


def _tracker() -> Any:
    import patches

    return patches.MODE_TRACKER[0] if patches.MODE_TRACKER else None


def _manageable(tensor: torch.Tensor) -> bool:
    """0.19.2's ``ChunkOffloadHandler._can_manage_tensor_for_offload`` with the tracker's GPU/host split for
    ``device.type == "cuda"`` (and no stray-fake check: every tensor here is fake)."""
    tracker = _tracker()
    on_gpu = not tracker.is_host(tensor) if tracker is not None else tensor.device.type == "cuda"
    return not isinstance(tensor, torch.nn.Parameter) and on_gpu


def _tensor_push_0_16(self: Any, tensor: torch.Tensor) -> Any:
    """0.16.1's ``ChunkOffloadHandler.tensor_push`` without its stray-tensor assert (module docstring)."""
    tensor_tag = (self._offloaded_group_index, self._tensor_count_current_group)
    self._tensor_count_current_group += 1
    self.offload_groups[self._offloaded_group_index - 1].push_tensor(tensor_tag, tensor)
    return tensor_tag


def _counted_reload(reload: Callable[..., Any]) -> Callable[..., Any]:
    def counted(self: Any, state: Any, non_blocking: Any = None) -> Any:
        import patches

        tracker = _tracker()
        if tracker is None:
            return reload(self, state, non_blocking)
        category, module = tracker.category, tracker.module
        tracker.category, tracker.module = "activations", RELOADED
        try:
            with patches.CpuForCuda(tracker):
                return reload(self, state, non_blocking)
        finally:
            tracker.category, tracker.module = category, module

    return counted


def apply() -> None:
    """Patch the device spots of megatron-core's fine-grained manager (module docstring); once, in the child."""
    from megatron.core.extensions import transformer_engine as te_extension
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as manager

    if getattr(te_extension, "cpu_offload", None) is None:
        te_extension.cpu_offload = types.SimpleNamespace(CPUOffloadEnabled=False)
    handler = manager.ChunkOffloadHandler
    if hasattr(handler, "_can_manage_tensor_for_offload"):  # 0.19.2
        handler._can_manage_tensor_for_offload = staticmethod(_manageable)
    else:  # 0.16.1
        handler.tensor_push = _tensor_push_0_16
    handler.reload = _counted_reload(handler.reload)
    manager.print_offload_summary_table = lambda *args, **kwargs: None
    keep_weight_attributes()
    import standins

    # expert_fc1 offloading asks TE's GroupedLinear to save its original input (set_save_original_input): outside FP8
    # its per-GEMM inputs are views of that input, one storage either way (standins.FACTS["grouped_linear"])
    standins.GroupedLinearStandIn.save_original_input = False
    torch.cuda.nvtx.range_push = lambda *args, **kwargs: None
    torch.cuda.nvtx.range_pop = lambda *args, **kwargs: None


def keep_weight_attributes() -> None:
    """Under saved-tensor hooks (both offload mechanisms) autograd hands a saved parameter back as a new tensor
    object, without the parameter's Python attributes. TE's linears keep the weight's own object for backward
    (``linear.py``: ``origin_weight_ref``); megatron-core's local linears, which stand in for them here, read
    ``hasattr(weight, "grad_added_to_main_grad")`` on the saved one (``tensor_parallel/layers.py``): False, so the
    weight gradient goes missing and DDP refuses. Every parameter of the trace has the attribute (DDP sets it), so it
    is answered at class level as the parameter answers; megatron-core sets ``main_grad`` on the saved one itself."""
    from torch._subclasses.fake_tensor import FakeTensor

    FakeTensor.grad_added_to_main_grad = False  # type: ignore[attr-defined]


def reset(spec: dict[str, Any]) -> None:
    """A new manager for each traced spec: megatron-core keeps one per process (a batch traces many runs)."""
    if spec["transformer"].get("fine_grained_activation_offloading"):
        from megatron.core.pipeline_parallel.fine_grained_activation_offload import PipelineOffloadManager

        PipelineOffloadManager.reset_instance()


def te_layout(layers: list[Any], config: Any) -> None:
    """TE's fused norms in the layer specs (module docstring), where fine-grained offloading is on."""
    if not getattr(config, "fine_grained_activation_offloading", False):
        return
    import standins
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP

    fused = standins.LayerNormColumnParallelLinearStandIn
    for layer in layers:
        sub = layer.submodules
        if not config.multi_latent_attention:  # MLA's input norm is a TENorm of its own in TE's spec
            sub.input_layernorm = IdentityOp
            sub.self_attention.submodules.linear_qkv = fused
        dense = _dense_mlp(sub.mlp, MLP)
        if dense is not None:  # a MoE layer's pre-MLP norm feeds the router: TENorm
            sub.pre_mlp_layernorm = IdentityOp
            dense.linear_fc1 = fused


def _dense_mlp(spec: Any, mlp: type) -> Any:
    """The ``MLPSubmodules`` of a dense MLP's spec: a ``ModuleSpec`` (0.16.1) or a ``partial`` of
    ``MLP.as_mlp_submodule`` (0.19.2); None for anything else (a MoE layer)."""
    if getattr(spec, "module", None) is mlp:
        return spec.submodules
    if getattr(getattr(spec, "func", None), "__self__", None) is mlp:
        return spec.keywords.get("submodules")
    return None


def warm_iteration(spec: dict[str, Any], tracker: Any, run: Callable[[], None], built: dict[str, Any]) -> None:
    """One forward-backward and optimizer step before the traced one (module docstring), its peaks forgotten."""
    if not spec["transformer"].get("fine_grained_activation_offloading"):
        return
    run()
    for chunk in built["model"]:
        chunk.zero_grad_buffer()
    built["optimizer"].zero_grad()
    tracker.peaks.clear()
    tracker.phase = "build"
