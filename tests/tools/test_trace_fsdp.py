"""Megatron-FSDP in the trace: megatron-core's own ``FullyShardedDataParallel`` built and stepped on fake tensors
(real 0.16.1 and 0.19.2, a small dense model), its buffers sharded as upstream shards them."""

from __future__ import annotations

from typing import Any

import pytest

SMALL = {  # a real width: toy widths make fixed-size tensors weigh several per cent
    "num_layers": 2,
    "hidden_size": 1024,
    "ffn_hidden_size": 4096,
    "num_attention_heads": 16,
    "num_query_groups": 8,
    "kv_channels": 64,
    "vocab_size": 32000,
    "seq_length": 2048,
    "micro_batch_size": 1,
    "num_gpus": 4,
    "grad_reduce_in_fp32": False,
}


def _peaks(release: str, runs: list[dict[str, Any]]) -> list[dict[str, int]]:
    from mbridge_offload.plan.inputs.resolve import resolve
    from mbridge_offload_tools.trace import spec as specs
    from mbridge_offload_tools.trace.run import spawn_batch

    batch = [specs.build_run(r.model, r.setup, 0) for r in (resolve(dict(run)) for run in runs)]
    got = spawn_batch(release, batch)
    assert not [g["error"] for g in got if "error" in g], release
    return [max(g["phases"].values(), key=lambda p: p["total"])["by_category"] for g in got]


@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.parametrize("release", ["0.16.1", "0.19.2"])
def test_megatron_fsdp_is_built_and_shards_as_upstream(release: str) -> None:
    """DDP with the distributed optimizer, then Megatron-FSDP ``no_shard`` and ``optim`` (ZeRO-1): the same weights
    and gradients as DDP (whole copies), fp32 main weights and moments whole (``no_shard``, 4x DDP's shard at DP 4)
    or sharded as DDP's; ``optim_grads_params`` (ZeRO-3): the persistent weight and gradient shards are a quarter
    of DDP's whole copies, the rest of the weights the all-gathered units in flight."""
    from mbridge_offload_tools.exact.run import installs

    if release not in {i.version for i in installs()}:
        pytest.skip(f"megatron-core {release} is not installed here")
    fsdp = {**SMALL, "use_megatron_fsdp": True}
    ddp, no_shard, optim, zero3 = _peaks(
        release,
        [
            {**SMALL, "distributed_optimizer": True},
            {**fsdp, "fsdp_sharding_strategy": "no_shard"},
            {**fsdp, "fsdp_sharding_strategy": "optim"},
            {**fsdp, "fsdp_sharding_strategy": "optim_grads_params"},
        ],
    )
    for run in (no_shard, optim):  # up to FSDP's bucket padding (a few KiB)
        assert run["weights"] == pytest.approx(ddp["weights"], rel=1e-3)
    assert optim["optimizer"] == pytest.approx(ddp["optimizer"], rel=1e-3)
    assert no_shard["optimizer"] == pytest.approx(4 * ddp["optimizer"], rel=1e-3)
    # ZeRO-3 at the peak (the loss, before any unit's backward): the gradient shard only; the weight shard plus,
    # unsharded, the double buffer's two layers (all this model has) and the root module (embedding, output layer)
    assert zero3["gradients"] == pytest.approx(ddp["weights"] / 4, rel=1e-3)
    assert zero3["weights"] == pytest.approx(ddp["weights"] * 1.25, rel=1e-3)
