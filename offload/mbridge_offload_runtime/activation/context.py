"""Layer-level activation offloading with Transformer Engine's call shape (the schedule is in ``schedule.py``, the
per-pass mechanics in ``passes.py``).

It follows TE v2 (``transformer_engine/pytorch/cpu_offload.py``): same errors, same schedule, same size threshold
by default. Unlike TE, ``double_buffering`` is a real option, views are folded onto their base whatever their
coverage, several forwards may run before their backwards, and every pass is accounted.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import deque
from types import TracebackType
from typing import Any

import torch

from mbridge_offload_runtime import device
from mbridge_offload_runtime.activation.eligibility import Eligibility
from mbridge_offload_runtime.activation.passes import BackwardStep, LayerStore, Pass, unpack
from mbridge_offload_runtime.activation.pool import HostBufferPool, ReloadBuffers
from mbridge_offload_runtime.activation.schedule import DEFAULT_MIN_TENSOR_SIZE, LayerPhase, OffloadStats, Schedule

__all__ = ["ManualController", "OffloadContext", "get_cpu_offload_context"]


class _DisabledContext(contextlib.nullcontext):
    """What ``enabled=False`` returns: a no-op context that still answers ``inside_context``."""

    inside_context = False


class OffloadContext:
    """The context entered around each layer's forward; ``sync`` is the matching ``sync_fn``. Accounting:
    :attr:`stats` (the last pass whose backward finished), :attr:`history`, :attr:`current` (the running forward).
    """

    def __init__(
        self,
        schedule: Schedule,
        eligibility: Eligibility,
        double_buffering: bool = False,
        retain_pinned_cpu_buffers: bool = False,
        pin_memory: bool = True,
        history: int = 16,
        stream: device.Stream | None = None,
    ) -> None:
        self.schedule = schedule
        self.eligibility = eligibility
        self.device = eligibility.device
        self.stream = stream if stream is not None else device.new_stream("offload")
        self.pool = HostBufferPool(retain=retain_pinned_cpu_buffers, pin=pin_memory)
        self.reload_buffers = ReloadBuffers(self.device) if double_buffering else None
        self.history: deque[OffloadStats] = deque(maxlen=history)
        self._inside = False
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._layer = -1
        self._pass: Pass | None = None
        self.last_pass: Pass | None = None  # the pass of the latest forward (the manual controller acts on it)

    @property
    def inside_context(self) -> bool:
        """True while a layer's forward runs inside the context (Megatron Core's linear layers read it)."""
        return self._inside

    @property
    def stats(self) -> OffloadStats | None:
        return self.history[-1] if self.history else None

    @property
    def current(self) -> OffloadStats | None:
        return self._pass.stats if self._pass is not None else None

    def __enter__(self) -> OffloadContext:
        if self._inside:
            raise RuntimeError(
                "activation offload: the offload context was entered twice without leaving it; enter it once "
                "around each layer's forward (nested layers must not each enter it)."
            )
        self._inside = True
        try:
            self._enter_layer()
        except BaseException:
            self._abandon()  # a failed entry must not leave the context entered (or its hooks installed)
            raise
        return self

    def _enter_layer(self) -> None:
        if not torch.is_grad_enabled():
            return  # evaluation: nothing is saved, the layer count is left alone
        if self._pass is not None and self._pass.forward_abandoned():
            # The previous forward stopped between layers (an exception outside the context): its graph is gone,
            # so this layer starts a new forward rather than continuing the count.
            self.reset()
        self._layer = (self._layer + 1) % self.schedule.model_layers
        if self._layer == 0 or self._pass is None:
            self._pass = self.last_pass = Pass(self)
        self._pass.enter_layer(self._layer)
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pass.push, unpack)
        hooks.__enter__()
        self._hooks = hooks

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._inside = False
        hooks, self._hooks = self._hooks, None
        try:
            if hooks is not None:
                hooks.__exit__(exc_type, exc, tb)
        except BaseException:
            self.reset()
            raise
        if exc_type is not None:
            self.reset()  # the forward is abandoned: the next one starts again at layer 0

    def _abandon(self) -> None:
        try:
            self.__exit__(None, None, None)
        finally:
            self.reset()

    def sync(self, tensor: torch.Tensor) -> torch.Tensor:
        """The ``sync_fn``: ``tensor``'s ``grad_fn`` gets a pre-hook that tells the schedule when backward reaches
        the layer that just ran; returns it unchanged (or an alias of a leaf)."""
        if not (torch.is_grad_enabled() and isinstance(tensor, torch.Tensor) and tensor.requires_grad):
            return tensor
        if self._pass is None or self._inside:
            return tensor
        if tensor.grad_fn is None:
            tensor = tensor.view_as(tensor)  # a leaf has no node to hook; an alias gives it one
        step = BackwardStep(self._pass, self._layer)
        node = tensor.grad_fn
        assert node is not None  # requires_grad and not a leaf (the alias above)
        node.register_prehook(step)
        self._pass.anchor(step)
        return tensor

    def pass_finished(self, finished: Pass) -> None:
        self.history.append(finished.stats)
        if self._pass is finished:
            self._pass = None

    def reset(self) -> None:
        """Forget the layer count (automatic when a layer raises inside the context)."""
        self._layer, self._pass = -1, None

    def reset_buffers(self) -> None:
        """Drop the retained host buffers, so that new shapes are accepted."""
        self.pool.clear()


class ManualController:
    """What ``manual_synchronization=True`` returns third: TE ≥ 2.10's ``ManualOffloadSynchronizer`` methods. A
    layer none of them is called for keeps its saved tensors on the device; layers count ``0 … model_layers − 1``.

    Example:
        >>> ctx, sync, manual = get_cpu_offload_context(True, model_layers=n, manual_synchronization=True)
        >>> for i, layer in enumerate(layers):
        ...     with ctx:
        ...         out[i] = layer(inp[i])
        ...     out[i] = sync(out[i]); manual.start_offload_layer(i)
        >>> for i in range(n): manual.release_activation_forward_gpu_memory(i)
        >>> for i in reversed(range(n)): manual.start_reload_layer(i)
    """

    def __init__(self, context: OffloadContext) -> None:
        self.context = context

    def start_offload_layer(self, layer_id: int) -> None:
        """Start the device→host copies of layer ``layer_id``'s saved tensors (on the offload stream)."""
        store = self._store(layer_id)
        if store is not None:
            store.start_offload()

    def release_activation_forward_gpu_memory(self, layer_id: int) -> None:
        """Drop the layer's device copies once their offload is done; ``RuntimeError`` if it was not started."""
        store = self._store(layer_id, "release_activation_forward_gpu_memory")
        if store is not None:
            store.release(at=-1)

    def start_reload_layer(self, layer_id: int) -> None:
        """Start the layer's host→device copies (each saved tensor waits only for its own); ``RuntimeError`` if it
        was not released."""
        store = self._store(layer_id, "start_reload_layer")
        if store is not None:
            store.start_reload(at=-1)

    def _store(self, layer_id: int, step: str = "") -> LayerStore | None:
        """The layer's store in the latest pass; ``RuntimeError`` if ``step`` needs another phase (as in TE)."""
        if not 0 <= layer_id < self.context.schedule.model_layers:
            raise ValueError(f"layer_id is {layer_id}; it must be in [0, {self.context.schedule.model_layers})")
        last = self.context.last_pass
        store = last.store(layer_id) if last is not None else None
        if store is not None and step in _NEEDS and store.phase is not _NEEDS[step][0]:
            _, what, first = _NEEDS[step]
            raise RuntimeError(
                f"activation offload: {step}({layer_id}) needs {what}; layer {layer_id} is {store.phase.value} "
                f"(call {first} first)"
            )
        return store


# The phase each manual step needs, what to call it in the error, and the step that gets a layer there.
_NEEDS = {
    "release_activation_forward_gpu_memory": (LayerPhase.OFFLOAD_STARTED, "a started offload", "start_offload_layer"),
    "start_reload_layer": (LayerPhase.RELEASED, "a released layer", "release_activation_forward_gpu_memory"),
}


def get_cpu_offload_context(
    enabled: bool = False,
    num_layers: int | None = 1,
    model_layers: int = 1,
    offload_activations: bool = True,
    offload_weights: bool = False,
    double_buffering: bool = False,
    manual_synchronization: bool = False,
    retain_pinned_cpu_buffers: bool = False,
    offload_stream: device.Stream | None = None,
    *,
    min_tensor_size: int = DEFAULT_MIN_TENSOR_SIZE,
    pin_memory: bool = True,
) -> tuple[Any, ...]:
    """Activation offloading for a sequence of layers, with Transformer Engine ≥ 2.10's signature and positional
    order (Megatron Core's wrapper puts ``retain_pinned_cpu_buffers`` seventh: ``megatron.py`` adapts it).

    Enter ``context`` around each layer's forward and pass each layer's output through ``sync_fn``. Tensors saved
    in the first ``num_layers`` layers that qualify (:class:`Eligibility`) are copied to the host as they are saved,
    dropped from the device when layer ``L − k + i`` starts, and reloaded when backward reaches ``L − 1 − k + i``.

    Args:
        enabled: turn offloading on; when False a no-op context and the identity are returned.
        num_layers: ``k``, how many of the first layers to offload (``0 ≤ k ≤ model_layers − 1``); ignored
            with ``manual_synchronization``.
        model_layers: ``L``, how many layers enter the context per forward.
        offload_activations: offload saved activations (the only thing offloaded).
        offload_weights: deprecated as in TE; has no effect beyond a ``DeprecationWarning``.
        double_buffering: reload into two persistent device buffer sets instead of fresh memory (TE ignores it).
        manual_synchronization: no automatic schedule; a :class:`ManualController` is returned third.
        retain_pinned_cpu_buffers: keep host buffers and reuse them next iteration (shapes must not change).
        offload_stream: the stream for the copies (only with ``manual_synchronization``, as in TE).
        min_tensor_size: saved tensors with fewer elements stay on the device.
        pin_memory: page-lock host buffers (where CUDA is present).

    Returns:
        ``(context, sync_fn)``, or ``(context, sync_fn, controller)`` with ``manual_synchronization`` (the
        controller is None when offloading is off).

    Raises:
        ValueError: nothing to offload, ``num_layers`` out of range (or None without manual synchronization),
            an ``offload_stream`` without manual synchronization, or a bad ``min_tensor_size``.

    Example:
        >>> context, sync_fn = get_cpu_offload_context(True, 2, len(layers), min_tensor_size=1024)
        >>> for layer in layers:
        ...     with context:
        ...         x = layer(x)
        ...     x = sync_fn(x)
    """
    off = (_DisabledContext(), _identity, None) if manual_synchronization else (_DisabledContext(), _identity)
    if not enabled:
        return off
    if not offload_activations and not offload_weights:
        raise ValueError("CPU Offloading is enabled while it is not mentioned what to offload (weights/activations)")
    if offload_weights:
        warnings.warn(
            "Offloading weights is deprecated. Using offload_weights=True does not have any effect.",
            DeprecationWarning,
            stacklevel=2,
        )
        if not offload_activations:
            return off
    if offload_stream is not None and not manual_synchronization:
        raise ValueError("offload_stream can be provided only if manual_synchronization is True")
    if model_layers < 1:
        raise ValueError(f"model_layers is {model_layers}; it must be at least 1")
    schedule = Schedule(model_layers, model_layers, manual=True)
    if not manual_synchronization:
        schedule = Schedule(model_layers, _check_layers(num_layers, model_layers))
    eligibility = Eligibility(device.compute_device(), min_tensor_size)
    context = OffloadContext(
        schedule, eligibility, double_buffering, retain_pinned_cpu_buffers, pin_memory, stream=offload_stream
    )
    return (context, context.sync, ManualController(context)) if manual_synchronization else (context, context.sync)


def _check_layers(num_layers: int | None, model_layers: int) -> int:
    """The automatic schedule's ``num_layers``, validated (``model_layers`` is at least 1)."""
    if num_layers is None:
        # TE 2.10 allows None only because manual mode ignores it; its automatic schedule compares it with
        # model_layers and fails there, so refuse it here with the fix.
        raise ValueError(
            "num_layers is None; without manual_synchronization it must be an int between 0 and "
            f"model_layers - 1 ({model_layers - 1}); pass manual_synchronization=True to schedule layers yourself"
        )
    if num_layers < 0:
        raise ValueError(f"num_layers is {num_layers}; it must be between 0 and model_layers - 1")
    if num_layers > model_layers - 1:
        raise ValueError(
            "Cannot offload all layers without manual synchronization - last layer is not offloaded. "
            f"num_layers is {num_layers} and model_layers is {model_layers}; set num_layers to at most "
            f"{model_layers - 1}."
        )
    if num_layers == model_layers - 1 and num_layers > 0:
        warnings.warn(
            "Offloading num_layers == model_layers - 1 is not recommended, it prevents overlapping of "
            "computation and offload/reload.",
            stacklevel=3,
        )
    return num_layers


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
