"""Every allocation of the traced step: a ``TorchDispatchMode`` that counts each new storage once.

Runs only in the trace's child process (imports torch). Each op's output tensors are looked at; a storage not seen
before is counted with its ``nbytes()`` and the category and module current at that moment, and
``weakref.finalize`` on the storage takes it off when the last tensor using it dies (a fake tensor's storage keeps
its Python object alive as long as any tensor holds it, so the finalizer runs exactly then). Views share their
base's storage and are never counted twice. Storages made before the mode was entered (none: the model is built
inside it) are not seen.

The live bytes by category are kept as counters; each phase keeps a copy of them (and of the activation bytes by
module) at its highest point, so ``phases`` and ``by_module`` come from the same moment as the peak.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

CATEGORIES = ("weights", "gradients", "optimizer", "activations", "other")
_DEVICE = torch.ops.prim.device.default


class Tracker(TorchDispatchMode):
    """Live and peak bytes by category, phase and module (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list[Any]] = {}  # storage key -> [nbytes, category, module]
        self.by_category: dict[str, int] = defaultdict(int)
        self.by_module: dict[str, int] = defaultdict(int)
        self.total = 0
        self.category = "other"
        self.module = ""
        self.phase = "build"
        self.peaks: dict[str, dict[str, Any]] = {}
        self.allocations = 0
        self.ops = 0  # ops dispatched: what the trace's time grows with (docs/trace.md, "Speed")
        # Host memory (the CPU side of optimizer offload): storages made by .cpu(), pin_memory, device="cpu", and
        # whatever an op makes from them. Not in the GPU's total.
        self.force: str | None = None  # "host" / "device": what the device mode says the next outputs are
        self.host_bytes = 0
        self.host_peak = 0
        # Elements a masked_select gives while the MoE permutation runs (trace.patches: balanced routing); a fake
        # tensor has no mask values to count.
        self.selected: int | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if func is _DEVICE:  # autograd asks every tensor's device (2/3 of the ops): it allocates nothing
            return func(*args, **(kwargs or {}))
        if func is torch.ops.aten.masked_select.default and self.selected is not None:
            out = args[0].new_empty((self.selected,))
        else:
            out = func(*args, **(kwargs or {}))
        host = self.force == "host" or (
            self.force is None
            and any(isinstance(a, torch.Tensor) and self.is_host(a) for a in tree_flatten((args, kwargs))[0])
        )
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t, host)
        return out

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
