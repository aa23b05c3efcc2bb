"""``HybridDeviceOptimizer``: a drop-in for Megatron Core's optimizer CPU offload, bucketed and resumable.

Schedule of one ``step()`` (streams on CUDA; on CPU the same calls run as plain copies)::

    compute  |== device optimizer ==|                  wait(h2d[0]) wait(h2d[1]) ... -> next forward
    d2h      |g0|g1|g2|...                             (grads of bucket i -> flat host grad i)
    host         [cpu step 0][cpu step 1][cpu step 2]  (each starts when its own grads have landed)
    h2d                      |w0|        |w1|       |w2|  (bucket i's weights back while bucket i+1 steps)

See ``docs/optimizer-runtime.md`` for the split rule, the bucket layout and the checkpoint format.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from mbridge_offload_runtime import device
from mbridge_offload_runtime.optimizer.buckets import (
    Bucket,
    TransferStats,
    build_bucket,
    grad_of,
    plan_buckets,
    split_params,
)
from mbridge_offload_runtime.optimizer.clip import clip_grad_norm_
from mbridge_offload_runtime.optimizer.grad_hooks import GradCopyHooks
from mbridge_offload_runtime.optimizer.state import (
    LiveParamState,
    export_param_states,
    import_param_states,
    saved_param_states,
    validate_state_dict,
)

DEFAULT_BUCKET_SIZE_NUMEL = 1 << 22  # 4 Mi elements: 16 MiB of fp32 master, small enough to pipeline well
# Implementation selectors of torch optimizers: never copied between the HDO groups and the sub-optimizers'
# defaults, so each side keeps its own fast path (fused CPU AdamW, TE/foreach on the GPU).
_SELECTOR_KEYS = frozenset({"fused", "foreach", "capturable", "differentiable", "decoupled_weight_decay"})
# Kernel selectors: injected into the sub-optimizers only when the caller chose none.
_KERNEL_KEYS = frozenset({"fused", "foreach"})
# Where each parameter is updated (``state.py`` reads the same tuples): ``("bucket", bucket, k)`` on the CPU,
# ``("device", tensor)`` by the device optimizer (the parameter or its fp32 master), ``("resident", param)`` for a
# parameter already on the host, updated in place.
Slot = tuple[Any, ...]


def _init_parameters(cls: type[torch.optim.Optimizer]) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(cls.__init__).parameters.values())
    except (TypeError, ValueError):
        return []


def _constructor_defaults(cls: type[torch.optim.Optimizer]) -> dict[str, Any]:
    """The hyper-parameters ``cls`` fills a param group with when the caller leaves them out."""
    skip = {"self", "params"} | _KERNEL_KEYS
    return {
        p.name: p.default
        for p in _init_parameters(cls)
        if p.name not in skip and p.default is not inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD
    }


def _hyper(group: dict[str, Any], skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """A param group's hyper-parameters: everything but its params (and ``skip``)."""
    return {k: v for k, v in group.items() if k != "params" and k not in skip}


def _check_optimizer_cls(cls: Any, name: str) -> type[torch.optim.Optimizer]:
    if cls is None:
        return torch.optim.AdamW
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        what = repr(cls) if isinstance(cls, (type, str)) else f"an instance of {type(cls).__name__}"
        raise TypeError(
            f"`{name}` is {what}, which is not a torch.optim.Optimizer subclass; pass an optimizer class such as "
            "torch.optim.AdamW (the class, not an instance)."
        )
    return cls


class HybridDeviceOptimizer(torch.optim.Optimizer):
    """Update ``offload_fraction`` of the parameters on the CPU and the rest on the device, in one optimizer.

    Same constructor as ``megatron.core.optimizer.cpu_offloading.HybridDeviceOptimizer``. Without CUDA the
    "device" is the CPU and the same path runs with plain copies. Checkpoints are plain per-parameter torch state
    dicts, independent of the split.

    Args:
        params: parameters or param-group dicts, as for any torch optimizer.
        offload_fraction: fraction of device-parameter elements updated on the CPU, in [0, 1] (which ones:
            :func:`buckets.split_params`).
        cpu_optimizer_cls: optimizer class for the host buckets; default ``torch.optim.AdamW`` with ``fused=True``.
        gpu_optimizer_cls: optimizer class for the device part; default ``torch.optim.AdamW``.
        param_update_in_fp32: keep fp32 masters (host and device) for non-fp32 parameters.
        pin_cpu_grads / pin_cpu_params: page-lock the host gradient buffers / master copies (CUDA only).
        overlap_cpu_optimizer_d2h_h2d: pipeline the copies on side streams; off, they run on the compute stream.
        bucket_size_numel: target elements per host bucket (default 4 Mi); ``1`` gives every parameter its own.
        **defaults: hyper-parameters (lr, betas, eps, weight_decay, ...) for the param groups and sub-optimizers.

    Raises:
        ValueError: ``offload_fraction`` outside [0, 1] or a bad ``bucket_size_numel``.
        TypeError: a non-tensor parameter or an optimizer class that is not a ``torch.optim.Optimizer``.

    Example:
        >>> model = torch.nn.Linear(4, 4)
        >>> opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.5, lr=1e-3, weight_decay=0.01)
        >>> model(torch.randn(2, 4)).sum().backward()
        >>> opt.step(); opt.zero_grad()
        >>> round(opt.offloaded_fraction, 2)
        0.8
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        offload_fraction: float = 0.5,
        cpu_optimizer_cls: type[torch.optim.Optimizer] | None = None,
        gpu_optimizer_cls: type[torch.optim.Optimizer] | None = None,
        param_update_in_fp32: bool = False,
        pin_cpu_grads: bool = True,
        pin_cpu_params: bool = True,
        overlap_cpu_optimizer_d2h_h2d: bool = True,
        bucket_size_numel: int = DEFAULT_BUCKET_SIZE_NUMEL,
        **defaults: Any,
    ) -> None:
        if isinstance(offload_fraction, bool) or not isinstance(offload_fraction, (int, float)):
            raise TypeError(f"`offload_fraction` is {offload_fraction!r}; it must be a number in [0, 1].")
        if not 0.0 <= float(offload_fraction) <= 1.0:
            raise ValueError(
                f"`offload_fraction` is {offload_fraction}, outside [0, 1]: it is the fraction of parameter "
                "elements updated on the CPU; use 0.0 for none and 1.0 for all."
            )
        if isinstance(bucket_size_numel, bool) or not isinstance(bucket_size_numel, int) or bucket_size_numel < 1:
            raise ValueError(f"`bucket_size_numel` is {bucket_size_numel!r}; it must be a positive integer.")
        offload_fraction = self.offload_fraction = float(offload_fraction)
        # The param groups get hyper-parameters only (no classes, no offload options), so that checkpoints load
        # with weights_only=True and do not depend on the split. ``self.defaults`` still carries every constructor
        # argument because Megatron's DistributedOptimizer re-creates the optimizer as ``cls(params, **defaults)``.
        options = {k: v for k, v in locals().items() if k in _OPTION_KEYS}
        self.cpu_optimizer_cls = _check_optimizer_cls(cpu_optimizer_cls, "cpu_optimizer_cls")
        self.gpu_optimizer_cls = _check_optimizer_cls(gpu_optimizer_cls, "gpu_optimizer_cls")
        self.param_update_in_fp32 = param_update_in_fp32
        self.pin_cpu_grads, self.pin_cpu_params = pin_cpu_grads, pin_cpu_params
        self.overlap_cpu_optimizer_d2h_h2d = overlap_cpu_optimizer_d2h_h2d
        self.bucket_size_numel = bucket_size_numel
        self._hyper_defaults = dict(defaults)
        self._built = False
        self._recopy_after_load = False
        self._hooks: GradCopyHooks | None = None
        super().__init__(params, dict(defaults))  # our add_param_group checks every parameter
        self.defaults = {**defaults, **options}
        self._build()

    # ------------------------------------------------------------------ construction
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (torch semantics); existing state is kept and the split is recomputed."""
        for i, p in enumerate(param_group["params"] if isinstance(param_group.get("params"), (list, tuple)) else []):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"parameter {i} is a {type(p).__name__}, not a torch.Tensor: pass model.parameters().")
        full, self.defaults = self.defaults, self._hyper_defaults  # fill groups with hyper-parameters only
        try:
            super().add_param_group(param_group)
        finally:
            self.defaults = full
        if self._built:
            states = export_param_states(self, clone=True)
            self._build()
            import_param_states(self, states)

    def _follow_param_groups(self) -> None:
        """Rebuild on parameters a wrapper swapped into ``param_groups`` (states follow by index, as in
        :meth:`add_param_group`). Megatron's ``Float16OptimizerWithFloat16Params`` (bf16 or fp16 without the
        distributed optimizer) replaces each 16-bit parameter of the optimizer it wraps by its fp32 main copy after
        the optimizer is built: stepping the parameters seen at construction would update nothing the wrapper reads
        back (the model would never train) and keep fp32 masters of parameters no one steps. megatron-core's own
        HDO fails there with a KeyError at its first step (NVIDIA/Megatron-LM#4042)."""
        current = [p for g in self.param_groups for p in g["params"]]
        if len(current) == len(self._params) and all(a is b for a, b in zip(current, self._params, strict=True)):
            return
        states = export_param_states(self, clone=True)
        self._build()
        import_param_states(self, states)

    def _master_dtype(self, p: torch.Tensor) -> torch.dtype:
        return torch.float32 if self.param_update_in_fp32 and p.dtype != torch.float32 else p.dtype

    def _sub_optimizer(self, cls: type[torch.optim.Optimizer], groups: dict[int, list]) -> torch.optim.Optimizer:
        """``cls`` over ``{HDO group index: params}``, each group with its HDO group's hyper-parameters."""
        subs = [{**_hyper(self.param_groups[gi], _OPTION_KEYS), "params": ps} for gi, ps in sorted(groups.items())]
        # Both parts default to torch's fused kernel (CPU and CUDA have one for Adam/AdamW/SGD): it is the fastest
        # path on either side, and the same kernel on both sides makes a resume at another fraction bit-exact.
        # A kernel the caller chose (``fused``/``foreach`` in the groups or defaults) is left alone.
        chosen = any(k in g for g in subs for k in _KERNEL_KEYS)
        floating = all(p.is_floating_point() for ps in groups.values() for p in ps)
        fused = not chosen and floating and any(p.name == "fused" for p in _init_parameters(cls))
        kwargs: dict[str, Any] = {"fused": True} if fused else {}
        return cls(subs, **kwargs)

    def _build(self) -> None:
        compute = device.compute_device()
        flat = [(gi, p) for gi, g in enumerate(self.param_groups) for p in g["params"]]
        self._params = [p for _, p in flat]
        on_device = [p.device.type == compute.type for p in self._params]
        offload = split_params(self._params, self.offload_fraction, on_device)
        self._device_numel = sum(p.numel() for p, d in zip(self._params, on_device, strict=True) if d)
        self._offloaded_numel = sum(p.numel() for p, o in zip(self._params, offload, strict=True) if o)
        # Where each parameter's update happens (filled below for every index).
        slots: list[Slot | None] = [None] * len(flat)
        self._masters: dict[int, torch.Tensor] = {}
        device_groups: dict[int, list] = defaultdict(list)
        resident_groups: dict[int, list] = defaultdict(list)
        offloaded = []
        for i, ((gi, p), d, o) in enumerate(zip(flat, on_device, offload, strict=True)):
            if o:
                offloaded.append((i, gi, p))
            elif d:
                inner = p
                if self._master_dtype(p) != p.dtype:
                    inner = self._masters[i] = p.detach().clone().float()
                device_groups[gi].append(inner)
                slots[i] = ("device", inner)
            else:
                # Already on the host (a CUDA run with some CPU params): updated in place, nothing to copy.
                resident_groups[gi].append(p)
                slots[i] = ("resident", p)

        def host_opt(gi: int):
            return lambda flat_param: self._sub_optimizer(self.cpu_optimizer_cls, {gi: [flat_param]})

        self._buckets: list[Bucket] = []
        for gi, entries in plan_buckets(offloaded, self.bucket_size_numel, self._master_dtype):
            dtype = self._master_dtype(entries[0][1])
            bucket = build_bucket(gi, entries, dtype, self.pin_cpu_params, self.pin_cpu_grads, host_opt(gi))
            for k, (i, _) in enumerate(entries):
                slots[i] = ("bucket", bucket, k)
            self._buckets.append(bucket)
        self._slot: list[Slot] = [slot for slot in slots if slot is not None]
        assert len(self._slot) == len(flat), "every parameter has a slot"
        # Which HDO group each sub-optimizer group mirrors (the sub-optimizers hold only the groups with params).
        self._device_group_index, self._resident_group_index = sorted(device_groups), sorted(resident_groups)
        self.device_optimizer = self._sub_optimizer(self.gpu_optimizer_cls, device_groups) if device_groups else None
        self.resident_optimizer = (
            self._sub_optimizer(self.cpu_optimizer_cls, resident_groups) if resident_groups else None
        )
        self._d2h = device.new_stream() if self.overlap_cpu_optimizer_d2h_h2d else device.current_stream()
        self._h2d = device.new_stream() if self.overlap_cpu_optimizer_d2h_h2d else device.current_stream()
        self._device_versions = {i: self._params[i]._version for i in self._masters}
        self._install_hooks()
        self._state_entries = -1
        self._built = True
        self._rebuild_state()

    def _install_hooks(self) -> None:
        """With overlap on, gradient copies start in backward (post-accumulate-grad hooks, see ``grad_hooks``)."""
        self.remove_hooks()
        if self.overlap_cpu_optimizer_d2h_h2d and self._buckets:
            self._hooks = GradCopyHooks(self._buckets, self._d2h)
            # Unregister when this optimizer is dropped (Megatron's DistributedOptimizer replaces the one it got).
            weakref.finalize(self, self._hooks.remove)

    def remove_hooks(self) -> None:
        """Unregister the gradient hooks; ``step()`` then copies every gradient itself (same result)."""
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside start no gradient copies: use it for all but the last micro-batch.

        Without it accumulation is still correct (each hook copies the running sum, the last copy wins); it only
        saves the earlier micro-batches' transfers, like Megatron DDP's ``no_sync()`` for its reduce-scatter.
        """
        with self._hooks.no_sync() if self._hooks is not None else contextlib.nullcontext():
            yield

    def _group_optimizers(self) -> list[tuple[torch.optim.Optimizer, list[int]]]:
        """The device and resident optimizers that exist, each with the HDO group index of each of its groups."""
        pairs = [
            (self.device_optimizer, self._device_group_index),
            (self.resident_optimizer, self._resident_group_index),
        ]
        return [(opt, index) for opt, index in pairs if opt is not None]

    # ------------------------------------------------------------------ reporting
    @property
    def offloaded_numel(self) -> int:
        """Elements of the parameters updated on the CPU."""
        return self._offloaded_numel

    @property
    def total_numel(self) -> int:
        """Elements of all device parameters (the denominator of ``offload_fraction``)."""
        return self._device_numel

    @property
    def offloaded_fraction(self) -> float:
        """The achieved split, ``offloaded_numel / total_numel`` (0.0 for an empty optimizer)."""
        return self._offloaded_numel / self._device_numel if self._device_numel else 0.0

    def is_offloaded(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is updated on the CPU."""
        return any(p is param and self._slot[i][0] == "bucket" for i, p in enumerate(self._params))

    @property
    def sub_optimizers(self) -> list[torch.optim.Optimizer]:
        """The bucket CPU optimizers, then the device optimizer (and the host-resident one, if any)."""
        subs = [b.optimizer for b in self._buckets]
        return subs + [o for o in (self.device_optimizer, self.resident_optimizer) if o is not None]

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    @property
    def transfer_stats(self) -> TransferStats:
        """Copies, bytes each way and CPU-stepped elements since construction or :meth:`reset_transfer_stats`."""
        return functools.reduce(TransferStats.add, (b.stats for b in self._buckets), TransferStats())

    def reset_transfer_stats(self) -> None:
        """Zero the counters of :attr:`transfer_stats`."""
        for b in self._buckets:
            b.stats = TransferStats()

    # ------------------------------------------------------------------ the step
    def _push_hyperparameters(self) -> None:
        """Copy lr/wd/... from the HDO groups (what schedulers and users change) into every sub-optimizer."""
        skip = _SELECTOR_KEYS | _OPTION_KEYS  # wrappers such as ZeroRedundancyOptimizer copy options into groups
        hyper = [_hyper(g, skip) for g in self.param_groups]
        for b in self._buckets:
            b.optimizer.param_groups[0].update(hyper[b.group_index])
        for opt, index in self._group_optimizers():
            for sub, gi in zip(opt.param_groups, index, strict=True):
                sub.update(hyper[gi])

    def _refresh_stale_copies(self) -> None:
        """Re-copy weights written outside the optimizer (a model-only checkpoint load), seen by version counter;
        writes through ``.data`` are not seen, which is why :meth:`refresh_from_model` exists."""
        for b in self._buckets:
            stale = [k for k, p in enumerate(b.members) if p._version != b.versions[k]]
            if stale:
                b.refresh_members(stale)
        for i, v in self._device_versions.items():
            if self._params[i]._version != v:
                self._masters[i].copy_(self._params[i].detach())
        if self._recopy_after_load:
            # A wrapper may write the weights after loading us (Megatron's Float16OptimizerWithFloat16Params copies
            # its saved fp32 mains in through ``.data``, which no version counter sees): the host copies of
            # full-precision members follow the weights once more; the saved fp32 master of a 16-bit member stays
            # (it holds the bits the member lacks).
            self._recopy_after_load = False
            for b in self._buckets:
                b.refresh_members([k for k, p in enumerate(b.members) if p.dtype == b.flat_param.dtype])

    def _step_in_place(self, opt: torch.optim.Optimizer | None, with_masters: bool) -> None:
        if opt is None:
            return
        swapped = []
        if with_masters:
            for i, master in self._masters.items():
                g = grad_of(self._params[i])
                master.grad = None if g is None else g.to(master.dtype)
        for group in opt.param_groups:
            for p in group["params"]:
                # Megatron's precision-aware path leaves the grad in ``decoupled_grad``; torch optimizers read .grad.
                if hasattr(p, "decoupled_grad") and p.grad is not p.decoupled_grad:
                    swapped.append((p, p.grad))
                    p.grad = p.decoupled_grad
        opt.step()
        for p, g in swapped:
            p.grad = g
        if with_masters and self._masters:
            params = [self._params[i] for i in self._masters]
            torch._foreach_copy_(params, list(self._masters.values()))
            self._device_versions = {i: self._params[i]._version for i in self._masters}
            # The fp32 copies of the gradients are the step's transient: kept on the masters they would stay resident
            # through the next forward and backward (4 bytes per GPU-stepped parameter, measured on an H200:
            # docs/benchmarks-memory-gpu.md). The next step makes new ones; the caching allocator orders the free
            # after the copies above on this stream.
            for master in self._masters.values():
                master.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient (those without one are skipped, as in torch).

        Returns:
            The loss of ``closure`` (run with grad enabled), or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._follow_param_groups()
        self._push_hyperparameters()
        self._refresh_stale_copies()
        compute = device.current_stream()
        # Backward wrote the grads on the compute stream; the D2H stream starts after it, and does not wait
        # for the device optimizer enqueued below (it touches only the non-offloaded parameters).
        self._d2h.wait_stream(compute)
        # The H2D stream needs no wait on the compute stream: each bucket's H2D copy is issued only after the host
        # waited on that bucket's d2h_done, recorded on the D2H stream after the wait above, so every compute-stream
        # read of the weights it overwrites has finished before the copy is even issued.
        missing = {}
        with device.on_stream(self._d2h):
            for bi, b in enumerate(self._buckets):
                grads = [grad_of(p) for p in b.members]
                current = self._hook_copied(bi, grads)
                missing[id(b)] = b.copy_grads_in(grads, self._d2h, current)
        # The device part is asynchronous on a GPU: it runs while the host steps the buckets below.
        self._step_in_place(self.device_optimizer, with_masters=True)
        self._step_in_place(self.resident_optimizer, with_masters=False)
        for b in self._buckets:
            if len(missing[id(b)]) == len(b.members):
                continue  # no member has a grad this step: nothing to do, as torch would do nothing
            b.step_and_copy_back(missing[id(b)], self._h2d)
            # The next forward reads these weights: the compute stream (not the host) waits for the copy.
            compute.wait_event(b.h2d_done)
        if self._hooks is not None:
            self._hooks.reset()  # consumed: the next backward's copies start afresh
        self._rebuild_state()
        return loss

    def _hook_copied(self, bi: int, grads: list) -> set[int]:
        """Members of bucket ``bi`` whose gradient a backward hook already copied, unchanged since."""
        if self._hooks is None:
            return set()
        return {k for k, g in enumerate(grads) if g is not None and self._hooks.is_current(bi, k, g)}

    # ------------------------------------------------------------------ state
    def _rebuild_state(self) -> None:
        """``self.state``: the union of sub-optimizer states keyed by the original params (live views)."""
        entries = sum(len(o.state) for o in self.sub_optimizers)
        if entries == self._state_entries:
            return
        self._state_entries = entries
        live = export_param_states(self, clone=False)
        self.state = defaultdict(LiveParamState, {self._params[i]: LiveParamState(entry) for i, entry in live.items()})

    def _sync_hdo_state_to_sub_optimizers(self) -> None:
        """Write ``self.state`` (e.g. tensors Megatron's DistributedOptimizer assigned) into the sub-optimizers."""
        states = {i: dict(self.state[p]) for i, p in enumerate(self._params) if self.state.get(p)}
        import_param_states(self, states)

    def _saved_group(self, gi: int) -> dict[str, Any]:
        """Group ``gi`` with every hyper-parameter a plain torch optimizer needs: from the sub-optimizer that steps
        it, else the class's constructor defaults; the HDO group's own values win. ``fused`` comes along like torch
        saves it, so a plain optimizer that loads the checkpoint runs the same kernel (a bit-exact resume)."""
        full = _constructor_defaults(self.cpu_optimizer_cls if self._buckets else self.gpu_optimizer_cls)
        subs = [b.optimizer.param_groups[0] for b in self._buckets if b.group_index == gi]
        for opt, index in self._group_optimizers():
            subs += [g for g, i in zip(opt.param_groups, index, strict=True) if i == gi]
        if subs:
            full.update(_hyper(subs[0]))
        full.update(_hyper(self.param_groups[gi]))
        return full

    def state_dict(self) -> dict[str, Any]:
        """A torch-format state dict: per-parameter state keyed by index, the same for any split or bucketing.

        Like torch's, it holds references to the live state (a bucket member's entries are views into its flat
        state), so it costs no memory: save it before the next ``step()``. Every group carries the full
        hyper-parameters, so a plain ``torch.optim.AdamW`` loads it when offloading is turned off.

        Returns:
            ``{"state": {index: {"step", "exp_avg", ..., ["master_param"]}}, "param_groups": [...]}`` with plain
            tensors, numbers and tuples only, so ``torch.load(..., weights_only=True)`` reads it.
        """
        self._follow_param_groups()
        groups, start = [], 0
        for gi, g in enumerate(self.param_groups):
            groups.append({**self._saved_group(gi), "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        return {"state": saved_param_states(self), "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by this class (any split) or by a plain torch optimizer of the same model.

        Load the model weights first: the host copies and masters are refreshed from them (a saved
        ``master_param`` then overrides the master).

        Raises:
            ValueError: the state dict has a different group/parameter layout or state shapes (another model).
        """
        self._follow_param_groups()
        states = validate_state_dict(self, state_dict)
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            # Upstream checkpoints carry the constructor options (and classes) in every group: not ours to take.
            group.update(_hyper(saved, _OPTION_KEYS))
        self.refresh_from_model()
        import_param_states(self, states)
        self._recopy_after_load = True

    def refresh_from_model(self) -> None:
        """Re-copy every host copy and fp32 master from the current model weights.

        Call it after loading model weights without the optimizer (``--no-load-optim``, the Megatron Bridge #4082
        case), else the first step writes the stale copies back; ``step()``'s version checks miss ``.data`` writes.
        """
        with torch.no_grad():
            for b in self._buckets:
                b.refresh_members()
            for i, master in self._masters.items():
                master.copy_(self._params[i].detach())
            self._device_versions = {i: self._params[i]._version for i in self._masters}

    def update_fp32_param_by_new_param(self) -> None:
        """Upstream's name (Megatron's DistributedOptimizer calls it); same as :meth:`refresh_from_model`."""
        self.refresh_from_model()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``.grad`` and ``decoupled_grad`` of the model parameters (the host buffers need no clearing)."""
        self._follow_param_groups()
        super().zero_grad(set_to_none)
        if self._hooks is not None:
            self._hooks.reset()
        for p in self._params:
            if getattr(p, "decoupled_grad", None) is not None:
                if set_to_none:
                    p.decoupled_grad = None
                else:
                    p.decoupled_grad.zero_()

    def dummy_step(self) -> None:
        """Materialize the optimizer state (zeros, ``step`` 0), as Megatron's DistributedOptimizer needs before it
        loads state in place; unlike upstream's, the parameters and the lr schedule are left untouched."""
        saved = [p.detach().clone() for p in self._params]
        grads = [(p, p.grad) for p in self._params]
        for p in self._params:
            p.grad = torch.zeros_like(p)
        self.step()
        with torch.no_grad():
            for (p, g), value in zip(grads, saved, strict=True):
                p.copy_(value)
                p.grad = g
            for opt in self.sub_optimizers:
                for st in opt.state.values():
                    for v in st.values():
                        if isinstance(v, torch.Tensor):
                            v.zero_()
            self.refresh_from_model()
        # No device.synchronize() here: the weights, masters and device state above are written on the compute
        # stream, which orders every later use (a checkpoint load copies into them on that stream too); the host
        # state was written by the host itself, and refresh_from_model's blocking copies into the host masters
        # return only after the compute stream (which waited for every bucket's H2D copy) has caught up.

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, process_group=None) -> torch.Tensor:
        """Clip all gradients (host- and device-updated) by their global norm; call it between backward and step.

        ``process_group``: the ranks holding disjoint shards, over which the norm is summed. Returns the total norm
        before clipping (0-dim).
        """
        return clip_grad_norm_(self._params, max_norm, norm_type, process_group)


# Constructor options: kept out of the param groups (and dropped from loaded ones, where upstream saved them).
_OPTION_KEYS = frozenset(inspect.signature(HybridDeviceOptimizer.__init__).parameters) - {"self", "params", "defaults"}
