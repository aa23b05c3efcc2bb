"""Every allocation of the traced step: a ``FakeTensorMode`` that counts each new storage once.

Runs only in the trace's child process (imports torch). Each op's output tensors are looked at; a storage not seen
before is counted with its ``nbytes()`` and the category and module current at that moment, and
``weakref.finalize`` on the storage takes it off when the last tensor using it dies (a fake tensor's storage keeps
its Python object alive as long as any tensor holds it, so the finalizer runs exactly then). Views share their
base's storage and are never counted twice. Storages made before the mode was entered (none: the model is built
inside it) are not seen.

The live bytes by category are kept as counters; each phase keeps a copy of them (and of the activation bytes by
module) at its highest point, so ``phases`` and ``by_module`` come from the same moment as the peak.

Speed (docs/trace.md, "Speed"): the trace's time is the number of ops the fake mode dispatches, 100-200 us each,
and the bookkeeping around each. The tracker *is* the fake mode (a subclass of it, not a second mode above it): an op
crosses one Python mode, not two, and autograd's device queries (``prim.device``, 3/5 of the ops of a MoE stage:
several per tensor in every backward node and DDP hook) are answered at once.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Any

import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, in_kernel_invocation_manager
from torch.utils._pytree import SUPPORTED_NODES, tree_flatten

CATEGORIES = ("weights", "gradients", "optimizer", "activations", "other")
_DEVICE = torch.ops.prim.device.default
_MASKED_SELECT = torch.ops.aten.masked_select.default
# What the fake mode answers for prim.device (the tensor's fake device), without its dispatch around it.
_ANSWER_DEVICE = fake_tensor._DISPATCH_META_HANDLERS[_DEVICE]
_ATEN = torch.ops.aten
# Views of one tensor (DDP's buffer views, ``param.data``'s detach, autograd's expand per parameter): most of a MoE
# stage's time. The fake mode runs each through its dispatch cache, which misses on every new storage offset, and
# slice through a Python kernel written for symbolic sizes (~1 ms an op). With static sizes its own last step is
# all they need: the meta kernel on the tensor's meta storage, wrapped as a fake tensor on the input's device.
_VIEWS = frozenset(
    (
        _ATEN.slice.Tensor,
        _ATEN.view.default,
        _ATEN.detach.default,
        _ATEN.expand.default,
        _ATEN.as_strided.default,
        _ATEN.t.default,
        _ATEN.transpose.int,
        _ATEN.permute.default,
        _ATEN.unsqueeze.default,
        _ATEN.select.int,
        _ATEN.split_with_sizes.default,
    )
)
# copy_ writes into a tensor that exists (DDP's buffers, the optimizer's shards): its meta kernel checks the shapes
# and gives that tensor back; nothing is made.
_COPY = _ATEN.copy_.default


def _tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensors among an op's arguments (or outputs), as ``tree_flatten`` finds them: an aten schema nests them
    one list deep at most (``Tensor[]``, ``Tensor?[]``), which this reads without pytree's per-leaf cost (the host
    scan runs on every op); anything deeper or of another kind goes to ``tree_flatten``."""
    found = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif type(a) is list or type(a) is tuple:
            for b in a:
                if isinstance(b, torch.Tensor):
                    found.append(b)
                elif type(b) in SUPPORTED_NODES or isinstance(b, (list, tuple, dict)):
                    return _deep(args, kwargs)
        elif type(a) in SUPPORTED_NODES or isinstance(a, (list, tuple, dict)):
            return _deep(args, kwargs)
    return found


def _deep(args: Any, kwargs: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]


class Tracker(FakeTensorMode):
    """Live and peak bytes by category, phase and module (module docstring)."""

    def __init__(self, fast: bool = True) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.live: dict[int, list[Any]] = {}  # storage key -> [nbytes, category, module]
        self.by_category: dict[str, int] = defaultdict(int)
        self.by_module: dict[str, int] = defaultdict(int)
        self.total = 0
        self.category = "other"
        self.module = ""
        self.phase = "build"
        self.peaks: dict[str, dict[str, Any]] = {}
        self.allocations = 0
        self.ops = 0  # ops dispatched by the traced program: what the trace's time grows with
        # Of those, the ones the fake mode ran through its full dispatch (its cache, its kernels): the others are
        # answered here at once (``fast``: device queries, views, copy_; off only to hold them to the full path).
        self.slow_ops = 0
        self.fast = fast
        # Ops the fake mode runs while it answers one (decompositions, new_empty for masked_select) are its own,
        # as they were for a mode above it: not counted, their outputs not tracked but as the op's.
        self.inside = 0
        # Host memory (the CPU side of optimizer offload): storages made by .cpu(), pin_memory, device="cpu", and
        # whatever an op makes from them. Not in the GPU's total.
        self.force: str | None = None  # "host" / "device": what the device mode says the next outputs are
        self.host_bytes = 0
        self.host_peak = 0
        self.host_live = 0  # host storages alive: none (every run without optimizer offload) skips the arg scan
        # Elements a masked_select gives while the MoE permutation runs (trace.patches: balanced routing); a fake
        # tensor has no mask values to count.
        self.selected: int | None = None

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Dynamo is off in the child (trace.patches.apply): no wrapper around every op's dispatch to keep it out.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.inside:
            return self.dispatch(func, types, args, kwargs)
        self.ops += 1
        if func is _DEVICE and self.fast:  # autograd asks every tensor's device (3/5 of the ops)
            return _ANSWER_DEVICE(args)
        self.inside += 1
        try:
            if func is _MASKED_SELECT and self.selected is not None:
                out = args[0].new_empty((self.selected,))
            elif self.fast and func in _VIEWS and self._plain(args[0]):
                with in_kernel_invocation_manager(self):
                    meta = func(*args, **(kwargs or {}))
                out = self._wrap(meta, args[0].fake_device)
            elif self.fast and func is _COPY and self._plain(args[0]) and self._plain(args[1]):
                with in_kernel_invocation_manager(self):
                    func(*args, **(kwargs or {}))
                out = args[0]
            else:
                self.slow_ops += 1
                out = self.dispatch(func, types, args, kwargs)
        finally:
            self.inside -= 1
        host = self.force == "host" or (
            self.force is None and self.host_live > 0 and any(self.is_host(a) for a in _tensors(args, kwargs))
        )
        if type(out) is FakeTensor:
            self.track(out, host)
        elif out is not None:
            for t in _tensors((out,), None):
                self.track(t, host)
        return out

    def _plain(self, t: Any) -> bool:
        """Whether ``t`` is one of this mode's fake tensors with nothing the fake mode's slow path is for: no
        constant value, no real tensor beside it (the trace has no symbolic sizes)."""
        return type(t) is FakeTensor and t.fake_mode is self and t.constant is None and t.real_tensor is None

    def _wrap(self, meta: Any, device: torch.device) -> Any:
        """A view op's meta output(s) as fake tensors on ``device`` (what the fake mode's last step makes)."""
        if isinstance(meta, (list, tuple)):
            return type(meta)(self._wrap(m, device) for m in meta)
        return self.fake_tensor_converter.from_meta_and_device(self, meta, device)

    def is_host(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in host memory (module docstring)."""
        entry = self.live.get(t.untyped_storage()._cdata)
        return entry is not None and entry[1] == "host"

    def track(self, t: torch.Tensor, host: bool = False) -> None:
        """Count ``t``'s storage if it is new (in host memory when ``host``)."""
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return
        nbytes = int(storage.nbytes())
        self.allocations += 1
        weakref.finalize(storage, self._free, key)
        if host:
            self.live[key] = [nbytes, "host", ""]
            self.host_live += 1
            self.host_bytes += nbytes
            self.host_peak = max(self.host_peak, self.host_bytes)
            return
        self.live[key] = [nbytes, self.category, self.module]
        self.total += nbytes
        self.by_category[self.category] += nbytes
        if self.category == "activations" and self.module:
            self.by_module[self.module] += nbytes
        self._update_peak()

    def _update_peak(self) -> None:
        peak = self.peaks.get(self.phase)
        if peak is None or self.total > peak["total"]:
            self.peaks[self.phase] = {
                "total": self.total,
                "by_category": dict(self.by_category),
                "by_module": dict(self.by_module),
            }

    def _free(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is None:
            return
        nbytes, category, module = entry
        if category == "host":
            self.host_live -= 1
            self.host_bytes -= nbytes
            return
        self.total -= nbytes
        self.by_category[category] -= nbytes
        if category == "activations" and module:
            self.by_module[module] -= nbytes

    def resized(self, storage: Any) -> None:
        """A storage resized in place (``trace.patches``: recompute's freed outputs): its live bytes follow."""
        entry = self.live.get(storage._cdata)
        if entry is None or entry[1] == "host":
            return
        nbytes = int(storage.nbytes())
        delta, entry[0] = nbytes - entry[0], nbytes
        self.total += delta
        self.by_category[entry[1]] += delta
        if entry[1] == "activations" and entry[2]:
            self.by_module[entry[2]] += delta
        self._update_peak()

    def retag(self, t: torch.Tensor, category: str) -> None:
        """Say that ``t``'s storage belongs to ``category`` (weights, gradients, optimizer state), whatever was
        current when it was made."""
        key = t.untyped_storage()._cdata
        entry = self.live.get(key)
        if entry is None:
            self.track(t)
            entry = self.live[key]
        nbytes, old, module = entry
        if old == category or old == "host":
            return
        self.by_category[old] -= nbytes
        if old == "activations" and module:
            self.by_module[module] -= nbytes
        self.by_category[category] += nbytes
        entry[1] = category

    def mark_phase(self, phase: str) -> None:
        """Start ``phase``: its peak starts at what is live now."""
        self.phase = phase
        if phase in self.peaks:  # a phase entered again (forward_backward around each loss) keeps its peak
            self._update_peak()
            return
        self.peaks[phase] = {
            "total": self.total,
            "by_category": dict(self.by_category),
            "by_module": dict(self.by_module),
        }
