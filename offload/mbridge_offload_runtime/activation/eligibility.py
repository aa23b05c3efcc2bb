"""Which saved tensors are worth offloading, and the user's opt-outs (a region, or tensors)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from mbridge_offload_runtime.activation.schedule import DEFAULT_MIN_TENSOR_SIZE

ViewSpec = tuple[torch.Size, tuple[int, ...], int | torch.SymInt]  # as_strided's size, stride, offset

_DO_NOT_OFFLOAD = "_mbo_do_not_offload"
_keep_depth = [0]


@contextlib.contextmanager
def keep_on_device() -> Iterator[None]:
    """Keep every tensor saved inside this block on the device, even within an offloaded layer (an output head
    whose activations are used right away in backward, or too large to move in time).

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
    """Which saved tensors on ``compute_device`` of at least ``min_tensor_size`` elements are worth offloading."""

    def __init__(self, compute_device: torch.device, min_tensor_size: int = DEFAULT_MIN_TENSOR_SIZE) -> None:
        if min_tensor_size < 0:
            raise ValueError(f"min_tensor_size is {min_tensor_size}; it must be >= 0 (elements)")
        self.device = compute_device
        self.min_tensor_size = min_tensor_size

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
    dims = sorted((d for d in zip(tensor.shape, tensor.stride(), strict=True) if d[0] != 1), key=lambda d: d[1])
    for size, stride in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def fold_view(tensor: torch.Tensor) -> tuple[torch.Tensor, ViewSpec | None]:
    """The tensor to copy (the view's base) and how to rebuild ``tensor`` from it (``None``: it is the base)."""
    base = tensor._base
    if base is None or base.dtype != tensor.dtype:
        return tensor, None
    offset = tensor.storage_offset() - base.storage_offset()
    span = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    if tensor.numel() == 0 or offset < 0 or offset + span >= base.numel():
        # The view reaches storage its base tensor does not cover (e.g. a base that is itself an alias of a
        # larger buffer): the base's copy could not rebuild it, so the view is copied on its own.
        return tensor, None
    return base, (tensor.size(), tensor.stride(), offset)
