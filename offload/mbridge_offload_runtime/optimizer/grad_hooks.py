"""Start each offloaded gradient's D2H copy in backward, as soon as autograd has finished accumulating it.

As torchao's ``CPUOffloadOptimizer`` does, a post-accumulate-grad hook on every offloaded parameter of at least
``buckets.SMALL_COPY_NUMEL`` elements issues its copy on the D2H stream while backward computes earlier layers.
``step()`` uses a hook copy only if the gradient's storage and version counter are unchanged since (clipping,
unscaling, another micro-batch, ``decoupled_grad`` make it copy again), so a hook copy can be wasted work but
never a stale input. With accumulation each firing copies the running sum and the last copy wins;
``optimizer.no_sync()`` skips the earlier micro-batches' copies, like Megatron DDP's ``no_sync()``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

from mbridge_offload_runtime import device
from mbridge_offload_runtime.optimizer import buckets as _buckets
from mbridge_offload_runtime.optimizer.buckets import Bucket


def _signature(grad: torch.Tensor) -> tuple[int, int]:
    return grad.data_ptr(), grad._version  # the version counter is bumped by every in-place op


class GradCopyHooks:
    """Post-accumulate-grad hooks that copy the buckets' large members' gradients on ``d2h_stream``."""

    def __init__(self, buckets: list[Bucket], d2h_stream: device.Stream) -> None:
        self.buckets = buckets
        self.d2h = d2h_stream
        self.deferred = False
        self.copied: dict[tuple[int, int], tuple[int, int]] = {}
        self.handles: list = []
        ref = weakref.ref(self)  # the hooks must not keep a dropped optimizer's buffers alive
        for bi, bucket in enumerate(buckets):
            for k, param in enumerate(bucket.members):
                # Small members are left to step(), which moves runs of them in one copy each: a copy per small
                # tensor in backward costs more host time in launches than it hides (read at build time, so a
                # test can lower it).
                if param.requires_grad and param.numel() >= _buckets.SMALL_COPY_NUMEL:
                    self.handles.append(param.register_post_accumulate_grad_hook(_make_hook(ref, bi, k)))

    def copy_one(self, bi: int, k: int, grad: torch.Tensor) -> None:
        bucket = self.buckets[bi]
        # Autograd wrote this gradient on the compute stream: the copy must not start before that write. Later
        # writes to it on the compute stream (the next micro-batch, clipping) may overlap this read; that copy is
        # then stale, the version check in step() sees it, and the re-copy queues behind it on this same stream.
        self.d2h.wait_stream(device.current_stream())
        with device.on_stream(self.d2h), device.speculative():
            bucket.grad_views[k].copy_(grad, non_blocking=device.is_pinned(bucket.flat_grad))
        # The gradient may be freed (zero_grad) while the copy is in flight: keep its memory until the D2H is done.
        device.record_stream(grad, self.d2h)
        self.copied[bi, k] = _signature(grad)
        bucket.count("d2h", 1, bucket.grad_views[k].nbytes)

    def is_current(self, bi: int, k: int, grad: torch.Tensor) -> bool:
        """Whether the host buffer already holds exactly ``grad`` (copied by a hook, unchanged since)."""
        return self.copied.get((bi, k)) == _signature(grad)

    def reset(self) -> None:
        """Forget the copies (after ``step()`` consumed them, or ``zero_grad()`` dropped the gradients)."""
        self.copied.clear()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        saved, self.deferred = self.deferred, True
        try:
            yield
        finally:
            self.deferred = saved

    def remove(self) -> None:
        """Unregister every hook (idempotent)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.copied.clear()


def _make_hook(ref: weakref.ReferenceType, bi: int, k: int):
    def on_grad_accumulated(param: torch.Tensor) -> None:
        hooks = ref()
        if hooks is None or hooks.deferred or param.grad is None:
            return
        hooks.copy_one(bi, k, param.grad)

    return on_grad_accumulated
