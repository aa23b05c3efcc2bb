"""The planner's MoE layer activations held to what a real megatron-core ``MoELayer`` saves for backward.

Each megatron-core release runs in its own process (``tests/support/mcore_moe_saved.py``: the local spec's pre-MLP
norm and ``MoELayer``, bf16, EP 1, real CPU tensors, every saved tensor counted once per storage). The planner's
bytes for the same layer (``kind_activations`` of a MoE symbol: the pre-MLP norm's input and the MoE tensors) must be
within 5 % of the measured bytes, over top-k, expert counts, SwiGLU or GeLU, shared experts and both dispatchers.
Simulated on CPU: routing is whatever the initialised router gives, and dropless routing saves ``T·k`` routed tokens
whatever their split over the experts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from mbridge_offload.plan.memory.activations import kind_activations
from mbridge_offload.plan.model.architecture import MOE, ModelSpec
from mbridge_offload.plan.model.run import Setup

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
MCORE_NEW = ROOT / ".mcore" / "0.19.2"

CASES = [
    {"h": 256, "ffn": 128, "seq": 256, "experts": 16, "topk": 4},
    {"h": 256, "ffn": 192, "seq": 256, "experts": 8, "topk": 2, "shared": 256},
    {"h": 128, "ffn": 64, "seq": 256, "experts": 32, "topk": 8},
    {"h": 256, "ffn": 128, "seq": 128, "experts": 8, "topk": 2, "glu": False},
    {"h": 256, "ffn": 128, "seq": 256, "experts": 16, "topk": 4, "dispatcher": "allgather"},
]


def _measured(pythonpath: Path | None) -> dict:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "support" / "mcore_moe_saved.py"), *map(json.dumps, CASES)],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _planned(case: dict) -> int:
    m = ModelSpec(
        name="moe-case", num_layers=1, hidden_size=case["h"], ffn_hidden_size=case["ffn"], num_attention_heads=4,
        num_query_groups=4, kv_channels=case["h"] // 4, vocab_size=1024, seq_length=case["seq"],
        gated_linear_unit=case.get("glu", True), num_moe_experts=case["experts"], moe_ffn_hidden_size=case["ffn"],
        moe_router_topk=case["topk"], moe_shared_expert_intermediate_size=case.get("shared"),
    )  # fmt: skip
    return sum(t.nbytes for t in kind_activations(m, Setup(num_gpus=1), MOE, True))


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(None, id="0.16.1"),
        pytest.param(
            MCORE_NEW, id="0.19.2",
            marks=pytest.mark.skipif(not MCORE_NEW.exists(), reason="make setup installs .mcore/0.19.2"),
        ),
    ],
)  # fmt: skip
def measured(request) -> dict:
    return _measured(request.param)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[json.dumps(c) for c in CASES])
def test_planned_moe_layer_is_within_5_percent_of_what_megatron_core_saves(measured, index) -> None:
    """The planner's bytes for one MoE layer (norm input, router, dispatcher, experts) match the measured ones."""
    got = sum(measured["results"][index].values())
    planned = _planned(CASES[index])
    assert abs(planned - got) / got < 0.05, (planned, got, measured["results"][index])
