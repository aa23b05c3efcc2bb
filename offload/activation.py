"""Layer-level activation offloading with Transformer Engine's call shape.

``get_cpu_offload_context(...)`` returns ``(context, sync_fn)``: enter ``context`` around each layer's forward
and pass each layer's output through ``sync_fn``, exactly as Megatron Core's ``TransformerBlock`` does with
TE. Inside the context, ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor autograd saves; the
ones that qualify (see :class:`Eligibility`) in the first ``num_layers`` layers are copied to host memory as
they are saved (on a side stream on CUDA), dropped from the device when layer ``L − k + i`` starts, and
copied back when backward reaches layer ``L − 1 − k + i`` (the schedule is in ``offload.activation_schedule``;
the per-pass mechanics in ``offload.activation_pass``). On CPU the same state machine runs with plain copies.

The runtime follows TE v2 (``transformer_engine/pytorch/cpu_offload.py``): same errors, same schedule, same
size threshold by default. Unlike TE, ``double_buffering`` is a real option, views are folded onto their base
whatever their coverage, several forwards may run before their backwards, and every pass is accounted.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from types import TracebackType

import torch
from torch import nn

from offload import device
from offload.activation_pass import BackwardStep, Pass, ViewSpec, fold_view, unpack
from offload.activation_pool import HostBufferPool, ReloadBuffers
from offload.activation_schedule import DEFAULT_MIN_TENSOR_SIZE, OffloadStats, Schedule

__all__ = [
    "DEFAULT_MIN_TENSOR_SIZE",
    "Eligibility",
    "OffloadContext",
    "OffloadHandle",
    "OffloadStats",
    "get_cpu_offload_context",
    "keep_on_device",
    "mark_not_offload",
    "offload_layers",
]


_DO_NOT_OFFLOAD = "_mbo_do_not_offload"
_keep_depth = [0]


@contextlib.contextmanager
def keep_on_device() -> Iterator[None]:
    """Keep every tensor saved inside this block on the device, even within an offloaded layer.

    Use it for regions whose activations are consumed right away in backward, or are too large to move in
    time (an output head). Works whether it is entered inside or outside the offload context.

    Example:
        >>> with context:
        ...     h = layer.body(x)
        ...     with keep_on_device():
        ...         y = layer.head(h)
    """
    _keep_depth[0] += 1
    try:
        yield
    finally:
        _keep_depth[0] -= 1


def mark_not_offload(*tensors: torch.Tensor) -> None:
    """Mark tensors (e.g. module buffers) that must never be offloaded; TE's ``_TE_do_not_offload`` is honoured too."""
    for tensor in tensors:
        setattr(tensor, _DO_NOT_OFFLOAD, True)


class Eligibility:
    """Which saved tensors are worth offloading, and why the others are not.

    Args:
        compute_device: the device whose memory we relieve; tensors elsewhere stay put.
        min_tensor_size: smallest number of elements worth a copy (default TE's ``256 * 1024``).
    """

    def __init__(self, compute_device: torch.device, min_tensor_size: int = DEFAULT_MIN_TENSOR_SIZE) -> None:
        if min_tensor_size < 0:
            raise ValueError(f"min_tensor_size is {min_tensor_size}; it must be >= 0 (elements)")
        self.device = compute_device
        self.min_tensor_size = min_tensor_size

    def skip_reason(self, tensor: torch.Tensor) -> str | None:
        """``None`` if ``tensor`` should be offloaded, else the reason it stays."""
        return self.classify(tensor)[0]

    def classify(self, tensor: torch.Tensor) -> tuple[str | None, torch.Tensor, ViewSpec | None]:
        """``(reason or None, what to copy, how to rebuild the view)``; the hot path of the pack hook.

        Cheap checks come first; the Python-level ``isinstance`` checks (``nn.Parameter`` has a metaclass) run
        only for tensor subclasses, since a plain ``torch.Tensor`` can be neither a parameter nor a fake tensor.
        """
        if _keep_depth[0]:
            return "opt_out", tensor, None
        plain = type(tensor) is torch.Tensor
        if not plain and isinstance(tensor, nn.Parameter):
            return "parameter", tensor, None  # weights live on the device anyway; copying costs bandwidth
        raw = tensor._base
        if raw is not None and type(raw) is not torch.Tensor and isinstance(raw, nn.Parameter):
            return "parameter", tensor, None  # a view of a weight (e.g. ``w.t()`` saved by a matmul)
        if _marked(tensor) or (raw is not None and _marked(raw)):
            return "buffer", tensor, None
        if not plain and isinstance(tensor, torch._subclasses.FakeTensor):
            return "fake", tensor, None
        if tensor.device != self.device:
            return "other_device", tensor, None
        if tensor.numel() < self.min_tensor_size:
            return "small", tensor, None
        base, view = fold_view(tensor)
        if not _dense(base):
            return "non_contiguous", tensor, None  # overlapping or gappy storage: a host copy cannot mirror it
        return None, base, view


def _marked(tensor: torch.Tensor) -> bool:
    """Marked by :func:`mark_not_offload` (``offload_layers`` marks buffers), TE's, or made by ``nn.Buffer``."""
    attrs = tensor.__dict__
    return bool(attrs) and (_DO_NOT_OFFLOAD in attrs or "_TE_do_not_offload" in attrs or "_is_buffer" in attrs)


def _dense(tensor: torch.Tensor) -> bool:
    """Contiguous, or a permutation of contiguous (e.g. a transposed product): copyable with its strides."""
    if tensor.is_contiguous():
        return True
    expected = 1
    for size, stride in sorted((d for d in zip(tensor.shape, tensor.stride(), strict=True) if d[0] != 1), key=_stride):
        if stride != expected:
            return False
        expected *= size
    return True


def _stride(dim: tuple[int, int]) -> int:
    return dim[1]


class _DisabledContext(contextlib.nullcontext):
    """What ``enabled=False`` returns: a no-op context that still answers ``inside_context``."""

    inside_context = False


class OffloadContext:
    """The context entered around each layer's forward; ``sync`` is the matching ``sync_fn``.

    Build it with :func:`get_cpu_offload_context`. Accounting: :attr:`stats` (the last pass whose backward
    finished), :attr:`history` (recent passes), :attr:`current` (the pass whose forward is running).
    """

    def __init__(
        self,
        schedule: Schedule,
        eligibility: Eligibility,
        double_buffering: bool = False,
        retain_pinned_cpu_buffers: bool = False,
        pin_memory: bool = True,
        history: int = 16,
    ) -> None:
        self.schedule = schedule
        self.eligibility = eligibility
        self.device = eligibility.device
        self.stream = device.new_stream()
        self.pool = HostBufferPool(retain=retain_pinned_cpu_buffers, pin=pin_memory)
        self.reload_buffers = ReloadBuffers(self.device) if double_buffering else None
        self.history: deque[OffloadStats] = deque(maxlen=history)
        self._inside = False
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._layer = -1
        self._pass: Pass | None = None

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
        if not torch.is_grad_enabled():
            return self  # evaluation: nothing is saved, the layer count is left alone
        self._layer = (self._layer + 1) % self.schedule.model_layers
        if self._layer == 0 or self._pass is None:
            self._pass = Pass(self)
        self._pass.enter_layer(self._layer)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pass.push, unpack)
        self._hooks.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._inside = False
        if self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(exc_type, exc, tb)
        if exc_type is not None:
            self.reset()  # the forward is abandoned: the next one starts again at layer 0

    def sync(self, tensor: torch.Tensor) -> torch.Tensor:
        """The ``sync_fn``: mark ``tensor`` as the output of the layer that just ran; returns it unchanged.

        Its ``grad_fn`` gets a pre-hook that tells the schedule when backward reaches this layer.
        """
        if not (torch.is_grad_enabled() and isinstance(tensor, torch.Tensor) and tensor.requires_grad):
            return tensor
        if self._pass is None or self._inside:
            return tensor
        if tensor.grad_fn is None:
            tensor = tensor.view_as(tensor)  # a leaf has no node to hook; an alias gives it one
        tensor.grad_fn.register_prehook(BackwardStep(self._pass, self._layer))
        return tensor

    def pass_finished(self, finished: Pass) -> None:
        self.history.append(finished.stats)
        if self._pass is finished:
            self._pass = None

    def reset(self) -> None:
        """Forget the layer count (done automatically when a layer raises inside the context)."""
        self._layer, self._pass = -1, None

    def reset_buffers(self) -> None:
        """Drop the retained host buffers, so that new shapes are accepted."""
        self.pool.clear()


def get_cpu_offload_context(
    enabled: bool = False,
    num_layers: int = 1,
    model_layers: int = 1,
    offload_activations: bool = True,
    offload_weights: bool = False,
    double_buffering: bool = False,
    retain_pinned_cpu_buffers: bool = False,
    *,
    min_tensor_size: int = DEFAULT_MIN_TENSOR_SIZE,
    pin_memory: bool = True,
) -> tuple[OffloadContext | _DisabledContext, Callable[[torch.Tensor], torch.Tensor]]:
    """Activation offloading for a sequence of layers, with Transformer Engine's signature.

    Args:
        enabled: turn offloading on; when False a no-op context and the identity are returned.
        num_layers: ``k``, how many of the first layers to offload (``0 ≤ k ≤ model_layers − 1``).
        model_layers: ``L``, how many layers enter the context per forward.
        offload_activations: offload saved activations (the only thing offloaded).
        offload_weights: deprecated as in TE; has no effect beyond a ``DeprecationWarning``.
        double_buffering: reload into two persistent device buffer sets instead of fresh memory.
        retain_pinned_cpu_buffers: keep host buffers and reuse them next iteration (shapes must not change).
        min_tensor_size: saved tensors with fewer elements stay on the device.
        pin_memory: page-lock host buffers (where CUDA is present).

    Returns:
        ``(context, sync_fn)``.

    Raises:
        ValueError: nothing to offload, ``num_layers`` out of range, or a bad ``min_tensor_size``.

    Example:
        >>> context, sync_fn = get_cpu_offload_context(True, 2, len(layers), min_tensor_size=1024)
        >>> for layer in layers:
        ...     with context:
        ...         x = layer(x)
        ...     x = sync_fn(x)
        >>> x.sum().backward()
        >>> context.stats.bytes_offloaded
    """
    if not enabled:
        return _DisabledContext(), _identity
    if not offload_activations and not offload_weights:
        raise ValueError("CPU Offloading is enabled while it is not mentioned what to offload (weights/activations)")
    if offload_weights:
        warnings.warn(
            "Offloading weights is deprecated. Using offload_weights=True does not have any effect.",
            DeprecationWarning,
            stacklevel=2,
        )
        if not offload_activations:
            return _DisabledContext(), _identity
    _check_layers(num_layers, model_layers)
    return _build(num_layers, model_layers, double_buffering, retain_pinned_cpu_buffers, min_tensor_size, pin_memory)


def _build(
    num_layers: int, model_layers: int, double: bool, retain: bool, min_size: int, pin: bool
) -> tuple[OffloadContext, Callable[[torch.Tensor], torch.Tensor]]:
    ctx = OffloadContext(
        Schedule(model_layers, num_layers),
        Eligibility(device.compute_device(), min_size),
        double_buffering=double,
        retain_pinned_cpu_buffers=retain,
        pin_memory=pin,
    )
    return ctx, ctx.sync


def _check_layers(num_layers: int, model_layers: int) -> None:
    if model_layers < 1:
        raise ValueError(f"model_layers is {model_layers}; it must be at least 1")
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


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


# The nn.Module wrapper lives in its own module; imported last because it builds on the names above.
from offload.activation_layers import OffloadHandle, offload_layers  # noqa: E402
