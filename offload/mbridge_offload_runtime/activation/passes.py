"""One pass of activation offloading: the saved tensors of one forward, until its backward is over.

The context creates a :class:`Pass` (one :class:`LayerStore` per layer) at layer 0 of every forward with grad
enabled, so several forwards may be in flight (gradient accumulation): each handle points at its pass and layer.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Protocol

import torch

from mbridge_offload_runtime import device
from mbridge_offload_runtime.activation.eligibility import Eligibility, ViewSpec
from mbridge_offload_runtime.activation.pool import HostBufferPool, ReloadBuffers, empty_strided
from mbridge_offload_runtime.activation.schedule import (
    LayerPhase,
    OffloadStats,
    Residency,
    Schedule,
    ScheduleEvent,
    check_transition,
)
from mbridge_offload_runtime.device import Event, Stream


class PassOwner(Protocol):
    """What a pass needs of ``context.OffloadContext`` (which imports this module)."""

    schedule: Schedule
    eligibility: Eligibility
    pool: HostBufferPool
    reload_buffers: ReloadBuffers | None
    device: torch.device
    stream: Stream

    def pass_finished(self, finished: Pass) -> None: ...


@dataclass(frozen=True)
class SavedHandle:
    """What autograd keeps for an offloaded saved tensor: its copy, and how to rebuild the view."""

    store: LayerStore
    slot: int
    view: ViewSpec | None

    def load(self) -> torch.Tensor:
        return self.store.load(self.slot, self.view)


def unpack(packed: object) -> torch.Tensor:
    return packed.load() if isinstance(packed, SavedHandle) else packed  # type: ignore[return-value]


def storage_key(tensor: torch.Tensor) -> tuple[object, ...]:
    """Identity of a tensor's data. Not an object id: the alias we keep does not keep the Python object alive, so
    its id can be reused; the storage is kept alive, so its address cannot."""
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape, tensor.stride(), tensor.dtype)


def _without_graph(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor that stays, detached if it has a ``grad_fn``. Why: a saved output returned as-is from a pack hook
    makes a cycle (tensor → grad_fn → saved tensor), so a forward whose backward never runs would hold its
    activations until the garbage collector runs; autograd re-attaches the grad_fn on unpack."""
    return tensor.detach() if tensor.grad_fn is not None else tensor


@dataclass(slots=True)
class Slot:
    """One saved tensor of a layer on its round trip: device copy → host copy → reloaded copy."""

    on_device: torch.Tensor | None  # the forward's tensor (a detached alias), kept until the D2H copies finish
    ready: Event | None  # recorded on the compute stream when it was saved
    host: torch.Tensor | None = None  # set once its D2H copy is issued
    reloaded: torch.Tensor | None = None  # set once its H2D copy is issued
    reload_event: Event | None = None  # recorded on the side stream after that copy
    waited: bool = False  # the compute stream already waits for ``reload_event``


class LayerStore:
    """The saved tensors of one offloaded layer in one pass, and its round trip through host memory."""

    def __init__(self, owner: Pass, layer: int) -> None:
        self.owner = owner
        self.layer = layer
        self.phase = LayerPhase.NOT_OFFLOADED
        self.freed = False
        self.nbytes = 0
        self._index: dict[tuple[object, ...], int] = {}  # the same tensor saved twice is copied once
        self._slots: list[Slot] = []
        self._copied = 0  # slots [0, _copied) have a host copy
        self._offload_done: Event | None = None
        self._double_buffered = False
        self._backward_done = False

    # forward ---------------------------------------------------------------------------------------------
    def push(self, base: torch.Tensor) -> tuple[int, bool]:
        """``(slot, is_new)`` for ``base``; a new one starts its copy unless a manual layer's offload is not started."""
        key = storage_key(base)
        slot = self._index.get(key)
        if slot is not None:
            return slot, False
        slot = len(self._slots)
        # Why: the side stream must not read ``base`` before the compute stream has finished producing it.
        ready = device.new_event()
        ready.record(device.current_stream())
        self._index[key] = slot
        # A detached alias keeps the storage alive until release without a reference cycle through grad_fn.
        self._slots.append(Slot(base.detach(), ready))
        self.owner.residency.add(self.layer, base.numel() * base.element_size())
        if not self.owner.ctx.schedule.manual or self.phase is LayerPhase.OFFLOAD_STARTED:
            self.start_offload()
        return slot, True

    def start_offload(self) -> None:
        """Issue the device→host copies not issued yet (at push, or by the manual controller)."""
        if self.phase is LayerPhase.NOT_OFFLOADED:
            self._set_phase(LayerPhase.OFFLOAD_STARTED)
            self.owner.log_event("fwd", "offload_start", self.layer, self.owner.layer)
        elif self.phase is not LayerPhase.OFFLOAD_STARTED:
            raise RuntimeError(
                f"activation offload: layer {self.layer} is {self.phase.value}; its offload can start only before "
                "its device copies are released"
            )
        for index in range(self._copied, len(self._slots)):
            self._copy_out(index, self._slots[index])

    def _copy_out(self, index: int, slot: Slot) -> None:
        ctx, base = self.owner.ctx, slot.on_device
        assert base is not None and slot.ready is not None  # not released: the phase check above
        host, new = ctx.pool.acquire(self.layer, index, base.shape, base.stride(), base.dtype)
        # Why: wait for the event recorded when the tensor was saved, not for everything queued since.
        ctx.stream.wait_event(slot.ready)
        with torch.no_grad(), device.on_stream(ctx.stream):
            host.copy_(base, non_blocking=device.is_pinned(host))
        # Why: one event after the last copy; the stream is ordered, so it covers all earlier copies.
        self._offload_done = ctx.stream.record_event()
        slot.host = host
        self._copied = index + 1
        nbytes = base.numel() * base.element_size()
        self.nbytes += nbytes
        stats = self.owner.stats
        stats.bytes_offloaded += nbytes
        stats.copies_offloaded += 1
        stats.host_buffers_allocated += int(new)

    def release(self, at: int) -> None:
        """Drop the device copies once the D2H copies are done (forward of layer ``L − k + i``)."""
        if self.phase is not LayerPhase.OFFLOAD_STARTED:
            return  # nothing was offloaded in this layer
        self._set_phase(LayerPhase.RELEASED)
        # Why: the compute stream may reuse this memory as soon as we drop it, so it waits for the copies.
        if self._offload_done is not None:
            device.current_stream().wait_event(self._offload_done)
        for slot in self._slots:
            slot.on_device = slot.ready = None
        self.owner.residency.drop(self.layer)
        self.owner.log_event("fwd", "release", self.layer, at)

    # backward --------------------------------------------------------------------------------------------
    def start_reload(self, at: int, late: bool = False) -> None:
        """Issue the H2D copies (backward of layer ``L − 1 − k + i``, or on first use when ``late``)."""
        if self.phase is not LayerPhase.RELEASED:
            return  # never released (forward stopped early, or nothing saved): the device copies are still here
        self._set_phase(LayerPhase.RELOAD_STARTED)
        ctx = self.owner.ctx
        hosts = self._hosts()
        specs = [(h.shape, h.stride(), h.dtype) for h in hosts]
        # A reload after the layer's backward (a retained graph) has no later free to return a shared set.
        shared = ctx.reload_buffers if not self._backward_done else None
        targets = shared.take(self.layer, specs) if shared is not None else None
        self._double_buffered = targets is not None
        if shared is not None:
            self.owner.stats.double_buffer_hits += int(targets is not None)
            self.owner.stats.double_buffer_misses += int(targets is None)
        if targets is None:
            # Why: allocate on the compute stream, so the caching allocator keeps the memory in its pool.
            targets = [empty_strided(spec, ctx.device) for spec in specs]
        # Why: the copies overwrite memory the compute stream may have used until now.
        ctx.stream.wait_stream(device.current_stream())
        with torch.no_grad(), device.on_stream(ctx.stream):
            for slot, host, dst in zip(self._slots[: len(hosts)], hosts, targets, strict=True):
                dst.copy_(host, non_blocking=device.is_pinned(host))
                device.record_stream(dst, ctx.stream)
                slot.reloaded, slot.reload_event, slot.waited = dst, ctx.stream.record_event(), False
        self.owner.stats.bytes_reloaded += self.nbytes
        self.owner.residency.add(self.layer, self.nbytes)
        self.owner.log_event("bwd", "reload_late" if late else "reload_start", self.layer, at)

    def load(self, slot: int, view: ViewSpec | None) -> torch.Tensor:
        """The unpack hook's answer for copy ``slot``, rebuilt as the view that was saved."""
        if self.freed:
            raise RuntimeError(
                f"activation offload: the host copies of layer {self.layer} went back to the pool when its backward "
                "finished; with retain_pinned_cpu_buffers=True a second backward through the same graph "
                "(retain_graph=True or create_graph=True) is not supported, because the next iteration reuses "
                "those buffers. Run the forward again, or build the context without retain_pinned_cpu_buffers."
            )
        self.owner.ensure_end_callback()
        if self.phase is LayerPhase.RELEASED:
            self.start_reload(self.owner.backward_layer, late=True)
        entry = self._slots[slot]
        if self.phase in (LayerPhase.NOT_OFFLOADED, LayerPhase.OFFLOAD_STARTED):
            tensor = entry.on_device  # never released (a manual layer never offloaded, or not yet)
        else:
            if not entry.waited:
                # Why: wait only for this tensor's copy, so the rest of the layer keeps loading behind compute.
                assert entry.reload_event is not None  # reloading: start_reload issued every slot's copy
                device.current_stream().wait_event(entry.reload_event)
                entry.waited = True
            if self.phase is LayerPhase.RELOAD_STARTED:
                self._set_phase(LayerPhase.RELOADED)
            tensor = entry.reloaded
        assert tensor is not None  # the phase says which copy is live
        return tensor if view is None else tensor.as_strided(*view)

    def free(self, at: int) -> list[torch.Tensor]:
        """The layer's backward is over: drop the device copies; returns host buffers the pool may reuse. Unless the
        pool retains them, host copies die with the graph, so a retained graph can unpack again (a late reload)."""
        if self.freed:
            return []
        if self._double_buffered and self.owner.ctx.reload_buffers is not None:
            self.owner.ctx.reload_buffers.give_back(self.layer)
        self._double_buffered = False
        self._backward_done = True
        if self._copied:
            self.owner.log_event("bwd", "free", self.layer, at)
        if self.phase is LayerPhase.OFFLOAD_STARTED:
            self.release(at)
        elif self.phase in (LayerPhase.RELOAD_STARTED, LayerPhase.RELOADED):
            self._set_phase(LayerPhase.RELEASED)
        for entry in self._slots:
            entry.reloaded = entry.reload_event = None
        self._index = {}
        if not self.owner.ctx.pool.retain:
            return []
        self.freed = True
        host = self._hosts()
        for entry in self._slots:
            entry.host = None
        self._copied = 0
        return host

    def _hosts(self) -> list[torch.Tensor]:
        return [slot.host for slot in self._slots[: self._copied] if slot.host is not None]

    def _set_phase(self, new: LayerPhase) -> None:
        check_transition(self.layer, self.phase, new)
        self.phase = new


class Pass:
    """One forward with grad enabled, and its backward."""

    def __init__(self, ctx: PassOwner) -> None:
        self.ctx = ctx
        self.stats = OffloadStats()
        self.residency = Residency(self.stats)
        self.layer = -1
        self.backward_layer = ctx.schedule.model_layers
        self._stores: dict[int, LayerStore] = {}
        self._resident_seen: dict[int, set[tuple[object, ...]]] = {}
        self._backward_seen: set[int] = set()
        self._end_queued = False
        self.finished = False
        self._anchors: list[weakref.ref] = []  # objects only this pass's autograd graph keeps alive

    def anchor(self, obj: object) -> None:
        """Remember ``obj`` (held by the graph only: a handle, a grad_fn hook) to tell whether the graph died."""
        self._anchors = [*self._anchors[-1:], weakref.ref(obj)]

    def forward_abandoned(self) -> bool:
        """True if this forward stopped part-way and its graph was freed. Why: an exception between layers (outside
        the context) never reaches ``__exit__``; the next forward would continue the old count otherwise."""
        in_progress = 0 <= self.layer < self.ctx.schedule.model_layers - 1
        return in_progress and bool(self._anchors) and all(ref() is None for ref in self._anchors)

    def log_event(self, phase: str, action: str, layer: int, at: int) -> None:
        """Account one schedule event (not a stream event)."""
        self.stats.events.append(ScheduleEvent(phase, action, layer, at))

    # forward ---------------------------------------------------------------------------------------------
    def enter_layer(self, layer: int) -> None:
        """Layer ``layer`` starts forward: release the offloaded layers whose window ends here."""
        self.layer = layer
        for old in self.ctx.schedule.releases_when_entering(layer):
            if old in self._stores:
                self._stores[old].release(at=layer)

    def push(self, tensor: torch.Tensor) -> object:
        """The pack hook: a handle for an offloaded tensor, the tensor itself otherwise."""
        reason, base, view = self.ctx.eligibility.classify(tensor)
        if reason is not None:
            self.stats.skipped[reason] += 1
            return _without_graph(tensor)
        if not self.ctx.schedule.is_offloaded(self.layer):
            self._count_resident(base)
            kept = _without_graph(tensor)
            if kept is not tensor:
                self.anchor(kept)  # a detached alias only the graph holds
            return kept
        store = self._stores.get(self.layer)
        if store is None:
            store = self._stores[self.layer] = LayerStore(self, self.layer)
        slot, is_new = store.push(base)
        self.stats.tensors_offloaded += 1
        self.stats.tensors_deduplicated += int(not is_new)
        handle = SavedHandle(store, slot, view)
        self.anchor(handle)
        return handle

    def _count_resident(self, base: torch.Tensor) -> None:
        seen = self._resident_seen.setdefault(self.layer, set())
        self.stats.tensors_resident += 1
        key = storage_key(base)
        if key not in seen:
            seen.add(key)
            self.residency.add(self.layer, base.numel() * base.element_size())

    # backward --------------------------------------------------------------------------------------------
    def backward_reached(self, layer: int) -> None:
        """The gradient reached layer ``layer``'s output: later layers are done, start the scheduled reloads."""
        self.ensure_end_callback()
        if layer in self._backward_seen:
            return
        self._backward_seen.add(layer)
        self.backward_layer = layer
        if self.ctx.schedule.manual:
            return  # the manual controller starts reloads; frees wait for the end of this backward
        self._free_layers_above(layer, at=layer)
        for i in self.ctx.schedule.reloads_when_backward_reaches(layer):
            if i in self._stores:
                self._stores[i].start_reload(at=layer)

    def ensure_end_callback(self) -> None:
        if not self._end_queued:
            self._end_queued = True
            # Why: layer 0 has no later sync point; the engine calls this once the whole backward is done.
            torch.autograd.Variable._execution_engine.queue_callback(self.backward_end)

    def backward_end(self) -> None:
        if self.ctx.schedule.manual:
            # Manual schedules may run one backward per layer (TE's example): free the layers this one reached.
            self._end_queued = False
            for i in sorted(self._backward_seen & set(self._stores)):
                self.ctx.pool.give_back(self._stores.pop(i).free(at=-1))
            self._backward_seen.clear()
            if self._stores:
                return
        else:
            self._free_layers_above(-1, at=-1)
        self.finished = True
        self.ctx.pass_finished(self)

    def store(self, layer: int) -> LayerStore | None:
        """The offloaded state of ``layer`` in this pass (None if it saved nothing eligible)."""
        return self._stores.get(layer)

    def _free_layers_above(self, layer: int, at: int) -> None:
        for i in [i for i in self._stores if i > layer]:
            self.ctx.pool.give_back(self._stores.pop(i).free(at))
        for i in [i for i in self._resident_seen if i > layer]:
            del self._resident_seen[i]
        for i in self.residency.layers():
            if i > layer:
                self.residency.drop(i)


class BackwardStep:
    """The ``grad_fn`` pre-hook that ``sync_fn`` registers on a layer's output."""

    def __init__(self, owner: Pass, layer: int) -> None:
        self.owner = owner
        self.layer = layer

    def __call__(self, grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        self.owner.backward_reached(self.layer)
