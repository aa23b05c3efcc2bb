"""Multi-token prediction in the trace: megatron-core builds the MTP depths, their embedding and their loss on the
last stage (real 0.16.1 and 0.19.2, every run of a release in one child process), and the planner holds to it.
"""

from __future__ import annotations

from typing import Any

import pytest

from mbridge_offload.plan.memory.stage import estimate_memory
from mbridge_offload.plan.model.architecture import GB
from mbridge_offload.plan.model.params import padded_vocab, stage_params
from mbridge_offload_tools.exact.run import installs
from mbridge_offload_tools.trace import spec as specs
from mbridge_offload_tools.trace.run import spawn_batch
from tests.plan.test_trace_differential import _resolved

pytestmark = [pytest.mark.megatron, pytest.mark.slow]
RELEASES = sorted({i.version for i in installs()} & {"0.16.1", "0.19.2"})
BASE = {  # real widths: at toy widths fixed-size tensors the planner leaves out weigh several per cent
    "num_layers": 4,
    "hidden_size": 4096,
    "ffn_hidden_size": 14336,
    "num_attention_heads": 32,
    "num_query_groups": 8,
    "kv_channels": 128,
    "vocab_size": 32000,
    "seq_length": 4096,
    "tp": 2,
    "pp": 2,
    "global_batch_size": 32,
    "num_gpus": 16,
}
MTP = "model:\n  mtp_num_layers: {}\n"
RUNS = {
    "pp1": {**BASE, "pp": 1, "num_layers": 2, "config": MTP.format(1)},
    "pp2_two_depths": {**BASE, "config": MTP.format(2)},
    "full_recompute": {
        **BASE,
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
        "config": MTP.format(1),
    },
    "layout": {**BASE, "num_layers": 5, "pipeline_layout": "Ett|t|t|tmL"},  # VPP 2, the depth in the last chunk
}
_CACHE: dict[str, list[tuple[Any, int, dict[str, Any]]]] = {}


def traced(release: str) -> dict[str, tuple[Any, int, dict[str, Any]]]:
    """Per run: the planner's resolved run, its last stage, and the trace of that stage."""
    if release not in _CACHE:
        resolved = [_resolved(case) for case in RUNS.values()]
        batch = [specs.build_run(r.model, r.setup, r.setup.pp - 1) for r in resolved]
        got = spawn_batch(release, batch)
        assert not [g["error"] for g in got if "error" in g]
        _CACHE[release] = [(r, r.setup.pp - 1, g) for r, g in zip(resolved, got, strict=True)]
    return dict(zip(RUNS, _CACHE[release], strict=True))


def _peak(got: dict[str, Any]) -> dict[str, Any]:
    return max(got["phases"].values(), key=lambda p: p["total"])


@pytest.mark.parametrize("release", RELEASES)
def test_the_last_stage_builds_the_depths_and_their_own_embedding_as_the_planner_counts(release: str) -> None:
    for name, (r, stage, got) in traced(release).items():
        assert r.model.mtp_num_layers > 0, name
        assert got["params"] == sum(t.numel for t in stage_params(r.model, r.setup, stage)), name
    r, stage, _ = traced(release)["pp2_two_depths"]
    names = [t.name for t in stage_params(r.model, r.setup, stage)]
    # megatron-core's GPTModel embeds the shifted tokens on the MTP stage: pre_process or mtp_process
    assert names[0] == "embedding" and "output_layer" in names
    assert padded_vocab(r.model, r.setup.tp) > 0


def test_the_planner_holds_the_mtp_stage_to_megatron_core_0_19_2() -> None:
    if "0.19.2" not in RELEASES:
        pytest.skip("megatron-core 0.19.2 is not installed here (scripts/setup installs it)")
    for name, (r, stage, got) in traced("0.19.2").items():
        w = next(x for x in estimate_memory(r.model, r.setup).stages if x.stage == stage)
        peak = _peak(got)
        cat = peak["by_category"]
        resident = cat["weights"] + cat["gradients"] + cat["optimizer"]
        assert w.weights + w.gradients + w.optimizer == pytest.approx(resident, rel=0.01), name
        assert w.total - int(r.setup.overhead_gb * GB) == pytest.approx(peak["total"], rel=0.05), name


def test_megatron_core_0_16_1_holds_the_depths_bf16_logits_through_the_main_loss() -> None:
    """0.16.1's ``GPTModel._postprocess`` keeps ``mtp_logits`` while the main loss runs; 0.19.2's
    ``process_mtp_loss`` drops them before: one bf16 ``[s, b, V/TP]`` tensor apart at the loss (the planner counts
    0.19.2's)."""
    if RELEASES != ["0.16.1", "0.19.2"]:
        pytest.skip("needs both megatron-core releases")
    r, _, old = traced("0.16.1")["pp1"]
    _, _, new = traced("0.19.2")["pp1"]
    logits = 2 * r.setup.seq_length * padded_vocab(r.model, r.setup.tp) // r.setup.tp
    gap = old["phases"]["loss"]["total"] - new["phases"]["loss"]["total"]
    assert gap == pytest.approx(logits, rel=0.02)
