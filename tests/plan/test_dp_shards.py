"""The distributed optimizer's buffer layout and per-rank shards (``plan/memory/dp_shards.py``) against megatron-core.

megatron-core 0.19.2 lays a buffer out in a static method, ``DistributedOptimizer._compute_per_buffer_param_layout``
(0.16.1 does the same inside ``_ParamAndGradBuffer.__init__``, which needs real tensors and process groups): it is
run here on generated parameter lists, in a subprocess with that release first on the path, and the planner's layout
must give every parameter the same start and every bucket the same bounds. Ownership and the HDO order on top of the
layout are held to megatron-core's real DDP and optimizer by the trace differential (``generate_hdo``,
``tests/plan/test_trace_differential.py``), where the planner's resident state matches the traced rank's exactly.
"""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys

import pytest

from mbridge_offload.plan.memory import dp_shards
from mbridge_offload.plan.memory.stage import greedy_offload
from mbridge_offload_runtime.upstream import hdo_offload_mask
from tests.support.differential import version_env

pytestmark = pytest.mark.megatron

_UPSTREAM = """
import json, sys
from types import SimpleNamespace
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

class P:
    def __init__(self, n, shared):
        self.data = SimpleNamespace(nelement=lambda: n)
        if shared:
            self.shared_embedding = True

out = []
for case in json.load(sys.stdin):
    params = [P(n, s) for n, s in zip(case["numels"], case["shared"])]
    config = SimpleNamespace(pad_buckets_for_high_nccl_busbw=False)
    layout = DistributedOptimizer._compute_per_buffer_param_layout(params, case["size"], case["dp"], config)
    out.append({"starts": [layout.param_index_map[p][0] for p in params], "buckets": layout.bucket_indices})
json.dump(out, sys.stdout)
"""


def _cases(n: int) -> list[dict]:
    rng = random.Random(20261207)
    out = []
    for _ in range(n):
        count = rng.randint(1, 40)
        numels = [rng.choice((1, 7, 64, 1000, 4096, 65536, 3 * 10**6, 4 * 10**7)) for _ in range(count)]
        shared = [False] * count
        if rng.random() < 0.3:  # a tied embedding with PP > 1: first (stage 0) or last (the last stage)
            shared[rng.choice((0, count - 1))] = True
        size = rng.choice((None, None, 40_000_000, 1_000_000, 5000))
        out.append({"numels": numels, "shared": shared, "size": size, "dp": rng.choice((1, 2, 3, 8, 64, 384))})
    return out


@pytest.mark.skipif(version_env("0.19.2") is None, reason="megatron-core 0.19.2 not installed (make setup installs it)")
def test_the_buffer_layout_is_megatron_cores_on_generated_parameter_lists():
    cases = _cases(200)
    proc = subprocess.run(
        [sys.executable, "-c", _UPSTREAM],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        env=version_env("0.19.2"),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for case, theirs in zip(cases, json.loads(proc.stdout), strict=True):
        starts, bounds = dp_shards.layout(case["numels"], case["dp"], case["size"], case["shared"])
        assert starts == theirs["starts"], case
        assert list(itertools.pairwise(bounds)) == [tuple(b) for b in theirs["buckets"]], case


def test_every_rank_owns_its_equal_part_of_every_bucket_and_nothing_twice():
    for case in _cases(200):
        numels, dp = case["numels"], case["dp"]
        starts, bounds = dp_shards.layout(numels, dp, case["size"], case["shared"])
        owned = dp_shards.owned(numels, starts, bounds, dp)
        # every element of every parameter has exactly one owner; padding has none
        for i, n in enumerate(numels):
            assert sum(r.get(i, 0) for r in owned) == n
        # and each rank's part of the buffer is the same size (what it holds of it is that, less padding)
        assert all(sum(r.values()) <= bounds[-1] // dp for r in owned)


def test_the_greedy_split_is_hdos_prefix():
    rng = random.Random(7)
    for _ in range(300):
        numels = [rng.randint(1, 10**6) for _ in range(rng.randint(0, 30))]
        f = rng.choice((0.0, 0.1, 0.25, 0.5, 0.75, 1.0, rng.random()))
        mask = hdo_offload_mask(numels, f)
        assert greedy_offload(numels, f) == sum(n for n, host in zip(numels, mask, strict=True) if host)


def test_the_gpus_of_a_stage_map_to_their_data_parallel_ranks_as_megatron_core_orders_them():
    # TP fastest, then CP, then DP (dense); expert ranks ETP fastest, then EP, then expert DP
    ranks = dp_shards.gpu_ranks(tp=2, cp=2, dp=2, ep=4, etp=1)
    assert [d for d, _ in ranks] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [e for _, e in ranks] == [0, 0, 0, 0, 1, 1, 1, 1]
