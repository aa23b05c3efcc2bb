"""Flat host buckets: the offloaded part of :class:`mbridge_offload_runtime.optimizer.hybrid.HybridDeviceOptimizer`.

A bucket is a run of offloaded parameters of one param group and one master dtype: a flat host master, a flat
host gradient buffer and one CPU optimizer over the flat master (one fused AdamW call per bucket). Members, and
the optimizer's per-element state, are views ``flat[offset:offset + numel]``. Flattening is exact for element-wise
optimizers (Adam, AdamW, SGD, ...); ones with per-tensor statistics (LAMB, Adafactor, Muon) need
``bucket_size_numel=1``, a bucket per parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import astuple, dataclass, field
from typing import cast

import torch

from mbridge_offload_runtime import device
from mbridge_offload_runtime.upstream import hdo_offload_mask

_MISSING = object()
# Members below this many elements cross PCIe in batches: a run of consecutive small members is gathered into one
# device staging buffer and moved by one copy (and back the same way). Chosen, not measured: below ~1 MiB of fp32 a
# host<->device copy costs more in its launch (several microseconds of host time each) than in its bytes, and
# per-tensor launches were what made fraction 0.25 cost as much as 1.0 on many small tensors.
SMALL_COPY_NUMEL = 1 << 18


@dataclass
class TransferStats:
    """What one bucket moved and stepped, cumulative: host<->device copy calls (one ``cudaMemcpyAsync`` each on a
    GPU) and their bytes each way, and elements the CPU optimizer stepped."""

    d2h_copies: int = 0
    d2h_bytes: int = 0
    h2d_copies: int = 0
    h2d_bytes: int = 0
    cpu_numel: int = 0

    def add(self, other: TransferStats) -> TransferStats:
        return TransferStats(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


def transfer_runs(ks: list[int], members: list[torch.Tensor]) -> list[list[int]]:
    """Cut ascending member indices into copy units: each large member alone, consecutive small ones of one dtype
    together."""
    runs: list[list[int]] = []
    for k in ks:
        small = members[k].numel() < SMALL_COPY_NUMEL
        last = runs[-1] if runs else None
        if (
            small
            and last is not None
            and last[-1] == k - 1
            and members[last[-1]].numel() < SMALL_COPY_NUMEL
            and members[last[-1]].dtype == members[k].dtype
        ):
            last.append(k)
        else:
            runs.append([k])
    return runs


def grad_of(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient the optimizer should use: ``decoupled_grad`` when the attribute exists (Megatron's
    precision-aware path), else ``.grad`` — the same precedence as Megatron Core's HybridDeviceOptimizer."""
    grad = getattr(param, "decoupled_grad", _MISSING)
    return param.grad if grad is _MISSING else cast("torch.Tensor | None", grad)


@dataclass
class Bucket:
    """One flat host buffer set and the CPU optimizer that updates it."""

    group_index: int
    indices: list[int]  # global parameter indices (param_groups order, as in torch state dicts)
    members: list[torch.Tensor]  # the model parameters (on the compute device)
    offsets: list[int]
    flat_param: torch.Tensor  # host master copy, 1-D
    flat_grad: torch.Tensor  # host gradient buffer, 1-D
    param_views: list[torch.Tensor]
    grad_views: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    d2h_done: device.Event = field(default_factory=device.new_event)
    h2d_done: device.Event = field(default_factory=device.new_event)
    versions: list[int] = field(default_factory=list)  # members' ``_version`` right after our last write
    stats: TransferStats = field(default_factory=TransferStats)

    @property
    def numel(self) -> int:
        return self.flat_param.numel()

    def is_per_element(self, value: object) -> bool:
        """Whether an optimizer state value is laid out like the flat master (else it is a scalar such as step)."""
        return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == self.numel

    def span(self, run: list[int]) -> tuple[int, int]:
        """The flat range ``[lo, hi)`` a run of consecutive members occupies."""
        return self.offsets[run[0]], self.offsets[run[-1]] + self.members[run[-1]].numel()

    def member_view(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        member = self.members[k]
        return flat[self.offsets[k] : self.offsets[k] + member.numel()].view(member.shape)

    def flat_state(self) -> dict:
        return self.optimizer.state.get(self.flat_param, {})

    def member_state(self, k: int, clone: bool) -> dict:
        """Member ``k``'s optimizer state: slices of the per-element tensors, copies of the scalars.

        ``clone=False`` returns views that stay live (for ``optimizer.state``); ``clone=True`` returns
        independent tensors (for ``state_dict()``: saving a view would save the whole flat storage).
        """
        out = {}
        for key, value in self.flat_state().items():
            if self.is_per_element(value):
                view = self.member_view(value, k)
                out[key] = view.clone() if clone else view
            elif isinstance(value, torch.Tensor):
                out[key] = value.clone() if clone else value
            else:
                out[key] = value
        return out

    def refresh_members(self, ks: list[int] | None = None) -> None:
        """Copy model weights into the host master (all members, or members ``ks``)."""
        which = range(len(self.members)) if ks is None else ks
        dst = [self.param_views[k] for k in which]
        if dst:
            torch._foreach_copy_(dst, [self.members[k].detach() for k in which])
        self.versions = [p._version for p in self.members]

    def copy_grads_in(
        self, grads: list, d2h_stream: device.Stream, current: set[int] | frozenset = frozenset()
    ) -> list[int]:
        """Issue this bucket's gradient copies on the D2H stream; returns the members without a grad.

        Members in ``current`` are already in the host buffer (a backward hook copied them, see ``grad_hooks``).
        """
        missing = [k for k, g in enumerate(grads) if g is None]
        for k in missing:
            self.grad_views[k].zero_()
        todo = [k for k in range(len(grads)) if grads[k] is not None and k not in current]
        non_blocking = device.is_pinned(self.flat_grad)
        runs = transfer_runs(todo, self.members)
        singles = [run[0] for run in runs if len(run) == 1]
        for run in (run for run in runs if len(run) > 1):
            # One gather on the device (this stream, after the grads' producers) and one copy across.
            lo, hi = self.span(run)
            staging = torch.cat([grads[k].reshape(-1) for k in run]).to(self.flat_grad.dtype)
            self.flat_grad[lo:hi].copy_(staging, non_blocking=non_blocking)
            self.count("d2h", 1, (hi - lo) * self.flat_grad.element_size())
        if singles:
            torch._foreach_copy_([self.grad_views[k] for k in singles], [grads[k] for k in singles],
                                 non_blocking=non_blocking)  # fmt: skip
            self.count("d2h", len(singles), sum(self.grad_views[k].nbytes for k in singles))
        # Recorded after this bucket's last copy on the D2H stream (hook copies were issued there earlier), so the
        # host waiting on it sees every gradient of the bucket.
        self.d2h_done.record(d2h_stream)
        return missing

    def step_and_copy_back(self, missing: list[int], h2d_stream: device.Stream) -> None:
        """Run one bucket's CPU optimizer and issue its H2D copy."""
        # Host waits only for this bucket's gradients; later buckets' copies keep flowing meanwhile.
        self.d2h_done.synchronize()
        # The previous step's H2D copy reads the flat master: it must be done before we overwrite it.
        self.h2d_done.synchronize()
        keep = None
        if missing:
            # Members without a grad are skipped like torch skips them: their weights and moments are restored.
            keep = [(k, self.param_views[k].clone(), self.member_state(k, clone=True)) for k in missing]
        self.optimizer.step()
        skipped = set(missing)
        if keep is not None:
            for k, value, state in keep:
                self.param_views[k].copy_(value)
                for key, live in self.member_state(k, clone=False).items():
                    if key in state and self.is_per_element(self.flat_state()[key]):
                        live.copy_(state[key])
                    elif self.is_per_element(self.flat_state().get(key)):
                        live.zero_()  # state created in this very step: a fresh member starts at zero
        self.stats.cpu_numel += self.numel - sum(self.members[k].numel() for k in missing)
        with device.on_stream(h2d_stream):
            back = [k for k in range(len(self.members)) if k not in skipped]
            if back:
                self._copy_back(back)
            self.h2d_done.record(h2d_stream)
        self.versions = [p._version for p in self.members]

    def _copy_back(self, ks: list[int]) -> None:
        """Copy members ``ks`` from the host master into the model (on the current, H2D, stream)."""
        non_blocking = device.is_pinned(self.flat_param)
        runs = transfer_runs(ks, self.members)
        singles = [run[0] for run in runs if len(run) == 1]
        for run in (run for run in runs if len(run) > 1):
            # One copy across into a device staging buffer (allocated and freed on this stream), then one
            # device-side scatter into the members.
            lo, hi = self.span(run)
            first = self.members[run[0]]
            staging = torch.empty(hi - lo, dtype=self.flat_param.dtype, device=first.device)
            staging.copy_(self.flat_param[lo:hi], non_blocking=non_blocking)
            staging = staging.to(first.dtype)
            views = [staging[o - lo : o - lo + self.members[k].numel()].view(self.members[k].shape)
                     for k, o in ((k, self.offsets[k]) for k in run)]  # fmt: skip
            torch._foreach_copy_([self.members[k] for k in run], views)
            self.count("h2d", 1, (hi - lo) * self.flat_param.element_size())
        if singles:
            torch._foreach_copy_([self.members[k] for k in singles], [self.param_views[k] for k in singles],
                                 non_blocking=non_blocking)  # fmt: skip
            self.count("h2d", len(singles), sum(self.param_views[k].nbytes for k in singles))

    def count(self, way: str, copies: int, nbytes: int) -> None:
        setattr(self.stats, f"{way}_copies", getattr(self.stats, f"{way}_copies") + copies)
        setattr(self.stats, f"{way}_bytes", getattr(self.stats, f"{way}_bytes") + nbytes)


def build_bucket(
    group_index: int,
    entries: list[tuple[int, torch.Tensor]],
    master_dtype: torch.dtype,
    pin_params: bool,
    pin_grads: bool,
    make_optimizer: Callable[[torch.Tensor], torch.optim.Optimizer],
) -> Bucket:
    """One bucket over ``(global_index, param)`` entries: flat buffers (``flat_param.grad`` is ``flat_grad`` once
    and for all), the master filled from the model weights, and ``make_optimizer(flat_param)``."""
    members = [p for _, p in entries]
    offsets, total = [], 0
    for p in members:
        offsets.append(total)
        total += p.numel()
    flat_param = device.empty_host((total,), master_dtype, pin=pin_params)
    flat_grad = device.empty_host((total,), master_dtype, pin=pin_grads)
    flat_grad.zero_()
    param_views = [flat_param[o : o + p.numel()].view(p.shape) for o, p in zip(offsets, members, strict=True)]
    grad_views = [flat_grad[o : o + p.numel()].view(p.shape) for o, p in zip(offsets, members, strict=True)]
    flat_param.grad = flat_grad
    indices = [i for i, _ in entries]
    optimizer = make_optimizer(flat_param)
    bucket = Bucket(group_index, indices, members, offsets, flat_param, flat_grad, param_views, grad_views, optimizer)
    with torch.no_grad():
        bucket.refresh_members()
    return bucket


def plan_buckets(
    offloaded: list[tuple[int, int, torch.Tensor]], bucket_size_numel: int, master_dtype_of: Callable
) -> list[tuple[int, list[tuple[int, torch.Tensor]]]]:
    """Cut ``(global_index, group_index, param)`` triples, in order, into ``(group_index, entries)`` buckets.

    A bucket closes when the group, the master dtype or ``requires_grad`` changes (frozen parameters share no
    bucket with trained ones), or when the next parameter would pass ``bucket_size_numel``.
    """
    plans: list[tuple[int, list[tuple[int, torch.Tensor]]]] = []
    key, size = None, 0
    for index, group_index, p in offloaded:
        k = (group_index, master_dtype_of(p), p.requires_grad)
        if k != key or (size > 0 and size + p.numel() > bucket_size_numel):
            plans.append((group_index, []))
            key, size = k, 0
        plans[-1][1].append((index, p))
        size += p.numel()
    return plans


def split_params(params: list[torch.Tensor], offload_fraction: float, on_device: list[bool]) -> list[bool]:
    """Which parameters go to the host: Megatron Core's greedy prefix rule (``upstream.hdo_offload_mask``) over
    the parameters on the compute device; the others are not counted and never "offloaded"."""
    numels = [p.numel() if d else 0 for p, d in zip(params, on_device, strict=True)]
    return [d and host for d, host in zip(on_device, hdo_offload_mask(numels, offload_fraction), strict=True)]
