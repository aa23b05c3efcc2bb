"""The precision-aware optimizer, traced (TE FusedAdam's stand-in under megatron-core's DistributedOptimizer) and
planned: the same resident state and the same optimizer-step transient, on dense and MoE runs, both releases.

Real megatron-core (the venv's 0.16.1 and .mcore/0.19.2); one child per release traces every case.
"""

from __future__ import annotations

from typing import Any

import pytest

from mbridge_offload.plan.inputs.resolve import resolve
from mbridge_offload.plan.memory.stage import estimate_memory
from mbridge_offload_tools.exact.run import installs
from mbridge_offload_tools.trace import spec as specs
from mbridge_offload_tools.trace.run import spawn_batch

pytestmark = [pytest.mark.megatron, pytest.mark.slow]
RELEASES = sorted({i.version for i in installs()} & {"0.16.1", "0.19.2"})
GIB = 2**30
RUN = {
    "num_layers": 2,
    "hidden_size": 1024,
    "ffn_hidden_size": 4096,
    "num_attention_heads": 8,
    "num_query_groups": 4,
    "kv_channels": 128,
    "vocab_size": 32000,
    "seq_length": 1024,
    "num_gpus": 8,
    "tp": 2,
    "distributed_optimizer": True,
    "precision_aware_optimizer": True,
}
MOE = {"num_moe_experts": 8, "moe_ffn_hidden_size": 512, "moe_router_topk": 2, "ep": 4}
# (exp_avg, exp_avg_sq, main params, bf16 gradients): Bridge's precision-aware recipes (fp32 everything with
# remainders; bf16 moments) and the dtypes whose copies TE makes in its step (fp16 moments, one bf16 moment, an
# fp16 master)
DTYPES = [
    ("fp32", "fp32", "fp32", False),
    ("bf16", "bf16", "fp32", True),
    ("fp16", "fp16", "fp32", True),
    ("bf16", "fp32", "fp32", False),
    ("bf16", "bf16", "fp16", True),
]


def _inputs(dtypes: tuple[str, str, str, bool], moe: bool) -> dict[str, Any]:
    exp_avg, exp_avg_sq, main, bf16_grads = dtypes
    return {
        **RUN,
        **(MOE if moe else {}),
        "exp_avg_dtype": exp_avg,
        "exp_avg_sq_dtype": exp_avg_sq,
        "main_params_dtype": main,
        "grad_reduce_in_fp32": not bf16_grads,
    }


CASES = [(d, moe) for d in DTYPES for moe in (False, True)]
_TRACED: dict[str, list[dict[str, Any]]] = {}


def _traced(release: str, case: int) -> dict[str, Any]:
    """The child's answer for CASES[case] (all of one release traced at once, on first use)."""
    if release not in _TRACED:
        _TRACED[release] = spawn_batch(release, [specs.build(resolve(_inputs(*c)), 0) for c in CASES])
    return _TRACED[release][case]


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize(
    "case", range(len(CASES)), ids=[f"{'moe' if m else 'dense'}-{'-'.join(map(str, d))}" for d, m in CASES]
)
def test_the_planner_counts_the_optimizer_state_and_step_transient_the_trace_finds(release: str, case: int) -> None:
    inputs = _inputs(*CASES[case])
    traced = _traced(release, case)["phases"]["optimizer_step"]["by_category"]
    r = resolve(inputs)
    planned = {p.name: p for p in estimate_memory(r.model, r.setup).stages[0].phases}["optimizer_step"]
    # the optimizer state TE's FusedAdam makes (moments, remainders or master, scales): the same bytes
    assert traced["optimizer"] == pytest.approx(planned.optimizer, rel=0.01)
    # what its step allocates beyond that: TE's fp32 copies of the low-precision states of one parameter group
    step = planned.other - r.setup.overhead_gb * 1e9
    assert traced["other"] == pytest.approx(step, rel=0.02, abs=2e6)
