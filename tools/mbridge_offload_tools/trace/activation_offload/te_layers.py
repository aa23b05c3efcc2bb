"""Transformer Engine's layer-level activation offload (``model.cpu_offloading``), stood in with TE's call shape.

``get_cpu_offload_context`` as TE takes it; its behaviour follows TE's v2 code path
(``transformer_engine/pytorch/cpu_offload.py``, TE 2.10 on).

megatron-core's ``TransformerBlock`` asks its TE wrapper (``extensions/transformer_engine.py``, defined only where TE
imports) for ``(context, sync_function)`` and runs every layer inside the context, then passes the layer's output
through the function. TE's ``DefaultOffloadSynchronizer`` (``TE_FACTS``), which this module follows:

- what: every tensor autograd saves inside the context that is on the GPU, not a parameter, not marked
  ``_TE_do_not_offload``, contiguous (else skipped with a warning) and of at least ``min_numel`` elements (256 Ki from
  2.12, none before); a view that covers its whole base is offloaded as the base, duplicates once;
- which layers: ``0 .. num_layers-1`` of the ``model_layers`` (megatron-core passes ``config.num_layers``: PP 1), never
  the last (``num_layers > model_layers - 1`` is refused);
- when: layer ``i``'s copy to pinned host buffers starts at the forward of layer ``i+1``, its GPU tensors are dropped
  at the forward of layer ``L-k+i`` (``finish_offload_map``), it is reloaded into new GPU tensors at the backward of
  layer ``L-1-k+i`` (``start_reload_map``) and everything it holds is released at the backward of the next layer (or
  at the end of the backward pass); host buffers go with it unless ``retain_pinned_cpu_buffers``.

Streams and events only order the copies on a GPU; on one host thread the moments above are the whole story, so the
stand-in has none. ``offload_weights`` has no effect since v2 (TE warns). The GPU/host split is the trace's tracker's
(every fake tensor is a CPU tensor); without a tracker (a real GPU run) it is the tensor's device.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import defaultdict
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

# TE's source, per release: lines of cpu_offload.py the stand-in follows (tests/tools/test_trace_offload.py reads them
# at TE's git tags where a checkout is given). The size floor came with 2.12; 2.10 and 2.11 offload any size.
TE_FACTS: dict[str, tuple[str, ...]] = {
    "v2.10": (
        "self.finish_offload_map[self.num_layers - num_offloaded_layers + layer_id].append(",
        "self.start_reload_map[self.num_layers - 1 - num_offloaded_layers + layer_id].append(",
        "return tensor._base.numel() == tensor.numel()",
        'reloaded_tensor = torch.empty_like(tensor, device=torch.device("cuda"))',
    ),
    "v2.18": (
        "self.finish_offload_map[self.num_layers - num_offloaded_layers + layer_id].append(",
        "self.start_reload_map[self.num_layers - 1 - num_offloaded_layers + layer_id].append(",
        "return tensor._base.numel() == tensor.numel()",
        'reloaded_tensor = torch.empty_like(tensor, device=torch.device("cuda"))',
        "if t.numel() < 256 * 1024:",
    ),
}
SIZE_FLOOR_FROM = (2, 12)
RELOADED = "TE layer offload: reloaded"  # the by_module name of the tensors a reload makes
V2_FROM = (2, 10)


def min_numel(te: tuple[int, ...]) -> int:
    """The smallest saved tensor TE ``te`` (major, minor) offloads on its v2 path."""
    return 256 * 1024 if tuple(te[:2]) >= SIZE_FLOOR_FROM else 0


def _tracker() -> Any:
    import patches

    return patches.MODE_TRACKER[0] if patches.MODE_TRACKER else None


def _on_gpu(t: torch.Tensor) -> bool:
    tracker = _tracker()
    return not tracker.is_host(t) if tracker is not None else t.device.type == "cuda"


class _Layer:
    """TE's ``OffloadableLayerState``: the forward's GPU tensors, their host copies, the reloaded ones."""

    def __init__(self, floor: int, retain: bool) -> None:
        self.floor, self.retain = floor, retain
        self.fwd: list[torch.Tensor] = []
        self.cpu: list[torch.Tensor] = []
        self.bwd: list[torch.Tensor] = []
        self.views: list[Any] = []
        self.ids: list[int] = []
        self.state = "not_offloaded"

    def wanted(self, t: torch.Tensor) -> bool:
        if t.numel() < self.floor or isinstance(t, torch.nn.Parameter) or getattr(t, "_TE_do_not_offload", False):
            return False
        if not _on_gpu(t):
            return False
        if not t.is_contiguous() and not getattr(t, "offload_base_tensor", False):
            warnings.warn("Tried to offload non-contiguous tensor, which is not supported.", stacklevel=2)
            return False
        return True

    def push(self, t: torch.Tensor) -> Any:
        if not self.wanted(t):
            return t
        self.fwd.append(t)
        return len(self.fwd) - 1

    def start_offload(self) -> None:
        self.state = "offload_started"
        self.views, tensors = [], []
        for t in self.fwd:  # _switch_to_base_tensors: a view over its whole base goes as the base
            whole = getattr(t, "offload_base_tensor", False) or (t._base is not None and t._base.numel() == t.numel())
            base = whole and t._base is not None
            self.views.append((t.shape, t.stride(), t.storage_offset()) if base else None)
            tensors.append(t._base if base and t._base is not None else t)
        unique: dict[int, int] = {}  # _deduplicate_tensors: one copy per tensor object
        self.ids = [unique.setdefault(id(t), len(unique)) for t in tensors]
        self.fwd = list({id(t): t for t in tensors}.values())
        fresh = not self.retain or not self.cpu
        for i, t in enumerate(self.fwd):
            if fresh:
                self.cpu.append(torch.empty_like(t, device=torch.device("cpu"), pin_memory=True))
            self.cpu[i].copy_(t, non_blocking=True)

    def release_forward(self) -> None:
        self.state = "offload_finished"
        self.fwd = []

    def start_reload(self) -> None:
        import patches

        self.state = "reload_started"
        tracker = _tracker()
        if tracker is None:
            reloaded = [self._reload(host) for host in self.cpu]
        else:  # backward runs outside the device mode, as "other": a reloaded tensor is an activation again
            saved, tracker.category, tracker.module = (tracker.category, tracker.module), "activations", RELOADED
            with patches.CpuForCuda(tracker):
                reloaded = [self._reload(host) for host in self.cpu]
            tracker.category, tracker.module = saved
        out = [reloaded[i] for i in self.ids]  # _restore_tensor_duplicates, then _switch_to_views
        self.bwd = [t.as_strided(*v) if v is not None else t for t, v in zip(out, self.views, strict=True)]

    @staticmethod
    def _reload(host: torch.Tensor) -> torch.Tensor:
        gpu = torch.empty_like(host, device=torch.device("cuda"))
        gpu.copy_(host, non_blocking=True)
        return gpu

    def pop(self, tag: Any) -> torch.Tensor:
        if isinstance(tag, torch.Tensor):
            return tag
        return self.fwd[tag] if self.state == "not_offloaded" else self.bwd[tag]

    def release_all(self) -> None:
        self.fwd, self.bwd = [], []
        if not self.retain:
            self.cpu = []
        self.state = "not_offloaded"


class Synchronizer:
    """TE's ``DefaultOffloadSynchronizer`` over ``model_layers`` layers, the first ``offloaded`` of them offloaded."""

    def __init__(self, model_layers: int, offloaded: int, floor: int, retain: bool = False) -> None:
        self.num_layers = model_layers
        self.layers = {i: _Layer(floor, retain) for i in range(model_layers)}
        self.offload = {i: i < offloaded for i in range(model_layers)}
        self.finish: defaultdict[int, list[int]] = defaultdict(list)
        self.reload: defaultdict[int, list[int]] = defaultdict(list)
        for i in range(offloaded):
            self.finish[model_layers - offloaded + i].append(i)
            self.reload[model_layers - 1 - offloaded + i].append(i)
        self.fwds: int | None = None
        self.previous_bwd: int | None = None
        self.current: int | None = None

    def fwd_step(self) -> int:
        if self.fwds in (None, self.num_layers - 1):
            for layer in self.layers.values():
                layer.release_all()
            self.fwds = 0
        else:
            assert self.fwds is not None
            self.fwds += 1
        self.current = self.fwds
        if self.offload.get(self.current - 1, False):
            self.layers[self.current - 1].start_offload()
        for i in self.finish[self.current]:
            self.layers[i].release_forward()
        return self.current

    def bwd_step(self, layer: int) -> None:
        if self.previous_bwd is not None:
            self.layers[self.previous_bwd].release_all()
        self.previous_bwd = self.current = layer
        for i in self.reload[layer]:
            self.layers[i].start_reload()

    def finish_part_of_bwd(self) -> None:
        if self.previous_bwd is not None:
            self.layers[self.previous_bwd].release_all()
        self.previous_bwd = None

    def push(self, t: torch.Tensor) -> Any:
        assert self.fwds is not None
        return self.layers[self.fwds].push(t) if self.offload.get(self.fwds, False) else t

    def pop(self, tag: Any) -> torch.Tensor:
        assert self.current is not None
        return self.layers[self.current].pop(tag)


class _Context(contextlib.ContextDecorator):
    """TE's ``_CpuOffloadContext``: the saved-tensor hooks around one layer's forward, and its sync function."""

    def __init__(self, sync: Synchronizer) -> None:
        self.offload_synchronizer = sync
        self.inside_context = False
        self.current_layer: int | None = None
        self._hooks: Any = None

    def __enter__(self) -> _Context:
        if self.inside_context:
            raise RuntimeError("Offloading context was entered without synchronization function being called.")
        self.inside_context = True
        self._hooks = saved_tensors_hooks(self.offload_synchronizer.push, self.offload_synchronizer.pop)
        self._hooks.__enter__()
        self.current_layer = self.offload_synchronizer.fwd_step()
        return self

    def __exit__(self, *args: Any) -> None:
        self._hooks.__exit__(*args)
        self.inside_context = False

    def synchronization_function(self, tensor: torch.Tensor) -> torch.Tensor:
        sync, layer = self.offload_synchronizer, self.current_layer
        assert layer is not None and not self.inside_context and tensor.requires_grad

        def hook(_: Any) -> None:
            # TE queues the release of the last layer's tensors for the end of this backward pass
            torch.autograd.Variable._execution_engine.queue_callback(sync.finish_part_of_bwd)
            sync.bwd_step(layer)

        assert tensor.grad_fn is not None
        tensor.grad_fn.register_prehook(hook)
        return tensor


def get_cpu_offload_context(
    enabled: bool = False,
    num_layers: int | None = 1,
    model_layers: int = 1,
    offload_activations: bool = True,
    offload_weights: bool = False,
    double_buffering: bool = False,
    manual_synchronization: bool = False,
    retain_pinned_cpu_buffers: bool = False,
    offload_stream: Any = None,
) -> tuple[Any, Any]:
    """TE's ``get_cpu_offload_context`` (v2 path; the release is ``standins.TE_VERSION``): ``(context, sync_fn)``.

    Raises:
        ValueError: as TE: nothing to offload, or every layer (the last one never is).
        NotImplementedError: ``manual_synchronization`` (megatron-core never asks for it) or a TE release before
            2.10 (its v1 path, not stood in).
    """
    import standins

    if not enabled:
        return contextlib.nullcontext(), lambda x: x
    if tuple(standins.TE_VERSION) < V2_FROM:
        raise NotImplementedError("Transformer Engine before 2.10 offloads through its v1 path, not stood in")
    if manual_synchronization or offload_stream is not None:
        raise NotImplementedError("TE's manual offload synchronization is not stood in")
    if not offload_weights and not offload_activations:
        raise ValueError("CPU Offloading is enabled while it is not mentioned what to offload (weights/activations)")
    if offload_weights:
        warnings.warn(
            "Offloading weights is deprecated. Using offload_weights=True does not have any effect.",
            DeprecationWarning,
            stacklevel=2,
        )
        if not offload_activations:
            return contextlib.nullcontext(), lambda x: x
    k = int(num_layers or 0)
    if k > model_layers - 1:
        raise ValueError(
            "Cannot offload all layers without manual synchronization - last layer is not"
            f" offloaded. Got num_layers={k}, model_layers={model_layers}."
        )
    sync = Synchronizer(model_layers, k, min_numel(standins.TE_VERSION), retain_pinned_cpu_buffers)
    context = _Context(sync)
    return context, context.synchronization_function


def megatron_core_wrapper(
    enabled: bool,
    num_layers: int,
    model_layers: int,
    activation_offloading: bool,
    weight_offloading: bool,
    double_buffering: bool,
    retain_pinned_cpu_buffers: bool = False,
) -> tuple[Any, Any]:
    """megatron-core's ``get_cpu_offload_context`` (``extensions/transformer_engine.py``; 0.16.1 passes six arguments,
    0.19.2 seven) on TE 2.10 and later: TE's function with ``retain_pinned_cpu_buffers`` by name."""
    return get_cpu_offload_context(
        enabled,
        num_layers,
        model_layers,
        activation_offloading,
        weight_offloading,
        double_buffering,
        retain_pinned_cpu_buffers=retain_pinned_cpu_buffers,
    )


def apply() -> None:
    """``TransformerBlock`` builds TE's offload context from this stand-in (without TE its name is None there and
    ``cpu_offloading`` is refused). With offloading off it gives what TE gives: a null context and the identity."""
    from megatron.core.transformer import transformer_block

    transformer_block.get_cpu_offload_context = megatron_core_wrapper


def after_build(config: Any) -> None:
    """Forget the context megatron-core hands its linears (``config._cpu_offloading_context``): its only readers
    (``tensor_parallel/layers.py``, both releases) mark a linear's input ``activation_offloading``, which TE's v1 path
    reads and v2 does not, and assert ``cpu_offloading`` off where TE is absent (the trace's case)."""
    if getattr(config, "cpu_offloading", False):
        config._cpu_offloading_context = None
