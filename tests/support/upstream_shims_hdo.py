"""The three labelled shims that let megatron-core's own HybridDeviceOptimizer run on a CPU-only machine.

Each shim replaces one CUDA-only call with the
behaviour it has on a GPU when the work is already complete; nothing in the optimizer's own logic is changed.

1. SHIM-STREAMS: ``torch.cuda.current_stream`` / ``Stream`` / ``stream`` -> no-op stream and event objects.
2. SHIM-PIN: ``torch.Tensor.pin_memory`` -> identity (and callers pass ``pin_cpu_grads=False``).
3. SHIM-IS-CUDA: parameters wrapped in :class:`FakeDevParam`, whose ``is_cuda`` is True, so that upstream counts
   them as GPU parameters; ``param.detach().clone().cpu()`` then yields a plain CPU tensor as the "CPU copy".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class _Event:
    def synchronize(self) -> None:
        return None

    def wait(self, stream: object | None = None) -> None:
        return None


class _Stream:
    def wait_stream(self, other: object) -> None:
        return None

    def record_event(self, event: object | None = None) -> _Event:
        return _Event()


class FakeDevParam(torch.nn.Parameter):
    """SHIM-IS-CUDA: a CPU parameter that reports ``is_cuda`` so upstream treats it as a GPU parameter."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def fake_dev_params(module: torch.nn.Module) -> list[FakeDevParam]:
    """Replace every parameter of ``module`` by a FakeDevParam with the same data; returns them in order."""
    out = []
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            fake = FakeDevParam(p.detach().clone(), requires_grad=p.requires_grad)
            mod._parameters[name] = fake
            out.append(fake)
    return out


@contextlib.contextmanager
def upstream_hdo_shims() -> Iterator[None]:
    """SHIM-STREAMS and SHIM-PIN for the duration of the block (restored afterwards)."""
    saved = (torch.cuda.current_stream, torch.cuda.Stream, torch.cuda.stream, torch.Tensor.pin_memory)
    torch.cuda.current_stream = lambda *a, **k: _Stream()  # SHIM-STREAMS
    torch.cuda.Stream = lambda *a, **k: _Stream()  # SHIM-STREAMS
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # SHIM-STREAMS
    torch.Tensor.pin_memory = lambda self, *a, **k: self  # SHIM-PIN
    try:
        yield
    finally:
        torch.cuda.current_stream, torch.cuda.Stream, torch.cuda.stream, torch.Tensor.pin_memory = saved
