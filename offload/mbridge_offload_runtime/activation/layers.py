"""``offload_layers``: activation offloading for a plain ``nn.ModuleList`` via forward hooks."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from torch import nn

from mbridge_offload_runtime.activation.context import OffloadContext, get_cpu_offload_context
from mbridge_offload_runtime.activation.eligibility import mark_not_offload
from mbridge_offload_runtime.activation.schedule import DEFAULT_MIN_TENSOR_SIZE, OffloadStats

__all__ = ["OffloadHandle", "offload_layers"]


class OffloadHandle:
    """What :func:`offload_layers` returns: the live context, and ``remove()`` (or leaving ``with``)."""

    def __init__(self, context: OffloadContext) -> None:
        self.context = context
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    @property
    def stats(self) -> OffloadStats | None:
        return self.context.stats

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def __enter__(self) -> OffloadHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _enter(self, module: nn.Module, args: tuple[object, ...]) -> None:
        self.context.__enter__()

    def _leave(self, module: nn.Module, args: tuple[object, ...], output: object) -> object:
        # Why: with always_call, torch runs this hook from inside its ``except`` when the layer raised; the
        # context must see the exception to start the next forward at layer 0.
        exc = sys.exc_info() if output is None else (None, None, None)
        self.context.__exit__(*exc)
        if exc[0] is not None:
            return None
        if isinstance(output, torch.Tensor):
            return self.context.sync(output)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (self.context.sync(output[0]), *output[1:])
        return output


def offload_layers(
    module_list: Sequence[nn.Module],
    num_layers: int,
    *,
    double_buffering: bool = False,
    retain_pinned_cpu_buffers: bool = False,
    min_tensor_size: int = DEFAULT_MIN_TENSOR_SIZE,
    pin_memory: bool = True,
) -> OffloadHandle:
    """Offload the activations of the first ``num_layers`` modules of a sequential stack.

    Forward hooks run each module inside the context and sync its output; the modules' buffers are marked as not
    offloadable. The modules must run in order, once per forward.

    Args:
        module_list: the layers, in forward order (e.g. an ``nn.ModuleList``).
        num_layers: how many of the first layers to offload (``0 ≤ num_layers ≤ len(module_list) − 1``).
        double_buffering, retain_pinned_cpu_buffers, min_tensor_size, pin_memory: as in
            :func:`get_cpu_offload_context`.

    Raises:
        ValueError: ``num_layers`` out of range.

    Example:
        >>> handle = offload_layers(model.layers, num_layers=4, min_tensor_size=4096)
        >>> loss = model(batch).sum(); loss.backward()
        >>> print(handle.stats.bytes_offloaded)
        >>> handle.remove()
    """
    modules = list(module_list)
    context, _ = get_cpu_offload_context(
        True,
        num_layers,
        len(modules),
        double_buffering=double_buffering,
        retain_pinned_cpu_buffers=retain_pinned_cpu_buffers,
        min_tensor_size=min_tensor_size,
        pin_memory=pin_memory,
    )
    handle = OffloadHandle(context)
    for module in modules:
        mark_not_offload(*module.buffers())
        handle._hooks.append(module.register_forward_pre_hook(handle._enter))
        # always_call: leave the context even if the layer raises, so the next forward can enter it again.
        handle._hooks.append(module.register_forward_hook(handle._leave, always_call=True))
    return handle
