"""Per-parameter optimizer state in and out of :class:`mbridge_offload_runtime.optimizer.hybrid.HybridDeviceOptimizer`.

The saved form is torch's, indexed in param_groups order: a bucket's flat state is cut into per-parameter slices on
the way out and joined on the way in, so it does not depend on the split or the bucketing. ``master_param`` is
saved for parameters with an fp32 master (non-fp32 ones with ``param_update_in_fp32``).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class HybridDeviceOptimizer(Protocol):
    """What this module reads of ``hybrid.HybridDeviceOptimizer`` (which imports this module)."""

    param_groups: list[dict[str, Any]]
    device_optimizer: torch.optim.Optimizer | None
    resident_optimizer: torch.optim.Optimizer | None
    _params: list[torch.Tensor]
    _slot: list[Any]
    _buckets: list[Any]
    _state_entries: int

    def _master_dtype(self, param: torch.Tensor) -> torch.dtype: ...

    def _rebuild_state(self) -> None: ...


_SCALAR_KEYS = frozenset({"step"})


class LiveParamState(dict):
    """One parameter's entry of ``HybridDeviceOptimizer.state``: live tensors (sub-optimizer state, or views into a
    bucket's flat state); assigning a tensor of the same shape to an existing key copies it into them.

    Why: Megatron's DistributedOptimizer loads by assigning ``optimizer.state[param][key] = tensor``, and not every
    load path calls ``_sync_hdo_state_to_sub_optimizers`` afterwards (the legacy ``load_parameter_state`` does not);
    upstream's HDO shares its sub-optimizers' dicts, so such writes land. Other values are stored as given.
    """

    def __setitem__(self, key: Any, value: Any) -> None:
        current = self.get(key)
        if (
            isinstance(current, torch.Tensor)
            and isinstance(value, torch.Tensor)
            and current is not value
            and current.shape == value.shape
        ):
            with torch.no_grad():
                current.copy_(value)
            return
        super().__setitem__(key, value)


def _is_per_element(key: str, value: Any, param: torch.Tensor) -> bool:
    return key not in _SCALAR_KEYS and isinstance(value, torch.Tensor) and value.shape == param.shape


def export_param_states(opt: HybridDeviceOptimizer, clone: bool) -> dict[int, dict[str, Any]]:
    """Every parameter's state keyed by its global index (parameters without state are left out)."""
    out: dict[int, dict[str, Any]] = {}
    for i, p in enumerate(opt._params):
        slot = opt._slot[i]
        if slot[0] == "bucket":
            bucket, k = slot[1], slot[2]
            state = bucket.member_state(k, clone=clone)
            master = bucket.param_views[k].clone() if clone else bucket.param_views[k]
        else:
            sub = opt.device_optimizer if slot[0] == "device" else opt.resident_optimizer
            assert sub is not None  # a device (resident) slot exists only with a device (resident) optimizer
            state = dict(sub.state.get(slot[1], {}))
            master = slot[1]
        if state:
            if opt._master_dtype(p) != p.dtype:
                state["master_param"] = master
            out[i] = state
    return out


def saved_param_states(opt: HybridDeviceOptimizer) -> dict[int, dict[str, Any]]:
    """Every parameter's state for ``state_dict()``: the live tensors (or views), not copies, except the scalar
    ones (``step``): a bucket keeps one for all its members, and an optimizer that loads the dict steps each
    parameter's ``step`` in place, so a shared one would count N times."""
    out = export_param_states(opt, clone=False)
    for state in out.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and (key in _SCALAR_KEYS or value.dim() == 0):
                state[key] = value.clone()
    return out


def validate_state_dict(opt: HybridDeviceOptimizer, state_dict: Any) -> dict[int, dict[str, Any]]:
    """``state_dict``'s states by global index; ``ValueError`` if it is not one, or was saved for another model."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("not an optimizer state dict: expected a dict with 'state' and 'param_groups' keys.")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(
            f"optimizer state dict from a different model: it has {len(saved_groups)} param groups, this optimizer "
            f"has {len(opt.param_groups)}. Build the optimizer with the same param groups as the saved run."
        )
    id_map, start = {}, 0
    for g, (saved, ours) in enumerate(zip(saved_groups, opt.param_groups, strict=True)):
        if len(saved["params"]) != len(ours["params"]):
            raise ValueError(
                f"optimizer state dict from a different model: param group {g} has {len(saved['params'])} "
                f"parameters in the state dict but {len(ours['params'])} in this optimizer."
            )
        id_map.update({sid: start + j for j, sid in enumerate(saved["params"])})
        start += len(ours["params"])
    states = {}
    for sid, state in state_dict["state"].items():
        if sid not in id_map:
            raise ValueError(f"optimizer state dict has state for parameter id {sid!r}, which no param group lists.")
        i = id_map[sid]
        p = opt._params[i]
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key not in _SCALAR_KEYS and value.shape != p.shape:
                raise ValueError(
                    f"optimizer state dict from a different model: parameter {i} has shape {tuple(p.shape)} but "
                    f"its saved {key!r} has shape {tuple(value.shape)}."
                )
        states[i] = state
    return states


def _saved(state: dict[str, Any] | None) -> dict[str, Any]:
    """A saved per-parameter state without ``master_param`` (loaded into the masters, not the optimizer)."""
    return {k: v for k, v in (state or {}).items() if k != "master_param"}


def _copy_scalar(live: dict[str, Any], key: str, value: Any) -> None:
    """Set a non-per-element entry (``step``): into the live tensor when it has the shape, else as a copy."""
    current = live.get(key)
    if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor) and current.shape == value.shape:
        if current.data_ptr() != value.data_ptr() or current.dtype != value.dtype:  # not the live tensor itself
            current.copy_(value)
    else:
        live[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value


def _bucket_fits(bucket, live: dict[str, Any], template: dict[str, Any], members: list[dict[str, Any] | None]) -> bool:
    """Whether the saved states can be copied into the bucket's live flat state as they are (same keys, and each
    per-element value already of the dtype torch's own load would give it, so a copy rounds exactly as a load)."""
    if set(live) != set(template):
        return False
    for key, value in template.items():
        if not _is_per_element(key, value, bucket.members[next(k for k, s in enumerate(members) if s)]):
            continue
        flat = live[key]
        if not bucket.is_per_element(flat) or flat.dtype != bucket.flat_param.dtype:
            return False
        if any(s and key in s and s[key].dtype != flat.dtype for s in members):
            return False
    return True


def _load_flat(bucket, member_states: list[dict | None]) -> None:
    """Load one bucket's members into its flat state, slice by slice: in place when the live state has the same
    layout (any stepped optimizer, and Megatron's, which initialises state before loading: no memory beyond the
    caller's state dict), else into a flat state allocated once and given to the optimizer's ``load_state_dict``."""
    members: list[dict[str, Any] | None] = [_saved(s) or None for s in member_states]
    first = next(k for k, s in enumerate(members) if s)
    template: dict[str, Any] = members[first] or {}
    live = bucket.flat_state()
    in_place = _bucket_fits(bucket, live, template, members)
    flat: dict[str, Any] = live if in_place else {}
    for key, value in template.items():
        if not _is_per_element(key, value, bucket.members[first]):
            _copy_scalar(flat, key, value)
            continue
        if not in_place:
            flat[key] = torch.empty(bucket.numel, dtype=value.dtype)
        for k, s in enumerate(members):
            part = s.get(key) if s else None
            view = flat[key][bucket.offsets[k] : bucket.offsets[k] + bucket.members[k].numel()]
            if part is None:
                view.zero_()  # a member without saved state starts from zero moments, as in a fresh optimizer
            elif part.data_ptr() != view.data_ptr():  # Megatron's dist-ckpt load fills the live views in place
                view.copy_(part.detach().reshape(-1))
    if not in_place:
        group = {k: v for k, v in bucket.optimizer.param_groups[0].items() if k != "params"}
        bucket.optimizer.load_state_dict({"state": {0: flat}, "param_groups": [{**group, "params": [0]}]})


def _sub_fits(sub: torch.optim.Optimizer, saved: dict[Any, dict[str, Any]]) -> bool:
    """Whether every saved state matches its parameter's live state key for key, shape for shape and dtype for
    dtype (then copying in place equals torch's load, which would cast to exactly these dtypes)."""
    for p, s in saved.items():
        live = sub.state.get(p)
        if not live or set(live) != set(s):
            return False
        for key, value in s.items():
            current = live[key]
            if isinstance(value, torch.Tensor) != isinstance(current, torch.Tensor):
                return False
            per_element = key not in _SCALAR_KEYS and isinstance(value, torch.Tensor)
            if per_element and (current.shape, current.dtype) != (value.shape, value.dtype):
                return False
            if per_element and value.is_floating_point() and p.is_floating_point() and current.dtype != p.dtype:
                return False
    return True


def _load_sub(opt: HybridDeviceOptimizer, kind: str, sub: torch.optim.Optimizer, states: dict[int, dict]) -> None:
    """Load the device (or host-resident) sub-optimizer: in place when its live state has the saved layout, else
    through its own ``load_state_dict`` with copies (torch keeps a same-device tensor as is, and the caller's may
    be views that another optimizer still steps)."""
    index_of = {id(opt._slot[i][1]): i for i in range(len(opt._params)) if opt._slot[i][0] == kind}
    params = [p for group in sub.param_groups for p in group["params"]]
    saved = {p: _saved(states.get(index_of[id(p)])) for p in params}
    saved = {p: s for p, s in saved.items() if s}
    if _sub_fits(sub, saved):
        for p in params:
            if p not in saved:
                sub.state.pop(p, None)
                continue
            for key, value in saved[p].items():
                _copy_scalar(sub.state[p], key, value)
        return
    sub_states, groups, j = {}, [], 0
    for group in sub.param_groups:
        ids = []
        for p in group["params"]:
            if p in saved:
                sub_states[j] = {
                    k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in saved[p].items()
                }
            ids.append(j)
            j += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    sub.load_state_dict({"state": sub_states, "param_groups": groups})


def _load_masters(opt: HybridDeviceOptimizer, states: dict[int, dict[str, Any]]) -> None:
    for i, s in states.items():
        master = s.get("master_param")
        if master is None or opt._master_dtype(opt._params[i]) == opt._params[i].dtype:
            continue
        slot = opt._slot[i]
        target = slot[1].param_views[slot[2]] if slot[0] == "bucket" else slot[1]
        target.copy_(master)


def import_param_states(opt: HybridDeviceOptimizer, states: dict[int, dict[str, Any]]) -> None:
    """Replace every sub-optimizer's state with ``states`` (global index -> torch per-parameter state; only read).

    Values are copied into the live state where it has the saved layout (the usual resume), else loaded through
    each sub-optimizer's own ``load_state_dict``, so dtype and device follow torch's rules for that optimizer.
    """
    with torch.no_grad():
        _load_masters(opt, states)
        for bucket in opt._buckets:
            member_states = [states.get(i) or None for i in bucket.indices]
            if any(_saved(s) for s in member_states):
                _load_flat(bucket, member_states)
            else:
                bucket.optimizer.state.clear()
        for kind, sub in (("device", opt.device_optimizer), ("resident", opt.resident_optimizer)):
            if sub is not None:
                _load_sub(opt, kind, sub, states)
    opt._state_entries = -1
    opt._rebuild_state()
