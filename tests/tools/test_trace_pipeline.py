"""The trace on pipelines the even split leaves out: ``pipeline_model_parallel_layout`` (with VPP, standalone
embedding and loss stages) and uneven first/last stages, as megatron-core builds them (real 0.16.1 and 0.19.2, small
models, every stage of a run in one child process).
"""

from __future__ import annotations

from typing import Any

import pytest

from mbridge_offload.plan.inputs.resolve import resolve
from mbridge_offload.plan.memory.stage import estimate_memory
from mbridge_offload.plan.model.params import stage_params
from mbridge_offload_tools.exact.run import installs
from mbridge_offload_tools.trace import spec as specs
from mbridge_offload_tools.trace.run import spawn_batch

pytestmark = [pytest.mark.megatron, pytest.mark.slow]
RELEASES = sorted({i.version for i in installs()} & {"0.16.1", "0.19.2"})
SMALL = {
    "hidden_size": 256,
    "ffn_hidden_size": 512,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "kv_channels": 64,
    "vocab_size": 1024,
    "seq_length": 1024,
    "micro_batch_size": 1,
}
RUNS = {
    # PP 2, VPP 2 from the layout; rank 0 holds the embedding's chunk and the third, rank 1 the loss stage alone
    "layout_vpp": {"num_layers": 6, "pp": 2, "pipeline_layout": "Et|tt|ttt|L", "num_gpus": 4, "global_batch_size": 8},
    # PP 3, a standalone embedding stage
    "layout_standalone": {"num_layers": 5, "pp": 3, "pipeline_layout": "E|ttt|ttL", "num_gpus": 3},
    # megatron-core's uneven split with VPP: the first rank's 2 layers over its 2 chunks, 4 on the last
    "uneven_vpp": {
        "num_layers": 6,
        "pp": 2,
        "vpp": 2,
        "num_layers_in_first_pipeline_stage": 2,
        "num_gpus": 4,
        "global_batch_size": 8,
    },
}
_CACHE: dict[tuple[str, str], tuple[Any, list[dict[str, Any]]]] = {}


def every_stage(release: str, name: str) -> tuple[Any, list[dict[str, Any]]]:
    """The planner's resolved run and the trace of each of its stages."""
    if (release, name) not in _CACHE:
        r = resolve({**SMALL, "global_batch_size": 2, **RUNS[name]})
        got = spawn_batch(release, [specs.build_run(r.model, r.setup, st) for st in range(r.setup.pp)])
        assert not [g["error"] for g in got if "error" in g]
        _CACHE[release, name] = (r, got)
    return _CACHE[release, name]


def _peak(got: dict[str, Any]) -> int:
    return max(p["total"] for p in got["phases"].values())


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("name", sorted(RUNS))
def test_each_stage_holds_the_layers_megatron_core_assigns_it(release: str, name: str) -> None:
    r, got = every_stage(release, name)
    planned = [sum(t.numel for t in stage_params(r.model, r.setup, st)) for st in range(r.setup.pp)]
    assert [g["params"] for g in got] == planned
    assert len(set(planned)) > 1  # the split is uneven: a wrong stage assignment would show


@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_trace_finds_the_stage_the_planner_finds_worst(name: str) -> None:
    r, got = every_stage(RELEASES[-1], name)
    peaks = [_peak(g) for g in got]
    worst = estimate_memory(r.model, r.setup).worst.stage
    assert peaks.index(max(peaks)) == worst, (peaks, worst)


def test_the_layout_reaches_megatron_core_as_the_planners_stages() -> None:
    r = resolve({**SMALL, **RUNS["layout_standalone"]})
    assert specs.layout(r.model, r.setup) == "E|ttt|ttL"
    r = resolve({**SMALL, **RUNS["layout_vpp"]})
    spec = specs.build_run(r.model, r.setup, 0)
    assert spec["transformer"]["pipeline_model_parallel_layout"] == "Et|tt|ttt|L"
    assert spec["parallel"]["vpp"] == 2 and spec["num_microbatches"] == 4  # interleaved: 2·PP to its steady state
