"""Streams and events on the CPU that keep CUDA's happens-before, and a checker that fails on unordered access.

Without CUDA every copy is synchronous, so a missing ``wait_event`` changes nothing a test can see. Here
:class:`CpuStream` and :class:`CpuEvent` keep vector clocks (what each stream, and the host, knows complete), and
:func:`recording` sees every tensor operation and raises :class:`OrderingError` on

* a read of a buffer before the copy (or kernel) that wrote it is ordered before the reader;
* a write of a buffer while an earlier access on another stream may still run;
* a device buffer freed on its allocation stream while another stream may still use it, unless ``record_stream``
  told the allocator about that stream (the caching allocator's semantics).

Model (CUDA semantics, strict where CUDA is lenient): an operation on a host buffer of ``device.empty_host`` that
is not a host↔device copy runs on the host; every other runs on the current stream, after everything the host
knows complete. Copies to or from host buffers are asynchronous unless ``non_blocking=False``; ``.item()``
synchronises; waiting on an event never recorded is a no-op. With CUDA this module is never used.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["CpuEvent", "CpuStream", "OrderingError", "OrderingRecorder", "recording"]

_ids = itertools.count(1)
Clock = dict[int, int]
Op = tuple[int, int]  # (stream id, sequence number on that stream)


class OrderingError(RuntimeError):
    """An access to a buffer that is not ordered after the copy it depends on (see the module docstring)."""


def _join(into: Clock, other: Clock) -> None:
    for key, value in other.items():
        if into.get(key, 0) < value:
            into[key] = value


class CpuStream:
    """A stream on the CPU: work on it is ordered; it learns of other work only by waiting (as on CUDA)."""

    def __init__(self, name: str = "side") -> None:
        self.id = next(_ids)
        self.name = name
        _names[self.id] = name
        self.knowledge: Clock = {self.id: 0}  # for each stream, the last of its operations ordered before ours
        _streams.add(self)

    def issue(self) -> Op:
        if self is not HOST:
            # Why: the host enqueues this work after everything it already saw complete.
            _join(self.knowledge, HOST.knowledge)
        self.knowledge[self.id] += 1
        return self.id, self.knowledge[self.id]

    def knows(self, op: Op) -> bool:
        """True if ``op`` is ordered before the next operation on this stream."""
        return self.knowledge.get(op[0], 0) >= op[1]

    def wait_stream(self, other: CpuStream) -> None:
        _join(self.knowledge, other.knowledge)

    def wait_event(self, event: CpuEvent) -> None:
        if event.snapshot is not None:  # an event never recorded is complete (CUDA: the wait is a no-op)
            _join(self.knowledge, event.snapshot)

    def record_event(self, event: CpuEvent | None = None) -> CpuEvent:
        event = event if event is not None else CpuEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        _join(HOST.knowledge, self.knowledge)

    def query(self) -> bool:
        self.synchronize()  # a True answer tells the host the work is done
        return True

    def __repr__(self) -> str:
        return f"CpuStream({self.name})"


class CpuEvent:
    """An event on the CPU: a snapshot of what its stream had enqueued when it was recorded."""

    def __init__(self) -> None:
        self.snapshot: Clock | None = None

    def record(self, stream: CpuStream | None = None) -> None:
        stream = stream if stream is not None else current_stream()
        _join(stream.knowledge, HOST.knowledge)
        self.snapshot = dict(stream.knowledge)

    def wait(self, stream: CpuStream | None = None) -> None:
        (stream if stream is not None else current_stream()).wait_event(self)

    def synchronize(self) -> None:
        if self.snapshot is not None:
            _join(HOST.knowledge, self.snapshot)

    def query(self) -> bool:
        self.synchronize()
        return True


_streams: weakref.WeakSet[CpuStream] = weakref.WeakSet()
_names: dict[int, str] = {}  # kept after a stream dies, for messages about work it did
HOST = CpuStream("host")
COMPUTE = CpuStream("compute")
_local = threading.local()  # the current stream is per thread, as torch.cuda's is


def _stack() -> list[CpuStream]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = [COMPUTE]
    return stack


def current_stream() -> CpuStream:
    """The stream work is issued on in this thread (``COMPUTE`` unless inside :func:`on_stream`)."""
    return _stack()[-1]


@contextlib.contextmanager
def on_stream(stream: CpuStream) -> Iterator[None]:
    """Issue the enclosed work on ``stream``."""
    stack = _stack()
    stack.append(stream)
    try:
        yield
    finally:
        stack.pop()


def _is_speculative() -> bool:
    return getattr(_local, "speculative", 0) > 0


@contextlib.contextmanager
def speculative() -> Iterator[None]:
    """Copies issued inside are speculative: their owner checks later whether the data they moved is still
    current (a backward-hook gradient copy, redone in ``step()`` when the gradient's version changed), so a later
    write racing with them is no violation. They must still be ordered after the writes they read, and a freed
    source still needs ``record_stream``."""
    _local.speculative = getattr(_local, "speculative", 0) + 1
    try:
        yield
    finally:
        _local.speculative -= 1


def synchronize() -> None:
    """The host waits for every stream (``torch.cuda.synchronize``)."""
    for stream in list(_streams):
        stream.synchronize()


# ---------------------------------------------------------------------------------------------------------
# the access checker
# ---------------------------------------------------------------------------------------------------------
@dataclass
class _Entry:
    """One access to the bytes ``[lo, hi)`` of a storage: operation ``(sid, n)``, a write or a read."""

    lo: int
    hi: int
    sid: int
    n: int
    write: bool
    speculative: bool = False  # made under ``speculative()``: later writes need not wait for it

    def overlaps(self, lo: int, hi: int) -> bool:
        return self.lo < hi and lo < self.hi


@dataclass
class _Access:
    """One storage: where it lives, its accesses not yet superseded, its allocation stream. Accesses are kept per
    byte range, so copies into disjoint views of one buffer (a bucket's members) do not order each other."""

    host: bool
    entries: list[_Entry] = field(default_factory=list)
    alloc: CpuStream | None = None
    recorded: set[int] = field(default_factory=set)
    label: str = ""


_aten = torch.ops.aten
_COPIES = {_aten.copy_.default, _aten._foreach_copy_.default, _aten._to_copy.default}
_METADATA = {_aten.is_pinned.default, _aten.set_.source_Storage_storage_offset, _aten.record_stream.default}


def _stream_name(sid: int) -> str:
    return _names.get(sid, f"stream {sid}")


_host_storages: set[int] = set()


def mark_host(tensor: torch.Tensor) -> None:
    """Remember that ``tensor``'s storage is a (pinned) host buffer, for as long as it lives."""
    key = _key(tensor)
    if key is not None and key not in _host_storages:
        _host_storages.add(key)
        weakref.finalize(tensor.untyped_storage(), _host_storages.discard, key)


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[lo, hi)`` of its storage a tensor (or view) can touch."""
    size = tensor.element_size()
    lo = int(tensor.storage_offset()) * size  # int: a recorded eager run has no symbolic sizes
    if tensor.numel() == 0:
        return lo, lo
    extent = 1 + sum((n - 1) * abs(st) for n, st in zip(tensor.shape, tensor.stride(), strict=True))
    return lo, lo + int(extent) * size


def _tensors(value: object) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _key(tensor: torch.Tensor) -> int | None:
    storage = tensor.untyped_storage()
    return storage.data_ptr() if storage.nbytes() > 0 else None


class OrderingRecorder(TorchDispatchMode):
    """The dispatch mode behind :func:`recording`: ``operations`` checked, ``violations`` found (the first raised)."""

    def __init__(self) -> None:
        super().__init__()
        self._storages: dict[int, _Access] = {}
        self.operations = 0
        self.violations: list[str] = []
        self._pending: list[str] = []

    def register_host(self, tensor: torch.Tensor) -> None:
        """``tensor`` is a (pinned) host buffer, written by the host now."""
        mark_host(tensor)
        access = self._access(tensor)
        access.host, access.alloc = True, HOST
        access.label = f"host buffer {tuple(tensor.shape)}"
        sid, n = HOST.issue()
        access.entries = [_Entry(0, tensor.untyped_storage().nbytes(), sid, n, True)]

    def is_host(self, tensor: torch.Tensor) -> bool:
        key = _key(tensor)
        if key is None:
            return False
        access = self._storages.get(key)
        return access.host if access is not None else key in _host_storages

    def record_stream(self, tensor: torch.Tensor, stream: CpuStream) -> None:
        """``tensor.record_stream(stream)``: the allocator keeps the memory until ``stream``'s work is done."""
        self._access(tensor).recorded.add(stream.id)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._raise_pending()
        if func.is_view or func in _METADATA:
            return func(*args, **kwargs)
        reads, writes = _reads_and_writes(func, args, kwargs)
        stream = self._stream_for(func, reads + writes)
        op = stream.issue()
        self.operations += 1
        seen = {_key(t) for t in reads + writes}
        if stream is HOST:
            # Why: the host cannot touch device memory; a non-host tensor in host work is host memory in truth
            # (e.g. the optimizer's step counter), so only the booked host buffers are checked.
            reads, writes = [t for t in reads if self.is_host(t)], [t for t in writes if self.is_host(t)]
        for tensor in reads:
            self._check_read(tensor, stream, op, func)
        for tensor in writes:
            self._check_write(tensor, stream, op, func)
        out = func(*args, **kwargs)
        for tensor in _tensors(out):
            if _key(tensor) not in seen:
                self._allocated(tensor, stream, op)
        if _blocks_host(func, args, kwargs, stream, any(self.is_host(t) for t in reads + writes)):
            # Why: a blocking copy (or ``.item()``) returns to the host only when the stream has done it.
            stream.synchronize()
        return out

    def _stream_for(self, func: object, tensors: list[torch.Tensor]) -> CpuStream:
        hosts = [self.is_host(t) for t in tensors]
        if hosts and all(hosts):
            return HOST  # host-only work (the CPU optimizer, a memcpy between host buffers)
        if any(hosts) and func not in _COPIES:
            return HOST  # a host buffer in a kernel: only the host can run it
        return current_stream()

    def _check_read(self, tensor: torch.Tensor, stream: CpuStream, op: Op, func: object) -> None:
        access, (lo, hi) = self._access(tensor), _span(tensor)
        for e in access.entries:
            if e.write and e.overlaps(lo, hi) and not stream.knows((e.sid, e.n)):
                self._fail(
                    f"{func} on {stream.name} reads {access.label} before its write on "
                    f"{_stream_name(e.sid)} is ordered before it (wait on the copy's event first)"
                )
        spec = _is_speculative()
        for e in access.entries:
            if not e.write and (e.lo, e.hi, e.sid, e.speculative) == (lo, hi, stream.id, spec):
                e.n = op[1]  # the same reader again: one entry per range and stream
                return
        access.entries.append(_Entry(lo, hi, stream.id, op[1], False, spec))

    def _check_write(self, tensor: torch.Tensor, stream: CpuStream, op: Op, func: object) -> None:
        access, (lo, hi) = self._access(tensor), _span(tensor)
        for e in access.entries:
            if e.speculative:
                continue  # its result is re-validated by its owner, so a racing write only makes it stale
            if e.overlaps(lo, hi) and e.sid != stream.id and not stream.knows((e.sid, e.n)):
                kind = "a write" if e.write else "a read"
                self._fail(
                    f"{func} on {stream.name} overwrites {access.label} while {kind} on "
                    f"{_stream_name(e.sid)} may still use it (wait for it before writing)"
                )
        # Everything this write covers is ordered before it now: later checks need only the write.
        access.entries = [e for e in access.entries if not (lo <= e.lo and e.hi <= hi)]
        access.entries.append(_Entry(lo, hi, stream.id, op[1], True, _is_speculative()))

    def _allocated(self, tensor: torch.Tensor, stream: CpuStream, op: Op) -> None:
        access = self._access(tensor, fresh=True)
        access.host = stream is HOST
        access.label = f"{'host' if access.host else 'device'} buffer {tuple(tensor.shape)}"
        access.alloc = stream
        access.entries = [_Entry(0, tensor.untyped_storage().nbytes(), stream.id, op[1], True)]

    def _access(self, tensor: torch.Tensor, fresh: bool = False) -> _Access:
        key = _key(tensor)
        if key is None:
            return _Access(host=False)  # an empty storage holds nothing to order
        access = self._storages.get(key)
        if access is None or fresh:
            host = key in _host_storages
            label = f"{'host' if host else 'device'} buffer {tuple(tensor.shape)}"
            access = self._storages[key] = _Access(host=host, label=label)
            weakref.finalize(tensor.untyped_storage(), self._freed, key, access)
        return access

    def _freed(self, key: int, access: _Access) -> None:
        """The storage died: its allocation stream may reuse the memory at once (caching allocator)."""
        if self._storages.get(key) is access:
            del self._storages[key]
        alloc = access.alloc
        if alloc is None or alloc is HOST:
            return
        for sid, n in [(e.sid, e.n) for e in access.entries]:
            if sid != alloc.id and sid not in access.recorded and not alloc.knows((sid, n)):
                # Why: raised at the next operation; a finalizer cannot raise into the code that freed it.
                self._pending.append(
                    f"{access.label} was freed on {alloc.name} while work on "
                    f"{_stream_name(sid)} may still use it (wait for it, or record_stream)"
                )
                return

    def _fail(self, message: str) -> None:
        self.violations.append(message)
        raise OrderingError("ordering: " + message)

    def _raise_pending(self) -> None:
        if self._pending:
            message = self._pending.pop(0)
            self._pending.clear()
            self._fail(message)

    def check(self) -> None:
        """Raise the first violation found at a free (else raised at the next operation)."""
        self._raise_pending()


def _reads_and_writes(
    func: torch._ops.OpOverload, args: tuple, kwargs: dict
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Split the tensor arguments of an aten operation by its schema: mutated ones are writes."""
    reads: list[torch.Tensor] = []
    writes: list[torch.Tensor] = []
    for index, arg in enumerate(func._schema.arguments):
        value = args[index] if index < len(args) else kwargs.get(arg.name)
        target = writes if arg.alias_info is not None and arg.alias_info.is_write else reads
        target.extend(_tensors(value))
    return reads, writes


def _blocks_host(func: object, args: tuple, kwargs: dict, stream: CpuStream, touches_host: bool) -> bool:
    """Whether the host waits for this operation: ``.item()``, or a host↔device copy with non_blocking=False."""
    if stream is HOST:
        return False
    if func is _aten._local_scalar_dense.default:
        return True
    if func not in _COPIES or not touches_host:
        return False  # a device-to-device copy is asynchronous whatever non_blocking says
    if "non_blocking" in kwargs:
        return not kwargs["non_blocking"]
    return not (func is not _aten._to_copy.default and len(args) > 2 and args[2])


_active: list[OrderingRecorder] = []


def active() -> OrderingRecorder | None:
    """The recorder in force, if any (``device`` asks it about host buffers and ``record_stream``)."""
    return _active[-1] if _active else None


@contextlib.contextmanager
def recording() -> Iterator[OrderingRecorder]:
    """Check every tensor access made inside the block for stream ordering (CPU only).

    Raises:
        OrderingError: on the first unordered access (also at exit, for a buffer freed too early).
        RuntimeError: where CUDA is present (real streams cannot be checked this way).
    """
    if torch.cuda.is_available():
        raise RuntimeError("ordering.recording() checks the CPU model of streams; it cannot run with CUDA")
    recorder = OrderingRecorder()
    _active.append(recorder)
    try:
        with recorder:
            yield recorder
        recorder.check()
    finally:
        _active.remove(recorder)
