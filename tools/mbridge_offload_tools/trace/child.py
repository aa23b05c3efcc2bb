"""Child process of ``trace``: megatron-core's own model, DDP and optimizer for one rank, on fake tensors.

Run as a script with the target's megatron-core first on its path (``python child.py < spec.json``), never imported
by the CLI or the MCP server (which stay torch-free). The spec (built by ``trace.spec`` from the planner's resolved
inputs) names the TransformerConfig, DistributedDataParallelConfig and OptimizerConfig fields, the layout and the
pipeline stage to trace. Prints one JSON object: the peak bytes by phase, category and module (``tracker``).

How it runs (``docs/trace.md``): torch's ``fake`` process-group backend (``FakeStore``) for any world size, ranks
placed so that this process is the first rank of the traced pipeline stage; ``FakeTensorMode`` with the CPU-host
patches (``trace.patches``); the model, DDP buffers and optimizer built inside the tracker, one warm-up optimizer
step (Adam's moments exist from the first step on), then megatron-core's own forward-backward schedule (its 1F1B or
interleaved schedule, P2P through the fake group) and one optimizer step, every allocation counted.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from typing import Any

# The child is run as a file: its package's siblings by path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "float8_e4m3fn"}


def _dtype(torch: Any, name: str | None) -> Any:
    return getattr(torch, _DTYPES.get(name or "fp32", name or "float32"))


def _init_parallel(spec: dict[str, Any]) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    p = spec["parallel"]
    world = p["world"]
    # rank order tp-cp-ep-dp-pp: the pipeline rank is rank // (world / pp); the first rank of the traced stage.
    rank = spec["stage"] * (world // p["pp"]) + spec.get("gpu", 0)  # the stage's GPUs follow each other in rank order
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    kwargs: dict[str, Any] = dict(
        tensor_model_parallel_size=p["tp"],
        pipeline_model_parallel_size=p["pp"],
        virtual_pipeline_model_parallel_size=p.get("vpp"),
        context_parallel_size=p["cp"],
        expert_model_parallel_size=p["ep"],
        expert_tensor_parallel_size=p.get("etp"),
        create_gloo_process_groups=False,  # gloo's new_group is not implemented on the fake backend
    )
    parallel_state.initialize_model_parallel(**kwargs)
    from megatron.core.tensor_parallel import random

    random.model_parallel_cuda_manual_seed = lambda *a, **k: None


def _reset_moe_tracker() -> None:
    """Forget the MoE layers' auxiliary-loss tracker (and MTP's loss tracker): megatron-core keeps each in a module
    global, one tensor per loss sized by the first model's layer count, which the next spec of a batch (more layers)
    would index past."""
    from megatron.core.transformer.moe import moe_utils

    legacy = getattr(moe_utils, "_MOE_LAYER_WISE_LOGGING_TRACKER", None)  # 0.16.1
    if isinstance(legacy, dict):
        legacy.clear()
    getter = getattr(moe_utils, "get_moe_metrics_tracker", None)  # 0.19.2
    metrics = getattr(getter(), "metrics", None) if getter is not None else None
    if isinstance(metrics, dict):
        metrics.clear()
    # the MTP loss tracker: the same, sized by the first model's MTP depths
    from megatron.core.transformer import multi_token_prediction

    tracker = getattr(getattr(multi_token_prediction, "MTPLossLoggingHelper", None), "tracker", None)
    if isinstance(tracker, dict):
        tracker.clear()


def _one(spec: dict[str, Any], started: float) -> dict[str, Any]:
    import megatron.core
    import step
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    _init_parallel(spec)
    try:
        answer = step.trace(torch, spec)
    finally:  # the next spec of a batch has its own world
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        _reset_moe_tracker()
    answer["megatron_core"] = megatron.core.__version__.split("+")[0]
    answer["seconds"] = round(time.perf_counter() - started, 2)
    return answer


def main() -> None:
    """One spec on stdin, one answer on stdout; ``{"batch": [spec, ...]}`` answers ``{"batch": [answer or
    {"error": ...}, ...]}`` with one import of megatron-core (the differential test traces many configs)."""
    data = json.load(sys.stdin)
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import patches
        from activation_offload import fine_grained, te_layers

        patches.apply()
        te_layers.apply()
        fine_grained.apply()
        if "batch" not in data:
            json.dump(_one(data, started), sys.stdout)
            return
        out = []
        for spec in data["batch"]:
            try:
                out.append(_one(spec, time.perf_counter()))
            except Exception as exc:  # one config's failure is its answer, the batch goes on
                out.append({"error": f"{type(exc).__name__}: {exc}"[:400]})
        json.dump({"batch": out}, sys.stdout)


if __name__ == "__main__":
    main()
