"""The user's evidence anchors every prediction: an OOM message is a lower bound on its stage's peak (the settings
never "fit", the first option frees the overshoot with the margin), a memory report is a point, each figure compared
with the stage of the rank that printed it (megatron-core's rank order) or the worst stage, and the answer says which.
"""

from __future__ import annotations

import pytest

from mbridge_offload.config import sources
from mbridge_offload.config.errors import InputError
from mbridge_offload.plan.inputs.resolve import resolve
from mbridge_offload.plan.memory.stage import estimate_memory
from mbridge_offload.plan.search import planner

GiB = 2**30


def oom(rank: int | None, allocated: float, requested: float, unallocated: float = 2.05, gpu: float = 79.11) -> str:
    prefix = f"[rank{rank}]: " if rank is not None else ""
    return (
        f"{prefix}torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {requested:.2f} GiB. GPU 0 has a total "
        f"capacity of {gpu:.2f} GiB of which 1.20 GiB is free. Including non-PyTorch memory, this process has 77.90 "
        f"GiB memory in use. Of the allocated memory {allocated:.2f} GiB is allocated by PyTorch, and "
        f"{unallocated:.2f} GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
        "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
    )


def report(rank: int, peak_gib: float) -> str:
    mib = peak_gib * 1024
    return (
        f"[Rank {rank}] (after 2 iterations) memory (MB) | allocated: {mib * 0.7:.2f} | max allocated: {mib:.2f} | "
        f"reserved: {mib * 1.1:.2f} | max reserved: {mib * 1.1:.2f}"
    )


# The issue's case: Llama 3 8B at 8k tokens with full recompute on 8 x H100: the model alone says it fits.
SFT = {
    "model": "llama3-8b",
    "gpu": "h100-80gb",
    "num_gpus": 8,
    "seq_length": 8192,
    "recompute_granularity": "full",
    "recompute_method": "uniform",
    "recompute_num_layers": 1,
}


def test_the_model_alone_says_the_issues_run_fits():
    est = planner.estimate(resolve(SFT))
    assert est.fits and est.memory_gib.total < 74.12 + 3.0


def test_an_oom_message_is_a_lower_bound_the_settings_never_fit_and_the_first_option_frees_the_overshoot():
    log = oom(0, 74.12, 3.00)
    est = planner.estimate(resolve({**SFT, "measured_log": log}))
    a = est.calibration
    assert not est.fits and a.ooms and a.measured_kind == "bound" and a.measured_bound_gib == pytest.approx(77.12)
    assert est.memory_gib.total >= 77.12  # never predicted below what the process already held
    assert a.fragmentation_gib == a.expandable_segments_gib == pytest.approx(2.05)
    assert any("expandable_segments:True would recover up to that" in n for n in a.notes)
    assert any("would fit" in n for n in est.notes)  # what would fit with the shift, as for --ooms
    (fig,) = [f for f in a.figures if f.used]
    assert (fig.kind, fig.line_number, fig.stage) == ("bound", 1, 0) and "Tried to allocate 3.00 GiB" in fig.line
    rec = planner.recommend(resolve({**SFT, "measured_log": log}))
    first = rec.options[0]
    assert first.fits and not first.alternative and first.memory_gib.total <= rec.budget_gib
    overshoot = rec.memory_gib.without_offload.total - rec.budget_gib
    assert rec.memory_gib.without_offload.total - first.memory_gib.total >= overshoot > 0
    assert "optimizer.optimizer_offload_fraction=0.05" not in first.overrides  # the issue's ×1.00 answer is gone


def test_a_bound_below_the_prediction_does_not_lower_it_but_a_point_does():
    predicted = planner.estimate(resolve(SFT)).memory_gib.total
    bound = planner.estimate(resolve({**SFT, "measured_log": oom(0, predicted - 20, 1.0)}))
    assert bound.memory_gib.total >= predicted and not bound.fits  # an OOM still means these settings failed
    point = planner.estimate(resolve({**SFT, "measured_log": report(0, predicted - 5)}))
    assert point.calibration.measured_kind == "point" and point.fits
    assert point.memory_gib.total == pytest.approx(predicted - 5, abs=0.01)
    assert point.calibration.memory_offset_gib == pytest.approx(-5, abs=0.01)


# Qwen3-30B-A3B's recipe: 16 GPUs, TP2 PP2 (DP4): ranks 0-7 are stage 0, 8-15 stage 1 in megatron-core's default
# order tp-cp-ep-dp-pp; with --use-tp-pp-dp-mapping (tp-cp-ep-pp-dp) stage = (rank // 2) % 2.
QWEN = {"model": "qwen3-30b-a3b", "gpu": "h100-80gb"}


@pytest.fixture(scope="module")
def qwen_stages() -> list[float]:
    r = resolve(QWEN)
    assert (r.setup.num_gpus, r.setup.tp, r.setup.pp) == (16, 2, 2)
    return [st.total / GiB for st in estimate_memory(r.model, r.setup).stages]


@pytest.mark.parametrize("rank, stage", [(3, 0), (12, 1), (None, 1)])
def test_an_oom_is_compared_with_the_failing_ranks_stage_else_the_worst(qwen_stages, rank, stage):
    worst = max(range(2), key=lambda s: qwen_stages[s])
    stage = worst if rank is None else stage
    bound = qwen_stages[stage] + 10.0
    est = planner.estimate(resolve({**QWEN, "measured_log": oom(rank, bound - 1.0, 1.0)}))
    (fig,) = est.calibration.figures
    assert fig.stage == stage and est.calibration.measured_stage == stage
    assert fig.shift_gib == pytest.approx(10.0, abs=0.01)
    if rank is None:
        assert "names no rank" in fig.stage_source and "worst predicted stage" in fig.stage_source
    else:
        assert (
            f"rank {rank} " in fig.stage_source and f"pipeline stage {stage} (order tp-cp-ep-dp-pp" in fig.stage_source
        )
    # every prediction now holds the failing stage at (at least) its bound
    assert est.memory_gib.total >= bound - 0.01


def test_the_rank_order_comes_from_the_config(qwen_stages):
    text = "model:\n  num_layers: 48\ndist:\n  use_tp_pp_dp_mapping: true\n"
    loaded = sources.load(text)
    r = resolve(QWEN, loaded.config, loaded.raw, loaded.source)
    est = planner.estimate(resolve({**QWEN, "measured_log": oom(2, 60.0, 1.0)}, loaded.config, loaded.raw))
    assert r.setup.pp == 2
    (fig,) = est.calibration.figures
    assert fig.stage == 1 and "tp-cp-ep-pp-dp" in fig.stage_source  # default order: rank 2 is stage 0


def test_memory_reports_of_every_stage_anchor_the_jobs_peak_to_the_models(qwen_stages):
    log = "\n".join([report(0, 44.0), report(8, 44.5)])  # stage 0 and stage 1, above their resident ~43.8 GiB
    est = planner.estimate(resolve({**QWEN, "measured_log": log}))
    a = est.calibration
    assert a.measured_kind == "point" and a.measured_peak_gib == pytest.approx(44.5, abs=0.01)
    assert est.memory_gib.total == pytest.approx(44.5, abs=0.01)  # the job's peak reproduced
    assert {f.line_number: f.stage for f in a.figures} == {1: 0, 2: 1}
    assert a.figures[0].used and a.figures[0].line_number == 2  # the figure that counted is listed first


def test_a_report_of_one_stage_shifts_by_that_stages_error(qwen_stages):
    est = planner.estimate(resolve({**QWEN, "measured_log": report(3, qwen_stages[0] + 2.0)}))
    assert est.calibration.measured_stage == 0
    assert est.calibration.memory_offset_gib == pytest.approx(2.0, abs=0.01)
    assert est.memory_gib.total == pytest.approx(max(qwen_stages) + 2.0, abs=0.01)


def test_a_point_and_a_later_oom_keep_the_larger_shift(qwen_stages):
    log = "\n".join([report(8, qwen_stages[1] + 1.0), oom(12, qwen_stages[1] + 4.0, 1.0)])
    a = planner.estimate(resolve({**QWEN, "measured_log": log})).calibration
    assert a.measured_kind == "bound" and a.memory_offset_gib >= 5.0 - 0.01
    assert a.measured_peak_gib == pytest.approx(qwen_stages[1] + 1.0, abs=0.01)  # the point is still reported


def test_a_different_gpu_in_the_message_is_said():
    a = planner.estimate(resolve({**SFT, "measured_log": oom(0, 120.0, 3.0, gpu=139.81)})).calibration
    assert any("139.81 GiB total capacity" in n and "h100-80gb" in n for n in a.notes)


def test_a_log_without_figures_is_refused_before_any_answer(tmp_path):
    (tmp_path / "train.log").write_text("loss 3.2\nloss 3.1\n")
    with pytest.raises(InputError, match="nothing measured"):
        planner.recommend(resolve({**SFT, "measured_log": str(tmp_path / "train.log")}))


def test_the_step_time_of_the_log_is_its_median_after_warm_up():
    lines = [
        f"iteration {i} | elapsed time per iteration (ms): {ms} |" for i, ms in enumerate((9000, 2500, 2400, 2600))
    ]
    a = planner.estimate(resolve({**SFT, "measured_log": "\n".join(lines)})).calibration
    assert a.measured_step_s == pytest.approx(2.5) and a.measured_kind is None
    assert [f.kind for f in a.figures] == ["step"] * 4
