"""Child process of ``validate --exact``: build the real megatron-core configs and print what they raise.

Run as a script (never imported by the server or the CLI, which stay torch-free):
``python exact_child.py < {"model": {...}, "optimizer": {...}, "ddp": {...}}``. Prints one JSON object:
``{"version": "0.16.1", "errors": [{"stage", "type", "message"}], "skipped": [...], "dropped": [...]}``.
Keys that are not fields of the installed release's dataclasses are not passed (listed in ``dropped``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings

_DTYPE_FIELDS = {"pipeline_dtype", "params_dtype", "main_grads_dtype", "main_params_dtype", "exp_avg_dtype"}
_DTYPE_FIELDS |= {"exp_avg_sq_dtype", "autocast_dtype", "grad_reduce_in_fp32_dtype"}
_SHORT = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "float": "float32", "half": "float16"}


def _value(torch, key: str, value):
    """Bridge's YAML writes dtypes as {_target_: torch.bfloat16}; dtype fields may also hold short names."""
    if isinstance(value, dict) and "_target_" in value:
        value = value["_target_"]
    if key in _DTYPE_FIELDS and isinstance(value, str):
        name = value.removeprefix("torch.")
        return getattr(torch, _SHORT.get(name, name), value)
    return value


def _build(torch, cls, body: dict, stage: str, out: dict) -> None:
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: _value(torch, k, v) for k, v in body.items() if k in fields}
    out["dropped"] += sorted(f"{stage}:{k}" for k in body if k not in fields and not k.startswith("_"))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cls(**kwargs)
    except Exception as exc:  # every error megatron-core raises is the answer
        out["errors"].append({"stage": stage, "type": type(exc).__name__, "message": str(exc)})


def main() -> None:
    data = json.load(sys.stdin)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core
        import torch
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.transformer import TransformerConfig
    out: dict = {"version": megatron.core.__version__.split("+")[0], "errors": [], "skipped": [], "dropped": []}
    model = data.get("model") or {}
    if all(model.get(k) is not None for k in ("num_layers", "hidden_size", "num_attention_heads")):
        _build(torch, TransformerConfig, model, "TransformerConfig", out)
    else:
        out["skipped"].append("TransformerConfig: num_layers, hidden_size and num_attention_heads are needed")
    _build(torch, OptimizerConfig, {"lr": 1e-4, **(data.get("optimizer") or {})}, "OptimizerConfig", out)
    _build(torch, DistributedDataParallelConfig, data.get("ddp") or {}, "DistributedDataParallelConfig", out)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
