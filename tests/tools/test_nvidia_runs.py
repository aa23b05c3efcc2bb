"""Every NVIDIA-measured run (evidence/nvidia_runs.py) against the planner: the rows' provenance, and the goal on the
rows no constant was fitted on (memory within 10 %, step time within 20 %). The rows that miss are listed as strict
expected failures, each with its error today, so that a fix shows up as a pass to move here."""

from __future__ import annotations

import pytest

from mbridge_offload_tools.evidence import nvidia_runs

ROWS = {(r.id, r.kind): r for r in nvidia_runs.accuracy()}
# The held-out misses today (step-time error, after the EP physics of plan/time/moe.py): Qwen3-30B-A3B at EP16
# on 16 H100 (+49 % to +83 %: the per-MoE-layer fixed cost fitted on the 25.11 performance summary, 4 ms x 64
# micro-batches x 48 layers, is more than these newer runs leave room for), its natural-routing GB200 run (-29 %:
# early-training imbalance beyond the assumed CV), GPT-OSS-120B on GB200 (-43 %, as its performance-summary rows) and
# Qwen3-235B-A22B on GB200 at 256 micro-batches (+46 %: the fixed cost again). The dense Qwen3-8B on 16 H100 (+19 %) and
# DeepSeek-V3 on GB300 (+19 %) came in when DP rings across NVLink domains were charged r x NIC, not one NIC.
# The held-out memory misses today (peak allocated): Moonlight-16B on 8 H100 (MLA, alltoall, precision-aware
# optimizer, TE 2.17) is under-predicted by 10.4 % to 13.3 %, and megatron-core's own step traced with the same
# settings lands within a few percent of the planner, so what the runs held beyond it is not in PyTorch tensors the
# trace can see from the model (TE workspaces, a GPU snapshot would tell); Qwen3-30B-A3B with HybridEP (TE 2.18, whose
# fused cross entropy keeps an fp32 gradient) came in at -8.6 %. The dense Llama 3 70B FP8-CS SFT with interleaving
# and only core_attn recomputed is over-predicted (+22.6 % at VPP5, +17.6 % at VPP10, +23.9 % at PP8), while its
# mlp-recompute and TP8 rows are within 3 %; the FP8 trace agrees with the planner on all six (within 2 %: the TE
# graphs of the MLP, which neither runs, are what is left). See docs/planner.md and docs/trace.md.
MISSES = {
    ("qwen3-30b-a3b pretrain H100", "step"),
    ("qwen3-30b-a3b resume H100", "step"),
    ("qwen3-30b-a3b pretrain GB200 MXFP8", "step"),
    ("qwen3-30b-a3b perf H100", "step"),
    ("gpt-oss-120b perf GB200", "step"),
    ("qwen3-235b-a22b perf GB200 MXFP8", "step"),
    ("moonlight-16b empty-list control memory", "memory"),
    ("moonlight-16b core_attn memory", "memory"),
    ("moonlight-16b mla_up_proj memory", "memory"),
    ("moonlight-16b mla_up_proj+mlp memory", "memory"),
    ("moonlight-16b moe_act memory", "memory"),
    ("moonlight-16b layernorm+moe_act memory", "memory"),
    ("llama3-70b sft H100 FP8-CS core_attn memory", "memory"),
    ("llama3-70b sft H100 FP8-CS VPP10 memory", "memory"),
    ("llama3-70b sft H100 FP8-CS PP8 memory", "memory"),
}
HELD_OUT = [key for key, r in ROWS.items() if not r.fitted]


def test_there_are_at_least_25_rows_each_with_its_source_revision_and_unit():
    assert len(ROWS) >= 25
    for r in ROWS.values():
        assert r.source and r.revision and r.unit in ("GiB", "GB", "ms", "s", "tokens/s/GPU")
        assert r.published > 0 and r.predicted > 0


def test_the_rows_constants_were_fitted_on_are_marked():
    fitted = {r.source for r in ROWS.values() if r.fitted}
    assert any("performance-summary" in s for s in fitted)  # the step-time efficiency
    assert any("cpu-offloading" in s for s in fitted)  # the allocator overhead and the CPU AdamW rate
    assert not any(r.fitted for r in ROWS.values() if r.source.startswith("model verification card"))


def test_the_misses_listed_are_held_out_rows():
    assert set(HELD_OUT) >= MISSES


@pytest.mark.parametrize(
    "key",
    [
        pytest.param(k, marks=pytest.mark.xfail(strict=True, reason=f"known miss: {ROWS[k].error:+.0%}"))
        if k in MISSES
        else k
        for k in HELD_OUT
    ],
    ids=[f"{k[0]} {k[1]}" for k in HELD_OUT],
)
def test_a_held_out_row_is_within_the_goal(key):
    r = ROWS[key]
    assert r.within_goal, f"{r.id}: {r.error:+.1%}"


def test_the_headline_counts_only_held_out_rows():
    counts = nvidia_runs.headline()
    assert counts["step"][1] + counts["memory"][1] == len(HELD_OUT)
    assert counts["step"][0] + counts["memory"][0] == len(HELD_OUT) - len(MISSES)


def test_every_memory_row_gives_its_unit_as_published_and_a_trace_figure_or_why_not():
    memory = [r for r in ROWS.values() if r.kind == "memory"]
    assert len([r for r in memory if not r.fitted]) >= 10
    assert {r.unit for r in memory} == {"GiB", "GB"}
    for r in memory:
        assert (r.traced is not None) != r.trace_note.startswith("not traced"), r.id


def test_a_gb_row_is_compared_in_decimal_gigabytes():
    from mbridge_offload.plan.memory.stage import estimate_memory
    from mbridge_offload.plan.model.architecture import GB

    (row,) = (r for r in nvidia_runs.load()["memory_rows"] if r["id"] == "llama3-70b sft H100 FP8-CS TP8 memory")
    total = estimate_memory(nvidia_runs.memory_model(row["model"]), nvidia_runs.memory_setup(row)).worst.total
    assert ROWS[(row["id"], "memory")].predicted == pytest.approx(total / GB)


def test_the_stored_trace_figures_name_their_megatron_core_and_date():
    from mbridge_offload_tools.evidence import traced_rows

    stored = traced_rows.stored()
    assert stored["rows"] and stored["megatron_core"] and stored["date"]
    for row_id in stored["rows"]:
        assert ROWS[(row_id, "memory")].traced is not None


@pytest.mark.long
@pytest.mark.megatron
def test_a_stored_trace_figure_is_what_the_trace_answers_today():
    from mbridge_offload_tools.evidence import traced_rows

    stored = traced_rows.stored()
    row_id = "qwen3-30b-a3b-card: no offload"
    got = traced_rows.trace_peaks({row_id: traced_rows.traceable()[row_id]}, stored["megatron_core"])
    assert got[row_id] == pytest.approx(stored["rows"][row_id]["peak_gib"], rel=0.002)
