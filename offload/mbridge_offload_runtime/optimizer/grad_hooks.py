"""Start each offloaded gradient's D2H copy in backward, as soon as autograd has finished accumulating it.

With ``overlap_cpu_optimizer_d2h_h2d=True`` :class:`GradCopyHooks` registers a post-accumulate-grad hook
(``Tensor.register_post_accumulate_grad_hook``, torch >= 2.1) on every offloaded parameter of at least
``buckets.SMALL_COPY_NUMEL`` elements (smaller ones are batched by ``step()``), as torchao's
``CPUOffloadOptimizer`` does: the copy into the bucket's host gradient buffer is issued on the D2H stream while
backward goes on computing earlier layers, so by ``step()`` most gradients are already on the host. On CPU the
same hooks run and the copies are plain copies, so the order is the same and tested.

Which copy counts. ``step()`` uses a hook copy only if the gradient is still the tensor the hook copied, unchanged
since: each copy remembers the gradient's storage pointer and version counter, and any in-place change after it
(clipping, loss-scale unscaling, another micro-batch's accumulation, ``decoupled_grad`` taking precedence) makes
``step()`` copy that gradient again. So a hook copy can be wasted work but never a stale input.

Gradient accumulation. Every hook firing copies the gradient accumulated so far; the device gradient keeps the
running sum (we never free it), so the last micro-batch's copy is the full gradient — torchao's behaviour without
``offload_gradients``. To skip the copies of the earlier micro-batches, run them inside
``optimizer.no_sync()``, the way Megatron's ``DistributedDataParallel.no_sync()`` holds back its gradient
reduce-scatter until the last micro-batch.
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
    """Identity of a gradient's contents: its storage and its version counter (bumped by every in-place op)."""
    return grad.data_ptr(), grad._version


class GradCopyHooks:
    """Post-accumulate-grad hooks that copy offloaded gradients into their host buckets during backward.

    Args:
        buckets: the optimizer's host buckets (``buckets.Bucket``), whose members get a hook each.
        d2h_stream: the stream the copies are issued on (a no-op stream on CPU).
    """

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
        """Issue member ``k`` of bucket ``bi``'s copy on the D2H stream and remember what was copied."""
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
        bucket.stats.d2h_copies += 1
        bucket.stats.d2h_bytes += bucket.grad_views[k].nbytes

    def is_current(self, bi: int, k: int, grad: torch.Tensor) -> bool:
        """Whether the host buffer already holds exactly ``grad`` (copied by a hook, unchanged since)."""
        return self.copied.get((bi, k)) == _signature(grad)

    def reset(self) -> None:
        """Forget the copies (after ``step()`` consumed them, or ``zero_grad()`` dropped the gradients)."""
        self.copied.clear()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside issue no copies (non-final micro-batches of a gradient accumulation)."""
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
