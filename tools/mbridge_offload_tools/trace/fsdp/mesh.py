"""What megatron-core's FSDP adapter needs from a GPU machine: its rank mesh, TE check, collectives (docs/trace.md).

Every spot is listed, with its reason, in ``docs/trace.md`` ("Megatron-FSDP"); ``install`` applies them.

megatron-core's ``mcore_fsdp_adapter`` lays out its rank mesh with ``einops.rearrange`` over ``torch.arange(world)``
(``_get_dp_tp_mesh``) and asserts einops is importable. einops is a pure-Python dependency every GPU install of
megatron-core has; this CPU environment does not (only Megatron Bridge's dependency folder has it). The child uses
the real einops when it is importable, else ``rearrange`` here: the patterns megatron-core writes (named axes, one
level of groups, no ellipsis), by reshape and permute — index arithmetic on the rank numbers, no device, no memory.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any


def _axes(side: str) -> list[list[str]]:
    return [g.split() if g.startswith("(") is False else g[1:-1].split() for g in re.findall(r"\([^)]*\)|\S+", side)]


def rearrange(tensor: Any, pattern: str, **sizes: int) -> Any:
    """``einops.rearrange(tensor, pattern, **sizes)`` for patterns without ellipsis or anonymous axes."""
    left, right = (_axes(side) for side in pattern.split("->"))
    known = dict(sizes)
    for group, dim in zip(left, tensor.shape, strict=True):
        unknown = [a for a in group if a not in known]
        if len(unknown) > 1:
            raise ValueError(f"cannot infer {unknown} in {pattern!r}")
        if unknown:
            known[unknown[0]] = dim // math.prod(known[a] for a in group if a in known)
        if math.prod(known[a] for a in group) != dim:
            raise ValueError(f"shape {tuple(tensor.shape)} does not match {pattern!r} with {sizes}")
    order = [a for group in left for a in group]
    flat = tensor.reshape([known[a] for a in order])
    wanted = [a for group in right for a in group]
    moved = flat.permute([order.index(a) for a in wanted])
    return moved.reshape([math.prod(known[a] for a in group) for group in right])


def install(adapter: Any) -> None:
    """Give megatron-core's adapter module ``einops`` (the real one when installed), and build its device meshes
    (``_init_dist_index``) outside the fake mode: rank numbers, read with ``.tolist()``, which a fake tensor cannot
    answer; no parameter or buffer is made there."""
    import types

    import patches
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    # megatron-core asserts TE 2.10 for FSDP with gradient_accumulation_fusion (Bridge's default): answered for the
    # TE release of the run, as for the optimizer's modules (no TE here)
    adapter.is_te_min_version = patches.te_min_version
    if not isinstance(getattr(adapter, "TELinear", object), type):
        import standins

        # 0.16.1 checks isinstance(module, (TELinear,)) to mark TP-duplicated weights, with TELinear a MagicMock
        # without TE (a TypeError): the stand-in for TE's duplicated linear, whose parallel_mode is None as TE's
        adapter.TELinear = standins.DuplicatedLinearStandIn
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer

    # its all-gathers and reduce-scatters are batched in torch's _coalescing_manager, as DDP's (trace.patches): one
    # by one they write the same preallocated buffers
    param_and_grad_buffer._coalescing_manager = patches._one_by_one
    # 0.16.1 checks every parameter's DTensor shard boundaries with values (all-gathered offsets, torch.all read as
    # a bool), which a fake tensor cannot give; 0.19.2 skips the check by default. Metadata only: no memory.
    param_and_grad_buffer.validate_uneven_dtensor = lambda *a, **k: None
    if not getattr(adapter, "HAVE_EINOPS", True):
        adapter.einops = types.SimpleNamespace(rearrange=rearrange)
        adapter.HAVE_EINOPS = True
    cls = adapter.FullyShardedDataParallel
    original = cls._init_dist_index
    if getattr(original, "_real_ranks", False):
        return

    def real(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return original(*args, **kwargs)

    functools.update_wrapper(real, original)
    real._real_ranks = True  # type: ignore[attr-defined]
    cls._init_dist_index = real
    _real_device_mesh()


def _real_device_mesh() -> None:
    """torch's ``DeviceMesh`` answers its coordinates and sub-meshes from its rank tensor (``nonzero``, ``tolist``:
    no fake kernel gives values); Megatron-FSDP asks them while it shards (``using_tensor_parallel``,
    ``get_coordinate``). Every method and property of the class runs outside the fake mode: rank numbers only."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    def outside(fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            with unset_fake_temporarily():
                return fn(*args, **kwargs)

        return functools.wraps(fn)(run)

    if getattr(DeviceMesh, "_real_ranks", False):
        return
    for name, attr in list(vars(DeviceMesh).items()):
        if isinstance(attr, property):
            setattr(DeviceMesh, name, property(outside(attr.fget) if attr.fget else None, attr.fset, attr.fdel))
        elif isinstance(attr, (staticmethod, classmethod)):
            setattr(DeviceMesh, name, type(attr)(outside(attr.__func__)))
        elif callable(attr) and name not in ("__init_subclass__", "__class_getitem__"):
            setattr(DeviceMesh, name, outside(attr))
    DeviceMesh._real_ranks = True  # type: ignore[attr-defined]
