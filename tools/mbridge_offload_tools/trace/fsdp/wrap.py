"""megatron-core's Megatron-FSDP wrapper for the traced rank, in place of DDP (inside the child only).

Builds megatron-core's own ``FullyShardedDataParallel`` (``distributed/fsdp/mcore_fsdp_adapter.py``) over each
model chunk, as Bridge's ``_ddp_wrap`` does for ``use_megatron_fsdp``, and tags its buffers by category.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def wrap(torch: Any, config: Any, ddp: dict[str, Any], chunks: list[Any], tracker: Any) -> list[Any]:
    from fsdp import mesh
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    mesh.install(mcore_fsdp_adapter)
    from megatron.core.distributed.fsdp.src.megatron_fsdp import utils

    # The double buffer's pool lives in a process-global buffer (utils.get_global_memory_buffer): each traced run
    # starts without one, as a training process does (the next spec of a batch would reuse the last one's, uncounted)
    utils._GLOBAL_MEMORY_BUFFER = None

    fields = DistributedDataParallelConfig.__dataclass_fields__
    kw = {k: v for k, v in ddp.items() if k in fields}
    for key in ("megatron_fsdp_main_params_dtype", "megatron_fsdp_main_grads_dtype"):
        if isinstance(kw.get(key), str):
            kw[key] = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[kw[key]])
    ddp_config = DistributedDataParallelConfig(**kw)
    with _modules_stay(torch):
        model = [
            FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
            for i, c in enumerate(chunks)
        ]
    _tag(model, tracker)
    from megatron.core.distributed import finalize_model_grads

    # As Bridge sets it (train.py): the schedule's last act. Megatron-FSDP reduce-scatters (or all-reduces) its
    # gradients and hands them to the optimizer there (finish_grad_sync: update_main_grads), not in the step.
    # Its allocations (the fp32 copies of bf16 gradient shards, update_main_grads) are the step's transients.
    def finalize(*args: Any, **kwargs: Any) -> Any:
        category, module = tracker.category, tracker.module
        tracker.category, tracker.module = "other", ""
        try:
            return finalize_model_grads(*args, **kwargs)
        finally:
            tracker.category, tracker.module = category, module

    config.finalize_model_grads_func = finalize
    return model


# what each of a parameter group's buffers holds (megatron_fsdp/param_and_grad_buffer.py ParameterGroup; hsdp_*: 0.16)
_ROLES = {
    "model_weight_buffer": "weights",
    "transpose_weight_buffer": "weights",
    "hfsdp_helper_wbuf": "weights",
    "hfsdp_helper_wtbuf": "weights",
    "hsdp_wbuf": "weights",
    "main_weight_buffer": "optimizer",
    "main_grad_buffer": "gradients",
    "hfsdp_helper_gbuf": "gradients",
    "hsdp_gbuf": "gradients",
}


def _tag(model: list[Any], tracker: Any) -> None:
    """Tag Megatron-FSDP's storages by category: each buffer's shard (or whole copy) now, and every unsharded bucket
    it allocates later (the all-gathered weights of an FSDP unit, its gradients before the reduce-scatter) when it
    is allocated, whatever phase is current: weights, gradients, and the optimizer's fp32 main weights."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as pgb

    roles: dict[int, str] = {}
    for m in model:
        for group in m.param_and_grad_buffer.parameter_groups:
            for name, category in _ROLES.items():
                buffer = getattr(group, name, None)
                if buffer is None:
                    continue
                roles[id(buffer)] = category
                if getattr(buffer, "data", None) is not None:
                    tracker.retag(buffer.data, category)
    cls = pgb.DataParallelBuffer
    # fetch_bucket on both releases; 0.19.2 also allocates through allocate_bucket_storage directly
    for name in ("fetch_bucket", "allocate_bucket_storage"):
        if hasattr(cls, name):
            setattr(cls, name, _tagging(cls, name, roles, tracker))


def _tagging(cls: Any, name: str, roles: dict[int, str], tracker: Any) -> Any:
    original = getattr(cls, f"_trace_{name}", None) or getattr(cls, name)
    setattr(cls, f"_trace_{name}", original)

    def allocate(self: Any, *args: Any, **kwargs: Any) -> Any:
        bucket = original(self, *args, **kwargs)
        category = roles.get(id(self))
        if category is not None and bucket.data is not None and bucket.data.untyped_storage().nbytes():
            tracker.retag(bucket.data, category)
        return bucket

    return allocate


@contextlib.contextmanager
def _modules_stay(torch: Any) -> Iterator[None]:
    """``MegatronFSDP`` moves its module to the GPU (``module.to(self.device)``): the parameters are there already
    (fake tensors the device mode marks as the GPU's), and ``Module._apply`` cannot swap a fake parameter for its
    copy. A move to the GPU leaves the module as it is while the wrapper is built."""
    original = torch.nn.Module.to

    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        device = args[0] if args else kwargs.get("device")
        if device is not None and str(device).startswith("cuda") and len(args) + len(kwargs) == 1:
            return self
        return original(self, *args, **kwargs)

    torch.nn.Module.to = to
    try:
        yield
    finally:
        torch.nn.Module.to = original
