"""A measured figure belongs to the run that produced it (the config as written, the hardware inputs, what the log
printed about its run); a setting the caller changes asks about another run, predicted as measured + model(asked) -
model(measured) per category, none negative; both runs are shown (``calibration.measured_run`` / ``asked_run``).
"""

from __future__ import annotations

import re

import pytest

from mbridge_offload.config import sources
from mbridge_offload.config.errors import InputError
from mbridge_offload.plan.inputs.resolve import resolve
from mbridge_offload.plan.search import planner
from mbridge_offload.plan.service import plan
from tests.support.configs import LLAMA3_8B, bridge_yaml

CONFIG = bridge_yaml(
    ("model", {**LLAMA3_8B, "seq_length": 8192, "tensor_model_parallel_size": 2, "sequence_parallel": True}),
    ("train", {"micro_batch_size": 1, "global_batch_size": 64}),
)
HARDWARE = {"gpu": "h100-80gb", "num_gpus": 8}


def report(peak_gib: float, rank: int = 0) -> str:
    """Megatron-LM's memory report (MB = MiB) of one rank."""
    mib = peak_gib * 1024
    return (
        f"[Rank {rank}] (after 10 iterations) memory (MB) | allocated: {mib * 0.6:.2f} | max allocated: {mib:.2f} | "
        f"reserved: {mib * 1.1:.2f} | max reserved: {mib * 1.1:.2f}"
    )


def model_total(overrides: list[str] = (), **flags) -> float:
    loaded = sources.load(CONFIG, list(overrides))
    return plan("estimate", {**HARDWARE, **flags}, loaded.config, loaded.raw, loaded.source).memory_gib.total


def answer(kind: str, log: str, overrides: list[str] = (), **flags):
    loaded = sources.load(CONFIG, list(overrides))
    return plan(kind, {**HARDWARE, "measured_log": log, **flags}, loaded.config, loaded.raw, loaded.source)


@pytest.fixture(scope="module")
def model():
    return {"mbs1": model_total(), "mbs2": model_total(["train.micro_batch_size=2"])}


def categories(b) -> dict[str, float]:
    return {k: getattr(b, k) for k in ("weights", "gradients", "optimizer", "activations", "other", "total")}


@pytest.mark.parametrize("how", ["set", "flag"])
def test_an_mbs1_report_asked_at_mbs2_predicts_the_models_delta_and_does_not_fit(model, how):
    measured = model["mbs1"] + 20.0  # the run used more than modelled; MBS 2 then cannot fit an 80 GB H100
    change = {"overrides": ["train.micro_batch_size=2"]} if how == "set" else {"micro_batch_size": 2}
    est = answer("estimate", report(measured), **change)
    assert est.memory_gib.total == pytest.approx(measured + model["mbs2"] - model["mbs1"], abs=0.02)
    assert not est.fits and est.memory_gib.total > est.budget_gib
    assert est.calibration.memory_offset_gib == pytest.approx(20.0, abs=0.01)  # taken at the measured run (MBS 1)


def test_the_answer_shows_the_measured_run_and_the_asked_run_side_by_side(model):
    c = answer("estimate", report(model["mbs1"] + 2.0), ["train.micro_batch_size=2"]).calibration
    assert (c.measured_run.settings["micro_batch_size"], c.asked_run.settings["micro_batch_size"]) == (1, 2)
    assert c.measured_run.memory_gib.total == pytest.approx(model["mbs1"] + 2.0, abs=0.01)  # reproduces the figure
    assert c.measured_run.model_gib == pytest.approx(model["mbs1"], abs=0.01)
    assert c.asked_run.model_gib == pytest.approx(model["mbs2"], abs=0.01)
    assert [(x.name, x.measured, x.asked) for x in c.changes] == [("micro_batch_size", 1, 2)]
    assert any("measured + model(asked) - model(measured)" in n for n in c.notes)


def test_nothing_changed_the_two_runs_are_the_same(model):
    c = answer("estimate", report(model["mbs1"] + 2.0)).calibration
    assert c.changes == [] and c.measured_run.settings == c.asked_run.settings
    assert c.asked_run.memory_gib.total == pytest.approx(model["mbs1"] + 2.0, abs=0.01)


def test_a_report_below_the_model_is_taken_off_activations_and_other_never_below_zero(model):
    est = answer("estimate", report(model["mbs1"] - 8.0), ["train.micro_batch_size=2"])
    b = est.memory_gib
    assert min(categories(b).values()) >= 0.0
    assert b.total == pytest.approx(model["mbs2"] - 8.0, abs=0.02)
    m = est.calibration.measured_run.memory_gib
    assert (m.weights, m.gradients, m.optimizer) == (b.weights, b.gradients, b.optimizer)  # counted, not shifted


def test_a_difference_larger_than_a_category_is_held_at_zero_and_said():
    text = CONFIG.replace("micro_batch_size: 1", "micro_batch_size: 4")
    loaded = sources.load(text)
    at4 = plan("estimate", HARDWARE, loaded.config, loaded.raw, loaded.source)
    resident = at4.memory_gib.weights + at4.memory_gib.gradients + at4.memory_gib.optimizer
    log = report(resident + 1.0)  # far below the model's activations at MBS 4
    asked = sources.load(text, ["train.micro_batch_size=1", "model.recompute_granularity=full"])
    flags = {**HARDWARE, "measured_log": log}
    est = plan("estimate", flags, asked.config, asked.raw, asked.source)
    assert min(categories(est.memory_gib).values()) >= 0.0
    assert est.calibration.clamped and "held at 0 GiB" in est.calibration.clamped[0]
    assert est.memory_gib.total == pytest.approx(sum(v for k, v in categories(est.memory_gib).items() if k != "total"))


def test_no_category_is_negative_over_generated_configs_with_the_same_log(model):
    log = report(model["mbs1"] - 10.0)
    cases = [
        [f"train.micro_batch_size={mbs}", f"model.seq_length={seq}", f"model.tensor_model_parallel_size={tp}", *extra]
        for mbs in (1, 2)
        for seq in (2048, 8192)
        for tp in (1, 2, 4)
        for extra in ([], ["model.recompute_granularity=full"], ["optimizer.optimizer_offload_fraction=0.5"])
    ]
    for overrides in cases:
        for kind in ("estimate", "recommend"):
            res = answer(kind, log, overrides)
            m = res.memory_gib
            shown = [m] if kind == "estimate" else [m.before, m.after, m.without_offload]
            shown += [o.memory_gib for o in getattr(res, "options", [])]
            for b in shown:
                if b is not None:
                    assert min(categories(b).values()) >= 0.0, (overrides, kind, b)
            assert all(ph.memory_gib >= 0 for st in res.phases for ph in st.phases), (overrides, kind)


def test_an_oom_of_the_measured_run_does_not_make_a_smaller_asked_run_fail():
    text = CONFIG.replace("micro_batch_size: 1", "micro_batch_size: 2")
    oom = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 "
        "GiB of which 0.50 GiB is free. Of the allocated memory 76.00 GiB is allocated by PyTorch, and 1.00 GiB is "
        "reserved by PyTorch but unallocated."
    )
    loaded = sources.load(text, ["train.micro_batch_size=1"])
    est = plan("estimate", {**HARDWARE, "measured_log": oom}, loaded.config, loaded.raw, loaded.source)
    c = est.calibration
    assert c.ooms and c.measured_run.settings["micro_batch_size"] == 2
    assert est.memory_gib.total < c.measured_run.memory_gib.total  # MBS 1 needs less than what failed at MBS 2
    assert est.fits == (est.memory_gib.total <= est.budget_gib)  # the verdict is the number's, not the OOM's


def test_without_a_config_the_logs_printed_micro_batch_describes_the_measured_run():
    flags = {"model": "llama3-8b", **HARDWARE, "tp": 2, "seq_length": 8192}
    at1 = planner.estimate(resolve({**flags, "micro_batch_size": 1})).memory_gib.total
    at2 = planner.estimate(resolve({**flags, "micro_batch_size": 2})).memory_gib.total
    log = report(at1 + 3.0) + "\n  micro_batch_size ................................ 1\n"
    est = planner.estimate(resolve({**flags, "micro_batch_size": 2, "measured_log": log}))
    c = est.calibration
    assert c.log_settings == {"micro_batch_size": 1}
    assert c.measured_run.settings["micro_batch_size"] == 1
    assert "the log's micro_batch_size" in c.measured_run.described_by
    assert est.memory_gib.total == pytest.approx(at2 + 3.0, abs=0.02)


def test_a_log_whose_printed_settings_disagree_with_the_config_is_flagged(model):
    log = "\n".join(
        [
            "using world size: 16, data-parallel size: 8, context-parallel size: 1, hierarchical context-parallel "
            "sizes: None, tensor-model-parallel size: 2, pipeline-model-parallel size: 1",
            "  seq_length ...................................... 4096",
            " iteration       20/    100 | consumed samples: 2560 | elapsed time per iteration (ms): 9000.0 | "
            "global batch size:   128 | lm loss: 2.0 |",
            report(model["mbs1"]),
        ]
    )
    c = answer("estimate", log).calibration
    found = {x.name: (x.log, x.given, x.given_source) for x in c.mismatches}
    assert found["seq_length"] == (4096, 8192, "config") and found["global_batch_size"] == (128, 64, "config")
    assert found["num_gpus"] == (16, 8, "flag")
    assert c.measured_run.settings["seq_length"] == 4096 and c.measured_run.settings["num_gpus"] == 16
    assert any("the log printed seq_length = 4096" in n for n in c.notes)


def test_a_plot_sweep_with_a_log_moves_with_the_lever(model):
    from mbridge_offload_tools.plot.points import Source, sweep_result

    loaded = sources.load(CONFIG)
    src = Source({**HARDWARE, "measured_log": report(model["mbs1"] + 5.0)}, loaded.config, loaded.raw, loaded.source)
    points = sweep_result(src, "micro_batch_size=1,2,4", "svg").points
    totals = [p.memory_gib.total for p in points]
    assert totals[0] < totals[1] < totals[2]
    assert totals[0] == pytest.approx(model["mbs1"] + 5.0, abs=0.02)
    assert totals[1] == pytest.approx(model["mbs2"] + 5.0, abs=0.02)


def test_a_measured_peak_given_as_a_number_belongs_to_the_config_as_written(model):
    loaded = sources.load(CONFIG, ["train.micro_batch_size=2"])
    flags = {**HARDWARE, "measured_peak_gib": model["mbs1"] + 4.0}
    est = plan("estimate", flags, loaded.config, loaded.raw, loaded.source)
    assert est.memory_gib.total == pytest.approx(model["mbs2"] + 4.0, abs=0.02)
    assert est.calibration.measured_run.settings["micro_batch_size"] == 1


def test_a_measured_step_calibrates_the_measured_run_and_the_asked_run_moves_with_it():
    line = " iteration {}/ 100 | elapsed time per iteration (ms): 12000.0 | global batch size:    64 |"
    log = "\n".join(line.format(i) for i in (10, 20, 30))
    at1 = answer("estimate", log)
    full = ["model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1"]
    asked = answer("estimate", log, full)
    assert at1.time_s.step == pytest.approx(12.0, rel=0.01)  # the measured run reproduces its step
    assert asked.time_s.step > 12.0 * 1.2  # another run: the recomputed forward at that efficiency, not pinned
    assert asked.time_s.efficiency == pytest.approx(at1.time_s.efficiency)
    assert asked.calibration.measured_run.settings["recompute_granularity"] is None


def test_a_setting_the_log_prints_and_nothing_states_describes_both_runs(model):
    log = "\n".join(
        [
            "using world size: 16, data-parallel size: 8, context-parallel size: 1, hierarchical context-parallel "
            "sizes: None, tensor-model-parallel size: 2, pipeline-model-parallel size: 1",
            report(model["mbs1"]),
        ]
    )
    loaded = sources.load(CONFIG, ["train.micro_batch_size=2"])
    est = plan("estimate", {"gpu": "h100-80gb", "measured_log": log}, loaded.config, loaded.raw, loaded.source)
    c = est.calibration
    assert est.num_gpus == 16 and c.mismatches == []
    assert {a.name: a.source for a in est.assumptions}["num_gpus"] == "log"
    assert [x.name for x in c.changes] == ["micro_batch_size"]  # the world size is the same in both runs


def test_measured_settings_name_the_measured_run_without_a_config():
    flags = {"model": "llama3-8b", **HARDWARE, "tp": 2, "seq_length": 8192}
    at1 = planner.estimate(resolve({**flags, "micro_batch_size": 1})).memory_gib.total
    at2 = planner.estimate(resolve({**flags, "micro_batch_size": 2})).memory_gib.total
    asked = {**flags, "micro_batch_size": 2, "measured_settings": ["micro_batch_size=1"], "measured_peak_gib": at1 + 2}
    est = planner.estimate(resolve(asked))
    assert est.memory_gib.total == pytest.approx(at2 + 2.0, abs=0.02)
    assert "measured_settings" in est.calibration.measured_run.described_by


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        (["gpu=b200"], "the same in the measured and the asked run"),
        (["micro_batch_size"], "expected NAME=VALUE"),
        (["warp=9"], "expected NAME=VALUE"),
        (["micro_batch_size=zero"], "(measured_settings): input should be a valid integer"),
    ],
)
def test_measured_settings_refuse_what_is_not_a_setting_of_the_run(settings, says):
    with pytest.raises(InputError, match=re.escape(says)):
        resolve({"model": "llama3-8b", "measured_settings": settings, "ooms": True})


def test_measured_settings_without_evidence_are_refused():
    with pytest.raises(InputError, match="none is given"):
        resolve({"model": "llama3-8b", "measured_settings": ["micro_batch_size=1"]})
