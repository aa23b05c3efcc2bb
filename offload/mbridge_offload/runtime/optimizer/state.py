"""Per-parameter optimizer state in and out of :class:`mbridge_offload.runtime.optimizer.hybrid.HybridDeviceOptimizer`.

The saved form is torch's: ``{"state": {index: {...}}, "param_groups": [{..., "params": [index, ...]}]}``, with
indices in param_groups order. A host bucket's flat state is cut into per-parameter slices on the way out and
joined again on the way in, so the form does not depend on the offload fraction, the overlap setting or the bucket
size. ``master_param`` (the fp32 master) is saved for parameters that have one, i.e. non-fp32 parameters with
``param_update_in_fp32``; native-fp32 parameters are their own master and have no such key.
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
    """One parameter's entry of ``HybridDeviceOptimizer.state``: its values are the live tensors (sub-optimizer
    state, or views into a bucket's flat state), and assigning a tensor to an existing key copies it into them.

    Megatron's DistributedOptimizer loads a checkpoint by assigning ``optimizer.state[param][key] = tensor``
    (``_set_main_param_and_optimizer_states``), and not every load path calls ``_sync_hdo_state_to_sub_optimizers``
    afterwards (the legacy ``load_parameter_state`` does not). Upstream's HDO shares its sub-optimizers' dicts, so
    such writes land; copying in place gives ours the same effect. A new key (or another shape) is stored as given
    and reaches the sub-optimizers through ``_sync_hdo_state_to_sub_optimizers``.
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
    """Every parameter's state for ``state_dict()``: references to the live tensors, not copies.

    Per-element tensors (``exp_avg``, ``master_param``, ...) are the live tensors or views into a bucket's flat
    state. Only the scalar tensors (``step``) are copied, because a bucket keeps one for all its members and an
    optimizer that loads the dict steps each parameter's ``step`` in place: a shared one would count N times.
    """
    out = export_param_states(opt, clone=False)
    for state in out.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and (key in _SCALAR_KEYS or value.dim() == 0):
                state[key] = value.clone()
    return out


def validate_state_dict(opt: HybridDeviceOptimizer, state_dict: Any) -> dict[int, dict[str, Any]]:
    """Check that ``state_dict`` fits this optimizer's parameters; map its states to global indices.

    Raises:
        ValueError: not an optimizer state dict, or one saved for a different model (group count, parameter
            count per group, or a state tensor whose shape differs from its parameter's).
    """
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


def _load_flat(bucket, member_states: list[dict | None]) -> None:
    first = next(k for k, s in enumerate(member_states) if s)
    template = member_states[first]
    flat: dict[str, Any] = {}
    for key, value in template.items():
        if _is_per_element(key, value, bucket.members[first]):
            parts = []
            for k, s in enumerate(member_states):
                part = s.get(key) if s else None
                numel = bucket.members[k].numel()
                if part is None:
                    parts.append(torch.zeros(numel, dtype=value.dtype))
                else:
                    parts.append(part.detach().reshape(-1).to("cpu", value.dtype))
            flat[key] = torch.cat(parts)
        else:
            flat[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
    group = {k: v for k, v in bucket.optimizer.param_groups[0].items() if k != "params"}
    bucket.optimizer.load_state_dict({"state": {0: flat}, "param_groups": [{**group, "params": [0]}]})


def _clear(sub: torch.optim.Optimizer) -> None:
    sub.state.clear()


def import_param_states(opt: HybridDeviceOptimizer, states: dict[int, dict[str, Any]]) -> None:
    """Replace every sub-optimizer's state with ``states`` (global index -> torch per-parameter state).

    ``master_param`` entries are copied into the masters; the rest goes through each sub-optimizer's own
    ``load_state_dict`` so that dtype and device placement follow torch's rules for that optimizer.
    """
    # Copies, not the caller's tensors: torch's own load keeps a same-device tensor as is, and a state dict of
    # ours (or an upstream one) may hold views that other members or another optimizer still step in place.
    states = {
        i: {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for i, s in states.items()
    }
    with torch.no_grad():
        for i, s in states.items():
            master = s.pop("master_param", None)
            if master is None or opt._master_dtype(opt._params[i]) == opt._params[i].dtype:
                continue
            slot = opt._slot[i]
            target = slot[1].param_views[slot[2]] if slot[0] == "bucket" else slot[1]
            target.copy_(master)
    for bucket in opt._buckets:
        member_states = [states.get(i) or None for i in bucket.indices]
        if any(member_states):
            _load_flat(bucket, member_states)
        else:
            _clear(bucket.optimizer)
    for kind, sub in (("device", opt.device_optimizer), ("resident", opt.resident_optimizer)):
        if sub is None:
            continue
        index_of = {id(opt._slot[i][1]): i for i in range(len(opt._params)) if opt._slot[i][0] == kind}
        sub_states, groups, j = {}, [], 0
        for group in sub.param_groups:
            ids = []
            for p in group["params"]:
                s = states.get(index_of[id(p)])
                if s:
                    sub_states[j] = s
                ids.append(j)
                j += 1
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        sub.load_state_dict({"state": sub_states, "param_groups": groups})
    opt._state_entries = -1
    opt._rebuild_state()
